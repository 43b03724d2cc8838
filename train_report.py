"""
What a training run records and says: its files (config.json, run_info.json, metrics.jsonl), the
sums of each log interval, the training FLOPs of each step, the progress line and 'train' record
every log_interval steps, and at the end the 'summary' record with the routing family's report.
"""
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import time

import numpy as np
import torch
from torch.utils._pytree import tree_map_only

import eval as evaluation
import flops
from files import RUN_FILES, write_whole
from run_state import drop_records_after, eval_rng, kept, restore_interval_lm
from sharding import SHARDED_DIR
from train_checks import TrainError

HERE = os.path.dirname(os.path.abspath(__file__))


def open_run_files(cfg, cfg_dict, proc, iter_num, evaluated=True):
    """config.json and run_info.json, and metrics.jsonl open for appending (rank 0 only). evaluated:
    does a resumed checkpoint hold its iteration's eval (run_state.drop_records_after)?"""
    os.makedirs(cfg.out_dir, exist_ok=True)
    if not (cfg.eval_only and cfg.init_from == 'resume'):     # an evaluation keeps the training's
        write_whole(os.path.join(cfg.out_dir, 'config.json'),
                    lambda f: json.dump(cfg_dict, f, indent=2))
        info = run_info(cfg, proc.dev, proc.dt, proc.world)
        write_whole(os.path.join(cfg.out_dir, 'run_info.json'),
                    lambda f: json.dump(info, f, indent=2))
    if cfg.init_from != 'resume':      # --overwrite: the old run goes only now that every check has
                                       # passed
        for name in ('ckpt.pt', 'metrics.jsonl'):
            if os.path.exists(os.path.join(cfg.out_dir, name)):
                os.remove(os.path.join(cfg.out_dir, name))
        # and its FSDP shards (DCP), which only the old ckpt.pt named: a run that is not FSDP,
        # or one stopped before its first save, never prunes them (sharding.prune_sharded)
        if os.path.isdir(os.path.join(cfg.out_dir, SHARDED_DIR)):
            shutil.rmtree(os.path.join(cfg.out_dir, SHARDED_DIR))
    else:                              # records a killed run logged after its last checkpoint are
                                       # redone
        drop_records_after(os.path.join(cfg.out_dir, 'metrics.jsonl'), iter_num, evaluated)
    return open(os.path.join(cfg.out_dir, 'metrics.jsonl'), 'a')


def code_version():
    """The git commit of this code (None outside git or before the first commit) and whether the
    working tree differs from it: run_info.json and bench.py's results record it."""
    def git(*args):
        try:
            r = subprocess.run(['git', *args], cwd=HERE, capture_output=True, text=True, timeout=10)
            return r.stdout.strip() if r.returncode == 0 else ''   # e.g. no commits yet: not a sha
        except Exception:
            return ''

    return dict(
        git_sha=git('rev-parse', 'HEAD') or None, git_dirty=bool(git('status', '--porcelain'))
    )


def run_info(cfg, dev, dt, world_size):
    return dict(
        **code_version(),
        torch=torch.__version__,
        cuda=torch.version.cuda,
        python=sys.version.split()[0],
        device=str(dev),
        device_name=torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'cpu',
        dtype=dt,
        world_size=world_size,
        host=socket.gethostname(),
        argv=sys.argv,
        threads=torch.get_num_threads(),
        started=time.strftime('%Y-%m-%dT%H:%M:%S%z'),
    )


def log(run, obj):
    if run.metrics_f is not None:
        try:
            run.metrics_f.write(json.dumps(obj) + '\n')
            run.metrics_f.flush()
        except OSError as e:           # name the file (a full disk: see main)
            raise OSError(e.errno, e.strerror, run.metrics_f.name) from None
    if getattr(run, 'loggers', None) is not None:     # --log: the same record, as scalars
        run.loggers.write(obj)


def count_params(params):
    return sum(p.numel() for p in {id(p): p for p in params}.values())    # tied weights once


def log_eval(run, res):
    """An eval's printed line and its 'eval' record, kept in the history the summary reads."""
    frac = res['val']['full_frac']
    print(
        f"iter {run.iter_num}: train loss {res['train']['loss']:.4f}, val loss "
        f"{res['val']['loss']:.4f}"
        + (f", val full-path fraction {np.mean(frac):.3f}" if frac else '')
    )
    rec = dict(
        type='eval',
        iter=run.iter_num,
        train_loss=res['train']['loss'],
        val_loss=res['val']['loss'],
        val_full_frac=frac,
    )
    if run.cfg.eval_only:             # an evaluation of the checkpoint, not a step of its training
        rec['eval_only'] = True
    run.history['eval'].append(rec)
    log(run, rec)


# --------------------------------------------------------------------------------------------------
# each step: its sums and FLOPs; each log step: the line, the record, the divergence check

