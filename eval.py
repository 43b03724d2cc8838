"""
Evaluate a checkpoint: validation loss under causal routing (what model.eval() means), next to the
same backbone with every gate forced to the full path (dense reference) and to the cheap path; the
realised full-path fraction per controlled layer; and, on the synthetic corpus, the full-path
fraction per difficulty class.

    python eval.py --ckpt=out/quickstart/ckpt.pt --json
    python eval.py --ckpt=out/quickstart/ckpt.pt --eval_iters=50 --device=cpu
    python eval.py --ckpt=out/quickstart/ckpt.pt --routing_map [--out=FILE.png]
    python eval.py --ckpt=out/ffn_stage1_lookup/ckpt.pt --room [--json]

eval_iters / calib_iters / batch_size default to the run's own values (0 = from the checkpoint).
The data (the checkpoint's data_dir, or --data_dir) must be the run's own, already prepared: eval.py
prepares nothing and refuses another corpus (tokenizer, vocabulary, content hash) with one line.
--room on a family without a forced-cheap path or random/oracle rules reports that number as
{"not_applicable": why} and says so on stderr.

--room: how much routing can matter for this backbone on the same validation batches (room()): the
loss with every decision forced full and forced cheap and, for the ffn family, under random and
oracle routing at the budget; room = cheap − full, gate_room = random − oracle. Studies (sweep.py)
report it beside their arm differences.

--routing_map: which path each token of a validation snippet (the first row of the first eval
batch, up to 64 tokens) took at each layer under causal eval-mode routing, printed as text ('#' full
path, '.' cheap path or skipped, '-' layer not routed) and drawn as a PNG (tokens as columns, layers
as rows; --out, a .png path, default routing_map.png beside the checkpoint, checked before any work;
needs matplotlib, else skipped with a note). On the synthetic corpus also the full-path fraction
per difficulty class per layer over the eval batches (a table, and a second PNG,
<out>_by_class.png). With --json, one JSON object instead of the text.

A progress bar over each pass's batches is drawn on stderr while stdout and stderr are terminals
(--quiet=True: none); the text, the JSON and the PNGs are the same either way.

Options are --key=value (underscores), as in every script: the spellings of before, `--ckpt PATH`
and `--routing-map`, are refused with one line naming today's.

train.py uses the functions here for its periodic evals and its end-of-run summary.
"""
import json
import os
import sys
from contextlib import nullcontext, redirect_stdout
from dataclasses import fields
from types import SimpleNamespace

import numpy as np
import torch

import progress
from checkpoint import load_checkpoint, load_model
from configurator import (ConfigError, asks_help, declared_defaults, load_config, print_help,
                          refuse_spaced_values, run_cli, source_group, writable_file)
from data.loader import (
    check_checkpoint_data,
    check_data,
    load_dataset_meta,
    load_tokenizer,
    open_splits,
)
from device import autocast_context, check_batch_fits, cli_device
from files import write_whole
from model import GPTConfig, read_stored_config
from routing import exec_path, overridden
from plots import SKIPPED, pyplot

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULTS = dict(
    ckpt='',                # the checkpoint file, e.g. out/quickstart/ckpt.pt
    eval_iters=0,           # validation batches (0: the run's own eval_iters)
    calib_iters=0,          # train-split batches calibrating the causal thresholds (0: the run's)
    device='auto',          # 'auto', 'cpu', 'cuda' or 'cuda:N'
    dtype='float32',        # 'float32', 'bfloat16', 'float16' or 'auto'
    data_dir='',            # the folder holding the run's prepared dataset ('': the run's own)
    batch_size=0,           # sequences per batch (0: the run's own)
    out='',                 # --routing_map's PNG ('': routing_map.png beside the checkpoint)
    quiet=False,            # no progress bar (there is none off a terminal either)
)
FLAGS = {
    '--json': 'print one JSON object instead of the text',
    '--routing_map': 'which path each token of a validation snippet took at each layer: text and '
                     'a PNG (--out; needs matplotlib)',
    '--room': 'how much routing can matter for this backbone: forced full vs cheap, and random '
              'vs oracle routing (ffn)',
}
OLD_SPELLINGS = {'--routing-map': '--routing_map'}


