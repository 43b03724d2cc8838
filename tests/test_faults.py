"""Fault injection for train.py's checkpointing: SIGKILL in the middle of a checkpoint write,
SIGTERM during a training step, SIGINT while a checkpoint is being written, and corrupt / truncated
ckpt.pt files.

Faults are injected deterministically, not by timing: train.py runs in a subprocess through a small
wrapper script (FAULT_WRAPPER, written to tmp_path) that patches torch.save or train.lr_at and then
runs train.main through configurator.run_cli, exactly like `python train.py`. The wrapper writes a
JSON record of what it did (before it dies) so that every test can assert the fault really happened.

Every comparison with the uninterrupted reference run is bitwise (torch.equal): all runs are on this
machine, on CPU, single-threaded (OMP_NUM_THREADS=1), with the same kernels, so an exact resume must
reproduce the very same bits; any tolerance would hide a lost or replayed step."""
import hashlib
import json
import os
import random
import signal
import sys
from collections import namedtuple
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from checkpoint import load_checkpoint  # noqa: E402
from conftest import finish, start, stop  # noqa: E402
from data import prepare as P  # noqa: E402
from files import host_name  # noqa: E402

ENV = {
    k: v
    for k, v in os.environ.items()
    if k
    not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    and not k.startswith("FAULT_")
}
# one thread: quick on a loaded 2-core box and bit-reproducible; unbuffered, so a SIGKILLed child's
# stdout (e.g. "removed ...") is not lost in its pipe buffer
ENV.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONHASHSEED="0", PYTHONUNBUFFERED="1")
MAX_ITERS, EVAL_INTERVAL = 12, 2        # checkpoints at iterations 2, 4, ..., 12 (none at 0)
# dropout > 0 so that the RNG state restored on resume matters
CFG = ["--n_layer=1", "--n_embd=32", "--n_head=2", "--block_size=16", "--batch_size=4",
       f"--eval_interval={EVAL_INTERVAL}", "--eval_iters=1", "--calib_iters=1", "--log_interval=1",
       f"--max_iters={MAX_ITERS}", "--device=cpu", "--dropout=0.1"]
TIMEOUT = 180