def start_counters(run):
    """The loop's running totals and clocks; fp16 overflow steps are counted on the device (no
    sync)."""
    cfg = run.cfg
    run.seqs_per_iter = cfg.gradient_accumulation_steps * cfg.batch_size
    # a full-only step, per sequence
    run.dense_step = 3 * flops.dense_forward_flops(run.raw_model.config, cfg.block_size)
    run.step_costs = {}
    saved = run.interval           # a resumed checkpoint's unfinished log interval, or None
    if saved is None:
        run.interval = new_interval(run.dev)
    else:                          # (DDP: each rank's share of the LM sums, share_interval)
        run.interval = tree_map_only(torch.Tensor, lambda t: t.to(run.dev), saved)
        if 'lm_w' not in run.interval:     # a checkpoint from before lm_w: every step counted
            run.interval['lm_w'] = torch.full((), float(run.interval['n']), device=run.dev)
        for key in ('lm', 'lm_w'):
            run.interval[key] = restore_interval_lm(run.interval, run.rank, run.world, key)
            run.interval.pop(key + '_ranks', None)
    skips = run.fp16_skips or dict(skipped=0, last=0, consecutive=0)    # a resumed run's, or none
    run.skipped = torch.full((), float(skips['skipped']), device=run.dev)
    run.last_skipped, run.consecutive_skips = skips['last'], skips['consecutive']
    run.t_last, run.it_last, run.start_iter = time.time(), run.iter_num, run.iter_num
    run.t_run = time.time() - run.flops_state['wall_s']


def new_interval(dev):
    """Sums over one log interval, kept on the device until the log step reads them: lm the LM
    losses, lm_w their weights (1/accum for each micro-batch that counted a target), whose ratio is
    the logged LM mean."""
    return dict(
        lm=torch.zeros((), device=dev),
        lm_w=torch.zeros((), device=dev),
        frac=None,
        ctrl_norm=torch.zeros((), device=dev),
        n=0,
        aux={},
    )


def accumulate(interval, aux, accum, stats):
    """Add one micro-batch's LM loss, auxiliary *_loss terms, the family's statistics `stats` and
    its full-path fractions to the interval's sums. A micro-batch with no counted target (lm_loss 0
    by definition) adds no weight to the LM mean: the mean is over the micro-batches that have a
    loss, each weighted 1/accum as in the training objective (and as eval.evaluate averages its
    batches with a counted target)."""
    interval['lm'] += aux['lm_loss'].float() / accum
    interval['lm_w'] += aux['lm_counted'].float() / accum
    for k, v in aux.items():
        if (k.endswith('_loss') and k != 'lm_loss') or k in stats:
            interval['aux'][k] = interval['aux'].get(k, 0.0) + v.detach().float() / accum
    if 'full_frac' in aux:
        f = aux['full_frac'].float() / accum
        interval['frac'] = f if interval['frac'] is None else interval['frac'] + f


def count_flops(run, opts):
    """Add the step's training FLOPs, exact and the paper's proxy, to the run's totals; returns the
    step's analytic cost per sequence (computed once per set of the family's step options)."""
    key = tuple(sorted(opts.items()))
    if key not in run.step_costs:
        mcfg, T = run.raw_model.config, run.cfg.block_size
        run.step_costs[key] = (flops.train_step_flops(mcfg, T, run.cfg.trainable,
                                                      **flops.lora_options(run.cfg), **opts),
                               flops.flops_proxy(mcfg, T, **opts))
    step, proxy_step = run.step_costs[key]
    run.flops_state['exact'] += run.seqs_per_iter * step['total']
    run.flops_state['proxy_num'] += run.seqs_per_iter * proxy_step * run.dense_step
    run.flops_state['dense'] += run.seqs_per_iter * run.dense_step
    return step


