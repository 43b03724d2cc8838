"""
What carries a training run across processes, signals and resumes: the end of a DDP process, the
run folder's lock, what a checkpoint holds and how a resume picks it up (iteration, best val loss,
FLOPs, log history, optimizer, scaler, RNG streams), the metrics records a resume redoes, and the
stop on a first Ctrl-C / SIGTERM.
"""
import json
import os
import random
import signal
import sys
import traceback
from contextlib import contextmanager
from dataclasses import asdict

import numpy as np
import torch
from torch.utils._pytree import tree_map_only

from checkpoint import load_checkpoint
from configurator import UserError
from data.loader import check_data, data_identity, load_dataset_meta, needs_preparing
from files import remove_stale_temps, write_whole
from runlock import LOCK_NAME, FolderBusy, enclosing_holder, holder, lock_folder
from train_checks import TrainError, check_out_dir, check_run_files


def end_ddp_process(run_checked, argv):
    """A DDP process ends with os._exit, on every path (done, stopped by a signal, an error).
    Left to the interpreter, freeing the DDP wrapper drops the last reference to the gloo process
    group, whose destructor joins gloo's worker thread while holding the GIL, which that thread
    waits for: about one run in ten then hangs after its work is done, deaf to SIGTERM. By now
    everything the run writes is on disk (the checkpoint fsynced, metrics flushed per record and
    closed, the lock released): only stdout and stderr remain to flush."""
    code = 1
    try:
        code = run_checked(argv)
    except UserError as e:    # one write: print's two (text, then '\n') let another rank's
        sys.stderr.write(f"error: {e}\n")     # output in between, on the same terminal
        code = 2
    except SystemExit as e:    # as the interpreter does: sys.exit(message) prints it, exits 1
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
        if code == 1 and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
    except KeyboardInterrupt:          # a second Ctrl-C
        code = 130
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def hold_out_dir(cfg, proc):
    """Rank 0 locks out_dir for the run's lifetime (runlock) and, holding it, checks that a fresh
    run finds no run there (check_run_files: before any rank writes, so no rank mistakes rank 0's
    new files for an old run); under DDP every rank learns the verdict, so that all of them stop
    with the same error if another process holds the folder or it holds a run, and at once if rank 0
    fails otherwise (an I/O error: a peer waiting on a dead rank 0 may wait until ddp_timeout)."""
    lock, refusal = None, None
    if proc.master:
        try:
            lock = lock_folder(cfg.out_dir, 'out_dir')
            check_run_files(cfg)
        except Exception as e:        # a UserError or not: raised once every rank knows
            refusal = e
            if lock is not None:
                lock.release()
                lock = None
    if proc.ddp:              # 0: locked; the holder's PID; -1: another error (rank 0 prints it)
        busy = isinstance(refusal, FolderBusy) and refusal.pid
        code = 0 if refusal is None else busy or -1
        status = torch.tensor([code], dtype=torch.int64, device=proc.dev)
        torch.distributed.broadcast(status, 0)
        code = int(status.item())
        if refusal is None and code > 0:         # its host: from the lock file, where seen here
            pid, host = holder(os.path.join(cfg.out_dir, LOCK_NAME), wait_s=0)
            above = enclosing_holder(cfg.out_dir) if pid != code else None
            if above is not None and above[1] == code:      # a folder above out_dir is held
                refusal = FolderBusy(cfg.out_dir, code, 'out_dir', above[2], inside=above[0])
            else:
                refusal = FolderBusy(cfg.out_dir, code, 'out_dir', host if pid == code else None)
        elif refusal is None and code < 0:
            refusal = TrainError(f"rank 0 refused out_dir {cfg.out_dir} (its error is above)")
    if refusal is not None:
        raise refusal
    return lock