@torch.no_grad()
def evaluate(model, batches, autocast=nullcontext(), force=None, quiet=True, desc=None,
             abandon=None):
    """Mean loss over batches [(x, y), ...] in eval mode (causal, hard routing), the mean realised
    full-path fraction per controlled layer (None for a dense model), exec_frac: the fraction
    sparse execution runs (compact MoD: the longest row's, each row padded to it; the reference
    path: 1; else full), and exec_path: the path it ran on (routed_rows.PATHS).
    quiet=False: a progress bar over the batches named desc, on a terminal (eval.py's command
    line; train.py's periodic evals keep the default, between its log lines).
    abandon: a function asked before each batch; where it says True, None is returned at once
    (train.py's stop on a signal)."""
    desc = desc or (f'val loss, forced {force}' if force else 'val loss')
    with model.mode(training=False):
        losses, fracs, execs, extra, path = [], [], [], {}, None
        for x, y in progress.progress(batches, desc=desc, quiet=quiet):
            if abandon is not None and abandon():
                return None
            with autocast:
                _, loss, aux = model(x, y, force=force)
            if bool((y != -1).any()):      # a batch with no counted target has no loss
                losses.append(float(aux['lm_loss']))
            if 'full_frac' in aux:
                fracs.append(aux['full_frac'].float().cpu())
                # e.g. MoD pads each row to the longest on the compact path
                path = exec_path(x, model.exec_mode)
                run = model.family.executed_fracs(aux['masks'], path)
                if run is not None:
                    execs.append(run.float().cpu())
            for k in model.family.eval_stats:     # e.g. TLOps saved, MoD's causal-rule accuracy
                if k in aux:
                    extra.setdefault(k, []).append(float(aux[k]))
    full = torch.stack(fracs).mean(0).tolist() if fracs else None
    return dict(loss=float(np.mean(losses)) if losses else float('nan'), full_frac=full,
                exec_frac=torch.stack(execs).mean(0).tolist() if execs else full, exec_path=path,
                **{k: float(np.mean(v)) for k, v in extra.items()})


@torch.no_grad()
def difficulty_fractions(model, batches, difficulty, class_names, autocast=nullcontext(),
                         quiet=True):
    """Full-path fraction per difficulty class, per controlled layer, in eval mode. `batches` are
    (x, y, starts); the routing decision at position t serves the prediction of token t+1, so it is
    attributed to the class of that target token, difficulty[start + t + 1]. quiet=False: a
    progress bar on a terminal."""
    with model.mode(training=False):
        T = batches[0][0].size(1)
        sums, counts = {}, np.zeros(len(class_names))
        for x, y, starts in progress.progress(batches, desc='by class', quiet=quiet):
            cls = np.stack(
                [np.asarray(difficulty[s + 1 : s + 1 + T], dtype=np.int64) for s in starts]
            )
            with autocast:
                masks = model(x, y)[2].get('masks', {})
            for c in range(len(class_names)):
                counts[c] += (cls == c).sum()
            for layer, m in masks.items():
                m = m.cpu().numpy()
                s = sums.setdefault(layer, np.zeros(len(class_names)))
                for c in range(len(class_names)):
                    s[c] += m[cls == c].sum()
    return {name: {int(l): float(sums[l][c] / max(1, counts[c])) for l in sorted(sums)}
            for c, name in enumerate(class_names)}


@torch.no_grad()
def routing_map(model, x, y=None, autocast=nullcontext()):
    """Eval-mode (causal, hard) routing of one sequence x (1, T): an (L, T) float array whose row l
    is aux['masks'][l][0] (1 = full path / active, values in [0, 1]) and NaN where layer l is not
    routed (absent from the masks). Rows cover the model's layers and any other layer index the
    masks name. Column t is the decision taken while processing input token x[0, t]."""
    with model.mode(training=False):
        with autocast:
            masks = model(x, y)[2].get('masks', {})
    grid = np.full((max([model.config.n_layer, *[int(l) + 1 for l in masks]]), x.size(1)), np.nan)
    for l, m in masks.items():
        grid[int(l)] = m[0].float().cpu().numpy()
    return grid


def token_text(decode, ids, width=8):
    """Each token id as printable text: spaces as '␣', newlines and other control characters
    escaped, cut to `width` characters."""
    out = []
    for i in ids:
        t = decode([i]).replace(' ', '␣')
        t = ''.join(c if c.isprintable() else repr(c)[1:-1] for c in t) or '∅'
        out.append(t if len(t) <= width else t[:width - 1] + '…')
    return out


