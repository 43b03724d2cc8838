"""
Plots of a study, as PNG files in OUT_ROOT/plots/, from each run's metrics.jsonl
(OUT_ROOT/<arm>/seed<s>/, the layout sweep.py writes). sweep.py calls write_plots after its summary
(--no_plots to skip); alone:

    python plots.py out/study_a3

- loss_curves.png   train LM loss and val loss against iteration, one colour per arm: the mean over
                    seeds, with a band from the lowest to the highest seed.
- pareto_flops.png  final val loss against the FLOPs proxy (flops_proxy of the run summary), one
                    point per arm with mean ± std error bars in both directions; the arms on the
                    Pareto front (no other arm is at least as good in both) are ringed and joined.
- pareto_tlops.png  the same against TLOps saved (higher is better): the last 'tlops_saved' any
                    record of the run holds (for TSA, train.py's training-time value); arms that
                    never log it are left out, and the plot is skipped with a note when no run does.
- pareto_eval_flops.png, pareto_eval_tlops.png  the same against the end-of-run summary's eval
                    forward FLOPs at the realised routing (× dense) and TLOps saved under eval
                    (hard, causal) routing; a dense run sits at 1.0 and 0.
- frontier_eval_flops.png, frontier_train_flops.png  final val loss against absolute eval forward
                    FLOPs per token and training FLOPs of the run (log scale), with the study's
                    dense frontier (its `frontier` arms, dense models of several sizes) as a line;
                    without a frontier, the Pareto front of all arms.
- grad_norms.png    controller gradient norm (ctrl_grad_norm) against iteration, log scale, mean and
                    min–max band over seeds.
- full_frac.png     realised full-path fraction per routed layer over training, one panel per arm
                    (mean over seeds): on the training batches ('full_frac' of train records, lines)
                    and under causal eval-mode routing on validation ('val_full_frac' of evals,
                    dots).

matplotlib is optional: without it write_plots prints one line saying the plots were skipped and how
to install it, and returns []. The data helpers (read_metrics, run_metrics, find_runs, seed_band,
pareto_front, arm_points, mean_std) need only numpy; sweep.py takes its per-run numbers from
run_metrics and its spread over seeds from mean_std.
"""
import json
import os
from dataclasses import replace

import numpy as np

import flops
from checkpoint import CheckpointError, load_checkpoint
from configurator import ConfigError, asks_help, print_help, run_cli, writable_folder
from files import write_whole
from model import FAMILIES, GPTConfig

SKIPPED = "plots skipped: matplotlib is not installed (pip install matplotlib)"


def pyplot():
    """matplotlib.pyplot on the non-interactive Agg backend, or None when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    return plt


# --------------------------------------------------------------------------------------------------
# data

def read_metrics(out_dir):
    """The run's records from its metrics.jsonl: its training's. An eval-only run of its checkpoint
    (eval_only=True) appends an eval and a summary marked eval_only, which are left out: another
    run, maybe under other eval settings, that neither finishes the training nor gives its
    results."""
    path = os.path.join(out_dir, 'metrics.jsonl')
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            try:
                rec = json.loads(line)
            except ValueError:      # a record cut short (a full disk, a kill mid-write): resume
                                    # drops it too
                continue
            if isinstance(rec, dict) and not rec.get('eval_only'):    # a non-object: as resume
                out.append(rec)
    return out


def run_metrics(out_dir):
    """The numbers one run contributes to sweep.py's summary (and to the Pareto plots): its
    training's (read_metrics)."""
    recs = read_metrics(out_dir)
    summ = next((r for r in reversed(recs) if r.get('type') == 'summary'), {})
    evals = [r for r in recs if r.get('type') == 'eval']
    train = [r for r in recs if r.get('type') == 'train']
    out = {
        k: summ.get(k)
        for k in ('avg_lm', 'best_val_lm', 'flops_proxy', 'eval_flops_vs_dense', 'wall_s')
    }
    out.update({k: v for k, v in summ.items() if k.startswith('hit_')})
    out['final_val_loss'] = evals[-1]['val_loss'] if evals else None
    lm = train_lm_curve(recs)
    out['final_train_lm'] = lm[-1][1] if lm else None
    out['tlops_saved'] = last_value(recs, 'tlops_saved')
    out['jepa_pred_std'] = last_value(recs, 'jepa_pred_std')   # G3: ~0 once its predictor collapsed
    out['trainable_params'] = summ.get('trainable_params')
    # the median logged step time, the first log (compilation, warm-up) left out
    steps = [r['ms_per_iter'] for r in train[1:] if r.get('ms_per_iter') is not None]
    out['ms_per_step'] = float(np.median(steps)) if steps else None
    norms = [r['ctrl_grad_norm'] for r in train if r.get('ctrl_grad_norm') is not None]
    out['ctrl_grad_norm'] = float(np.mean(norms)) if norms else None
    routing = summ.get('routing') or {}
    if routing:
        out['causal_val_loss'] = routing['val_loss']['loss']
        frac = routing['val_loss'].get('full_frac')
        out['realised_full_frac'] = float(np.mean(frac)) if frac else None
        # under eval (hard) routing
        out['eval_tlops_saved'] = routing['val_loss'].get('tlops_saved')
    out.update(absolute_flops(out_dir, summ, out))
    info = read_json_object(os.path.join(out_dir, 'run_info.json'))
    out['code'] = (
        'unknown' if info is None else
        f"{(info.get('git_sha') or 'unknown')[:10]}{'+dirty' if info.get('git_dirty') else ''}"
    )
    return out