FAULT_WRAPPER = r'''
"""python wrapper.py <train.py args>: train.py with one injected fault, chosen by FAULT_*
variables."""
import hashlib, io, json, os, shutil, signal, sys, time
sys.path.insert(0, {repo!r})
import torch
import train
from configurator import run_cli

# kill_in_save | sigint_in_save | sigterm_at_iter | sigterm_in_eval
MODE = os.environ["FAULT_MODE"]
# the AT-th checkpoint write of this process (1-based) / iteration / evaluation of a split
AT = int(os.environ["FAULT_AT"])
FRAC = float(os.environ.get("FAULT_FRAC", "0.5"))   # where in the file's bytes the fault strikes
RECORD = os.environ["FAULT_RECORD"]
COPY = os.environ.get("FAULT_COPY")
_torch_save, _save_checkpoint, _lr_at = torch.save, train.save_checkpoint, train.lr_at
_evaluate = train.evaluation.evaluate
saves, signalled, copied, evals = 0, False, False, 0


def record(**kw):
    with open(RECORD, "w") as f:
        json.dump(kw, f)
        f.flush()
        os.fsync(f.fileno())


def faulty_save(obj, f, *args, **kwargs):
    global saves, signalled
    name = getattr(f, "name", None)
    # only checkpoint.save_checkpoint's writes
    if not (isinstance(name, str) and ".tmp-" in name):
        return _torch_save(obj, f, *args, **kwargs)
    saves += 1
    if saves != AT:
        return _torch_save(obj, f, *args, **kwargs)
    buf = io.BytesIO()
    _torch_save(obj, buf, *args, **kwargs)
    data = buf.getvalue()
    cut = min(len(data), int(FRAC * (len(data) + 1)))
    ckpt = name[:name.rindex(".tmp-")]
    if MODE == "kill_in_save":
        prev = hashlib.sha256(open(ckpt, "rb").read()).hexdigest() if os.path.exists(ckpt) else None
        record(pid=os.getpid(), tmp=name, iter_num=obj["iter_num"], cut=cut, size=len(data),
               prev_sha256=prev)
        f.write(data[:cut])
        f.flush()
        os.fsync(f.fileno())
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)                                        # never reached
    elif MODE == "sigint_in_save":                            # Ctrl-C part-way through the write
        f.write(data[:cut])
        f.flush()
        os.kill(os.getpid(), signal.SIGINT)     # os.kill runs the Python handler before returning
        handler = signal.getsignal(signal.SIGINT)
        seen = getattr(getattr(handler, "__self__", None), "signum", None)
        f.write(data[cut:])
        signalled = True
        record(pid=os.getpid(), iter_num=obj["iter_num"], cut=cut, size=len(data),
               sha256=hashlib.sha256(data).hexdigest(), handler_saw=seen)
    else:
        return _torch_save(obj, f, *args, **kwargs)


def save_checkpoint(path, state):
    global copied
    _save_checkpoint(path, state)
    if signalled and not copied and COPY:                     # the checkpoint the SIGINT landed in
        shutil.copyfile(path, COPY)
        copied = True


def lr_at(cfg, it):
    if MODE == "sigterm_at_iter" and it == AT:      # during the step it -> it+1, not in a write
        record(pid=os.getpid(), iter=it)
        os.kill(os.getpid(), signal.SIGTERM)
    return _lr_at(cfg, it)


def evaluate(model, batches, *args, **kwargs):
    global evals
    evals += 1
    if MODE == "sigterm_in_eval" and evals == AT:   # before the split's first batch
        record(pid=os.getpid(), evaluation=evals, batches=len(batches))
        os.kill(os.getpid(), signal.SIGTERM)
    return _evaluate(model, batches, *args, **kwargs)


torch.save = faulty_save
train.save_checkpoint = save_checkpoint
train.lr_at = lr_at
train.evaluation.evaluate = evaluate
run_cli(train.main)
'''


# --------------------------------------------------------------------------------------------------
# helpers and fixtures

def run_py(script, args, env=None, timeout=TIMEOUT):
    """Run to completion; returns (CompletedProcess, pid)."""
    proc = start([sys.executable, script, *args], cwd=REPO, env=env or ENV)
    return finish(proc, timeout), proc.pid


def run_train(args):
    return run_py("train.py", args)[0]


def ok(r):
    assert r.returncode == 0, (
        f"exit {r.returncode}\nstdout:\n{r.stdout[-3000:]}\nstderr:\n{r.stderr[-3000:]}"
    )
    return r


def fault_env(mode, at, record, frac=0.5, copy=None):
    env = dict(
        ENV, FAULT_MODE=mode, FAULT_AT=str(at), FAULT_FRAC=repr(frac), FAULT_RECORD=str(record)
    )
    if copy is not None:
        env["FAULT_COPY"] = str(copy)
    return env


def sha256(path):
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def temps(out):
    return sorted(p.name for p in Path(out).glob("ckpt.pt.tmp-*"))


def assert_identical(a, b, where="ckpt"):
    """Recursively: tensors torch.equal (same dtype and shape), everything else ==."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), (
            f"{where}: tensors differ (max abs diff {(a.double() - b.double()).abs().max()})"
        )
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), (
            f"{where}: keys {sorted(map(str, a))} vs {sorted(map(str, b))}"
        )
        for k in a:
            assert_identical(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_identical(x, y, f"{where}[{i}]")
    elif isinstance(a, np.ndarray):
        assert np.array_equal(a, b), where
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def eval_records(out):
    """The run's 'eval' records in metrics.jsonl, in order."""
    lines = (Path(out) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["type"] == "eval"]