def map_cell(v):
    return '-' if np.isnan(v) else ('#' if v >= 0.5 else '.')


def routing_map_text(grid, tokens, per_line=32):
    """The map as text, per_line tokens per block: a line of tokens, then one line per layer ('#'
    full path (mask ≥ 0.5), '.' cheap or skipped, '-' layer not routed); cells right-aligned to the
    widest token plus one space."""
    w = max(len(t) for t in tokens) + 1
    blocks = []
    for a in range(0, len(tokens), per_line):
        lines = ['tok  ' + ''.join(t.rjust(w) for t in tokens[a:a + per_line])]
        lines += [
            f'L{l:<4}' + ''.join(map_cell(v).rjust(w) for v in row[a : a + per_line])
            for l, row in enumerate(grid)
        ]
        blocks.append('\n'.join(lines))
    return '\n\n'.join(blocks)


def class_table_text(by_class):
    """{class: {layer: fraction}} as a table: one row per class, one column per routed layer."""
    layers = sorted({l for row in by_class.values() for l in row})
    lines = ['class     ' + ''.join(f'{"L" + str(l):>7}' for l in layers)]
    lines += [
        f'{name:<10}' + ''.join(f'{row[l]:7.3f}' for l in layers) for name, row in by_class.items()
    ]
    return '\n'.join(lines)


def draw_routing_map(path, grid, tokens, by_class=None):
    """The map as a PNG at path and, when given, the per-class fractions as a second PNG beside it
    (<path>_by_class.png); returns the paths written, [] without matplotlib (after saying so)."""
    plt = pyplot()
    if plt is None:
        print(SKIPPED.replace('plots', 'routing map pictures'))
        return []
    fig, ax = plt.subplots(figsize=(max(6.0, 0.28 * len(tokens) + 2), 1.2 + 0.45 * len(grid)))
    cmap = plt.get_cmap('viridis').with_extremes(bad='lightgrey')
    im = ax.imshow(
        np.ma.masked_invalid(grid),
        cmap=cmap,
        vmin=0,
        vmax=1,
        aspect='auto',
        interpolation='nearest',
    )
    ax.set_xticks(
        range(len(tokens)), tokens, rotation=90 if max(map(len, tokens)) > 1 else 0, fontsize=8
    )
    ax.set_yticks(range(len(grid)), [f'L{l}' for l in range(len(grid))])
    ax.set_title(
        'path per token and layer (1 = full / active, 0 = cheap / skipped, grey = not routed)',
        fontsize=9,
    )
    fig.colorbar(im, ax=ax, fraction=0.02)
    paths = [save_figure(plt, fig, path)]
    if by_class:
        layers = sorted({l for row in by_class.values() for l in row})
        table = np.array([[row[l] for l in layers] for row in by_class.values()])
        fig, ax = plt.subplots(figsize=(1.5 + 0.8 * len(layers), 0.8 + 0.4 * len(by_class)))
        im = ax.imshow(table, cmap='viridis', vmin=0, vmax=1, aspect='auto')
        for (i, j), v in np.ndenumerate(table):
            ax.text(
                j,
                i,
                f'{v:.2f}',
                ha='center',
                va='center',
                color='w' if v < 0.6 else 'k',
                fontsize=8,
            )
        ax.set_xticks(range(len(layers)), [f'L{l}' for l in layers])
        ax.set_yticks(range(len(by_class)), list(by_class))
        ax.set_title('full-path fraction per class of the target token', fontsize=9)
        paths.append(save_figure(plt, fig, by_class_path(path)))
    return paths


def by_class_path(path):
    return os.path.splitext(path)[0] + '_by_class.png'


def is_png(path):
    """The file starts with the PNG signature (an earlier routing map, or another image)."""
    try:
        with open(path, 'rb') as f:
            return f.read(8) == b'\x89PNG\r\n\x1a\n'
    except OSError:
        return False


def save_figure(plt, fig, path):
    fig.tight_layout()
    fmt = os.path.splitext(path)[1][1:] or 'png'
    write_whole(path, lambda f: fig.savefig(f, format=fmt, dpi=110), binary=True)
    plt.close(fig)
    return path