def read_json_object(path):
    """The JSON object in a run's file, None where there is no file; a file that is no JSON object
    (hand-edited, damaged) is one ConfigError naming it."""
    try:
        with open(path) as f:
            value = json.load(f)
    except FileNotFoundError:
        return None
    except ValueError as e:
        value = e
    if not isinstance(value, dict):
        why = value if isinstance(value, ValueError) else f'a JSON {type(value).__name__}'
        raise ConfigError(f"{path} is not a JSON object ({why}); restore or remove it")
    return value


def absolute_flops(out_dir, summ, metrics):
    """From the run's config.json: a dense run's eval FLOPs ratio and TLOps saved (1 and 0: it is
    the reference point of those axes), and the absolute FLOPs that put models of different sizes on
    one axis: train_flops (the whole run, train.py's exact count) and eval_flops (one eval forward,
    per token, at the realised routing: the summary's, or for an older summary computed from
    config.json with the vocabulary the checkpoint was built with). Nothing for a run without a
    stored route."""
    stored = read_json_object(os.path.join(out_dir, 'config.json'))
    if stored is None or not summ or stored.get('route') not in FAMILIES:
        return {}
    out = (
        {}
        if FAMILIES[stored['route']].routes
        else dict(eval_flops_vs_dense=1.0, eval_tlops_saved=0.0)
    )
    out['train_flops'], out['eval_flops'] = summ.get('train_flops'), summ.get('eval_flops')
    ratio = out.get('eval_flops_vs_dense', metrics.get('eval_flops_vs_dense'))
    if out['eval_flops'] is None and ratio is not None:     # a summary written before it recorded
                                                            # eval_flops
        cfg = GPTConfig.from_dict(stored)
        vocab = cfg.vocab_size or built_vocab(out_dir)    # 0 in config.json: taken from the data
                                                          # when built
        if vocab:
            cfg = replace(cfg, vocab_size=vocab)
            out['eval_flops'] = (
                ratio * flops.dense_forward_flops(cfg, cfg.block_size) / cfg.block_size
            )
    return out


def built_vocab(out_dir):
    """The vocabulary the run's model was built with (its checkpoint's), or None without a
    checkpoint."""
    try:
        return load_checkpoint(os.path.join(out_dir, 'ckpt.pt'))['model_args'].get('vocab_size')
    except CheckpointError:           # none kept (e.g. results/ copies), or unreadable
        return None


def last_value(recs, key):
    """The last non-None value of key in any record, or None."""
    return next((r[key] for r in reversed(recs) if r.get(key) is not None), None)


def train_lm_curve(recs):
    """[(iter, train LM loss)] of the 'train' records."""
    return [
        (r['iter'], r['lm_loss'])
        for r in recs
        if r.get('type') == 'train' and r.get('lm_loss') is not None
    ]