def assert_same_final_state(out, reference):
    """Bitwise: every weight, every optimizer moment and step count, the scaler, the iteration and
    the best val loss equal those of the uninterrupted run (same machine, same kernels: no
    tolerance)."""
    mine, ref = load_checkpoint(str(Path(out) / "ckpt.pt")), reference.ckpt()
    assert mine["iter_num"] == ref["iter_num"] == MAX_ITERS
    assert_identical(mine["model"], ref["model"], "model")
    assert_identical(mine["optimizer"], ref["optimizer"], "optimizer")
    assert_identical(mine["scaler"], ref["scaler"], "scaler")
    assert mine["best_val_loss"] == ref["best_val_loss"]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """A 60k-token synthetic corpus in <tmp>/data/syn (not named 'synthetic': never auto-prepared
    over)."""
    folder = tmp_path_factory.mktemp("data") / "syn"
    P.prepare("synthetic", out_dir=folder, num_tokens=60000)
    return folder


def data_args(folder):
    return [f"--data_dir={folder.parent}", f"--dataset={folder.name}"]


class Reference:
    """The uninterrupted run, started in the background when first requested so that it overlaps the
    first test's own runs (2 cores); ckpt() waits for it and returns its final checkpoint."""

    def __init__(self, data_dir, out):
        self.out, self._ckpt = out, None
        self.proc = start([sys.executable, "train.py", *CFG, *data_args(data_dir),
                           f"--out_dir={out}"], cwd=REPO, env=ENV)

    def ckpt(self):
        if self._ckpt is None:
            ok(finish(self.proc, TIMEOUT))
            assert temps(self.out) == []
            self._ckpt = load_checkpoint(str(self.out / "ckpt.pt"))
            assert self._ckpt["iter_num"] == MAX_ITERS
        return self._ckpt

    def close(self):
        stop(self.proc)


@pytest.fixture(scope="module")
def reference(data_dir, tmp_path_factory):
    ref = Reference(data_dir, tmp_path_factory.mktemp("reference") / "out")
    yield ref
    ref.close()


@pytest.fixture
def wrapper(tmp_path):
    path = tmp_path / "fault_wrapper.py"
    path.write_text(FAULT_WRAPPER.format(repo=str(REPO)))
    return path


# --------------------------------------------------------------------------------------------------
# SIGTERM during a training step: save, exit 0, and the resume is bit-exact
# (tests/test_train.py checks that a signalled run saves and that its printed resume command runs,
# but not that the resumed run ends bit-equal to an uninterrupted one)

@pytest.mark.xdist_group('faults_reference')
def test_sigterm_mid_step_then_resume_is_bit_exact(reference, data_dir, wrapper, tmp_path):
    out, rec = tmp_path / "out", tmp_path / "sigterm.json"
    args = [*CFG, *data_args(data_dir), f"--out_dir={out}"]
    # while computing step 4 -> 5
    r, pid = run_py(wrapper, args, fault_env("sigterm_at_iter", 4, rec))
    ok(r)
    assert json.loads(rec.read_text()) == {"pid": pid, "iter": 4}, "the SIGTERM was never sent"
    assert "stopped by signal at iteration 5" in r.stdout and "done:" not in r.stdout, r.stdout[
        -2000:
    ]
    assert load_checkpoint(str(out / "ckpt.pt"))["iter_num"] == 5      # 5: not an eval iteration
    assert temps(out) == []
    r2 = ok(run_train([*args, "--init_from=resume"]))
    assert "done:" in r2.stdout
    assert_same_final_state(out, reference)