def share_rank0_outcome(proc, error, what):
    """Raise error, rank 0's exception in a step only it does (None: it succeeded), on every rank
    at once: under DDP one broadcast tells the others, which raise a TrainError naming `what` rank 0
    could not do. Left to find out in their next collective, they would stop only when rank 0's
    connection drops (under NCCL, at ddp_timeout), blaming an unresponsive process. Rank 0 says
    its error before the broadcast and then exits as run_cli would (2 for a UserError, else 1):
    once another rank has stopped, torchrun ends the rest, rank 0 too, perhaps before it spoke."""
    if proc.ddp:
        if error is not None:
            if isinstance(error, UserError):
                print(f"error: {error}", file=sys.stderr, flush=True)
            else:
                traceback.print_exception(error)
                sys.stderr.flush()
        status = torch.tensor([0 if error is None else 1], dtype=torch.int64, device=proc.dev)
        torch.distributed.broadcast(status, 0)
        if error is not None:
            raise SystemExit(2 if isinstance(error, UserError) else 1) from error
        if status.item():
            raise TrainError(f"rank 0 could not {what} (its error is above)")
    if error is not None:
        raise error


# --------------------------------------------------------------------------------------------------
# where a run starts: its inputs, whether a resume has anything left to do, what it picks up
# and the records it redoes

def open_inputs(cfg, master, check_fields):
    """The dataset's meta.json and the checkpoint the run starts from (None from scratch or GPT-2),
    checked against each other; check_fields(cfg, ckpt) compares the config with the checkpoint
    first, before the data is read or prepared."""
    check_out_dir(cfg, held=False)      # (the run files: rank 0 checked them, hold_out_dir)
    if master:                  # temp files of writers killed mid-write (the files they were to
                                # replace are intact)
        for tmp in remove_stale_temps(cfg.out_dir):
            print(f"removed {tmp}, left by a write that was killed")
    ckpt = start_checkpoint(cfg)        # (before data is prepared)
    done = finished_already(cfg, ckpt)
    if ckpt is not None and not done:
        check_fields(cfg, ckpt)
    meta = load_dataset_meta(cfg, master)
    if done:                            # nothing more to check: setup says so and stops
        return meta, ckpt
    check_data(cfg, meta, ckpt)
    return meta, ckpt


def start_checkpoint(cfg, mmap=False):
    """The checkpoint the run starts from: its own when it resumes (refused where it has none), the
    file init_from names, or None (from scratch or GPT-2)."""
    if cfg.init_from == 'resume':
        path = os.path.join(cfg.out_dir, 'ckpt.pt')
        if not os.path.exists(path):
            raise TrainError(
                f"init_from=resume but there is no checkpoint at {path}; start the run afresh "
                f"(with --overwrite=True if {cfg.out_dir} holds its other files)"
            )
        return load_checkpoint(path, mmap=mmap)
    return load_checkpoint(cfg.init_from, mmap=mmap) if os.path.isfile(cfg.init_from) else None


def check_inputs(cfg, check_fields):
    """open_inputs's checks without its work (no data prepared, no file removed, the checkpoint's
    tensors not read): the checkpoint against the config, and the data's meta.json, returned (None
    for a built-in corpus the run will prepare). For a sweep, each run's before the first starts."""
    ckpt = start_checkpoint(cfg, mmap=True)
    if ckpt is not None and not finished_already(cfg, ckpt):
        check_fields(cfg, ckpt)
    return None if needs_preparing(cfg) else load_dataset_meta(cfg, True, prepare_missing=False)


def finished_already(cfg, ckpt):
    """A resume (not eval-only) of a run whose checkpoint reached max_iters and whose metrics hold
    the summary its training wrote at that iteration (a run killed between its last checkpoint and
    its summary is not finished, nor made so by an eval-only run's summary: resuming writes the
    summary; nor is one whose summary says a signal stopped it, during its final eval)."""
    if cfg.init_from != 'resume' or cfg.eval_only or ckpt is None:
        return False
    if ckpt['iter_num'] < cfg.max_iters:
        return False
    path = os.path.join(cfg.out_dir, 'metrics.jsonl')
    if not os.path.exists(path):
        return False
    with open(path) as f:
        records = [r for line in f if (r := parse_record(line)) is not None]
    return any(r.get('type') == 'summary' and r.get('iter') == ckpt['iter_num']
               and not r.get('eval_only') and not r.get('stopped') for r in records)


