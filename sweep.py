"""
Run a study: a grid of arms x seeds, each arm a list of overrides on a base config, then summarise.

    python sweep.py config/study_a3.py                # run what is missing, then summarise and plot
    python sweep.py config/study_a3.py --jobs=2       # two runs at a time
    python sweep.py config/study_a3.py --summarize_only
    python sweep.py config/study_a3.py --no_plots     # summary only (plots need matplotlib)
    python sweep.py config/study_a3.py --max_iters=50 --device=cuda   # train.py overrides
    python sweep.py config/study_a3.py --dry_run      # the commands, and each run's time estimate

Overrides: every --key=value that is not one of the sweep's options is a train.py key, checked as
train.py checks it (known key, the default's type; exit 2 naming it) before any work, and appended
to every arm's run after the study's and the arm's own options (so it wins). The runs then go to a
folder of their own beside out_root, named by the overrides (out/study_a3+max_iters=50-<digest>):
the same study with other overrides, or none, never skips, resumes or summarises these runs, while
the same overrides in any order find them again. The summary records them. The 'before' runs are
not overridden: they are backbones a study's config files name by path and other studies share.
--seed and --out_dir are the study file's (seeds, out_root).

--dry_run prints every run's command with an estimate of its time and the total: its FLOPs
(flops.py: the training steps at its batch and trainable setting, plus its evals' forwards) over the
FLOP/s of one training step of the reference arm's first run, timed on this machine (median of 3
after a warm-up, random tokens; the output names the step it measured). Data loading, checkpoints
and process start-up are not counted. Progress: one line per run as it ends, "done: <run> [k/N runs,
elapsed, ETA]", the ETA from the time per run of the runs this sweep ran so far; on a terminal a
tqdm bar under the lines as well (--quiet=True: the lines only).

A study file defines: base (a config file), overrides (for every run), arms {name: [overrides]}
(a name is its folder: letters, digits and ._=+-, a letter or digit first), seeds, out_root,
reference (the arm the others are compared with), and optionally before (train.py argument lists
run once first, e.g. stage 1 of a two-stage recipe), threshold (see below) and skip (one line
saying why the study cannot run on this machine: the sweep prints it and exits 0); any other
lower-case name is refused as a misspelt field (helpers: UPPER_CASE or _names, imports and
functions). Run r of arm a writes to out_root/a/seed<s>/ (a relative out_root, as every relative
path in a study file, is relative to sweep.py's folder, wherever the sweep starts). A finished
run (its metrics.jsonl ends with its training's summary at max_iters, eval-only records aside) is
skipped; an interrupted one (ckpt.pt but no such summary) is resumed. A run folder whose config.json
differs from what the study now gives, other than in where and how it runs (HOW_KEYS), refuses the
study before any run starts (--summarize_only as well): its results would be summarised as the
study's. --jobs=N runs N train.py processes at a time, each with cpu_count // N threads
(OMP_NUM_THREADS, unless set); results do not depend on N (each run is its own process and seed).

The summary (summary.md, summary.json in out_root) gives per arm mean ± std over seeds of: avg LM,
best val LM, final val loss, causal val loss and realised full-path fraction (routed families),
threshold-hit iteration, controller grad norm, FLOPs proxy, TLOps saved (families that log
'tlops_saved'; its last logged value), wall time, G3's forecast spread (jepa_pred_std, its last
logged value: near 0 when the predictor has collapsed), and train.py's own hit_<x> columns when
the runs set lm_thresholds.
Against the reference arm it gives per-seed paired differences: wins in k/n seeds
and the mean difference with a 95% t-interval. Runs made by different code versions (git SHA / dirty
tree, from run_info.json) are flagged in the summary.

Threshold-hit iteration: the first logged iteration whose train LM loss (the 'lm_loss' of 'train'
records) is below a threshold: the study file's `threshold` if it sets one, else 1.05 × the
reference arm's final train LM loss (the last logged value, mean over its seeds). 1.05 makes
"reached 5% of where the reference ends" a question every arm can answer early, which is what the
metric is for (speed of optimisation, not endpoint). The value used and where it came from are in
the summary. Runs that never get there are counted as such (see Room below), never dropped.

Room: a study file may name room_ckpt, the backbone its arms start from ('{seed}' in it, in a
'before' run or in an override is replaced by the run's seed, so each seed can train its own
backbone). sweep.py runs `eval.py --room` on each seed's backbone (out_root/room/seed<s>.json,
measured again for a retrained backbone or other room_args) and puts the room (room_key, default
gate_room = random − oracle routing loss, else room = all-cheap − all-full) beside the reference
arm's seed std of its endpoint: below ROOM_FACTOR (10) × that std the summary says "no room" and
that the arm differences are not evidence; a std of 0 (one seed) or none gives "unknown".
Threshold hits are censored, not dropped: k/n runs hit, the mean over those that did, and a
per-seed comparison with never = ∞ (wins–losses–ties and the exact sign test's p).

Matched compute: a study file may name `frontier`, dense arms of several sizes. Each other arm is
then compared, per seed, with that seed's frontier interpolated (linear in log FLOPs, never
extrapolated) at the arm's own training FLOPs (the whole run) and its own eval FLOPs per token: the
paired difference, its t-interval, and in how many seeds the arm sits below the frontier. Its room
is how far the frontier spans in loss against the reference arm's seed std.

Scores: a study file may name `score`, a command run on each finished run with '{run}' replaced
by the run's folder and '{ckpt}' by its checkpoint (its init_from when a 0-step run saved none:
e.g. a zero-shot arm, ['--max_iters=0']), e.g. ['arith.py', '--ckpt={ckpt}', '--json'] (a
leading .py file runs with this Python, from this folder), printing one JSON object; it is cached
in <run>/score.json with the checkpoint's mtime and the command (a retrained run, or one the study
now scores with another command, is scored again). --jobs=N
scores N runs at a time.
`score_metrics` {key: lower is better?} names which of its numbers join the summary's table, each
with its paired comparison.
`room_arms` = (low arm, high arm, metric) measures the room from two arms instead of eval.py
--room: the high arm's mean minus the low arm's on that metric (e.g. full fine-tuning minus the
zero-shot backbone's accuracy), against ROOM_FACTOR × the reference arm's seed std of it.

Afterwards the plots of plots.py go to out_root/plots/ (skipped, with a note, without matplotlib).
Exit code 1 when a run failed (after the summary of those that finished; the failed runs' logs are
named), 2 for a bad study file or option.

Before the first run, every run's whole configuration (base + overrides + arm + seed, and the
'before' runs) goes through train.py's own parsing and checks: a typo, a wrong type or another
family's option in any arm refuses the study (exit 2, one line naming the arm and the key) and
nothing runs. So do the inputs train.py checks before its work, for each run not finished: the
device and dtype, the checkpoint it resumes or starts from (where it exists already: one a
'before' run writes is checked by that run), the prepared data and the batch against memory.
Not checked: whether W&B will start a run (--log=wandb: only starting one tells).

Stopping: each train.py runs in its own process group, so Ctrl-C at the terminal reaches the sweep
alone. On SIGINT or SIGTERM the sweep passes the signal on to the runs in flight (each checkpoints
and stops, as train.py does on a signal), starts no queued run, kills a run still alive
STOP_GRACE_S (120 s) later with its whole group, and exits 130 (SIGINT) or 143 (SIGTERM) with one
line on stderr giving the command that resumes the study (the same command: stopped runs resume
from their checkpoints). A signal after the runs (while scoring, measuring the room, summarising or
plotting) stops the sweep there, with the same exit codes and one line: what it wrote is whole, a
summary it had not yet replaced is kept, and the same command writes the rest.
"""
import collections
import contextlib
import difflib
import hashlib
import io
import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from types import ModuleType

import numpy as np

from configurator import (SMOKE_ENV, ConfigError, UserError, asks_help, load_config, parse_value,
                          print_help, run_cli, source_group, writable_folder)
from data.loader import EVAL_WINDOWS
from files import write_whole
from plots import mean_std, read_metrics, run_metrics, train_lm_curve, write_plots
import progress
from runlock import SWEEP_ROOT_ENV, lock_folder

HERE = os.path.dirname(os.path.abspath(__file__))
TRAIN = os.path.join(HERE, 'train.py')
# two-sided 95% quantiles of Student's t for df = 1..30; df > 30 uses df = 30's, a bound above the
# true quantile (2.042 > 2.000 at df 60; the normal's 1.96 would be below every one)
T95 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
       2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
       2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042]