@pytest.mark.xdist_group('faults_reference')
def test_signals_around_evals_keep_every_eval_once(reference, data_dir, wrapper, tmp_path):
    """One run stopped and resumed five times (one test, as each start costs seconds):
    1. SIGTERM at the start of iteration 0's val-split evaluation: the lone process abandons the
       eval (a long one would outlast a scheduler's grace period), saves at 0 without its record
       and exits 0;
    2. resumed, it evaluates 0 again; SIGTERM in step 3 -> 4 stops it at 4, before 4's eval;
    3. resumed, it evaluates 4, logs it, and is SIGKILLed while saving: its checkpoint still
       lacks the eval of 4;
    4. resumed, the record it logged is dropped and 4 evaluated again; SIGTERM at the start of
       the final val-split evaluation stops it at max_iters (not a finished run);
    5. resumed, it makes the final eval; SIGTERM at the start of the end-of-run report's first
       pass: the report is abandoned, the summary marked stopped;
    6. resumed, it makes the report and the summary.
    It ends bit-equal to the uninterrupted run, with the same eval records, each once."""
    out = tmp_path / "out"
    args = [*CFG, *data_args(data_dir), f"--out_dir={out}"]
    resume = [*args, "--init_from=resume"]

    def evals():
        return [e["iter"] for e in eval_records(out)]

    def summaries():
        return [m for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
                if m["type"] == "summary"]

    def fault(run_args, mode, at):
        rec = tmp_path / f"{mode}.json"
        r, pid = run_py(wrapper, run_args, fault_env(mode, at, rec))
        return r, pid, json.loads(rec.read_text())       # (no record: the fault never struck)

    r, pid, rec = fault(args, "sigterm_in_eval", 2)      # each eval: the train split, then val
    ok(r)
    assert rec == {"pid": pid, "evaluation": 2, "batches": 1}
    assert "stopped by signal during the evaluation at iteration 0" in r.stdout, r.stdout
    assert "iter 0: train loss" not in r.stdout           # no eval line: it was abandoned
    assert load_checkpoint(str(out / "ckpt.pt"))["iter_num"] == 0 and evals() == []

    r, pid, rec = fault(resume, "sigterm_at_iter", 3)
    ok(r)
    assert rec == {"pid": pid, "iter": 3}
    assert "stopped by signal at iteration 4" in r.stdout, r.stdout[-2000:]
    assert evals() == [0, 2]

    r, pid, rec = fault(resume, "kill_in_save", 1)
    assert r.returncode == -signal.SIGKILL and rec["iter_num"] == 4
    assert evals() == [0, 2, 4]
    assert load_checkpoint(str(out / "ckpt.pt"))["history"]["eval"][-1]["iter"] == 2

    final = 2 * (MAX_ITERS - 4) // EVAL_INTERVAL + 2     # evals at 4, 6, ..., MAX_ITERS
    r, pid, rec = fault(resume, "sigterm_in_eval", final)
    ok(r)
    assert rec == {"pid": pid, "evaluation": final, "batches": 1}
    assert f"stopped by signal during the evaluation at iteration {MAX_ITERS}" in r.stdout
    assert load_checkpoint(str(out / "ckpt.pt"))["iter_num"] == MAX_ITERS
    assert evals() == list(range(0, MAX_ITERS, EVAL_INTERVAL))
    assert temps(out) == []

    r, pid, rec = fault(resume, "sigterm_in_eval", 3)      # the final eval's 2, the report's 1st
    ok(r)
    assert rec == {"pid": pid, "evaluation": 3, "batches": 1}
    assert f"stopped by signal during the end-of-run report at iteration {MAX_ITERS}" in r.stdout
    assert "done:" not in r.stdout and "val loss with" not in r.stdout, r.stdout[-2000:]
    last = summaries()[-1]
    assert last["stopped"] is True and "routing" not in last
    assert evals() == list(range(0, MAX_ITERS + 1, EVAL_INTERVAL))

    r = ok(run_train(resume))
    assert "done:" in r.stdout, r.stdout[-2000:]
    assert "stopped" not in summaries()[-1] and "routing" in summaries()[-1]
    reference.ckpt()
    assert eval_records(out) == eval_records(reference.out)
    assert evals() == list(range(0, MAX_ITERS + 1, EVAL_INTERVAL))
    assert_same_final_state(out, reference)


# --------------------------------------------------------------------------------------------------
# SIGINT while save_checkpoint is writing: the write completes, the file is valid, then the run
# stops