def start_progress(cfg, ckpt, optimizer, scaler, master):
    """What a checkpoint carries across a resume: iteration, best val loss, cumulative training
    FLOPs (exact: autograd's count, and the paper's proxy; per sequence), the log history for the
    summary, the optimizer and scaler, and (rank 0, whose RNG draws matter) the RNG streams."""
    if ckpt is None or cfg.init_from != 'resume':
        return dict(
            resumed=False,
            iter_num=0,
            best_val=float('inf'),
            history=dict(train=[], eval=[]),
            flops_state=dict(exact=0.0, proxy_num=0.0, dense=0.0, wall_s=0.0),
            interval=None,
            fp16_skips=None,
        )
    if ckpt['optimizer'] is not None:         # (FSDP: loaded from the shards, sharding.py)
        optimizer.load_state_dict(ckpt['optimizer'])
    if ckpt['scaler'] or not scaler.is_enabled():
        scaler.load_state_dict(ckpt['scaler'])
    elif master:        # a run trained in bfloat16 or float32 resumed where dtype=auto is float16
        print("note: the checkpoint has no GradScaler state (trained without float16): float16's "
              "scaler starts afresh")
    if master and ckpt.get('rng') is not None:
        set_rng_state(ckpt['rng'])
    return dict(
        resumed=True,
        iter_num=ckpt['iter_num'],
        best_val=ckpt['best_val_loss'],
        history=ckpt['history'],
        flops_state=ckpt['flops_state'],
        interval=ckpt.get('interval'),       # (None in a checkpoint written before it was kept)
        fp16_skips=ckpt.get('fp16_skips'),   # (likewise)
    )


def evaluated_at(history, iter_num):
    """Does a checkpoint's history hold the eval of iteration iter_num? (A signal can save at an
    eval's iteration before the eval, or during it.)"""
    return any(e['iter'] == iter_num for e in history['eval'])


def drop_records_after(path, iter_num, evaluated=True):
    """Keep the metrics records up to the resumed iteration: the steps after it run again, and
    where the checkpoint lacks that iteration's eval (evaluated False), so does the eval: a
    record of it was logged by a run killed before its save."""
    if not os.path.exists(path):
        return

    def kept(r):
        it = r.get('iter', 0)
        return it < iter_num or it == iter_num and (
            evaluated or r.get('type') != 'eval' or bool(r.get('eval_only')))

    with open(path) as f:
        lines = [l for l in f if l.strip()]
    keep = [l if l.endswith('\n') else l + '\n' for l in lines
            if (r := parse_record(l)) is not None and kept(r)]
    if keep != lines:
        write_whole(path, lambda f: f.writelines(keep))


def parse_record(line):
    """A metrics line as a dict, or None for a line cut short (a full disk or a kill mid-write)."""
    try:
        r = json.loads(line)
    except ValueError:
        return None
    return r if isinstance(r, dict) else None


# --------------------------------------------------------------------------------------------------
# a checkpoint of the run

def checkpoint_state(run, model=None, sharded=None):
    """Everything an exact resume needs (start_progress reads it back). FSDP: `model` is the whole
    model's state gathered on rank 0, and the optimizer's state is not here but in the DCP folder
    `sharded` (relative to out_dir) beside the model's shards."""
    cfg = run.cfg
    return dict(
        model=run.raw_model.state_dict() if model is None else model,
        optimizer=run.optimizer.state_dict() if sharded is None else None,
        sharded=sharded,
        scaler=run.scaler.state_dict(),
        model_args=asdict(run.raw_model.config),
        iter_num=run.iter_num,
        best_val_loss=run.best_val,
        config=run.cfg_dict,
        history=run.history,
        flops_state=run.flops_state,
        interval=interval_state(run.interval),
        # the GradScaler's skipped steps: the summary counts them over the whole run, and the
        # stop after max_fp16_skips in a row counts across a resume
        fp16_skips=dict(skipped=int(run.skipped.item()), last=run.last_skipped,
                        consecutive=run.consecutive_skips),
        rng=rng_state(),
        sampler=dict(
            kind='epoch-permutation',
            seed=cfg.seed,
            next_iter=run.iter_num,
            micro_batches_per_iter=cfg.gradient_accumulation_steps,
        ),
        data_meta=data_identity(run.meta),
    )