ROOM_FACTOR = 10           # arm differences count where the room is >= 10 × the reference arm's
                           # seed std
THRESHOLD_FACTOR = 1.05     # default threshold: 1.05 × the reference arm's final train LM loss
STOP_GRACE_S = 120          # after a signal, a run gets this long to checkpoint before it is killed
EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}     # 128 + the signal, as a shell reports
# metric -> (where it comes from, lower is better?), in the summary's column order
METRICS = {
    'avg_lm': ('summary', True),
    'best_val_lm': ('summary', True),
    'final_val_loss': ('eval', True),
    'causal_val_loss': ('routing', True),
    'realised_full_frac': ('routing', None),
    'threshold_hit': ('train', True),
    'ctrl_grad_norm': ('train', True),
    'flops_proxy': ('summary', True),
    'tlops_saved': ('any', False),
    'eval_tlops_saved': ('routing', False),
    'eval_flops_vs_dense': ('summary', True),
    'eval_flops': ('summary', True),
    'train_flops': ('summary', True),
    'wall_s': ('summary', True),
    'trainable_params': ('summary', None),
    'ms_per_step': ('train', None),
    'jepa_pred_std': ('train', None),
}


# the fields a study file may set; other lower-case names are refused (a misspelt field)
STUDY_FIELDS = ('base', 'arms', 'seeds', 'out_root', 'overrides', 'reference', 'before',
                'threshold', 'skip', 'room_ckpt', 'room_key', 'room_args', 'frontier', 'score',
                'score_metrics', 'room_arms')


ARM_NAME = re.compile(r'[A-Za-z0-9][A-Za-z0-9._=+-]*')