@pytest.mark.xdist_group('faults_reference')
def test_sigint_during_checkpoint_write_completes_the_save(reference, data_dir, wrapper, tmp_path):
    """Ctrl-C arrives when 30% of the iteration-4 checkpoint is written: the handler only sets the
    stop flag, so the save finishes (the file is exactly the bytes torch.save produced) and is
    renamed into place; the run then stops on that checkpoint (no further step, no second save)
    and exits 0; resuming ends bit-equal to the uninterrupted run."""
    out, rec, copy = tmp_path / "out", tmp_path / "sigint.json", tmp_path / "saved_during_sigint.pt"
    args = [*CFG, *data_args(data_dir), f"--out_dir={out}"]
    r, pid = run_py(wrapper, args, fault_env("sigint_in_save", 2, rec, frac=0.3, copy=copy))
    ok(r)
    info = json.loads(rec.read_text())
    assert info["pid"] == pid and info["iter_num"] == 4, info
    assert 0 < info["cut"] < info["size"], info                      # really mid-write
    assert info["handler_saw"] == signal.SIGINT, "train.py's handler did not run during the write"
    assert copy.exists(), "the checkpoint write interrupted by SIGINT never completed"
    assert sha256(copy) == info["sha256"]                           # complete, byte for byte
    assert load_checkpoint(str(copy))["iter_num"] == 4
    assert "stopped by signal after the evaluation at iteration 4" in r.stdout, r.stdout[-2000:]
    assert "done:" not in r.stdout and "iter 5:" not in r.stdout, r.stdout[-2000:]
    assert sha256(out / "ckpt.pt") == info["sha256"]          # the one the SIGINT landed in
    assert temps(out) == []
    ok(run_train([*args, "--init_from=resume"]))
    assert_same_final_state(out, reference)


# --------------------------------------------------------------------------------------------------
# a truncated or foreign ckpt.pt: one clear error, exit 2, nothing touched