def log_progress(run, lr, loss_sum, norm, step):
    """Every log_interval steps: the interval's means (under DDP over every rank: the grad norms
    are of the all-reduced gradient, the rest is averaged here), a stop if training diverged, and
    (rank 0) one printed line and one 'train' record."""
    iv = run.interval
    if run.ddp:                                # log the global mean, not rank 0's share
        loss_sum = share_means(run, loss_sum)
    lossf = loss_sum.item()
    dtime = (time.time() - run.t_last) / max(1, run.iter_num - run.it_last)
    run.t_last, run.it_last = time.time(), run.iter_num
    n_skipped = check_divergence(run, lossf)
    n = max(1, iv['n'])
    lm_w = iv['lm_w'].item()      # 0: no micro-batch of the interval counted a target (None)
    lm = iv['lm'].item() / lm_w if lm_w > 0 else None
    frac = (iv['frac'] / n).tolist() if iv['frac'] is not None else None
    ctrl_norm = iv['ctrl_norm'].item() / n if run.ctrl_params else None
    aux_means = {k: float(v) / n for k, v in iv['aux'].items()}
    run.interval = new_interval(run.dev)
    if not run.master:
        return
    tps = run.seqs_per_iter * run.cfg.block_size / dtime
    peak = flops.peak_flops(run.dev, run.dt)         # MFU from the FLOPs this step really ran
    mfu = step['total'] * run.seqs_per_iter / run.world / dtime / peak if peak else None
    fs = run.flops_state
    proxy = fs['proxy_num'] / fs['dense']
    print(
        f"iter {run.iter_num}: loss {lossf:.4f}, lm {'-' if lm is None else f'{lm:.4f}'}, "
        f"lr {lr:.2e}, {dtime * 1000:.1f} ms/iter, {tps:,.0f} tok/s"
        + (f", mfu {mfu * 100:.1f}%" if mfu is not None else '')
        + (f", full {np.mean(frac):.3f}, flops proxy {proxy:.3f}x" if frac else '')
    )
    rec = dict(
        type='train',
        iter=run.iter_num,
        loss=lossf,
        lm_loss=lm,
        lr=lr,
        ms_per_iter=dtime * 1000,
        tokens_per_s=tps,
        mfu=mfu,
        grad_norm=float(norm),
        ctrl_grad_norm=ctrl_norm,
        full_frac=frac,
        flops_proxy=proxy,
        train_flops=fs['exact'],
        train_flops_vs_dense=fs['exact'] / fs['dense'],
        skipped_steps=n_skipped,
    )
    rec.update(aux_means)            # auxiliary terms, averaged over the log interval
    if lm is not None:               # the summary's LM metrics: over intervals that had a loss
        run.history['train'].append(dict(iter=run.iter_num, lm_loss=lm))
    log(run, rec)


def share_means(run, loss_sum):
    """DDP (every rank: a collective): the interval's sums over the ranks. The LM sums add (their
    ratio is the mean); the loss, routing fractions and auxiliary terms, each a mean over this
    rank's micro-batches, are averaged (every rank runs the same number). Returns the loss."""
    iv = run.interval
    keys = sorted(iv['aux'])                   # the same keys on every rank: one model
    frac = [] if iv['frac'] is None else [iv['frac'].reshape(-1)]
    parts = torch.cat([iv['lm'].reshape(1).float(), iv['lm_w'].reshape(1).float(),
                       loss_sum.reshape(1).float(), *frac,
                       *[torch.as_tensor(iv['aux'][k], device=run.dev).reshape(1) for k in keys]])
    # the keys follow from the config and the step's options alone; were a rank to hold other
    # terms, a mismatched all_reduce could hang, so the sizes are compared first
    size = torch.tensor([len(parts), -len(parts)], device=run.dev)
    torch.distributed.all_reduce(size, op=torch.distributed.ReduceOp.MAX)
    if size.tolist() != [len(parts), -len(parts)]:
        raise RuntimeError(f"DDP ranks logged different terms (this rank: {keys})")
    torch.distributed.all_reduce(parts)
    iv['lm'], iv['lm_w'] = parts[0], parts[1]            # summed
    means = parts[2:] / run.world                        # averaged
    if iv['frac'] is not None:
        iv['frac'] = means[1:1 + iv['frac'].numel()].reshape(iv['frac'].shape)
    for i, k in enumerate(keys):
        iv['aux'][k] = means[len(means) - len(keys) + i]
    return means[0]


def check_divergence(run, lossf):
    """Stop on a loss that is no longer finite, or (fp16) on max_fp16_skips overflow steps in a row;
    returns the number of steps the GradScaler skipped so far."""
    n_skipped = int(run.skipped.item())
    run.consecutive_skips = (
        run.consecutive_skips + (n_skipped - run.last_skipped)
        if n_skipped > run.last_skipped
        else 0
    )
    run.last_skipped = n_skipped
    if not math.isfinite(lossf) and not run.scaler.is_enabled():
        raise TrainError(f"loss is {lossf} at iteration {run.iter_num}; stopping; {kept(run)}. "
                         f"Try a lower learning_rate or grad_clip.")
    if run.scaler.is_enabled() and run.consecutive_skips >= run.cfg.max_fp16_skips:
        raise TrainError(
            f"{run.consecutive_skips} consecutive fp16 overflow steps by iteration {run.iter_num}; "
            f"stopping. Try dtype=bfloat16/float32 or a lower learning_rate."
        )
    return n_skipped


# --------------------------------------------------------------------------------------------------
# the end of the run