def interval_state(interval):
    """The sums of the log interval a checkpoint cuts (train_report.new_interval), on the CPU: the
    resumed run's next train record is then the mean over every step of the interval, as the run it
    continues would have logged it. (Under DDP rank 0's, with every rank's LM sum in lm_ranks:
    share_interval; every rank resumes the rest of the cut interval from rank 0's sums.)"""
    return tree_map_only(torch.Tensor, lambda t: t.detach().cpu(), interval)


def share_interval(run):
    """DDP, before a checkpoint (every rank: a collective): every rank's LM sums (lm, lm_w) of
    the open log interval, which the log step adds over the ranks, so that the checkpoint rank 0
    writes keeps each rank's share and not only its own (restore_interval_lm)."""
    for key in ('lm', 'lm_w'):
        parts = [torch.zeros_like(run.interval[key]) for _ in range(run.world)]
        torch.distributed.all_gather(parts, run.interval[key])
        run.interval[key + '_ranks'] = torch.stack(parts)


def restore_interval_lm(saved, rank, world, key='lm'):
    """This rank's LM sum `key` (lm or lm_w) of a resumed checkpoint's open log interval: its own
    share under the same number of processes; else the mean over the ranks that wrote it (the log
    step divides the sum of lm by that of lm_w, so every rank starting from the means logs the same
    mean); a single process's (no shares kept) as it is."""
    ranks = saved.get(key + '_ranks')
    if ranks is None:
        return saved[key]
    return ranks[rank] if len(ranks) == world else ranks.mean()


def kept(run):
    return (
        f"the last good checkpoint {run.ckpt_path} is left untouched"
        if os.path.exists(run.ckpt_path)
        else "no checkpoint was saved yet"
    )


# --------------------------------------------------------------------------------------------------
# random streams

def seed_rngs(seed):
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def rng_state():
    return dict(torch=torch.get_rng_state(), numpy=np.random.get_state(), python=random.getstate(),
                cuda=torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)


def set_rng_state(s):
    torch.set_rng_state(s['torch'])
    np.random.set_state(s['numpy'])
    random.setstate(s['python'])
    if s.get('cuda') is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s['cuda'])


@contextmanager
def eval_rng(dev, seed):
    """Evals draw random numbers (ffn_gate='random' decides per token at eval): fork the RNG and
    seed it, so evaluating never changes training and every eval is repeatable."""
    with torch.random.fork_rng(devices=[dev] if dev.type == 'cuda' else []):
        torch.manual_seed(seed)
        yield


# --------------------------------------------------------------------------------------------------
# stopping on a signal

class StopFlag:
    """First Ctrl-C / SIGTERM: finish the step, checkpoint, exit 0. A second Ctrl-C aborts at
    once."""

    def __init__(self):
        self.signum = None
        signal.signal(signal.SIGINT, self._handle)
        signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame):
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = signum


def stop_requested(run, stop, logged):
    """A signal stops a lone process after this step; DDP processes agree at a log step (a
    collective), so that all of them stop at the same iteration."""
    if not run.ddp:
        return stop.signum is not None
    return logged and any_rank(run.dev, stop.signum is not None)


def any_rank(dev, flag):
    """Whether `flag` holds on any rank (a collective: every rank calls it at the same point)."""
    value = torch.tensor(float(flag), device=dev)
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX)
    return value.item() > 0