def load_study(path):
    if os.path.isdir(path):
        raise ConfigError(f"study file {path} is a folder; name a study file in it, e.g. "
                          "config/study_a3.py")
    if not os.path.isfile(path):
        raise ConfigError(f"study file not found: {path}")
    ns = {}
    try:
        with open(path) as f:
            exec(compile(f.read(), path, 'exec'), ns)
    except SyntaxError as e:
        raise ConfigError(f"study {path}, line {e.lineno}: {e.msg}; fix the file") from None
    except (Exception, SystemExit) as e:     # a runtime error or an exit() in the file
        raise ConfigError(f"study {path}: {type(e).__name__}: {e}; fix the file") from None
    stray = [k for k, v in ns.items() if k.islower() and not k.startswith('_')
             and k not in STUDY_FIELDS and not callable(v) and not isinstance(v, ModuleType)]
    if stray:                        # a misspelt field would be ignored without a word
        close = difflib.get_close_matches(stray[0], STUDY_FIELDS, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ''
        raise ConfigError(f"study {path}: unknown field '{stray[0]}'{hint}; the fields are "
                          f"{', '.join(STUDY_FIELDS)} (helpers: UPPER_CASE or _names)")
    missing = [k for k in ('base', 'arms', 'seeds', 'out_root') if k not in ns]
    if missing:
        raise ConfigError(f"study {path} must define {', '.join(missing)}")
    if (not isinstance(ns['arms'], dict) or not ns['arms']
            or not isinstance(ns['seeds'], (list, tuple, range)) or not ns['seeds']):
        raise ConfigError(
            f"study {path}: arms must be a non-empty dict {{name: [overrides]}} and seeds a "
            f"non-empty list"
        )
    if not isinstance(ns['out_root'], str) or not ns['out_root']:
        raise ConfigError(f"study {path}: out_root must name a folder, e.g. out_root = "
                          "'out/study_x'")
    if not isinstance(ns['base'], str) or not ns['base']:
        raise ConfigError(f"study {path}: base must name a config file, e.g. base = "
                          f"'config/families_synthetic.py'; got {ns['base']!r}")
    # an arm is a folder of out_root: '../x', 'a/b' or '' would put its runs elsewhere
    odd = next((a for a in ns['arms'] if not (isinstance(a, str) and ARM_NAME.fullmatch(a))), None)
    if odd is not None:
        raise ConfigError(f"study {path}: arm name {odd!r} must be letters, digits and ._=+- "
                          "(not first), e.g. 'G1_b0.5': it names the arm's folder in out_root")
    whole = [isinstance(s, int) and not isinstance(s, bool) and 0 <= s < 2**63 for s in ns['seeds']]
    if not all(whole):
        raise ConfigError(f"study {path}: seeds must be whole numbers >= 0, got {ns['seeds']!r}")
    twice = next((s for i, s in enumerate(ns['seeds']) if s in ns['seeds'][:i]), None)
    if twice is not None:            # one run, counted as two seeds in every mean and std
        raise ConfigError(f"study {path}: seeds must differ: {twice} is given twice")

    def argv_list(v):                # (a string would be spread into one argument per character)
        return isinstance(v, (list, tuple)) and all(isinstance(a, str) for a in v)
    bad = next((a for a, ov in ns['arms'].items() if not argv_list(ov)), None)
    if bad is not None:
        raise ConfigError(f"study {path}: arm {bad!r} must be a list of train.py arguments, e.g. "
                          f"{{{bad!r}: ['--max_iters=100']}}; got {ns['arms'][bad]!r}")
    for key, script in (('overrides', 'train.py'), ('room_args', 'eval.py')):
        if not argv_list(ns.setdefault(key, [])):
            raise ConfigError(f"study {path}: {key} must be a list of {script} arguments, e.g. "
                              f"['--eval_iters=20']; got {ns[key]!r}")
    for where, argv in [*((f"arm {a!r}", ov) for a, ov in ns['arms'].items()),
                        ('overrides', ns['overrides'])]:
        mine = next((a for a in argv if a.split('=', 1)[0] in ('--seed', '--out_dir')), None)
        if mine:        # the sweep appends its own after them: they would change nothing
            key = mine.split('=', 1)[0][2:]
            raise ConfigError(f"study {path}: {where} gives {mine}, but the sweep sets each run's "
                              f"{key} itself; drop it and change {SET_BY_THE_SWEEP[key]}")
    before = ns.setdefault('before', [])
    if not isinstance(before, (list, tuple)) or not all(argv_list(a) for a in before):
        raise ConfigError(f"study {path}: before must be a list of train.py argument lists, e.g. "
                          f"[['config/stage1.py', '--out_dir=out/stage1']]; got {before!r}")
    ns.setdefault('reference', next(iter(ns['arms'])))
    if ns['reference'] not in ns['arms']:
        raise ConfigError(
            f"study {path}: reference arm {ns['reference']!r} is not one of {list(ns['arms'])}"
        )
    score, metrics = ns.setdefault('score', None), ns.setdefault('score_metrics', {})
    if score is not None and not (isinstance(score, list) and score
                                  and all(isinstance(a, str) for a in score)):
        raise ConfigError(f"study {path}: score must be a command as a list of strings, e.g. "
                          "['arith.py', '--ckpt={ckpt}', '--json']")
    if score is not None and not (os.path.isfile(os.path.join(HERE, score[0]))
                                  if score[0].endswith('.py') else shutil.which(score[0])):
        raise ConfigError(f"study {path}: score's command {score[0]!r} is no script of this "
                          "repository and no program on PATH; e.g. ['arith.py', "
                          "'--ckpt={ckpt}', '--json']")
    for key in ('room_ckpt', 'room_key'):
        value = ns.setdefault(key, None)
        if value is not None and not (isinstance(value, str) and value):
            raise ConfigError(f"study {path}: {key} must be a string or None; got {value!r}")
    if not isinstance(metrics, dict) or not all(isinstance(v, bool) for v in metrics.values()):
        raise ConfigError(f"study {path}: score_metrics must be {{key: lower_is_better}}, e.g. "
                          "{'accuracy': False}")
    skip = ns.setdefault('skip', None)
    if skip is not None and not (isinstance(skip, str) and skip and '\n' not in skip):
        raise ConfigError(f"study {path}: skip must be one line saying why the study cannot run "
                          "here (or None)")
    room_arms = ns.setdefault('room_arms', None)
    if room_arms is not None and (not isinstance(room_arms, (list, tuple)) or len(room_arms) != 3
                                  or any(a not in ns['arms'] for a in room_arms[:2])):
        raise ConfigError(f"study {path}: room_arms must be (low arm, high arm, metric) with both "
                          f"arms among {list(ns['arms'])}")
    if room_arms is not None and room_arms[2] not in (*METRICS, *metrics):
        raise ConfigError(f"study {path}: room_arms' metric {room_arms[2]!r} is not a column of "
                          f"the summary; name one of {[*METRICS, *metrics]}")
    # read only when the runs are summarised: checked here, before any of them
    threshold = ns.setdefault('threshold', None)
    if threshold is not None and not (isinstance(threshold, (int, float))
                                      and not isinstance(threshold, bool)
                                      and math.isfinite(threshold) and threshold > 0):
        raise ConfigError(f"study {path}: threshold must be a finite number > 0 (a train LM "
                          f"loss), or None for {THRESHOLD_FACTOR} × the reference arm's; got "
                          f"{threshold!r}")
    frontier = ns.get('frontier')
    if frontier is not None and (not isinstance(frontier, (list, tuple)) or len(frontier) < 2):
        raise ConfigError(f"study {path}: frontier must be a list of 2 or more dense arms of "
                          f"several sizes, e.g. ['dense_d64', 'dense_d128']; got {frontier!r}")
    stray = [a for a in frontier or [] if a not in ns['arms']]
    if stray:
        raise ConfigError(
            f"study {path}: frontier arm(s) {stray} are not among the arms {list(ns['arms'])}"
        )
    return ns


def in_here(path):
    """A study's relative paths (out_root, a 'before' run's --out_dir, room_ckpt) name places in
    this folder, where its runs start (train.py runs with cwd=HERE): the sweep looks for them
    there too, from whatever folder it was started."""
    if os.path.isabs(path) or os.path.realpath(os.getcwd()) == os.path.realpath(HERE):
        return path                    # (as given: the lines it prints stay as the user wrote it)
    return os.path.join(HERE, path)


def with_seed(argv, seed):
    """A run's arguments with '{seed}' replaced: per-seed paths, e.g. each seed's own stage-1
    backbone."""
    return [a.replace('{seed}', str(seed)) for a in argv]


def before_runs(study, path):
    """The 'before' runs as stages run in order, each a list of (argv, log name): an entry naming
    '{seed}' is one stage of a run per seed (each seed its own backbone, run jobs at a time)."""
    stages = []
    for argv in study['before']:
        if not any(a.startswith('--out_dir=') for a in argv):
            raise ConfigError(f"study {path}: every 'before' run must give --out_dir=")
        if any('{seed}' in a for a in argv):
            stages.append(
                [
                    (with_seed(argv, s) + [f'--seed={s}'], f'before_seed{s}.log')
                    for s in study['seeds']
                ]
            )
        else:
            stages.append([(list(argv), 'before.log')])
    return stages


def run_before(stages, root, jobs, children):
    """The 'before' runs in order, a stage's per-seed runs jobs at a time; 1 as soon as one failed
    (or was stopped by a signal: the arms need them finished)."""
    def one(run):
        argv, log = run
        out = in_here(next(a.split('=', 1)[1] for a in argv if a.startswith('--out_dir=')))
        print(f"before: {' '.join(argv)}", flush=True)
        return run_one([a for a in argv if not a.startswith('--out_dir=')], out,
                       os.path.join(root, log), jobs, children, root)
    for stage in stages:
        codes = run_all(one, stage, jobs, children)
        if children.signum is not None:
            return 1
        failed = [(out, code, log) for (out, code), (_, log) in zip(codes, stage) if code]
        for out, code, log in failed:
            print(
                f"error: 'before' run failed (exit {code}): {out}; see {root}/{log}",
                file=sys.stderr,
            )
        if failed:
            return 1
    return 0


def measure_room(study, root, children=None):
    """eval.py --room on each seed's backbone (the study's room_ckpt, '{seed}' replaced), cached in
    out_root/room/seed<s>.json with the checkpoint's mtime, eval.py's arguments and the eval
    windows' version (a retrained backbone, other room_args or other windows: measured again);
    {seed: report} ({} when no seed could be measured), or None when the study names no
    room_ckpt. After a stop (children.signum) nothing more is measured."""
    if not study.get('room_ckpt'):
        return None
    os.makedirs(os.path.join(root, 'room'), exist_ok=True)
    out = {}
    for s in study['seeds']:
        path, ckpt = (
            os.path.join(root, 'room', f'seed{s}.json'),
            in_here(with_seed([study['room_ckpt']], s)[0]),
        )
        if not os.path.exists(ckpt):
            continue
        cached = json.load(open(path)) if os.path.exists(path) else {}
        args = [f'--ckpt={ckpt}', '--room', '--json', *study.get('room_args', [])]
        if (cached.get('ckpt_mtime') != os.path.getmtime(ckpt) or cached.get('eval_args') != args
                or cached.get('eval_windows') != EVAL_WINDOWS):
            if stopping(children):
                break
            res = subprocess.run(
                [sys.executable, os.path.join(HERE, 'eval.py'), *args],
                capture_output=True,
                text=True,
                cwd=HERE,
            )
            if res.returncode:
                if stopping(children):     # the terminal's Ctrl-C reached it too: not a failure
                    break
                print(
                    f"room: eval.py --room failed on {ckpt}: {res.stderr.strip()[-300:]}",
                    file=sys.stderr,
                )
                continue
            cached = dict(json.loads(res.stdout), ckpt_mtime=os.path.getmtime(ckpt),
                          eval_args=args, eval_windows=EVAL_WINDOWS)
            write_whole(path, lambda f: json.dump(cached, f))
        out[s] = cached
    return out


def finished(out_dir):
    """The training wrote its summary at max_iters, not stopped by a signal in its final eval
    (read_metrics leaves an eval-only run's records out: a run killed between its last checkpoint
    and its summary is resumed, and the resume writes it, however it was evaluated since)."""
    recs = read_metrics(out_dir)
    cfg_path = os.path.join(out_dir, 'config.json')
    if (not recs or recs[-1].get('type') != 'summary' or recs[-1].get('stopped')
            or not os.path.exists(cfg_path)):
        return False
    with open(cfg_path) as f:
        return recs[-1]['iter'] >= json.load(f)['max_iters']


def child_env(jobs, root=None):
    """The environment of the train.py processes. PyTorch gives every process all the cores, so N
    processes at a time oversubscribe the machine (2 runs on 2 cores, each with 2 threads: 7× slower
    per iteration than each with 1); with jobs > 1 each gets cpu_count // jobs threads, unless the
    user set OMP_NUM_THREADS. root: the out_root this sweep holds, where its own runs may write
    (runlock refuses any other run there)."""
    env = dict(os.environ, **({SWEEP_ROOT_ENV: os.path.realpath(root)} if root else {}))
    if jobs > 1 and 'OMP_NUM_THREADS' not in env:
        env['OMP_NUM_THREADS'] = str(max(1, (os.cpu_count() or 1) // jobs))
    return env


class Children:
    """The train.py processes in flight, each in its own process group (so a Ctrl-C at the
    terminal reaches the sweep alone, and the sweep decides what its runs get), and the stop a
    signal asked for: the signal goes on to every run in flight (train.py checkpoints and stops, as
    on its own), no run starts after it, and a run still alive STOP_GRACE_S later is killed with its
    whole group."""

    def __init__(self):
        self.lock = threading.RLock()        # re-entrant: the handler runs in the main thread
        self.running = []
        self.signum = None                   # the first signal received
        self.kill_at = None

    def start(self, args, **kw):
        """A started Popen, or None once a stop was asked for (nothing new starts)."""
        with self.lock:
            if self.signum is not None:
                return None
            # (a process group of its own, with no stdin: a background group that read the
            # terminal would be stopped)
            proc = subprocess.Popen(args, process_group=0, stdin=subprocess.DEVNULL, **kw)
            self.running.append(proc)
            return proc

    def done(self, proc):
        with self.lock:
            self.running.remove(proc)

    def stop(self, signum, frame=None):
        """The signal handler; a second signal is passed on too (train.py aborts on a second
        Ctrl-C)."""
        with self.lock:
            if self.signum is None:
                self.signum, self.kill_at = signum, time.time() + STOP_GRACE_S
            for proc in self.running:
                signal_group(proc, signum)

    def kill_overdue(self):
        with self.lock:
            if self.kill_at is not None and time.time() > self.kill_at:
                for proc in self.running:
                    signal_group(proc, signal.SIGKILL)


def stopping(children):
    """Whether a signal asked the sweep to stop (children: the sweep's Children, or None)."""
    return children is not None and children.signum is not None


def stopped_summarising(children, argv):
    """After the runs, a signal stops the sweep where it is (scores, room, summary, plots), in one
    line: the files written so far are whole, and the same command writes the rest."""
    name = signal.Signals(children.signum).name
    print(f"stopped by {name} while summarising (no run was in flight); resume with: python "
          f"sweep.py {shlex.join(argv)}", file=sys.stderr)
    return EXIT_CODES[children.signum]


def signal_group(proc, signum):
    try:
        os.killpg(proc.pid, signum)
    except ProcessLookupError:      # already gone
        pass


def start_argv(out_dir):
    """How run_one starts a run not finished: resuming its checkpoint, or over what a run that died
    before its first checkpoint left."""
    if os.path.exists(os.path.join(out_dir, 'ckpt.pt')):
        return ['--init_from=resume']
    return ['--overwrite=True']


def run_one(argv, out_dir, log_path, jobs=1, children=None, root=None):
    """Run train.py (resuming if a checkpoint exists), one of `jobs` at a time; returns (out_dir,
    exit code), the code None when a stop was asked for before it started. root: the out_root
    this sweep holds (child_env)."""
    if finished(out_dir):
        return out_dir, 0
    children = children or Children()
    args = [sys.executable, TRAIN, *argv, f'--out_dir={out_dir}', *start_argv(out_dir)]
    if children.signum is not None:
        return out_dir, None
    os.makedirs(out_dir, exist_ok=True)
    with open(log_path, 'a') as log:
        proc = children.start(args, stdout=log, stderr=subprocess.STDOUT, cwd=HERE,
                              env=child_env(jobs, root))
        if proc is None:
            return out_dir, None
        try:
            code = proc.wait()
        finally:
            children.done(proc)
    return out_dir, code


def run_all(fn, items, jobs, children, on_done=None):
    """fn over items, jobs at a time, in order; the main thread waits in short steps so that a
    signal is handled at once and a run that outlives the grace period after it is killed.
    on_done(item, result) is called in the main thread as each finishes (the progress line)."""
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futs = [pool.submit(fn, item) for item in items]
        reported = set()
        while len(reported) < len(futs):
            wait(futs, timeout=0.2)
            children.kill_overdue()
            for i, f in enumerate(futs):
                if f.done() and i not in reported:
                    reported.add(i)
                    if on_done is not None and f.exception() is None:
                        on_done(items[i], f.result())
        return [f.result() for f in futs]


@contextlib.contextmanager
def stop_on_signals(children):
    """SIGINT and SIGTERM go to children.stop while the sweep runs; the previous handlers after."""
    old = {s: signal.signal(s, children.stop) for s in EXIT_CODES}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def check_configs(runs, made_later, inputs=True):
    """Every run's full configuration (config files, overrides, seed) through train.py's own
    parsing and checks, before the first run starts, and its inputs as train.py checks them before
    any work (train.check_run_inputs: device and dtype, its starting or resumed checkpoint, the
    prepared data, the batch against memory), for the run run_one would start: one bad option or
    input refuses the study, rather than failing its arm after the others ran. runs: (name, argv)
    with --out_dir; made_later: folders the study's 'before' runs write, whose checkpoints a later
    run may start from (they do not exist yet). inputs=False: the configurations alone."""
    import train             # torch: only where runs are started
    later = [os.path.abspath(os.path.join(HERE, d)) + os.sep for d in made_later]
    with contextlib.chdir(HERE), contextlib.redirect_stdout(io.StringIO()), \
            contextlib.redirect_stderr(io.StringIO()):     # the notes are for the runs' own logs
        for name, argv in runs:
            try:
                given = train.load_config(train.DEFAULTS, argv)
                made = os.path.abspath(given['init_from']).startswith(tuple(later))
                if made and not os.path.exists(given['init_from']):
                    argv = [*argv, '--init_from=scratch']    # checked as far as it can be
                starts = inputs and not finished(given['out_dir'])
                if starts:                  # as run_one starts it (HOW_KEYS: not compared below)
                    argv = [*argv, *start_argv(given['out_dir'])]
                run_cfg, cfg = train.read_config(argv)
            except UserError as e:
                raise ConfigError(f"{name}: {e}; fix the study file, no run was started") from None
            changed = changed_since_ran(cfg)
            if changed:
                k, had, now = changed[0]
                raise ConfigError(
                    f"{name}: {cfg['out_dir']} ran with {k}={had!r}, the study now gives {now!r}"
                    f"{f' (and {len(changed) - 1} more)' if len(changed) > 1 else ''}; its "
                    "results would be summarised as the study's: remove that folder to run it "
                    "again, or give the study another out_root"
                )
            if starts:
                try:
                    train.check_run_inputs(run_cfg)
                except UserError as e:
                    raise ConfigError(f"{name}: {e}; no run was started") from None


def check_room_args(study):
    """The study's room_args through eval.py's own option parsing, before the first run (they are
    used after the last)."""
    if not study.get('room_ckpt'):
        return
    import eval as ev        # torch: only where runs are started
    try:
        load_config(ev.DEFAULTS, [a for a in study['room_args'] if a not in ev.FLAGS])
    except UserError as e:
        raise ConfigError(f"room_args: {e}; fix the study file, no run was started") from None


# options that say where or how a run runs, not what it computes: a resumed or summarised run may
# differ in these from the study that made it
HOW_KEYS = ('out_dir', 'init_from', 'overwrite', 'eval_only', 'log', 'wandb_project',
            'wandb_run_name', 'data_dir', 'device', 'compile', 'ddp_timeout', 'verify_data')


def changed_since_ran(cfg):
    """[(key, value it ran with, value now)] for a run folder holding a checkpoint or a finished
    run (one of 0 steps saves no checkpoint) whose config.json differs from the configuration cfg
    (train.py's, relative to HERE) in what the run computes: a finished run would be skipped and an
    unfinished one resumed under other options,
    and the summary would mix them. Keys its config.json lacks (an older run) are not compared, nor
    an unfinished run's max_iters (it resumes to the study's)."""
    path = os.path.join(cfg['out_dir'], 'config.json')
    done = finished(cfg['out_dir'])
    if not ((done or os.path.exists(os.path.join(cfg['out_dir'], 'ckpt.pt')))
            and os.path.exists(path)):
        return []                       # nothing kept: the run starts over with these options
    with open(path) as f:
        ran = json.load(f)
    now = json.loads(json.dumps(cfg))   # tuples as lists, as config.json holds them
    # train.py resumes a stopped run to another max_iters; a finished one would be skipped
    skip = HOW_KEYS + (() if done else ('max_iters',))
    return [(k, ran[k], now[k]) for k in now if k in ran and k not in skip and ran[k] != now[k]]


def lm_threshold(study, results):
    """(threshold, where it came from): the study's `threshold`, else THRESHOLD_FACTOR × the mean
    over seeds of the reference arm's final train LM loss; (None, why) when neither is available."""
    if study.get('threshold') is not None:
        return float(study['threshold']), 'study file'
    finals = [
        m.get('final_train_lm') for (arm, _), m in results.items() if arm == study['reference']
    ]
    finals = [v for v in finals if v is not None]
    if not finals:
        return None, 'no train LM loss logged by the reference arm'
    return THRESHOLD_FACTOR * float(
        np.mean(finals)
    ), f"{THRESHOLD_FACTOR} × reference arm's final train LM"


def threshold_hit(out_dir, threshold):
    """First logged iteration whose train LM loss is below threshold (None if never)."""
    return next((it for it, v in train_lm_curve(read_metrics(out_dir)) if v < threshold), None)


def paired(arm_vals, ref_vals, lower_better):
    """Per-seed differences arm − reference: wins, mean and 95% t-interval of the difference."""
    d = [a - r for a, r in zip(arm_vals, ref_vals) if a is not None and r is not None]
    if not d:
        return None
    n, m = len(d), float(np.mean(d))
    half = (
        T95[min(n - 2, len(T95) - 1)] * float(np.std(d, ddof=1)) / math.sqrt(n)
        if n > 1
        else float('nan')
    )
    wins = sum(x < 0 for x in d) if lower_better else sum(x > 0 for x in d)
    return dict(n=n, wins=wins, mean_diff=m, ci95=[m - half, m + half])


def sign_test(wins, losses):
    """Two-sided exact sign test over the untied pairs: P(a split at least this uneven | no
    difference)."""
    n = wins + losses
    if n == 0:
        return 1.0
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(min(wins, losses) + 1)) / 2 ** n)


def paired_hits(arm_hits, ref_hits, ran):
    """Threshold hits compared per seed with a run that never got there counted as hitting at
    infinity (never dropped): wins (the arm got there first), losses, ties (same iteration, or
    neither got there), and the sign test's p over the untied seeds."""
    inf = float('inf')
    d = [
        (inf if a is None else a) - (inf if r is None else r)
        for a, r, ok in zip(arm_hits, ref_hits, ran)
        if ok
    ]
    if not d:
        return None
    wins, losses = sum(x < 0 for x in d), sum(x > 0 for x in d)   # inf - inf is nan: neither, a tie
    return dict(n=len(d), wins=wins, losses=losses, ties=len(d) - wins - losses,
                sign_p=sign_test(wins, losses))


def is_hit_metric(k):
    return k == 'threshold_hit' or k.startswith('hit_')


def summarize(study, results, threshold=(None, None), room=None, overrides=()):
    arms, seeds, ref = list(study['arms']), study['seeds'], study['reference']
    metrics = {**{k: (v, lower) for k, (v, lower) in METRICS.items()},
               **{k: ('score', lower) for k, lower in study.get('score_metrics', {}).items()}}
    keys = list(metrics) + sorted({k for r in results.values() for k in r if k.startswith('hit_')})
    table = {}
    for arm in arms:
        table[arm] = {}
        for k in keys:
            vals = [results.get((arm, s), {}).get(k) for s in seeds]
            mu, sd = mean_std(vals)
            entry = dict(mean=mu, std=sd, per_seed=vals)
            lower = metrics.get(k, (None, True))[1]
            ref_vals = [results.get((ref, s), {}).get(k) for s in seeds]
            if is_hit_metric(k):   # censored: a run that never hit is a result, not a missing value
                # a run that measured this hit
                ran = [k in results.get((arm, s), {}) for s in seeds]
                entry.update(
                    hits=sum(v is not None for v, ok in zip(vals, ran) if ok), runs=sum(ran)
                )
                if arm != ref:
                    both = [a and k in results.get((ref, s), {}) for a, s in zip(ran, seeds)]
                    entry['vs_reference'] = paired_hits(vals, ref_vals, both)
            elif arm != ref and lower is not None:
                entry['vs_reference'] = paired(vals, ref_vals, lower)
            table[arm][k] = entry
    codes = sorted({r.get('code', 'unknown') for r in results.values()})
    return dict(
        study=study['__file__'] if '__file__' in study else None,
        overrides=list(overrides),          # the command line's, on every run (after the arm's)
        reference=ref,
        seeds=seeds,
        code_versions=codes,
        mixed_code_versions=len(codes) > 1,
        threshold=dict(value=threshold[0], source=threshold[1]),
        table=table,
        room=(arms_room(study, table) if study.get('room_arms') else
              None if room is None else room_verdict(study, room, table[ref])),
        frontier=matched_compute(study, results, table[ref]),
    )


def frontier_at(points, x):
    """The dense frontier's loss at cost x: linear in log(cost) between the two frontier points
    either side of x (points: (cost, loss) of each dense size); None outside their range (never
    extrapolated)."""
    pts = sorted(p for p in points if p[0] > 0)         # a cost of 0 has no logarithm
    if len(pts) < 2 or not pts[0][0] <= x <= pts[-1][0]:
        return None
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * math.log(x / x0) / math.log(x1 / x0)


def matched_compute(study, results, ref_row, loss='final_val_loss'):
    """Each arm against the dense frontier (the study's `frontier`: dense arms of several sizes) at
    equal cost, per seed against that seed's own frontier: on the training FLOPs of the whole run
    and on the eval forward's FLOPs per token. Paired like the reference comparison (wins = below
    the frontier); a seed whose cost lies outside the frontier's range has no difference. Room: how
    far the frontier spans in loss (smallest minus largest model, mean over seeds) against the
    reference arm's seed std."""
    sizes, seeds = study.get('frontier') or [], study['seeds']
    if len(sizes) < 2:
        return None
    def point(arm, s, axis):
        m = results.get((arm, s), {})
        return (m[axis], m[loss]) if m.get(axis) is not None and m.get(loss) is not None else None
    axes = {}
    for axis in ('train_flops', 'eval_flops'):
        rows = {}
        for arm in study['arms']:
            if arm in sizes:
                continue
            at, own, missing = [], [], 0
            for s in seeds:
                p, pts = point(arm, s, axis), [q for q in (point(f, s, axis) for f in sizes) if q]
                missing += p is None or len(pts) < 2        # not measured: not the same as outside
                                                            # the range
                own.append(p and p[1])
                at.append(frontier_at(pts, p[0]) if p else None)
            rows[arm] = dict(
                paired(own, at, True) or {},
                inside=sum(v is not None for v in at),
                missing=missing,
                runs=len(seeds),
            )
        axes[axis] = rows
    spans = []
    for s in seeds:                 # smallest minus largest model, by whichever cost the runs
                                    # record
        pts = max(
            [
                sorted(q for q in (point(f, s, axis) for f in sizes) if q)
                for axis in ('eval_flops', 'train_flops')
            ],
            key=len,
        )
        spans.append(pts[0][1] - pts[-1][1] if len(pts) > 1 else None)
    span, std = mean_std(spans)[0], ref_row[loss]['std']
    enough = None if span is None or not std else span >= ROOM_FACTOR * std
    return dict(
        arms=sizes,
        loss=loss,
        axes=axes,
        span=span,
        span_per_seed=spans,
        seed_std=std,
        factor=ROOM_FACTOR,
        verdict={True: 'room', False: 'no room', None: 'unknown'}[enough],
    )


def score_run(study, out_dir, jobs=1, children=None):
    """The study's score command's JSON for a finished run (cached in <run>/score.json with the
    checkpoint's mtime, the command and the eval windows' version: a retrained run, another command
    or other windows is scored again); {}
    when the study has none, or with a note on stderr when it failed. jobs: how many score
    commands run at once (their threads shared as train.py runs share them). After a stop
    (children.signum) no score command starts."""
    if not study.get('score'):
        return {}
    path, ckpt = os.path.join(out_dir, 'score.json'), os.path.join(out_dir, 'ckpt.pt')
    if not os.path.exists(ckpt):        # a run of 0 steps saves nothing: it is its start model
        with open(os.path.join(out_dir, 'config.json')) as f:
            ckpt = json.load(f).get('init_from') or ckpt
    # (an init_from that is not a file, e.g. a hub name, has no mtime: its name and the command
    # key the cache)
    mtime = os.path.getmtime(ckpt) if os.path.exists(ckpt) else None
    command = [a.replace('{run}', out_dir).replace('{ckpt}', ckpt) for a in study['score']]
    cached = json.load(open(path)) if os.path.exists(path) else {}
    if (cached.get('ckpt_mtime') != mtime or cached.get('score_command') != command
            or cached.get('eval_windows') != EVAL_WINDOWS):
        if stopping(children):
            return {}
        argv = command
        if argv[0].endswith('.py'):
            argv = [sys.executable, os.path.join(HERE, argv[0]), *argv[1:]]
        res = subprocess.run(argv, capture_output=True, text=True, cwd=HERE, env=child_env(jobs))
        try:
            cached = dict(json.loads(res.stdout), ckpt_mtime=mtime, score_command=command,
                          eval_windows=EVAL_WINDOWS)
        except json.JSONDecodeError:
            res.returncode = res.returncode or 1
        if res.returncode:
            if stopping(children):         # the terminal's Ctrl-C reached it too: not a failure
                return {}
            print(f"score: {shlex.join(argv)} failed (exit {res.returncode}): "
                  f"{res.stderr.strip()[-300:]}", file=sys.stderr)
            return {}
        write_whole(path, lambda f: json.dump(cached, f))
    return {k: v for k, v in cached.items() if k in study['score_metrics']}


def score_runs(study, out_dirs, jobs=1, children=None):
    """score_run of each of out_dirs, jobs at a time (a score command is a process of its own),
    in the order given."""
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(lambda out_dir: score_run(study, out_dir, jobs, children),
                             out_dirs))