def routing_map_report(
    model,
    train_data,
    val_data,
    meta,
    eval_iters,
    calib_iters,
    autocast=nullcontext(),
    eval_seed=1337,
    n_tokens=64,
    quiet=True,
):
    """The routing map of the first row of the first eval batch (its first n_tokens tokens; the
    whole row is run, which gives the same decisions since eval routing is causal), after the same
    threshold calibration report() does, and the per-difficulty-class fractions over all eval
    batches (quiet=False: under a progress bar, on a terminal)."""
    batches, starts = calibrated_eval_batches(
        model, train_data, val_data, eval_iters, calib_iters, autocast, eval_seed
    )
    x, y = batches[0]
    T = min(n_tokens, x.size(1))
    grid = routing_map(model, x[:1], y[:1], autocast)[:, :T]
    ids = x[0, :T].tolist()
    out = dict(start=int(starts[0][0]), ids=ids, tokens=token_text(load_tokenizer(meta)[1], ids),
               map=[[None if np.isnan(v) else float(v) for v in row] for row in grid])
    if meta.get('difficulty_classes'):
        diff = np.memmap(
            os.path.join(meta['folder'], 'val_difficulty.bin'), dtype=np.uint8, mode='r'
        )
        out['full_frac_by_class'] = difficulty_fractions(
            model,
            [(x, y, s) for (x, y), s in zip(batches, starts)],
            diff,
            meta['difficulty_classes'],
            autocast,
            quiet,
        )
    return out


def map_grid(res):
    return np.array([[np.nan if v is None else v for v in row] for row in res['map']])


def print_routing_map(res, as_json):
    """Print the map (text or one JSON object); res['png'] lists the PNGs written."""
    if as_json:
        print(json.dumps(res))
        return
    print(
        f"routing map, eval mode, val tokens {res['start']}..{res['start'] + len(res['ids']) - 1} "
        f"('#' full path, '.' cheap / skipped, '-' not routed):"
    )
    print(routing_map_text(map_grid(res), res['tokens']))
    if res.get('full_frac_by_class'):
        print('\nfull-path fraction per difficulty class of the target token (eval batches):')
        print(class_table_text(res['full_frac_by_class']))
    if res['png']:
        print(f"\nwrote {', '.join(res['png'])}")


def refuse_old_spellings(argv):
    """One syntax in every script: `--ckpt PATH` and `--routing-map` are refused, naming today's
    spelling."""
    for arg in argv:
        if arg in OLD_SPELLINGS:
            raise ConfigError(f"{arg} is spelled {OLD_SPELLINGS[arg]} now")
    refuse_spaced_values(argv, DEFAULTS)     # --ckpt PATH: the value after a space


def parse_args(argv):
    """The options, every one checked before any work: (args, as_json, routing, room_only)."""
    refuse_old_spellings(argv)
    as_json, routing, room_only = '--json' in argv, '--routing_map' in argv, '--room' in argv
    if routing and room_only:
        raise ConfigError("--room and --routing_map are separate reports: give one of them")
    argv = [a for a in argv if a not in FLAGS]
    args = load_config(DEFAULTS, argv)
    if not args['ckpt']:
        raise ConfigError("--ckpt must name a checkpoint file, e.g. --ckpt=out/quickstart/ckpt.pt")
    if args['out'] and not routing:
        raise ConfigError("--out names the routing map's PNG: use it with --routing_map")
    for key in ('eval_iters', 'calib_iters', 'batch_size'):
        if args[key] < 0:
            raise ConfigError(
                f"{key} must be >= 1, or 0 for the checkpoint's own value; got {args[key]}"
            )
    if args['data_dir'] and not os.path.isdir(args['data_dir']):
        raise ConfigError(f"--data_dir={args['data_dir']} is not a folder; give the folder that "
                          "holds "
                          f"the run's prepared dataset (eval.py prepares no data)")
    if routing:             # the PNG, where named or beside the checkpoint: a writable .png path
        args['out'] = args['out'] or os.path.join(os.path.dirname(args['ckpt']), 'routing_map.png')
        writable_file(args['out'], 'out', suffix='.png')
        by_class = by_class_path(args['out'])        # the second PNG, written after the first
        if os.path.isdir(by_class) or (os.path.exists(by_class)
                                       and not os.access(by_class, os.W_OK)):
            raise ConfigError(f"--out={args['out']}: {by_class}, where the per-class PNG goes, is "
                              "a folder or not writable; choose another --out")
        for path in (args['out'], by_class):        # an earlier map is replaced, nothing else
            if os.path.isfile(path) and not is_png(path):
                raise ConfigError(f"--out={args['out']}: {path} exists and is not a PNG image, "
                                  "which the routing map would replace; choose another --out")
    cli_device(args['device'], args['dtype'])
    if not os.path.isfile(args['ckpt']):         # after the options: their errors come first
        raise ConfigError(f"--ckpt={args['ckpt']} is not a checkpoint file; name one, e.g. "
                          f"--ckpt=out/quickstart/ckpt.pt")
    return args, as_json, routing, room_only


