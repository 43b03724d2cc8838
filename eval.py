"""
Evaluate a checkpoint: validation loss under causal routing (what model.eval() means), next to the
same backbone with every gate forced to the full path (dense reference) and to the cheap path; the
realised full-path fraction per controlled layer; and, on the synthetic corpus, the full-path fraction
per difficulty class.

    python eval.py --ckpt out/quickstart/ckpt.pt --json
    python eval.py --ckpt=out/quickstart/ckpt.pt --eval_iters=50 --device=cpu

eval_iters / calib_iters / batch_size default to the run's own values (0 = from the checkpoint).

train.py uses the functions here for its periodic evals and its end-of-run summary.
"""
import json
import os
import sys
from contextlib import nullcontext

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))


@torch.no_grad()
def evaluate(model, batches, autocast=nullcontext(), force=None):
    """Mean loss over batches [(x, y), ...] in eval mode (causal, hard routing) and the mean realised
    full-path fraction per controlled layer (None for a dense model)."""
    was_training = model.training
    model.eval()
    losses, fracs = [], []
    for x, y in batches:
        with autocast:
            _, loss, aux = model(x, y, force=force)
        losses.append(float(aux['lm_loss']))
        if 'full_frac' in aux:
            fracs.append(aux['full_frac'].float().cpu())
    model.train(was_training)
    return dict(loss=float(np.mean(losses)),
                full_frac=torch.stack(fracs).mean(0).tolist() if fracs else None)


@torch.no_grad()
def difficulty_fractions(model, batches, difficulty, class_names, autocast=nullcontext()):
    """Full-path fraction per difficulty class, per controlled layer, in eval mode. `batches` are
    (x, y, starts); the routing decision at position t serves the prediction of token t+1, so it is
    attributed to the class of that target token, difficulty[start + t + 1]."""
    was_training = model.training
    model.eval()
    T = batches[0][0].size(1)
    sums, counts = {}, np.zeros(len(class_names))
    for x, y, starts in batches:
        cls = np.stack([np.asarray(difficulty[s + 1:s + 1 + T], dtype=np.int64) for s in starts])
        with autocast:
            masks = model(x, y)[2].get('masks', {})
        for c in range(len(class_names)):
            counts[c] += (cls == c).sum()
        for layer, m in masks.items():
            m = m.cpu().numpy()
            s = sums.setdefault(layer, np.zeros(len(class_names)))
            for c in range(len(class_names)):
                s[c] += m[cls == c].sum()
    model.train(was_training)
    return {name: {int(l): float(sums[l][c] / max(1, counts[c])) for l in sorted(sums)}
            for c, name in enumerate(class_names)}


def halt_report(model, batches, autocast=nullcontext(), taus=(0.3, 0.5, 0.7, 0.9)):
    """TSA: validation loss with the soft (1 − p) scaling the model was trained with, and with hard
    skipping (skip block l+1 where p_l > τ) at several τ — the comparison the paper never showed.
    Kept tokens add (1 − p)·Δ as in training ('scaled') or the whole Δ ('binary'). α is the mean active
    fraction (soft: mean 1 − p; hard: the fraction not skipped), TLOps saved 1 − (1 + (L−1)α)/L."""
    cfg = model.config
    saved = (cfg.halt_soft_eval, cfg.halt_tau, cfg.halt_hard)

    def row(**kw):
        r = evaluate(model, batches, autocast)
        alpha = float(np.mean(r['full_frac']))
        return dict(loss=r['loss'], alpha=alpha, tlops_saved=1 - (1 + (cfg.n_layer - 1) * alpha) / cfg.n_layer, **kw)
    try:
        cfg.halt_soft_eval = True
        soft = row()
        cfg.halt_soft_eval = False
        hard = []
        for mode in ('scaled', 'binary'):
            for tau in taus:
                cfg.halt_tau, cfg.halt_hard = tau, mode
                hard.append(row(tau=tau, mode=mode))
    finally:
        cfg.halt_soft_eval, cfg.halt_tau, cfg.halt_hard = saved
    return dict(soft=soft, hard=hard)