def arms_room(study, table):
    """The room measured by two arms (the study's room_arms: low, high, metric): the high arm's
    mean minus the low arm's, against ROOM_FACTOR × the reference arm's seed std of the metric;
    'unknown' where that std is not measured or is 0 (one seed has no spread), as room_verdict."""
    low, high, metric = study['room_arms']
    lo, hi, ref = table[low][metric], table[high][metric], table[study['reference']][metric]
    size = None if lo['mean'] is None or hi['mean'] is None else hi['mean'] - lo['mean']
    spread = ref['std']
    enough = None if size is None or not spread else abs(size) >= ROOM_FACTOR * spread
    return dict(
        values={f'{low} {metric}': dict(mean=lo['mean'], std=lo['std']),
                f'{high} {metric}': dict(mean=hi['mean'], std=hi['std'])},
        key=f'{high} − {low} {metric}', size=size, seed_std_metric=metric, seed_std=spread,
        seed_std_basis='raw', seed_std_raw=spread, factor=ROOM_FACTOR,
        verdict={True: 'room', False: 'no room', None: 'unknown'}[enough], source='arms')


def room_verdict(study, room, ref_row):
    """The study's room (eval.room of each seed's backbone, mean ± std over seeds) against the seed
    spread of the reference arm's endpoint: arm differences are evidence only where the room is at
    least ROOM_FACTOR × that std. Where each seed has its own backbone, backbones differ in level
    and a paired arm difference cancels that level, so the spread used is that of the endpoint
    relative to its own backbone's all-full loss (the raw spread is reported beside it)."""
    seeds = study.get('seeds') or sorted(room)          # per_seed lists in the study's seed order,
                                                        # None where missing
    measured = [s for s in seeds if s in room]
    keys = sorted(
        {
            k
            for r in room.values()
            for k, v in r.items()
            if isinstance(v, (int, float)) and k not in ('ckpt_mtime', 'eval_windows')
        }
    )
    out = {k: dict(zip(('mean', 'std'), mean_std([room[s].get(k) for s in measured])),
                   per_seed=[room.get(s, {}).get(k) for s in seeds]) for k in keys}
    key = study.get('room_key') or ('gate_room' if 'gate_room' in out else 'room')
    metric = next(
        (m for m in ('causal_val_loss', 'final_val_loss') if ref_row[m]['mean'] is not None), None
    )
    size, spread, raw, basis = (out.get(key) or {}).get('mean'), None, None, None
    if metric:
        ends = dict(zip(seeds, ref_row[metric]['per_seed']))
        raw = ref_row[metric]['std']
        rel = [
            ends[s] - room[s]['full']
            for s in measured
            if ends.get(s) is not None and room[s].get('full') is not None
        ]
        spread, basis = (
            (mean_std(rel)[1], "relative to each backbone's all-full loss")
            if len(rel) > 1
            else (raw, 'raw')
        )
    enough = None if size is None or not spread else size >= ROOM_FACTOR * spread
    return dict(
        values=out,
        key=key,
        size=size,
        seed_std_metric=metric,
        seed_std=spread,
        seed_std_basis=basis,
        seed_std_raw=raw,
        factor=ROOM_FACTOR,
        verdict={True: 'room', False: 'no room', None: 'unknown'}[enough],
    )