@pytest.mark.xdist_group('faults_reference')
@pytest.mark.parametrize("damage", ["truncated_half", "random_bytes"])
@pytest.mark.parametrize("use", ["resume", "init_from"])
def test_corrupt_checkpoint_fails_cleanly(reference, data_dir, tmp_path, damage, use):
    """resume: out_dir's own ckpt.pt; init_from: a checkpoint file to start stage 2 from, into a
    fresh out_dir that must not even be created."""
    reference.ckpt()
    out = tmp_path / "out"
    real = (reference.out / "ckpt.pt").read_bytes()
    bad = (
        real[: len(real) // 2]
        if damage == "truncated_half"
        else random.Random(0).randbytes(len(real))
    )
    if use == "resume":
        out.mkdir()
        for name in ("config.json", "metrics.jsonl", "run_info.json"):
            (out / name).write_bytes((reference.out / name).read_bytes())
        ckpt = out / "ckpt.pt"
    else:
        ckpt = tmp_path / "stage1.pt"
    ckpt.write_bytes(bad)
    before = {str(p): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    r = run_train([*CFG, *data_args(data_dir), f"--out_dir={out}",
                   "--init_from=resume" if use == "resume" else f"--init_from={ckpt}"])
    assert r.returncode == 2, f"exit {r.returncode}\n{r.stderr[-3000:]}"
    lines = r.stderr.splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("error:") and str(ckpt) in lines[0] and "corrupt" in lines[0], lines[
        0
    ]
    # the checkpoint and everything else untouched; init_from: no out_dir created
    assert {str(p): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before
    assert use == "resume" or not out.exists()


# --------------------------------------------------------------------------------------------------
# SIGKILL in the middle of checkpoint writes, then resume: bit-equal to the uninterrupted run

KILL_SEED = 14      # a fixed seed; its plan is asserted to cover the cases below before anything
                    # runs
N_KILLS = 3
# start/survivor: ckpt iteration or None
Kill = namedtuple("Kill", "start save iter_num frac survivor")


def kill_plan(seed):
    """Where each of N_KILLS processes dies: its `save`-th checkpoint write (the one of iteration
    iter_num) after a fraction `frac` of the file's bytes; each process resumes from the checkpoint
    the previous one left (`start`, None: none, so it starts fresh). `survivor` is the checkpoint
    that must be intact after the kill. A pure function of the seed."""
    rng, start, plan = random.Random(seed), None, []
    for _ in range(N_KILLS):
        base = start or 0
        save = rng.randint(1, (MAX_ITERS - base) // EVAL_INTERVAL)
        # empty temp, complete but unrenamed, partial
        frac = rng.choice((0.0, 1.0, rng.random(), rng.random()))
        survivor = start if save == 1 else base + EVAL_INTERVAL * (save - 1)
        plan.append(Kill(start, save, base + EVAL_INTERVAL * save, frac, survivor))
        start = survivor
    return plan


@pytest.mark.slow
def test_sigkill_during_checkpoint_writes_then_resume_is_bit_exact(
    reference, data_dir, wrapper, tmp_path
):
    plan = kill_plan(KILL_SEED)
    # not vacuous: a kill before any checkpoint exists, kills with one, a kill in a resumed process,
    # empty and partial temp files; and the last kill leaves a checkpoint, so the final run resumes
    assert any(k.survivor is None for k in plan) and plan[-1].survivor is not None, plan
    assert any(k.start is not None for k in plan), plan
    assert any(k.frac == 0.0 for k in plan) and any(0 < k.frac < 1 for k in plan), plan

    out = tmp_path / "out"
    ckpt = out / "ckpt.pt"
    base = [*CFG, *data_args(data_dir), f"--out_dir={out}"]
    orphan = None                        # the temp file the last killed writer left
    for n, kill in enumerate(plan):
        rec = tmp_path / f"kill{n}.json"
        args = (
            [*base, "--init_from=resume"]
            if kill.start is not None
            else [*base, "--overwrite=True"]
            if n
            else base
        )
        r, pid = run_py(wrapper, args, fault_env("kill_in_save", kill.save, rec, frac=kill.frac))
        where = f"kill {n} {kill}:\nstdout:\n{r.stdout[-2000:]}\nstderr:\n{r.stderr[-2000:]}"
        assert r.returncode == -signal.SIGKILL, where
        info = json.loads(rec.read_text())
        assert info["pid"] == pid and info["iter_num"] == kill.iter_num, (info, where)
        assert info["cut"] == min(info["size"], int(kill.frac * (info["size"] + 1))), info
        if orphan is not None:           # the previous writer's orphan went at this run's start
            assert f"removed {orphan}" in r.stdout, where
            assert not orphan.exists()
        # the killed writer's temp file is there (with exactly the bytes it got to write), and only
        # it
        orphan = out / f"ckpt.pt.tmp-{host_name()}-{pid}"
        assert info["tmp"] == str(orphan) and temps(out) == [orphan.name], (temps(out), info)
        assert orphan.stat().st_size == info["cut"]
        # the checkpoint from before the interrupted write is intact: unchanged and loadable
        if kill.survivor is None:
            assert info["prev_sha256"] is None and not ckpt.exists(), where
        else:
            assert info["prev_sha256"] is not None and sha256(ckpt) == info["prev_sha256"], where
            assert load_checkpoint(str(ckpt))["iter_num"] == kill.survivor
        if kill.survivor is None:
            # killed before any checkpoint existed: resume refuses with one line and exit 2 (after
            # removing the orphan); the next run starts afresh with --overwrite=True
            r = run_train([*base, "--init_from=resume"])
            assert r.returncode == 2, r.stderr[-3000:]
            lines = r.stderr.splitlines()
            assert len(lines) == 1 and lines[0].startswith("error:"), r.stderr
            assert "no checkpoint" in lines[0] and str(ckpt) in lines[0], lines[0]
            assert f"removed {orphan}" in r.stdout and not orphan.exists() and not ckpt.exists(), (
                r.stdout
            )
            orphan = None

    # the last resume, unpatched: it removes the last orphan and ends bit-equal to the reference
    r = ok(run_train([*base, "--init_from=resume"]))
    assert f"removed {orphan}" in r.stdout and not orphan.exists(), r.stdout[-2000:]
    assert "done:" in r.stdout and temps(out) == []
    assert_same_final_state(out, reference)