def finish_run(run, stopped, abandon=None):
    """Rank 0 (FSDP: every rank, rank 0 alone writing): the 'summary' record (and, for a routing
    family after a complete run, its routing report). An eval-only run's summary is marked
    eval_only and keeps the training's wall time; a run stopped by a signal's, stopped. abandon:
    asked before each batch of the report; where it says True, the report is dropped and the
    summary marked stopped (its resume makes both). False then, else True."""
    cfg = run.cfg
    if not cfg.eval_only:
        run.flops_state['wall_s'] = time.time() - run.t_run
    summary = run_summary(run.history['train'], run.history['eval'], cfg, run.flops_state['wall_s'])
    summary.update(
        type='summary',
        iter=run.iter_num,
        best_val_loss=run.best_val,
        skipped_steps=int(run.skipped.item()),
        trainable_params=count_params(run.params),
        flops_proxy=run.flops_state['proxy_num'] / max(1.0, run.flops_state['dense']),
        train_flops=run.flops_state['exact'],
    )
    if cfg.eval_only:
        summary['eval_only'] = True
    if stopped:                        # by a signal: its resume writes the run's summary
        summary['stopped'] = True
    complete = True
    if not stopped and run.raw_model.family.routes:
        try:
            summary.update(routing_summary(run, abandon))
        except evaluation.Abandoned:
            stopped, complete, summary['stopped'] = True, False, True
    if not run.master:                 # FSDP: the other ranks joined the report's forward
        return complete
    per_token = flops.dense_forward_flops(run.raw_model.config, cfg.block_size) / cfg.block_size
    if not run.raw_model.family.routes:
        summary['eval_flops'] = per_token             # absolute: puts models of different sizes on
                                                      # one axis
    elif 'eval_flops_vs_dense' in summary:
        summary['eval_flops'] = summary['eval_flops_vs_dense'] * per_token
    log(run, summary)
    run.metrics_f.close()
    if cfg.eval_only:
        print(f"evaluated {cfg.out_dir} at iteration {run.iter_num} (eval only: nothing trained); "
              f"its eval and summary are appended to {os.path.join(cfg.out_dir, 'metrics.jsonl')}")
    elif not stopped:
        written = [f for f in RUN_FILES if os.path.exists(os.path.join(cfg.out_dir, f))]
        print(
            f"done: {run.iter_num} iterations, best val loss {run.best_val:.4f}. Outputs in "
            f"{cfg.out_dir}/ "
            f"({', '.join(written)})."
            + (
                f"\nsample with: python sample.py --out_dir={cfg.out_dir}"
                if 'ckpt.pt' in written
                else ''
            )
        )
    return complete


def run_summary(log_lines, evals, cfg, wall_s):
    """avg LM, best LM, threshold hits: the seed paper's optimisation metrics, from this run's
    logs."""
    lm = [(r['iter'], r['lm_loss']) for r in log_lines]
    early = [v for it, v in lm if it <= cfg.avg_lm_until * cfg.max_iters]
    out = dict(avg_lm=float(np.mean(early)) if early else None,
               best_train_lm=min((v for _, v in lm), default=None),
               best_val_lm=min((e['val_loss'] for e in evals), default=None), wall_s=wall_s)
    for th in [float(t) for t in str(cfg.lm_thresholds).split(',') if t.strip()]:
        out[f'hit_{th:g}'] = next((it for it, v in lm if v < th), None)
    return out


def routing_summary(run, abandon=None):
    """The family's end-of-run report (eval.report), printed, and the eval forward's FLOPs at the
    realised routing: ideal (mean fractions) and as executed (sparse execution may run more, e.g.
    MoD pads every row to the longest)."""
    cfg, mcfg = run.cfg, run.raw_model.config
    with eval_rng(run.dev, cfg.eval_seed):
        out = dict(
            routing=evaluation.report(
                run.raw_model,
                run.train_data,
                run.val_data,
                run.meta,
                cfg.eval_iters,
                cfg.calib_iters,
                run.autocast,
                cfg.eval_seed,
                calibrate=cfg.trainable != 'draft',     # a draft run keeps the model as it was
                abandon=abandon,
            )
        )
    if run.master:
        print_routing(run.raw_model.family, out['routing'])
    dense_fwd = flops.dense_forward_flops(mcfg, cfg.block_size)
    for key, frac_key in (
        ('eval_flops_vs_dense', 'full_frac'),
        ('eval_flops_executed_vs_dense', 'exec_frac'),
    ):
        val = out['routing']['val_loss']
        path = val.get('exec_path') if frac_key == 'exec_frac' else None     # as executed
        out[key] = (flops.forward_flops(mcfg, cfg.block_size, 'sparse', full_frac=val[frac_key],
                                        path=path) / dense_fwd)
    return out


def print_routing(family, r):
    for line in family.report_lines(r):
        print(line)
    for name, per_layer in r.get('full_frac_by_class', {}).items():
        print(
            f"  full-path fraction for {name:>9} targets: "
            + ' '.join(f"L{l}:{v:.2f}" for l, v in per_layer.items())
        )