def markdown(summary):
    lines = []
    if summary.get('overrides'):
        lines.append(f"Overrides on every run (after each arm's own): "
                     f"`{' '.join(summary['overrides'])}`\n")
    if summary['mixed_code_versions']:
        lines.append(
            "**Warning: these runs come from different code versions: "
            f"{summary['code_versions']}**\n"
        )
    if len(summary['seeds']) < 3:
        lines.append(
            f"**{len(summary['seeds'])} seed(s): too few for the paired intervals to mean much; "
            "use 3 or more.**\n"
        )
    room = summary.get('room')
    if room is not None:
        lines.append(room_markdown(room))
    if summary.get('frontier'):
        lines.append(frontier_markdown(summary['frontier']))
    arms = list(summary['table'])
    keys = [
        k
        for k in summary['table'][arms[0]]
        if any(
            summary['table'][a][k]['mean'] is not None or summary['table'][a][k].get('runs')
            for a in arms
        )
    ]
    lines.append('| arm | ' + ' | '.join(keys) + ' |')
    lines.append('|---' * (len(keys) + 1) + '|')
    for arm in arms:
        cells = []
        for k in keys:
            cells.append(cell_text(summary['table'][arm][k]))
        lines.append(f"| {arm} | " + ' | '.join(cells) + ' |')
    lines.append(
        f"\nmean ± std over seeds {summary['seeds']}; (wins k/n, Δ) = per-seed paired comparison "
        "with "
        f"the reference arm `{summary['reference']}` (wins: better in k of n seeds; Δ = mean of "
        "arm − "
        "reference). Threshold hits: k/n runs got there, mean ± std over those that did; (w–l–t, "
        "p) "
        f"against the reference per seed with never = ∞, and the exact sign test's p. "
        f"Code: {', '.join(summary['code_versions'])}."
    )
    th = summary.get('threshold') or {}
    if th.get('value') is not None:
        lines.append(
            f"threshold_hit: first logged iteration with train LM < {th['value']:.4f} "
            f"({th['source']})."
        )
    return '\n'.join(lines)