def main(argv):
    import train
    from configurator import load_config
    from model import GPT, GPTConfig
    as_json = '--json' in argv
    argv = [a for a in argv if a != '--json']
    for i, a in enumerate(argv[:-1]):          # also accept the space-separated form: --ckpt PATH
        if a == '--ckpt':
            argv = argv[:i] + [f'--ckpt={argv[i + 1]}'] + argv[i + 2:]
            break
    args = load_config(dict(ckpt='', eval_iters=0, calib_iters=0, device='auto', dtype='float32',
                            data_dir='', batch_size=0), argv)
    if not args['ckpt'] or not os.path.isfile(args['ckpt']):
        raise train.TrainError(f"--ckpt must name a checkpoint file, got {args['ckpt']!r}")
    ck = torch.load(args['ckpt'], map_location='cpu', weights_only=False)
    cfg = type('C', (), {})()
    cfg.__dict__.update({**train.DEFAULTS, **ck['config']})
    cfg.data_dir = args['data_dir'] or cfg.data_dir
    cfg.device, cfg.dtype = args['device'], args['dtype']
    dev, dt = train.resolve_device_dtype(cfg)
    meta = train.load_dataset_meta(cfg, master=True)
    train.check_against_checkpoint(cfg, meta, ck, ())      # the data must be the run's (names the field)
    model = GPT(GPTConfig.from_dict(ck['model_args']))
    model.load_state_dict(ck['model'])
    model.to(dev)
    np_dtype = np.uint32 if meta.get('dtype') == 'uint32' else np.uint16
    B = args['batch_size'] or cfg.batch_size
    tr = train.Batches(os.path.join(meta['folder'], 'train.bin'), np_dtype, cfg.block_size, B, cfg.seed, dev)
    va = train.Batches(os.path.join(meta['folder'], 'val.bin'), np_dtype, cfg.block_size, B, cfg.seed, dev)
    torch.manual_seed(cfg.eval_seed)
    res = report(model, tr, va, meta, args['eval_iters'] or cfg.eval_iters, args['calib_iters'] or cfg.calib_iters,
                 eval_seed=cfg.eval_seed)
    res['ckpt'] = args['ckpt']
    print(json.dumps(res) if as_json else json.dumps(res, indent=2))
    return 0


def report(model, train_data, val_data, meta, eval_iters, calib_iters, autocast=nullcontext(), eval_seed=1337):
    """The end-of-run numbers: causal val loss beside the forced-full and forced-cheap references,
    realised budget, and per-difficulty-class routing (synthetic corpus)."""
    calib = [train_data.fetch(s)[0] for s in train_data.eval_batches(calib_iters, 3, eval_seed)]
    with autocast:
        model.calibrate(torch.cat(calib))               # a no-op for gates without scores
    starts = val_data.eval_batches(eval_iters, 2, eval_seed)
    batches = [val_data.fetch(s) for s in starts]
    out = dict(val_loss=evaluate(model, batches, autocast))
    if model.config.route == 'halt':
        out['halt'] = halt_report(model, batches, autocast)
    if model.config.route == 'ffn':
        out['val_loss_full'] = evaluate(model, batches, autocast, force='full')['loss']
        out['val_loss_cheap'] = evaluate(model, batches, autocast, force='cheap')['loss']
        out['budget'] = model.config.budget
        if meta.get('difficulty_classes'):
            diff = np.memmap(os.path.join(meta['folder'], 'val_difficulty.bin'), dtype=np.uint8, mode='r')
            out['full_frac_by_class'] = difficulty_fractions(
                model, [(x, y, s) for (x, y), s in zip(batches, starts)], diff, meta['difficulty_classes'], autocast)
    return out


if __name__ == '__main__':
    import train
    from configurator import ConfigError
    try:
        sys.exit(main(sys.argv[1:]))
    except (train.TrainError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