def main(argv):
    if asks_help(argv):
        return print_help(__doc__, 'python eval.py --ckpt=PATH [--key=value ...] [--json] '
                          '[--routing_map | --room]',
                          [source_group('eval.py options', DEFAULTS, (__file__, 'DEFAULTS'))],
                          flags=FLAGS)
    args, as_json, routing, room_only = parse_args(argv)
    # asked before --json sends stdout to stderr: no bar when the real stdout is not a terminal
    quiet = not progress.shown(args['quiet'])
    dev, dt = cli_device(args['device'], args['dtype'])
    autocast = autocast_context(dev, dt)        # the passes run at --dtype
    ck = load_checkpoint(args['ckpt'])
    # with --json, stdout holds exactly the one JSON object: notes on the way go to stderr
    with redirect_stdout(sys.stderr) if as_json else nullcontext():
        # train.py's defaults fill the keys a checkpoint does not hold
        cfg = SimpleNamespace(**{**{f.name: f.default for f in fields(GPTConfig)},
                                 **declared_defaults(os.path.join(HERE, 'train.py')),
                                 **read_stored_config(ck['config'])})
        cfg.data_dir = args['data_dir'] or cfg.data_dir
        meta = load_dataset_meta(cfg, master=True, prepare_missing=False)   # only training prepares
        check_checkpoint_data(cfg, meta, ck)      # the data must be the run's (names the field)
        check_data(cfg, meta, ck, skip_option=False)   # and intact: sha256 and token ids
        batch_size = args['batch_size'] or cfg.batch_size
        check_batch_fits(batch_size, cfg.block_size, meta['vocab_size'], dev)
        model = load_model(ck, dev, args['ckpt'])
        tr, va = open_splits(meta, cfg.block_size, batch_size, cfg.seed, dev)
        torch.manual_seed(cfg.eval_seed)
        eval_iters, calib_iters = (
            args['eval_iters'] or cfg.eval_iters,
            args['calib_iters'] or cfg.calib_iters,
        )
        if routing:
            res = routing_map_report(
                model, tr, va, meta, eval_iters, calib_iters, autocast, eval_seed=cfg.eval_seed,
                quiet=quiet
            )
            os.makedirs(os.path.dirname(os.path.abspath(args['out'])), exist_ok=True)
            res['png'] = draw_routing_map(args['out'], map_grid(res), res['tokens'],
                                          res.get('full_frac_by_class'))
        elif room_only:
            batches = [va.fetch(s) for s in va.eval_batches(eval_iters, 2, cfg.eval_seed)]
            res = room(model, batches, autocast, quiet=quiet)
            for key in ('room', 'gate_room'):
                if isinstance(res[key], dict):
                    why = res[key]['not_applicable']
                    print(f"note: {key}: not applicable: {why}", file=sys.stderr)
        else:
            res = report(model, tr, va, meta, eval_iters, calib_iters, autocast,
                         eval_seed=cfg.eval_seed, quiet=quiet)
    res['ckpt'] = args['ckpt']
    if routing:
        print_routing_map(res, as_json)
    else:
        print(json.dumps(res) if as_json else json.dumps(res, indent=2))
    return 0