def mean_text(e, n):
    """mean ± std of n values; one value has no spread to show (mean_std's 0.0 is not one)."""
    return f"{e['mean']:.4g}" + (f" ± {e['std']:.2g}" if n > 1 else '')


def cell_text(e):
    if 'runs' in e:                  # a threshold hit: censored
        cell = f"{e['hits']}/{e['runs']} hit" + (f", {mean_text(e, e['hits'])}"
                                                 if e['mean'] is not None else '')
        vs = e.get('vs_reference')
        return cell + (
            f" ({vs['wins']}–{vs['losses']}–{vs['ties']}, p={vs['sign_p']:.2g})" if vs else ''
        )
    if e['mean'] is None:
        return '—'
    vs = e.get('vs_reference')
    n, seeds = sum(v is not None for v in e['per_seed']), len(e['per_seed'])
    # the note under the table says 'over seeds [...]': a failed or missing run is named here
    return mean_text(e, n) + (f" ({n} of {seeds} seeds)" if n < seeds else '') + (
        f" (wins {vs['wins']}/{vs['n']}, Δ {vs['mean_diff']:+.3g})" if vs else ''
    )


def frontier_markdown(fr):
    span = 'unknown' if fr['span'] is None else f"{fr['span']:.4f}"
    std = 'unknown' if fr['seed_std'] is None else f"{fr['seed_std']:.4f}"
    lines = [
        f"**Matched compute: {fr['verdict']}.** The dense frontier ({', '.join(fr['arms'])}) spans "
        f"{span} nats of "
        f"{fr['loss']} from its smallest to its largest model, against the reference arm's seed "
        f"std of {std} "
        f"(needs ≥ {fr['factor']}×). Each arm minus the frontier at its own cost (linear in log "
        "FLOPs, per seed): "
        "mean [95% t-interval] (below the frontier in k of n seeds; inside its range in m of n "
        "seeds).\n",
        '| arm | at equal training FLOPs | at equal eval FLOPs |',
        '|---|---|---|',
    ]

    def cell(e):
        gone = f"; not measured {e['missing']}/{e['runs']}" if e['missing'] else ''
        if e['missing'] == e['runs']:
            return 'not measured'
        if not e.get('n'):
            return f"no seed inside the frontier (inside 0/{e['runs']}{gone})"
        lo, hi = e['ci95']
        return (
            f"{e['mean_diff']:+.4f} [{lo:+.4f}, {hi:+.4f}] (below {e['wins']}/{e['n']}; inside "
            f"{e['inside']}/{e['runs']}{gone})"
            if e['n'] > 1
            else f"{e['mean_diff']:+.4f} (below {e['wins']}/1; inside "
                 f"{e['inside']}/{e['runs']}{gone})"
        )

    for arm in fr['axes']['train_flops']:
        lines.append(
            f"| {arm} | {cell(fr['axes']['train_flops'][arm])} | "
            f"{cell(fr['axes']['eval_flops'][arm])} |"
        )
    return '\n'.join(lines) + '\n'


def room_markdown(room):
    vals = ', '.join(f"{k} {v['mean']:.4f} ± {v['std']:.4f}" for k, v in room['values'].items()
                     if v['mean'] is not None and not k.endswith('full_frac'))
    spread = 'unknown' if room['seed_std'] is None else f"{room['seed_std']:.4f}"
    head = (
        f"**Room: {room['verdict']}.** {room['key']} = {room['size']:.4f} against the reference "
        "arm's seed "
        f"std of {room['seed_std_metric']} = {spread}, {room['seed_std_basis']} (needs ≥ "
        f"{room['factor']}×; "
        f"raw std {room['seed_std_raw'] or 0:.4f})"
        if room['size'] is not None
        else f"**Room: {room['verdict']}** ({room['key']} not measured)"
    )
    tail = (
        ''
        if room['verdict'] == 'room'
        else '; the arm differences below are not evidence either way'
    )
    if room.get('source') == 'arms':
        return f"{head}{tail}. The two arms: {vals}.\n"
    return f"{head}{tail}. Backbones (eval.py --room, per seed): {vals}.\n"