def find_runs(root, arms=None):
    """{arm: {seed: out_dir}} for every root/<arm>/seed<s>/ holding a metrics.jsonl. Arms in the
    given order, else in summary.json's order when there is one, else sorted."""
    if arms is None:
        try:
            with open(os.path.join(root, 'summary.json')) as f:
                table = json.load(f)['table']
            arms = list(table) if isinstance(table, dict) else None
        except (FileNotFoundError, KeyError, TypeError, ValueError):
            arms = None
        if arms is None:        # no summary to order by, or not one sweep.py wrote
            arms = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
    runs = {}
    for arm in arms:
        folder = os.path.join(root, arm)
        seeds = [
            d for d in (os.listdir(folder) if os.path.isdir(folder) else []) if d.startswith('seed')
        ]
        dirs = {int(d[4:]): os.path.join(folder, d) for d in seeds if d[4:].isdigit()
                and os.path.exists(os.path.join(folder, d, 'metrics.jsonl'))}
        if dirs:
            runs[arm] = dict(sorted(dirs.items()))
    return runs


def curve(recs, kind, key):
    """{iter: value} over the records of type `kind` that have `key` (a number or a per-layer
    list)."""
    return {r['iter']: r[key] for r in recs if r.get('type') == kind and r.get(key) is not None}


def seed_band(dirs, kind, key):
    """(iters, mean, lo, hi) over the seeds of one arm at the iterations every seed logged; for
    per-layer lists the last three have a layer axis. None when no seed logged key."""
    curves = [c for c in (curve(read_metrics(d), kind, key) for d in dirs.values()) if c]
    iters = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
    if not iters:
        return None
    # (seeds, iters[, layers])
    v = np.array([[c[i] for i in iters] for c in curves], dtype=float)
    return np.array(iters), v.mean(0), v.min(0), v.max(0)


def mean_std(values):
    """(mean, sample std (ddof=1; 0.0 for one value)) of the values that are not None, or (None,
    None) when none is: the spread over seeds of sweep.py's summary and of the figures' error
    bars."""
    v = [x for x in values if x is not None]
    if not v:
        return None, None
    return float(np.mean(v)), float(np.std(v, ddof=1)) if len(v) > 1 else 0.0


def arm_points(runs, xkey, ykey='final_val_loss'):
    """{arm: (x mean, x std, y mean, y std)} over the seeds where both of run_metrics' xkey and
    ykey are present (std as mean_std: the summary's); arms with none are left out."""
    points = {}
    for arm, dirs in runs.items():
        ms = [run_metrics(d) for d in dirs.values()]
        pairs = [
            (m[xkey], m[ykey]) for m in ms if m.get(xkey) is not None and m.get(ykey) is not None
        ]
        if pairs:
            x, y = zip(*pairs)
            points[arm] = (*mean_std(x), *mean_std(y))
    return points


def pareto_front(xs, ys):
    """Indices of the points no other point dominates when both coordinates are minimised (j
    dominates i if x_j <= x_i and y_j <= y_i, one of them strictly), in increasing x. Negate x to
    maximise it."""
    pts = list(zip(xs, ys))
    front = [i for i, (x, y) in enumerate(pts)
             if not any(a <= x and b <= y and (a < x or b < y) for a, b in pts)]
    return sorted(front, key=lambda i: (xs[i], ys[i]))


# --------------------------------------------------------------------------------------------------
# figures: each returns a matplotlib figure, or a string saying why there is nothing to draw

def arm_colours(runs):
    return {arm: f'C{i % 10}' for i, arm in enumerate(runs)}


def draw_band(ax, band, colour, label):
    iters, mean, lo, hi = band
    ax.plot(iters, mean, color=colour, label=label)
    ax.fill_between(iters, lo, hi, color=colour, alpha=0.2, linewidth=0)


def plot_loss_curves(plt, runs):
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    colours = arm_colours(runs)
    for ax, (kind, key, title) in zip(
        axes, [('train', 'lm_loss', 'train LM loss'), ('eval', 'val_loss', 'val loss')]
    ):
        for arm, dirs in runs.items():
            band = seed_band(dirs, kind, key)
            if band is not None:
                draw_band(ax, band, colours[arm], arm)
        ax.set(title=f'{title} (mean over seeds, band: min–max)', xlabel='iteration', ylabel=title)
        ax.legend(fontsize=8)
    return fig