@torch.no_grad()
def room(model, batches, autocast=nullcontext(), seed=0, quiet=True):
    """How much routing can matter on these batches, for this backbone: the val loss with every
    routed decision forced full and forced cheap (the family's references), and under each of its
    room rules (ffn: random and oracle routing at the budget; the oracle peeks at the targets, so it
    bounds what a causal gate can reach). room = cheap − full; gate_room = random − oracle, what a
    learned gate can gain over chance at the budget; oracle_recovery = the share of the room oracle
    routing recovers. quiet=False: a progress bar per pass, on a terminal."""
    family = model.family
    out = {
        force: evaluate(model, batches, autocast, force=force, quiet=quiet)['loss']
        for force in family.references
    }
    for name, overrides in family.room_rules.items():
        torch.manual_seed(seed)                     # the random rule's draws
        with overridden(model.config, **overrides):
            r = evaluate(model, batches, autocast, quiet=quiet, desc=f'val loss, {name} routing')
        out[name], out[f'{name}_full_frac'] = r['loss'], r['full_frac']
    route = model.config.route
    # a family without these settings cannot give these numbers: say so in the report itself
    if {'full', 'cheap'} <= set(out):
        out['room'] = out['cheap'] - out['full']
    else:
        out['room'] = dict(not_applicable=f"route={route} has no forced-cheap setting (its "
                                          "references: "
                                          f"{', '.join(family.references) or 'none'}), so cheap - "
                                          "full is undefined")
    if {'random', 'oracle'} <= set(out):
        out['gate_room'] = out['random'] - out['oracle']
    else:
        out['gate_room'] = dict(not_applicable=f"route={route} has no random and oracle routing "
                                               "rules "
                                               f"to compare its gate with")
    measured = isinstance(out['room'], float)
    if {'full', 'cheap', 'oracle'} <= set(out) and measured and out['room'] > 0:
        out['oracle_recovery'] = (out['cheap'] - out['oracle']) / out['room']
    return out


def calibrated_eval_batches(
    model, train_data, val_data, eval_iters, calib_iters, autocast, eval_seed, calibrate=True
):
    """Calibrate the causal thresholds on held-out train-split batches (unless calibrate is
    False: the model's thresholds as they are), then fetch the fixed validation batches:
    ([(x, y), ...], their start offsets)."""
    if calibrate:
        calib = [train_data.fetch(s)[0]
                 for s in train_data.eval_batches(calib_iters, 3, eval_seed)]
        with autocast:
            model.calibrate(torch.cat(calib))           # a no-op for gates without scores
    starts = val_data.eval_batches(eval_iters, 2, eval_seed)
    return [val_data.fetch(s) for s in starts], starts


class Abandoned(Exception):
    """report's `abandon` said True before a batch (train.py's stop on a signal)."""


def report(
    model,
    train_data,
    val_data,
    meta,
    eval_iters,
    calib_iters,
    autocast=nullcontext(),
    eval_seed=1337,
    quiet=True,
    calibrate=True,
    abandon=None,
):
    """The end-of-run numbers: causal val loss beside the forced-full (dense) and forced-cheap
    references, realised budget, TLOps saved, MoD's causal-rule accuracy, TSA's soft vs hard and the
    exits' threshold sweep, and per-difficulty-class routing (synthetic corpus). quiet=False: a
    progress bar per pass over the batches, on a terminal (eval.py's command line). calibrate=False
    keeps the model's thresholds as they are. abandon: asked before each batch of every pass
    through `evaluate` (the family's too); where it says True, Abandoned is raised."""
    batches, starts = calibrated_eval_batches(
        model, train_data, val_data, eval_iters, calib_iters, autocast, eval_seed, calibrate
    )
    family = model.family

    def evaluated(*args, **kwargs):
        res = evaluate(*args, quiet=quiet, abandon=abandon, **kwargs)
        if res is None:
            raise Abandoned
        return res
    out = dict(val_loss=evaluated(model, batches, autocast))
    out.update(family.report(model, batches, autocast, evaluated))
    for force in family.references:     # forced full = the dense model; forced cheap = every token
                                        # skips
        out[f'val_loss_{force}'] = evaluated(model, batches, autocast, force=force)['loss']
    if family.by_class and meta.get('difficulty_classes'):
        diff = np.memmap(
            os.path.join(meta['folder'], 'val_difficulty.bin'), dtype=np.uint8, mode='r'
        )
        out['full_frac_by_class'] = difficulty_fractions(
            model,
            [(x, y, s) for (x, y), s in zip(batches, starts)],
            diff,
            meta['difficulty_classes'],
            autocast,
            quiet,
        )
    return out


if __name__ == '__main__':
    run_cli(main)