OPTIONS = dict(
    jobs=1,          # train.py processes at a time, each with cpu_count // jobs threads
    quiet=False,     # no progress bar (there is none off a terminal either)
)
FLAGS = {
    '--summarize_only': 'summarise and plot the runs already there; start none',
    '--dry_run': "print every run's train.py command and its estimated time; start none",
    '--no_plots': 'the summary only (the plots need matplotlib)',
}
OPTIONS_HELP = ("--jobs=N, --summarize_only, --dry_run, --no_plots, --quiet=True, and train.py's "
                "--key=value applied to every run")
SET_BY_THE_SWEEP = dict(out_dir='out_root in the study file', seed='seeds in the study file',
                        init_from=None, overwrite=None)    # resume/overwrite: the sweep decides


def parse_args(argv):
    """(study, options, jobs): the study file and every option checked before any run starts; the
    --key=value that are not the sweep's own are train.py overrides (options['overrides'])."""
    if not argv or not argv[0].endswith('.py'):
        raise ConfigError(
            "usage: python sweep.py config/study_<name>.py [--jobs=N] [--summarize_only] "
            "[--dry_run] [--no_plots] [--quiet=True] [--key=value of train.py ...]"
        )
    opts, overrides = {}, []
    for a in argv[1:]:
        key = a.split('=')[0]
        if key in ('--jobs', '--quiet', *FLAGS):
            opts[key] = a.split('=', 1)[1] if '=' in a else True
        elif a.startswith('--') and '=' in a:
            overrides.append(a)
        else:
            raise ConfigError(f"unknown option {a}; the options are {OPTIONS_HELP}")
    for flag in FLAGS:
        if opts.get(flag, True) is not True:
            raise ConfigError(f"{flag} takes no value, got {flag}={opts[flag]}; give {flag} alone")
    jobs = str(opts.get('--jobs', 1))
    if not jobs.isdigit() or not 1 <= int(jobs) <= 1024:
        raise ConfigError(f"--jobs must be a whole number from 1 to 1024, got {jobs!r}")
    quiet = parse_value(str(opts.get('--quiet', False)))
    if not isinstance(quiet, bool):
        raise ConfigError(f"--quiet must be True or False, got {opts['--quiet']!r}")
    opts['--quiet'] = quiet
    opts['overrides'] = check_overrides(overrides)
    study = load_study(argv[0])
    study['__file__'] = argv[0]
    if os.environ.get(SMOKE_ENV, '') not in ('', '0') and len(study['seeds']) > 1:
        # a smoke run checks that the study runs: its first seed of every arm shows that
        print(f"note: {SMOKE_ENV} is set: a smoke run of seed {study['seeds'][0]} only",
              file=sys.stderr)
        study['seeds'] = study['seeds'][:1]
    study['out_root'] = in_here(variant_root(study['out_root'], opts['overrides']))
    if not opts.get('--dry_run') and not study['skip']:   # it writes every run, the summary and
                                                            # the plots there
        writable_folder(study['out_root'], 'out_root', label=f"out_root={study['out_root']!r} of "
                                                             f"{argv[0]}")
    return study, opts, jobs


def check_overrides(overrides):
    """The command line's train.py overrides, each checked as train.py checks a --key=value (a
    known key, the default's type), before any work; those the sweep sets itself are refused."""
    if not overrides:
        return []
    import train             # torch: only where overrides are given
    for a in overrides:
        key = a[2:].split('=', 1)[0]
        if key in SET_BY_THE_SWEEP:
            where = SET_BY_THE_SWEEP[key]
            raise ConfigError(f"{a}: the sweep sets each run's {key} itself" + (
                f"; change {where}" if where else " (it resumes interrupted runs)"))
        try:
            with contextlib.redirect_stderr(io.StringIO()):     # a smoke run's note, once per run
                load_config(train.DEFAULTS, [a])
        except ConfigError as e:
            if key in train.DEFAULTS:          # a train.py key with a bad value
                raise ConfigError(f"{a}: {e}") from None
            raise ConfigError(f"{a} is neither an option of sweep.py nor a train.py key: {e}; the "
                              f"options are {OPTIONS_HELP}") from None
    return list(overrides)


def variant_root(out_root, overrides):
    """Where a study's runs go: out_root itself without overrides, else a folder of its own beside
    it named by the overrides (e.g. out/study_a3+max_iters=50-1f3a9c), so that the same study run
    with other overrides never skips, resumes or summarises runs made under different settings, and
    the same overrides (in any order where they set different keys) find their runs again."""
    if not overrides:
        return out_root
    last = {}
    for a in overrides:                  # left to right: a key given twice takes its last value
        key, _, value = a[2:].partition('=')
        last[key] = value
    canon = ','.join(f'{k}={v}' for k, v in sorted(last.items()))
    slug = re.sub(r'[^A-Za-z0-9._=,-]', '_', canon)[:60]
    digest = hashlib.sha1(canon.encode()).hexdigest()[:6]
    return f"{out_root.rstrip('/')}+{slug}-{digest}"


def main(argv):
    if asks_help(argv):
        return print_help(__doc__, 'python sweep.py STUDY.py [--jobs=N] [flags]',
                          [source_group('sweep.py options', OPTIONS, (__file__, 'OPTIONS'))],
                          flags=FLAGS)
    children = Children()
    with stop_on_signals(children):         # from the start: a Ctrl-C at any point ends in one line
        return sweep(argv, children)


def sweep(argv, children):
    study, opts, jobs = parse_args(argv)
    root, overrides = study['out_root'], opts['overrides']
    grid = [(arm, s, with_seed([study['base'], *study['overrides'], *ov, *overrides,
                                f'--seed={s}'], s))
            for arm, ov in study['arms'].items() for s in study['seeds']]
    if study['skip']:                 # e.g. weights this machine does not have: nothing to run
        print(f"{argv[0]}: skipped: {study['skip']}", flush=True)
        return 0
    before = before_runs(study, argv[0])
    if opts.get('--dry_run'):
        dry_run(study, grid, before, overrides)
        return stopped_summarising(children, argv) if stopping(children) else 0
    failed = []
    # (--summarize_only too: runs made under other options would be summarised as the study's;
    # but not their inputs, which summarising does not read: a copy of the study's folder
    # elsewhere may lack its data or GPU)
    made_later = [a.split('=', 1)[1] for stage in before for argv_, _ in stage for a in argv_
                  if a.startswith('--out_dir=')]
    check_configs([(f"'before' run {' '.join(a)}", a) for stage in before for a, _ in stage]
                  + [(f"arm {arm!r} seed {s}", [*a, f'--out_dir={root}/{arm}/seed{s}'])
                     for arm, s, a in grid], made_later, inputs=not opts.get('--summarize_only'))
    check_room_args(study)
    _lock = lock_folder(root, 'out_root')   # one sweep per folder, held until this returns
    if overrides:
        print(f"overrides on every run: {' '.join(overrides)}; runs in {root}", flush=True)
    if not opts.get('--summarize_only'):
        if children.signum is None and run_before(before, root, int(jobs), children):
            if children.signum is None:
                return 1      # every arm starts from them: nothing to run or summarise
        line = ProgressLine(grid, root, opts['--quiet'])

        def one(run):
            arm, s, a = run
            out = f'{root}/{arm}/seed{s}'
            return run_one(a, out, f'{out}.log', int(jobs), children, root)

        def report(run, result):
            out, code = result
            if code is None:
                return                  # not started: a stop was asked for
            if children.signum is not None and not finished(out):
                line.done(out, 'stopped')
                return
            line.done(out, 'done' if code == 0 else f'FAILED (exit {code})')
            if code:
                failed.append(out)
        run_all(one, grid, int(jobs), children, on_done=report)
        line.close()
        if children.signum is not None:   # what stopped resumes from its checkpoint; no summary
            name = signal.Signals(children.signum).name
            print(f"stopped by {name}; the runs in flight saved a checkpoint and nothing new was "
                  f"started; resume with: python sweep.py {shlex.join(argv)}", file=sys.stderr)
            return EXIT_CODES[children.signum]
    results = {
        (arm, s): run_metrics(f'{root}/{arm}/seed{s}')
        for arm, s, _ in grid
        if finished(f'{root}/{arm}/seed{s}')
    }
    threshold = lm_threshold(study, results)
    scores = score_runs(study, [f'{root}/{arm}/seed{s}' for arm, s in results], int(jobs),
                        children)
    room = measure_room(study, root, children)
    if stopping(children):        # a summary already there is kept, not replaced by part of one
        return stopped_summarising(children, argv)
    for ((arm, s), m), scored in zip(results.items(), scores):    # no threshold, no hit column
        if threshold[0] is not None:                               # (not a column of never-hits)
            m['threshold_hit'] = threshold_hit(f'{root}/{arm}/seed{s}', threshold[0])
        m.update(scored)
    summary = summarize(study, results, threshold, room=room, overrides=overrides)
    write_whole(os.path.join(root, 'summary.json'), lambda f: json.dump(summary, f, indent=2))
    md = markdown(summary)
    write_whole(os.path.join(root, 'summary.md'), lambda f: f.write(md + '\n'))
    print(md)
    if not opts.get('--no_plots') and not stopping(children):
        write_plots(root, arms=list(study['arms']), frontier=study.get('frontier'))
    if stopping(children):
        return stopped_summarising(children, argv)
    if failed:            # a failed run is not a user error: exit 1, after summarising what
                          # finished
        print(
            f"{len(failed)} of {len(grid)} runs failed; their logs: "
            f"{', '.join(o + '.log' for o in failed)}",
            file=sys.stderr,
        )
        return 1
    return 0