def plot_pareto(plt, runs, key, xlabel, maximise=False, frontier=None):
    """With frontier (dense arms of several sizes): those arms joined as a line on a log x axis, the
    reference each routed arm is read against, instead of the Pareto front of all arms."""
    points = arm_points(runs, key)
    if not points:
        return f"no run records '{key}'"
    if frontier is not None:
        return plot_frontier(
            plt, points, [a for a in frontier if a in points], arm_colours(runs), xlabel
        )
    arms = list(points)
    xs, xsd, ys, ysd = (np.array([points[a][k] for a in arms]) for k in range(4))
    colours = arm_colours(runs)
    fig, ax = plt.subplots(figsize=(7, 5))
    for i, arm in enumerate(arms):
        ax.errorbar(
            xs[i],
            ys[i],
            xerr=xsd[i],
            yerr=ysd[i],
            fmt='o',
            color=colours[arm],
            label=arm,
            capsize=3,
        )
    front = pareto_front(-xs if maximise else xs, ys)
    ax.plot(xs[front], ys[front], 'k--', linewidth=1)
    ax.scatter(xs[front], ys[front], s=180, facecolors='none', edgecolors='k', label='Pareto front')
    ax.set(xlabel=xlabel, ylabel='final val loss',
           title=f"val loss vs {xlabel.split(' (')[0]} (mean ± std over seeds)")
    ax.legend(fontsize=8)
    return fig


def plot_frontier(plt, points, sizes, colours, xlabel):
    if len(sizes) < 2:
        return 'fewer than two frontier arms have this value'
    fig, ax = plt.subplots(figsize=(7, 5))
    line = sorted(points[a][::2] for a in sizes)
    ax.plot(*zip(*line), 'k-', linewidth=1, label='dense frontier (' + ', '.join(sizes) + ')')
    for arm, (x, xsd, y, ysd) in points.items():
        ax.errorbar(
            x,
            y,
            xerr=xsd,
            yerr=ysd,
            fmt='s' if arm in sizes else 'o',
            color=colours[arm],
            label=arm,
            capsize=3,
        )
    ax.set_xscale('log')
    ax.set(
        xlabel=xlabel,
        ylabel='final val loss',
        title='val loss vs cost against the dense frontier (mean ± std over seeds)',
    )
    # beside the points, not over them
    ax.legend(fontsize=7, loc='upper left', bbox_to_anchor=(1.01, 1.0))
    return fig


def plot_grad_norms(plt, runs):
    bands = {arm: seed_band(dirs, 'train', 'ctrl_grad_norm') for arm, dirs in runs.items()}
    bands = {arm: b for arm, b in bands.items() if b is not None}
    if not bands:
        return "no run records 'ctrl_grad_norm'"
    colours = arm_colours(runs)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for arm, band in bands.items():
        draw_band(ax, band, colours[arm], arm)
    if all((b[2] > 0).all() for b in bands.values()):
        ax.set_yscale('log')
    ax.set(
        xlabel='iteration',
        ylabel='controller grad norm',
        title='controller gradient norm (band: min–max over seeds)',
    )
    ax.legend(fontsize=8)
    return fig


def plot_full_frac(plt, runs):
    bands = {arm: (seed_band(dirs, 'train', 'full_frac'), seed_band(dirs, 'eval', 'val_full_frac'))
             for arm, dirs in runs.items()}
    bands = {arm: b for arm, b in bands.items() if b[0] is not None or b[1] is not None}
    if not bands:
        return "no run records a per-layer 'full_frac' (dense runs only?)"
    ncols = min(3, len(bands))
    nrows = -(-len(bands) // ncols)
    fig, axes = plt.subplots(
        nrows, ncols, figsize=(5 * ncols, 3.6 * nrows), squeeze=False, sharey=True
    )
    for ax, (arm, (train_band, eval_band)) in zip(axes.flat, bands.items()):
        if train_band is not None:
            for j in range(train_band[1].shape[-1]):
                ax.plot(
                    train_band[0], train_band[1][:, j], color=f'C{j % 10}', label=f'layer slot {j}'
                )
        if eval_band is not None:
            for j in range(eval_band[1].shape[-1]):
                ax.plot(eval_band[0], eval_band[1][:, j], 'o:', color=f'C{j % 10}', markersize=3)
        ax.set(title=arm, xlabel='iteration', ylabel='full-path fraction', ylim=(-0.02, 1.02))
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(bands):]:
        ax.axis('off')
    fig.suptitle(
        'realised full-path fraction per routed layer (lines: train batches, dots: causal eval on '
        'val; '
        'slot j = j-th entry of full_frac)',
        fontsize=9,
    )
    fig.tight_layout()
    return fig


def figures(plt, runs, frontier=None):
    """(file name, figure or reason) for every plot; frontier: the dense arms drawn as a line."""
    yield 'loss_curves.png', plot_loss_curves(plt, runs)
    yield (
        'pareto_flops.png',
        plot_pareto(plt, runs, 'flops_proxy', 'FLOPs proxy (training, × dense)'),
    )
    yield (
        'pareto_tlops.png',
        plot_pareto(plt, runs, 'tlops_saved', 'TLOps saved (last logged value)', maximise=True),
    )
    yield (
        'pareto_eval_flops.png',
        plot_pareto(
            plt, runs, 'eval_flops_vs_dense', 'eval forward FLOPs at the realised routing (× dense)'
        ),
    )
    yield (
        'pareto_eval_tlops.png',
        plot_pareto(plt, runs, 'eval_tlops_saved', 'TLOps saved under eval routing', maximise=True),
    )
    yield (
        'frontier_eval_flops.png',
        plot_pareto(plt, runs, 'eval_flops', 'eval forward FLOPs per token', frontier=frontier),
    )
    yield (
        'frontier_train_flops.png',
        plot_pareto(plt, runs, 'train_flops', 'training FLOPs of the run', frontier=frontier),
    )
    yield 'grad_norms.png', plot_grad_norms(plt, runs)
    yield 'full_frac.png', plot_full_frac(plt, runs)


def write_plots(root, arms=None, out_dir=None, frontier=None):
    """Write every plot of the study in root to out_dir (root/plots by default); returns the paths.
    Never raises for a missing matplotlib or missing data: it prints what it skipped and why."""
    plt = pyplot()
    if plt is None:
        print(SKIPPED)
        return []
    runs = find_runs(root, arms)
    if not runs:
        print(f"plots skipped: no runs with a metrics.jsonl under {root}/<arm>/seed<s>/")
        return []
    out_dir = out_dir or os.path.join(root, 'plots')
    os.makedirs(out_dir, exist_ok=True)
    written = []
    for name, fig in figures(plt, runs, frontier):
        if isinstance(fig, str):
            print(f"plots: skipped {name}: {fig}")
            continue
        path = os.path.join(out_dir, name)
        write_whole(path, lambda f: fig.savefig(f, format='png', dpi=110, bbox_inches='tight'),
                    binary=True)
        plt.close(fig)
        written.append(path)
    print(f"plots: wrote {len(written)} PNG files to {out_dir}/")
    return written


def main(argv):
    if asks_help(argv):
        return print_help(__doc__, "python plots.py OUT_ROOT   (a study's out_root, as written by "
                          "sweep.py)", [])
    usage = "usage: python plots.py OUT_ROOT   (a study's out_root, as written by sweep.py)"
    if len(argv) != 1:
        raise ConfigError(f"plots.py takes one folder, got {len(argv)} arguments; {usage}")
    if argv[0].startswith('--'):
        raise ConfigError(f"plots.py takes no options ({argv[0]}); {usage}")
    if not os.path.isdir(argv[0]):
        what = 'is a file, not a folder' if os.path.exists(argv[0]) else 'does not exist'
        raise ConfigError(f"{argv[0]} {what}; {usage}")
    plots_dir = os.path.join(argv[0], 'plots')      # where the PNGs go: checked before any work
    if os.path.exists(plots_dir) and not os.path.isdir(plots_dir):
        raise ConfigError(f"{plots_dir} is a file, where the plots' folder goes; move it away")
    writable_folder(plots_dir, 'plots', label=f"the plots' folder {plots_dir}")
    if not find_runs(argv[0]):       # (sweep.py's summary of runs not yet made plots nothing)
        raise ConfigError(f"{argv[0]} holds no runs (no <arm>/seed<s>/metrics.jsonl): give a "
                          "study's out_root, as written by sweep.py")
    write_plots(argv[0])
    return 0


if __name__ == '__main__':
    run_cli(main)