def dry_run(study, grid, before, overrides):
    """Print every run's command (the 'before' runs as the study file gives them: the command
    line's overrides are not applied to them) and an estimate of each run's time and the total,
    from its training FLOPs and one measured training step (see estimate_seconds)."""
    root = study['out_root']
    runs = [('before', a, in_here(next(x.split('=', 1)[1] for x in a
                                       if x.startswith('--out_dir='))),
             [x for x in a if not x.startswith('--out_dir=')])
            for stage in before for a, _ in stage]
    runs += [(f'{arm} seed {s}', [*a, f'--out_dir={root}/{arm}/seed{s}'], f'{root}/{arm}/seed{s}',
              a) for arm, s, a in grid]
    if overrides:
        print(f"overrides on every arm's run (not the 'before' runs): {' '.join(overrides)}; "
              f"runs in {root}")
    ref = next(i for i, (arm, *_) in enumerate(grid) if arm == study['reference'])
    secs, basis = estimate_seconds([r[3] for r in runs], len(runs) - len(grid) + ref)
    for (name, a, out, _), t in zip(runs, secs):
        when = ('finished' if finished(out) else 'estimate unknown' if t is None
                else f'~{duration(t)}')
        print(f"{name}: python train.py {' '.join(a)}  [{when}]")
    todo = [t for (_, _, out, _), t in zip(runs, secs) if not finished(out)]
    known = [t for t in todo if t is not None]
    print(f"estimate: {duration(sum(known))} for the {len(known)} of {len(todo)} runs left that "
          f"could be costed, one at a time (--jobs=N shares the same cores: about the same total "
          f"on a CPU); {basis}")


def estimate_seconds(runs, measured):
    """Seconds each run (train.py arguments without --out_dir) would take, and a sentence saying
    what that was estimated from: the run's FLOPs (flops.py: max_iters training steps of
    batch_size x gradient_accumulation_steps sequences at its trainable setting, plus its evals'
    forwards; each step with its family's step options, such as oracle layers or an exit
    rotation) over the FLOP/s of one training step of runs[measured] timed here (the median of 3
    after 1 warm-up, random tokens, its model at its shape on its device). None where a run's
    config cannot be read or costed without its data."""
    from types import SimpleNamespace

    import bench
    import flops
    import train
    from device import autocast_context, resolve_device_dtype
    from train_checks import shape_only_model

    def costed(argv):
        with contextlib.chdir(HERE), contextlib.redirect_stdout(io.StringIO()), \
                contextlib.redirect_stderr(io.StringIO()):
            cfg = load_config(train.DEFAULTS, argv)
            meta = os.path.join(cfg['data_dir'] or os.path.join(HERE, 'data'), cfg['dataset'],
                                'meta.json')
            vocab = cfg['vocab_size'] or (json.load(open(meta))['vocab_size']
                                          if os.path.exists(meta) else 50304)
            mcfg = train.model_config(SimpleNamespace(**cfg), vocab_size=vocab)
        T, seqs = cfg['block_size'], cfg['batch_size'] * cfg['gradient_accumulation_steps']
        lora = flops.lora_options(cfg)
        # as timed: without the family's step options
        step = flops.train_step_flops(mcfg, T, cfg['trainable'], **lora)['total']
        # the run's own steps carry the family's step options (oracle layers, an exit rotation):
        # their mean cost over its first steps (the options repeat or are drawn uniformly)
        model, run = shape_only_model(mcfg), SimpleNamespace(**cfg)
        drawn = collections.Counter(
            tuple(sorted(flops.family_of(mcfg).step_options(model, s, run).items()))
            for s in range(min(cfg['max_iters'], 64)))
        mean_step = (sum(n * flops.train_step_flops(mcfg, T, cfg['trainable'], **lora,
                                                    **dict(o))['total']
                         for o, n in drawn.items()) / sum(drawn.values())) if drawn else step
        evals = (cfg['max_iters'] // max(1, cfg['eval_interval']) + 1) * 2 * cfg['eval_iters']
        total = cfg['max_iters'] * seqs * mean_step + evals * cfg['batch_size'] * \
            flops.forward_flops(mcfg, T, 'train')
        return cfg, mcfg, step, total

    costs = []
    for argv in runs:
        try:
            costs.append(costed(argv))
        except (UserError, OSError, ValueError):
            costs.append(None)
    if costs[measured] is None:
        return [None] * len(runs), 'no step could be measured (the reference run\'s config)'
    cfg, mcfg, step, _ = costs[measured]
    try:
        dev, dt = resolve_device_dtype(SimpleNamespace(**cfg))
        secs = bench.time_train_step(dict(cfg, bench_steps=3, bench_warmup=1), mcfg, dev,
                                     autocast_context(dev, dt),
                                     controller=cfg['trainable'] == 'controller')
    except UserError as e:
        return [None] * len(runs), f'no step could be measured: {e}'
    rate = step * cfg['batch_size'] / secs
    basis = (f"estimated from flops.py's FLOPs of each run and one measured training step of "
             f"{cfg['n_layer']}L d{cfg['n_embd']} T={cfg['block_size']} B={cfg['batch_size']} "
             f"(trainable={cfg['trainable']}) on {dev}: {secs * 1e3:.0f} ms, {rate:.3g} FLOP/s; "
             f"data loading, checkpoints and start-up not counted")
    return [None if c is None else c[3] / rate for c in costs], basis


def duration(seconds):
    """'45s', '12m05s', '3h07m'."""
    s = int(round(seconds))
    if s < 60:
        return f'{s}s'
    if s < 3600:
        return f'{s // 60}m{s % 60:02d}s'
    return f'{s // 3600}h{s % 3600 // 60:02d}m'


class ProgressLine:
    """k of N runs with the time so far and an ETA, one line per run as it ends (plain lines, also
    in a log) and a tqdm bar under them on a terminal. The ETA is the time per run of the runs this
    sweep ran so far (runs at a time included: elapsed / runs ended) times the runs left; runs
    already finished before the sweep began count in k but not in that rate."""

    def __init__(self, grid, root, quiet=False):
        self.total, self.t0 = len(grid), time.time()
        outs = [f'{root}/{arm}/seed{s}' for arm, s, _ in grid]
        self.already = {o for o in outs if finished(o)}
        self.ended = self.ran = 0
        self.bar = progress.bar(self.total, desc='runs', quiet=quiet)

    def done(self, out, status):
        self.ended += 1
        self.ran += out not in self.already
        elapsed = time.time() - self.t0
        left = self.total - self.ended
        eta = ('' if not left else ', ETA ?' if not self.ran
               else f', ETA {duration(elapsed / self.ran * left)}')
        text = f'{self.ended}/{self.total} runs, {duration(elapsed)}{eta}'
        self.bar.write(f"{status}: {out} [{text}]")
        self.bar.update(1)
        self.bar.set_postfix_str(text.split(', ', 1)[1])

    def close(self):
        self.bar.close()


if __name__ == '__main__':
    run_cli(main)
