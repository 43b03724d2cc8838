"""Tests for train.py: exact resume, DDP equivalence, the data sampler, output files, signals, a
full disk under the metrics, non-finite losses, input errors, the quickstart and the LR schedule.
(What train.py's helper modules do on their own: test_checkpoint.py, test_device.py,
test_run_state.py, test_train_report.py, test_train_checks.py.)

Everything runs on CPU with a 2-layer, 32-wide model on a 60k-token synthetic corpus prepared once
per session. Training runs are subprocesses (`python train.py ...`, OMP_NUM_THREADS=1 so runs are
quick and bit-reproducible); the sampler, the schedule and input errors are tested in-process."""
import contextlib
import errno
import io
import json
import math
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
import flops  # noqa: E402
import runlock  # noqa: E402
import train  # noqa: E402
from conftest import finish, run_group, start, stop  # noqa: E402
from data import loader, prepare as P  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402

ENV = {
    k: v
    for k, v in os.environ.items()
    if k
    not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
}
ENV.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONHASHSEED="0")
TINY = [
    "--n_layer=2",
    "--n_head=2",
    "--n_embd=32",
    "--block_size=32",
    "--batch_size=4",
    "--eval_iters=2",
    "--log_interval=1",
    "--eval_interval=5",
    "--warmup_iters=2",
    "--device=cpu",
]
NAN_ARGS = ["--learning_rate=1e6", "--grad_clip=0", "--decay_lr=False", "--warmup_iters=0"]


# --------------------------------------------------------------------------------------------------
# helpers and fixtures

def run_py(script, args, timeout=180, env=None):
    return run_group([sys.executable, script, *args], timeout, cwd=REPO, env=env or ENV)


def run_train(args, timeout=180):
    return run_py("train.py", args, timeout)


def start_train(args, **kw):
    return start([sys.executable, "train.py", *args], cwd=REPO, env=ENV, **kw)


def require(cond, msg=""):
    """A precondition: fails with RuntimeError rather than AssertionError, so it reads as a broken
    setup."""
    if not cond:
        raise RuntimeError(msg)


def ok(r):
    assert r.returncode == 0, (
        f"exit {r.returncode}\nstdout:\n{r.stdout[-3000:]}\nstderr:\n{r.stderr[-3000:]}"
    )
    return r


def data_args(synth):
    return [f"--data_dir={synth.parent}", f"--dataset={synth.name}"]


def read_metrics(out_dir):
    lines = Path(out_dir, "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def load_ckpt(out_dir):
    return torch.load(Path(out_dir) / "ckpt.pt", map_location="cpu", weights_only=False)


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


def eval_loss_of_ckpt(
    out_dir, synth, split="val", eval_iters=2, block_size=32, batch_size=4, seed=1337
):
    """Mean loss of ckpt.pt's model on the eval batches train.py uses for `split`, with the data
    read and the loss computed here (numpy + GPT forward), not by train.py's eval code."""
    ck = load_ckpt(out_dir)
    model = GPT(GPTConfig.from_dict(ck["model_args"]))
    model.load_state_dict(ck["model"])
    model.eval()
    meta = json.loads((synth / "meta.json").read_text())
    path = synth / f"{split}.bin"
    data = np.fromfile(path, dtype=meta["dtype"]).astype(np.int64)
    sampler = loader.Batches(
        str(path), np.dtype(meta["dtype"]).type, block_size, batch_size, seed, torch.device("cpu")
    )
    losses = []
    with torch.no_grad():
        for starts in sampler.eval_batches(eval_iters, 1 if split == "train" else 2):
            x = torch.tensor(np.stack([data[s:s + block_size] for s in starts]))
            y = torch.tensor(np.stack([data[s + 1:s + 1 + block_size] for s in starts]))
            logits = model(x, last_only=False)[0]
            losses.append(
                torch.nn.functional.cross_entropy(
                    logits.reshape(-1, logits.size(-1)), y.reshape(-1)
                ).item()
            )
    return float(np.mean(losses))


def expected_lr(it, lr, min_lr, warmup, decay_iters):
    """The nanoGPT schedule, written out independently of train.lr_at."""
    if it < warmup:
        return lr * (it + 1) / (warmup + 1)
    if it >= decay_iters:
        return min_lr
    progress = (it - warmup) / max(1, decay_iters - warmup)
    return min_lr + (lr - min_lr) * (math.cos(math.pi * progress) + 1) / 2


@pytest.fixture(scope="session")
def synth(tmp_path_factory):
    """A 60k-token synthetic corpus in <tmp>/data/syn (its folder name differs from 'synthetic', so
    train.py never auto-prepares over it)."""
    folder = tmp_path_factory.mktemp("data") / "syn"
    P.prepare("synthetic", out_dir=folder, num_tokens=60000)
    return folder


@pytest.fixture(scope="session")
def text_data(synth):
    """A tiny char-level dataset beside `synth` (a different vocabulary and tokenizer)."""
    src = synth.parent / "tiny.txt"
    src.write_text("the quick brown fox jumps over the lazy dog. " * 80)
    folder = synth.parent / "txt"
    P.prepare("text", out_dir=folder, input=str(src), tokenizer="char")
    return folder


BASE_OVERRIDES = {"max_iters": 6, "eval_interval": 3, "weight_decay": 0.05, "beta2": 0.99}


@pytest.fixture(scope="session")
def base_run(synth, tmp_path_factory):
    """One finished tiny run (6 iterations, evals at 0, 3, 6) shared by the read-only tests; tests
    that resume from it work on a copy."""
    out = tmp_path_factory.mktemp("base") / "out"
    args = [
        *TINY,
        *data_args(synth),
        f"--out_dir={out}",
        *[f"--{k}={v}" for k, v in BASE_OVERRIDES.items()],
    ]
    r = ok(run_train(args))
    return SimpleNamespace(out=out, args=args, result=r)


def copy_run(base_run, tmp_path):
    dst = tmp_path / "out"
    shutil.copytree(base_run.out, dst)
    return dst


def snapshot(folder):
    return {p.name: p.read_bytes() for p in sorted(Path(folder).iterdir())}


# --------------------------------------------------------------------------------------------------
# 1. exact resume

@pytest.mark.slow
@pytest.mark.parametrize("n,eval_interval,log_interval,accum,gate",
                         [(5, 3, 4, 2, "mlp"), (6, 4, 2, 1, "random")],
                         ids=["eval3-log4-accum2-N5", "random-gate-N6"])
def test_resume_is_bit_exact(synth, tmp_path, n, eval_interval, log_interval, accum, gate):
    """2N iterations in one go == N iterations, then --init_from=resume to 2N: every model and
    optimizer tensor identical. dropout=0.1 so the restored RNG state matters; lr_decay_iters is
    fixed at 2N so both runs follow the same schedule (with lr_decay_iters=0 it would follow
    max_iters). ffn_gate=random draws random numbers at eval too (stage 1 of the controller-only
    recipe): evals must not disturb the training RNG, or the resumed run's extra eval at N would
    change what follows."""
    common = [
        *TINY,
        *data_args(synth),
        "--dropout=0.1",
        f"--eval_interval={eval_interval}",
        f"--ffn_gate={gate}",
        f"--log_interval={log_interval}",
        f"--gradient_accumulation_steps={accum}",
        f"--lr_decay_iters={2 * n}",
    ]
    a, b = tmp_path / "a", tmp_path / "b"
    # in parallel with run B
    run_a = start_train([*common, f"--max_iters={2 * n}", f"--out_dir={a}"])
    try:
        ok(run_train([*common, f"--max_iters={n}", f"--out_dir={b}"]))
        assert load_ckpt(b)["iter_num"] == n
        r = ok(run_train([*common, f"--max_iters={2 * n}", f"--out_dir={b}", "--init_from=resume"]))
    finally:
        ra = finish(run_a)
    ok(ra)
    ca, cb = load_ckpt(a), load_ckpt(b)
    assert ca["iter_num"] == cb["iter_num"] == 2 * n
    assert_identical(ca["model"], cb["model"], "model")
    assert_identical(ca["optimizer"], cb["optimizer"], "optimizer")
    assert ca["best_val_loss"] == cb["best_val_loss"]
    # the logged train losses after the resume point are the same numbers too
    la = {m["iter"]: m["loss"] for m in read_metrics(a) if m["type"] == "train" and m["iter"] > n}
    lb = {m["iter"]: m["loss"] for m in read_metrics(b) if m["type"] == "train" and m["iter"] > n}
    assert la and la == lb
    assert f"iter {2 * n}" in r.stdout


class Crash(Exception):
    """A run dying at a chosen iteration (after its step, before the next checkpoint)."""


def test_a_checkpoint_inside_a_log_interval_resumes_its_means(synth, tmp_path, monkeypatch):
    """A checkpoint between two log steps (eval_interval 2, log_interval 3: at iteration 4) carries
    the interval's sums and the count of skipped steps: a run that dies after it and resumes logs
    the same train records (means over every step of the interval) and the same summary as the run
    that never stopped."""
    args = [*TINY, *data_args(synth), "--n_layer=1", "--block_size=16", "--batch_size=2",
            "--eval_iters=1", "--calib_iters=1", "--max_iters=6", "--eval_interval=2",
            "--log_interval=3", "--dropout=0.1"]
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    real_step = train.optimisation_step

    def step(run):          # as if the fp16 GradScaler skipped the steps of iterations 2 and 3
        out = real_step(run)
        if run.iter_num in (2, 3):
            run.skipped += 1
        return out

    def dies_at_5(run):
        out = step(run)
        if run.iter_num == 5:
            raise Crash
        return out

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            monkeypatch.setattr(train, "optimisation_step", step)
            assert train.main([*args, f"--out_dir={tmp_path / 'a'}"]) == 0
            monkeypatch.setattr(train, "optimisation_step", dies_at_5)
            with pytest.raises(Crash):
                train.main([*args, f"--out_dir={tmp_path / 'b'}"])
            monkeypatch.setattr(train, "optimisation_step", step)
            assert load_ckpt(tmp_path / "b")["iter_num"] == 4
            assert train.main([*args, f"--out_dir={tmp_path / 'b'}", "--init_from=resume"]) == 0
    finally:
        torch.set_num_threads(old)
        for s, h in handlers.items():
            signal.signal(s, h)
    timing = ("ms_per_iter", "tokens_per_s", "mfu", "wall_s")

    def records(out_dir, kind):
        return [{k: v for k, v in r.items() if k not in timing}
                for r in read_metrics(out_dir) if r["type"] == kind]

    assert records(tmp_path / "a", "train") == records(tmp_path / "b", "train")
    (sa,), (sb,) = records(tmp_path / "a", "summary"), records(tmp_path / "b", "summary")
    assert sa == sb and sa["skipped_steps"] == 2


def test_a_signal_checkpoint_keeps_the_wall_time_up_to_the_stop(synth, tmp_path, monkeypatch):
    """A run stopped by a signal between evals checkpoints the wall time it ran up to the stop,
    so that the resumed run's summary counts those steps' time too."""
    args = [*TINY, *data_args(synth), "--n_layer=1", "--block_size=16", "--batch_size=2",
            "--eval_iters=1", "--calib_iters=1", "--max_iters=3", "--eval_interval=100",
            f"--out_dir={tmp_path}"]
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    real_step, pause = train.optimisation_step, 0.3

    def slow_step(run):            # two slow steps after the first eval, then SIGTERM
        out = real_step(run)
        time.sleep(pause)
        if run.iter_num == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return out

    try:
        with contextlib.redirect_stdout(io.StringIO()):
            monkeypatch.setattr(train, "optimisation_step", slow_step)
            assert train.main(args) == 0
            assert load_ckpt(tmp_path)["iter_num"] == 2
            assert load_ckpt(tmp_path)["flops_state"]["wall_s"] >= 2 * pause
            monkeypatch.setattr(train, "optimisation_step", real_step)
            assert train.main([*args, "--init_from=resume"]) == 0
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    summary = [r for r in read_metrics(tmp_path) if r["type"] == "summary"][-1]
    assert summary["iter"] == 3 and summary["wall_s"] >= 2 * pause


# --------------------------------------------------------------------------------------------------
# 2. DDP (2 CPU processes, gloo) == 1 process with the same global batch

WRAPPER = """\
import os, runpy, sys
sys.path.insert(0, {repo!r})
import flops
flops.peak_flops = lambda *a, **k: 1e12     # a made-up CPU peak, so that mfu is logged on CPU
sys.argv = ['train.py'] + sys.argv[1:]
runpy.run_path(os.path.join({repo!r}, 'train.py'), run_name='__main__')
"""

GLOO_SMOKE = """\
import torch, torch.distributed as dist
dist.init_process_group('gloo')
t = torch.ones(1)
dist.all_reduce(t)
assert t.item() == 2
dist.destroy_process_group()
"""


@pytest.fixture(scope="module")
def ddp_runs(synth, tmp_path_factory):
    """The same 4 iterations (global batch 2 micro-batches of 4) run by 1 process with accumulation
    2 and by torchrun with 2 processes; train.py is run through a wrapper that fakes a CPU peak
    FLOP/s so that mfu is a number."""
    tmp = tmp_path_factory.mktemp("ddp")
    wrapper = tmp / "train_wrapper.py"
    wrapper.write_text(WRAPPER.format(repo=str(REPO)))
    common = [
        *TINY,
        *data_args(synth),
        "--gradient_accumulation_steps=2",
        "--max_iters=4",
        "--eval_interval=2",
        "--dropout=0.0",
    ]
    single = tmp / "single"
    ok(run_py(str(wrapper), [*common, f"--out_dir={single}"]))
    ddp = tmp / "ddp"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    r = run_group([*torchrun, wrapper, *common, f"--out_dir={ddp}"], 240, cwd=REPO, env=ENV)
    if r.returncode != 0:
        smoke = tmp / "gloo_smoke.py"
        smoke.write_text(GLOO_SMOKE)
        s = run_group([*torchrun, smoke], 120, cwd=tmp, env=ENV)
        if s.returncode != 0:
            pytest.skip(
                f"torchrun/gloo cannot start 2 CPU processes here: {s.stderr.strip()[-500:]}"
            )
        ok(r)
    return SimpleNamespace(single=single, ddp=ddp, result=r)


@pytest.mark.xdist_group('ddp_runs')
@pytest.mark.slow
def test_ddp_matches_single_process(ddp_runs):
    """Same final weights (float tolerance: DDP all-reduces the gradient as (g0 + g1)/2 where one
    process sums g0/2 + g1/2, so the last bits may differ: rtol=1e-5, atol=1e-6), and only rank 0
    writes metrics (as many lines as the single-process run)."""
    cs, cd = load_ckpt(ddp_runs.single), load_ckpt(ddp_runs.ddp)
    assert cs["iter_num"] == cd["iter_num"] == 4
    assert set(cs["model"]) == set(cd["model"])
    for k in cs["model"]:
        torch.testing.assert_close(cd["model"][k], cs["model"][k], rtol=1e-5, atol=1e-6, msg=k)
    ms, md = read_metrics(ddp_runs.single), read_metrics(ddp_runs.ddp)
    assert len(md) == len(ms) == 4 + 3 + 1         # 4 train lines, evals at 0, 2, 4, summary
    assert [m["type"] for m in md] == [m["type"] for m in ms]
    assert json.loads(Path(ddp_runs.ddp, "run_info.json").read_text())["world_size"] == 2
    # eval runs on rank 0 with identical weights and batches: the same losses
    for a, b in zip(ms, md):
        if a["type"] == "eval":
            assert b["val_loss"] == pytest.approx(a["val_loss"], rel=1e-5)
    assert ddp_runs.result.stdout.count("done:") == 1   # one process prints


@pytest.mark.xdist_group('ddp_runs')
@pytest.mark.slow
def test_ddp_logged_loss_is_global_mean(ddp_runs):
    ms = [m for m in read_metrics(ddp_runs.single) if m["type"] == "train"]
    md = [m for m in read_metrics(ddp_runs.ddp) if m["type"] == "train"]
    for a, b in zip(ms, md):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), f"iter {a['iter']}"


def mfu_per_token_rate(out_dir):
    """mfu / tokens_per_s for every train line (constant for a given model and world size)."""
    return [m["mfu"] / m["tokens_per_s"] for m in read_metrics(out_dir) if m["type"] == "train"]


@pytest.mark.xdist_group('ddp_runs')
@pytest.mark.slow
def test_ddp_mfu_accounts_for_world_size(ddp_runs):
    single, ddp = mfu_per_token_rate(ddp_runs.single), mfu_per_token_rate(ddp_runs.ddp)
    assert single and len(single) == len(ddp)
    for a, b in zip(single, ddp):          # same model and global batch: FLOPs per token agree to
                                           # ~routing noise
        assert b == pytest.approx(a / 2, rel=0.1)


def run_single_and_ddp(tmp, args):
    single, ddp = tmp / "single", tmp / "ddp"
    r1 = run_train([*args, f"--out_dir={single}"])
    require(r1.returncode == 0, r1.stdout[-2000:] + r1.stderr[-2000:])
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    r = run_group([*torchrun, "train.py", *args, f"--out_dir={ddp}"], 240, cwd=REPO, env=ENV)
    return single, ddp, r


@pytest.mark.xdist_group('ddp_runs')
@pytest.mark.slow
def test_ddp_matches_single_process_with_oracle_losses(ddp_runs, synth, tmp_path):
    """ffn_util_weight > 0 with 2 controlled layers and 1 oracle layer per step: the utility loss is
    deterministic given the layer, so the runs should still agree to float tolerance, and so
    should every train record's routing fractions and auxiliary terms (means over both ranks'
    micro-batches, as the single process averages its two)."""
    args = [
        *TINY,
        *data_args(synth),
        "--gradient_accumulation_steps=2",
        "--max_iters=4",
        "--eval_interval=100",
        "--eval_iters=1",
        "--route=ffn",
        "--ffn_layers=all",
        "--ffn_util_weight=0.5",
        "--ffn_oracle_layers_per_step=1",
    ]
    single, ddp, r = run_single_and_ddp(tmp_path, args)
    require(r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:])
    cs, cd = load_ckpt(single), load_ckpt(ddp)
    for k in cs["model"]:
        torch.testing.assert_close(cd["model"][k], cs["model"][k], rtol=1e-5, atol=1e-6, msg=k)
    ms, md = ([m for m in read_metrics(d) if m["type"] == "train"] for d in (single, ddp))
    assert len(ms) == len(md) == 4
    for a, b in zip(ms, md):
        assert {"util_loss", "utility_mean"} <= set(a) and set(a) == set(b)
        assert b["full_frac"] == pytest.approx(a["full_frac"], rel=1e-5, abs=1e-6)
        for k in ("loss", "lm_loss", "util_loss", "utility_mean"):
            assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-6), (k, a["iter"])


PID_WRAPPER = """\
import os, runpy, sys
sys.path.insert(0, {repo!r})
with open(os.path.join({tmp!r}, 'pid' + os.environ['RANK']), 'w') as f:
    f.write(str(os.getpid()))
sys.argv = ['train.py'] + sys.argv[1:]
runpy.run_path(os.path.join({repo!r}, 'train.py'), run_name='__main__')
"""


def start_ddp_and_wait_for_training(synth, tmp, extra):
    """torchrun with 2 processes, each writing its pid to tmp/pid<rank>; returns (proc, out, pids)
    once a train line is logged."""
    wrapper = tmp / "pid_wrapper.py"
    wrapper.write_text(PID_WRAPPER.format(repo=str(REPO), tmp=str(tmp)))
    out = tmp / "out"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    proc = start([*torchrun, wrapper, *TINY, *data_args(synth), "--gradient_accumulation_steps=2",
                  "--max_iters=1000000", "--eval_interval=1000000", f"--out_dir={out}", *extra],
                 cwd=REPO, env=ENV)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and proc.poll() is None:
            metrics = out / "metrics.jsonl"
            if metrics.exists() and '"type": "train"' in metrics.read_text():
                break
            time.sleep(0.1)
        if proc.poll() is not None:
            r = finish(proc)
            pytest.skip(f"torchrun/gloo did not start 2 CPU processes here: {r.stderr[-500:]}")
        pids = {rank: int((tmp / f"pid{rank}").read_text()) for rank in (0, 1)}
    except BaseException:              # (a skip too) the caller gets no process to end
        stop(proc)
        raise
    return proc, out, pids


CUT_WRAPPER = """\
import os, sys
sys.path.insert(0, {repo!r})
import train
step = train.optimisation_step
def cut(run):                        # every rank ends here, as a kill would end it
    if run.iter_num == {cut_at}:
        sys.stdout.flush()
        os._exit(0)
    return step(run)
train.optimisation_step = cut
sys.argv = ['train.py'] + sys.argv[1:]
train.run_cli(train.main)
"""


@pytest.mark.slow
def test_ddp_resume_mid_log_interval_logs_what_the_uninterrupted_run_logs(synth, tmp_path):
    """A checkpoint between two log steps (eval every 3, log every 2) of a 2-process run, cut at
    iteration 4, then resumed: the record at 4 averages every rank's steps 3 and 4, as the run
    that never stopped does (one process with the same global batch logs the same)."""
    args = [*TINY, *data_args(synth), "--gradient_accumulation_steps=2", "--max_iters=6",
            "--eval_interval=3", "--log_interval=2", "--decay_lr=False", "--dropout=0.0"]
    wrapper = tmp_path / "cut.py"
    wrapper.write_text(CUT_WRAPPER.format(repo=str(REPO), cut_at=4))
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    single = start([sys.executable, "train.py", *args, f"--out_dir={whole}"], cwd=REPO, env=ENV)
    try:
        r = run_group([*torchrun, wrapper, *args, f"--out_dir={cut}"], 240, cwd=REPO, env=ENV)
        require(r.returncode == 0 and load_ckpt(cut)["iter_num"] == 3, r.stderr[-2000:])
        r = run_group([*torchrun, "train.py", *args, f"--out_dir={cut}", "--init_from=resume"],
                      240, cwd=REPO, env=ENV)
        require(r.returncode == 0, r.stderr[-2000:])
    finally:
        ok(finish(single, 240))
    def train_lines(out):
        return [(m["iter"], m["lm_loss"]) for m in read_metrics(out) if m["type"] == "train"]
    resumed, uninterrupted = train_lines(cut), train_lines(whole)
    assert [i for i, _ in resumed] == [i for i, _ in uninterrupted] == [2, 4, 6]
    for (i, a), (_, b) in zip(resumed, uninterrupted):
        assert a == pytest.approx(b, rel=1e-5), f"iter {i}"


@pytest.mark.slow
def test_ddp_signal_to_one_worker_stops_all_with_one_message(synth, tmp_path):
    """SIGTERM to rank 1 only: every rank stops at a common iteration, rank 0 saves and prints the
    resume command, and nothing claims the run is done."""
    proc, out, pids = start_ddp_and_wait_for_training(synth, tmp_path, [])
    try:
        os.kill(pids[1], signal.SIGTERM)
        r = finish(proc, timeout=120)
    finally:
        stop(proc)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.count("stopped by signal") == 1 and "done:" not in r.stdout, r.stdout[-2000:]
    assert load_ckpt(out)["iter_num"] > 0


SIGNAL_RANK_0_IN_EVAL = """\
import os, signal, sys
sys.path.insert(0, {repo!r})
import train
evaluate, calls = train.evaluation.evaluate, []
def signalled(*a, **kw):              # rank 0's third split evaluated: the eval at iteration 5
    calls.append(1)
    if len(calls) == 3:
        os.kill(os.getpid(), signal.SIGTERM)
    return evaluate(*a, **kw)
train.evaluation.evaluate = signalled
sys.argv = ['train.py'] + sys.argv[1:]
train.run_cli(train.main)
"""


@pytest.mark.slow
def test_ddp_signal_to_rank_0_in_an_eval_abandons_it_and_stops_every_rank(synth, tmp_path):
    """SIGTERM to rank 0 (which alone evaluates) as its eval at iteration 5 starts: the eval is
    abandoned, rank 0 saves at 5 without the eval's record and tells rank 1 in its broadcast, and
    the launch ends with one stop message, not after more training steps."""
    wrapper, out = tmp_path / "signal_in_eval.py", tmp_path / "out"
    wrapper.write_text(SIGNAL_RANK_0_IN_EVAL.format(repo=str(REPO)))
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    r = run_group([*torchrun, wrapper, *TINY, *data_args(synth), f"--out_dir={out}",
                   "--gradient_accumulation_steps=2", "--max_iters=20"], 240, cwd=REPO, env=ENV)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("stopped by signal") == 1, r.stdout[-2000:]
    assert "stopped by signal during the evaluation at iteration 5" in r.stdout, r.stdout[-2000:]
    assert load_ckpt(out)["iter_num"] == 5
    records = read_metrics(out)
    assert [m["iter"] for m in records if m["type"] == "eval"] == [0]
    assert [m["iter"] for m in records if m["type"] == "train"] == [1, 2, 3, 4, 5]


@pytest.mark.slow
def test_ddp_hung_worker_times_out_with_an_error(synth, tmp_path):
    """A stopped (hung) rank: the other gives up after ddp_timeout with one error line, instead of
    waiting forever."""
    proc, out, pids = start_ddp_and_wait_for_training(synth, tmp_path, ["--ddp_timeout=5"])
    os.kill(pids[1], signal.SIGSTOP)
    t0 = time.time()

    def end_hung_rank():
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.kill(pids[1], sig)
            except ProcessLookupError:
                pass
    try:
        # once the live rank has given up, the stopped one is ended here: torchrun would give it
        # 30 s to answer a SIGTERM it cannot see while stopped
        while time.time() - t0 < 140 and running(pids[0]):
            time.sleep(0.2)
        gave_up_s = time.time() - t0
        end_hung_rank()
        r = finish(proc, timeout=60)
    finally:
        end_hung_rank()
        stop(proc)
    assert r.returncode != 0
    assert "error: a DDP process stopped responding" in r.stderr, r.stderr[-3000:]
    assert gave_up_s < 140


def running(pid):
    """Is pid alive (not exited, nor a zombie its parent has yet to reap)?"""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].split()[0] not in (b"Z", b"X")
    except FileNotFoundError:
        return False


# --------------------------------------------------------------------------------------------------
# 3. the sampler: tests/test_loader.py


# --------------------------------------------------------------------------------------------------
# 4. output files

def test_outputs(base_run, synth):
    out = base_run.out
    cfg = json.loads((out / "config.json").read_text())
    # config.json: the resolved config, i.e. the defaults with exactly what we passed applied
    expected = dict(train.DEFAULTS)
    for a in base_run.args:
        k, _, v = a[2:].partition("=")
        expected[k] = (
            type(train.DEFAULTS[k])(v) if not isinstance(train.DEFAULTS[k], bool) else v == "True"
        )
    assert cfg == expected
    assert cfg["weight_decay"] == 0.05 and cfg["beta2"] == 0.99 and cfg["n_layer"] == 2

    metrics = read_metrics(out)
    assert all(isinstance(m, dict) for m in metrics)
    assert len(Path(out, "metrics.jsonl").read_text().strip().splitlines()) == len(metrics)
    train_lines = [m for m in metrics if m["type"] == "train"]
    eval_lines = [m for m in metrics if m["type"] == "eval"]
    assert [m["iter"] for m in train_lines] == [1, 2, 3, 4, 5, 6]
    assert [m["iter"] for m in eval_lines] == [0, 3, 6]
    assert metrics[-1]["type"] == "summary"
    tokens_per_iter = 1 * 4 * 32
    for m in train_lines:
        assert {"iter", "loss", "lr", "ms_per_iter", "tokens_per_s", "mfu", "grad_norm"} <= set(m)
        assert m["mfu"] is None                                          # no known CPU peak
        assert math.isfinite(m["loss"]) and 0 < m["loss"] < 10
        assert math.isfinite(m["grad_norm"]) and m["grad_norm"] > 0
        assert m["ms_per_iter"] > 0
        assert m["tokens_per_s"] == pytest.approx(
            tokens_per_iter / (m["ms_per_iter"] / 1000), rel=1e-6
        )
        # the lr used for the step that produced iteration m["iter"]
        assert m["lr"] == pytest.approx(
            expected_lr(
                m["iter"] - 1,
                cfg["learning_rate"],
                cfg["min_lr"],
                cfg["warmup_iters"],
                cfg["max_iters"],
            ),
            rel=1e-12,
        )
    for m in eval_lines:
        assert {"train_loss", "val_loss"} <= set(m)
        assert math.isfinite(m["train_loss"]) and math.isfinite(m["val_loss"])
    assert eval_lines[-1]["val_loss"] < eval_lines[0]["val_loss"]      # it learns something
    assert metrics[-1]["best_val_loss"] == min(m["val_loss"] for m in eval_lines)

    # the checkpoint is the model the last eval measured (loss recomputed independently)
    ck = load_ckpt(out)
    assert ck["iter_num"] == 6 and ck["config"] == cfg
    assert ck["best_val_loss"] == metrics[-1]["best_val_loss"]
    assert eval_loss_of_ckpt(out, synth, "val") == pytest.approx(
        eval_lines[-1]["val_loss"], rel=1e-5
    )
    assert eval_loss_of_ckpt(out, synth, "train") == pytest.approx(
        eval_lines[-1]["train_loss"], rel=1e-5
    )

    info = json.loads((out / "run_info.json").read_text())
    assert {"git_sha", "git_dirty", "torch", "device"} <= set(info)
    assert info["torch"] == torch.__version__ and info["device"] == "cpu"
    assert isinstance(info["git_dirty"], bool)
    assert info["git_sha"] is None or isinstance(info["git_sha"], str)
    assert "sample.py" in base_run.result.stdout


# --------------------------------------------------------------------------------------------------
# 5. Ctrl-C / SIGTERM

RANK0_LOCK_FAILS = """\
import errno, sys
sys.path.insert(0, {repo!r})
import run_state
def lock_folder(folder, option):            # (rank 0 alone locks) an I/O error, not the user's
    raise OSError(errno.EIO, 'Input/output error')
run_state.lock_folder = lock_folder
import train
sys.argv = ['train.py'] + sys.argv[1:]
train.run_cli(train.main)
"""


@pytest.mark.slow
def test_ddp_every_rank_learns_of_rank_0_failing_to_lock_with_another_error(synth, tmp_path):
    """Rank 0's lock failing with an error that is not a UserError: rank 0 shows its traceback and
    the other rank stops with rank 0's verdict, sent in the broadcast it waits on (not by losing
    the connection, which a dead peer under NCCL does not break before ddp_timeout)."""
    wrapper, out = tmp_path / "lock_fails.py", tmp_path / "out"
    wrapper.write_text(RANK0_LOCK_FAILS.format(repo=str(REPO)))
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    r = run_group([*torchrun, wrapper, *TINY, *data_args(synth), f"--out_dir={out}",
                   "--gradient_accumulation_steps=2", "--ddp_timeout=600"], 120, cwd=REPO, env=ENV)
    assert r.returncode != 0 and "OSError: [Errno 5] Input/output error" in r.stderr, r.stderr
    assert f"error: rank 0 refused out_dir {out} (its error is above)\n" in r.stderr, r.stderr
    assert "stopped responding" not in r.stderr, r.stderr


RANK0_OUTPUTS_FAIL = """\
import errno, sys
sys.path.insert(0, {repo!r})
import train
log = []
if {what!r} == 'wandb':                   # W&B refuses the run (only rank 0 starts it)
    import wandb
    def init(**kw):
        raise wandb.errors.CommError('project tiny not found')
    wandb.init = init
    log = ['--log=wandb', '--wandb_project=tiny']    # (torchrun reads --log=... as its --log-dir)
else:                                     # rank 0 alone opens the run files: an I/O error
    def open_run_files(*a):
        raise OSError(errno.EIO, 'Input/output error')
    train.open_run_files = open_run_files
sys.argv = ['train.py'] + sys.argv[1:] + log
train.run_cli(train.main)
"""


@pytest.mark.slow
@pytest.mark.parametrize("what", ["wandb", "run_files"])
def test_ddp_every_rank_learns_of_rank_0_failing_to_start_its_loggers(synth, tmp_path, what):
    """Rank 0 alone starts the loggers and opens the run files: when that fails, the other rank
    stops at once with rank 0's verdict, sent in a broadcast, naming where the real error is
    (not as a lost connection, nor at ddp_timeout under NCCL), and the launch ends promptly."""
    wrapper, out = tmp_path / "outputs_fail.py", tmp_path / "out"
    wrapper.write_text(RANK0_OUTPUTS_FAIL.format(repo=str(REPO), what=what))
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    t0 = time.time()
    r = run_group([*torchrun, wrapper, *TINY, *data_args(synth), f"--out_dir={out}",
                   "--gradient_accumulation_steps=2", "--ddp_timeout=600"], 120, cwd=REPO,
                  env=ENV)
    assert time.time() - t0 < 110                # (ddp_timeout is 600)
    rank0 = ("error: --log=wandb: W&B could not start a run in project 'tiny' (CommError: project "
             "tiny not found)" if what == "wandb" else "OSError: [Errno 5] Input/output error")
    assert r.returncode != 0 and r.stderr.count(rank0) == 1, r.stderr[-3000:]
    other = "start its loggers" if what == "wandb" else "open its run files or loggers"
    assert r.stderr.count(f"error: rank 0 could not {other} (its error is above)\n") == 1, \
        r.stderr[-3000:]
    assert "stopped responding" not in r.stderr, r.stderr[-3000:]
    assert not (out / "metrics.jsonl").exists()


SIGNALS = {"SIGINT": signal.SIGINT, "SIGTERM": signal.SIGTERM}


@pytest.mark.slow
def test_ddp_every_rank_stops_when_rank_0_cannot_lock_the_folder(base_run, synth, tmp_path):
    """Only rank 0 takes out_dir's lock; when another process holds it, every rank stops with the
    same error line (none waits for a peer until ddp_timeout), and nothing in the folder is
    touched."""
    out = copy_run(base_run, tmp_path)
    before = snapshot(out)
    holder = runlock.lock_folder(out)               # this process stands in for a run writing there
    try:
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                    "--nproc_per_node=2"]
        r = run_group([*torchrun, "train.py", *base_run.args, f"--out_dir={out}",
                       "--init_from=resume", "--max_iters=8", "--gradient_accumulation_steps=2",
                       "--ddp_timeout=600"], 240, cwd=REPO, env=ENV)
    finally:
        holder.release()
    line = (f"error: out_dir {out} is in use by another run (PID {os.getpid()} on "
            f"{socket.gethostname()},")
    assert r.returncode != 0 and r.stderr.count(line) == 2, r.stderr[-3000:]    # both ranks
    assert f'File "{REPO / "train.py"}"' not in r.stderr          # no traceback of train.py's
    assert "stopped responding" not in r.stderr
    assert snapshot(out) == before


@pytest.mark.slow
def test_ddp_runs_always_exit(tmp_path):
    """Consecutive 2-process runs each exit 0 within the timeout and leave nothing running (before
    DDP workers ended with os._exit, about one in ten hung at exit). tests/ddp_soak.py runs 20;
    here 3
    (30-50 s on a loaded 2-core machine)."""
    r = run_group([sys.executable, "tests/ddp_soak.py", "--runs=3", "--timeout=120"], 600,
                  cwd=REPO, env=ENV)
    assert r.returncode == 0 and "3 of 3 runs exited 0" in r.stdout, \
        r.stdout[-3000:] + r.stderr[-3000:]


@pytest.fixture(scope="module")
def signalled_runs(synth, tmp_path_factory):
    """Two endless runs started side by side; once each has logged a train line it gets SIGINT resp.
    SIGTERM; then each is resumed with the command it printed (capped at 2 more iterations)."""
    tmp = tmp_path_factory.mktemp("signals")
    runs = {}
    try:
        for name in SIGNALS:
            out = tmp / name
            args = [
                *TINY,
                *data_args(synth),
                "--max_iters=1000000",
                "--eval_interval=1000000",
                f"--out_dir={out}",
            ]
            runs[name] = SimpleNamespace(out=out, proc=start_train(args))
        deadline = time.time() + 90
        pending = set(runs)
        while pending and time.time() < deadline:
            for name in list(pending):
                run, metrics = runs[name], runs[name].out / "metrics.jsonl"
                if run.proc.poll() is not None:
                    pending.discard(name)          # died early: reported by the test
                elif metrics.exists() and '"type": "train"' in metrics.read_text():
                    run.proc.send_signal(SIGNALS[name])
                    run.signalled = True
                    pending.discard(name)
            time.sleep(0.05)
        for run in runs.values():
            run.result = finish(run.proc, timeout=60)
    finally:
        for run in runs.values():
            stop(run.proc)
    try:
        for run in runs.values():                      # resume both, side by side
            run.ckpt = load_ckpt(run.out) if (run.out / "ckpt.pt").exists() else None
            run.resume = None
            line = next((l for l in run.result.stdout.splitlines() if "init_from=resume" in l),
                        None)
            if run.result.returncode == 0 and run.ckpt is not None and line:
                cmd = shlex.split(line[line.index("python"):])
                run.cmd = cmd
                run.resume_proc = start_train([*cmd[2:],
                                               f"--max_iters={run.ckpt['iter_num'] + 2}"])
        for run in runs.values():
            if hasattr(run, "resume_proc"):
                run.resume = finish(run.resume_proc)
    finally:                                           # one timing out leaves none running
        for run in runs.values():
            if hasattr(run, "resume_proc"):
                stop(run.resume_proc)
    return runs


@pytest.mark.xdist_group('signalled_runs')
@pytest.mark.parametrize("name", list(SIGNALS))
def test_signal_saves_and_resume_command_works(signalled_runs, name):
    run = signalled_runs[name]
    assert getattr(run, "signalled", False), (
        f"never reached a train line: {run.result.stderr[-2000:]}"
    )
    assert run.result.returncode == 0, run.result.stderr
    assert "init_from=resume" in run.result.stdout
    assert run.ckpt is not None
    k = run.ckpt["iter_num"]
    assert k > 0
    assert all(torch.isfinite(v).all() for v in run.ckpt["model"].values())
    # the printed command resumes (later --key=value override earlier ones, so max_iters is capped)
    assert run.cmd[:2] == ["python", "train.py"] and "--init_from=resume" in run.cmd
    ok(run.resume)
    assert load_ckpt(run.out)["iter_num"] == k + 2
    # the interrupted run logged step k last and saved exactly that; the resumed run went on from k
    assert [m["iter"] for m in read_metrics(run.out) if m["type"] == "train"][-3:] == [
        k,
        k + 1,
        k + 2,
    ]


# --------------------------------------------------------------------------------------------------
# 6. a full disk under the metrics (atomic checkpoints: test_checkpoint.py)

def test_full_disk_under_the_metrics_is_one_error_naming_disk_space(synth, tmp_path, monkeypatch):
    """ENOSPC while appending to metrics.jsonl (not a checkpoint write): a TrainError naming the
    disk and the file, not an OSError traceback."""
    out = tmp_path / "o"
    real = train.open_run_files

    class FullDisk:
        name = str(out / "metrics.jsonl")

        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")
        flush = close = lambda self: None

    def open_full(*args):
        real(*args).close()
        return FullDisk()
    monkeypatch.setattr(train, "open_run_files", open_full)
    with pytest.raises(train.TrainError, match=r"no space left on the disk while writing "
                                               r".*metrics\.jsonl.*init_from=resume"):
        train.main(
            [*TINY, *data_args(synth), f"--out_dir={out}", "--max_iters=2", "--eval_iters=1"]
        )


# --------------------------------------------------------------------------------------------------
# 7. non-finite loss

@pytest.fixture(scope="module")
def nan_runs(base_run, synth, tmp_path_factory):
    """lr=1e6 runs, two at a time: from scratch; resumed from the good 6-iteration base run with no
    eval before the blow-up; and resumed with an eval after every step."""
    tmp = tmp_path_factory.mktemp("nan")
    runs = {}
    for name in ("resume_no_eval", "resume_eval_every_step"):
        out = tmp / name
        shutil.copytree(base_run.out, out)
        runs[name] = SimpleNamespace(out=out, before=(out / "ckpt.pt").read_bytes(), args=[
            *base_run.args, f"--out_dir={out}", "--init_from=resume", "--max_iters=100",
            "--eval_interval=1000" if name == "resume_no_eval" else "--eval_interval=1", *NAN_ARGS])
    runs["scratch"] = SimpleNamespace(
        out=tmp / "scratch",
        args=[
            *TINY,
            *data_args(synth),
            f"--out_dir={tmp / 'scratch'}",
            "--max_iters=100",
            "--eval_interval=1000",
            *NAN_ARGS,
        ],
    )
    names = list(runs)
    for pair in (names[:2], names[2:]):
        procs = {n: start_train(runs[n].args) for n in pair}
        try:
            for n, proc in procs.items():
                runs[n].result = finish(proc)
        finally:
            for proc in procs.values():
                stop(proc)
    return runs


@pytest.mark.xdist_group('nan_runs')
def test_nonfinite_loss_stops_with_error_and_keeps_checkpoint(nan_runs):
    """Resume a good run with lr=1e6: the loss blows up, train.py exits 2 naming the iteration, and
    the checkpoint from before (no eval in between) is byte-identical and finite."""
    run = nan_runs["resume_no_eval"]
    r = run.result
    assert r.returncode == 2, r.stderr
    assert "error:" in r.stderr and re.search(r"iteration \d+", r.stderr), r.stderr
    assert "Traceback" not in r.stderr
    assert (run.out / "ckpt.pt").read_bytes() == run.before
    ck = load_ckpt(run.out)
    assert ck["iter_num"] == 6 and all(torch.isfinite(v).all() for v in ck["model"].values())


@pytest.mark.xdist_group('nan_runs')
def test_nonfinite_loss_from_scratch(nan_runs):
    run = nan_runs["scratch"]
    r = run.result
    assert r.returncode == 2 and re.search(r"error: .*iteration \d+", r.stderr), r.stderr
    assert "Traceback" not in r.stderr
    assert not (run.out / "ckpt.pt").exists()   # no eval happened after iteration 0: nothing to
                                                # save
    assert "no checkpoint was saved yet" in r.stderr and "left untouched" not in r.stderr


def test_overwrite_replaces_the_old_run(base_run, synth, tmp_path):
    """--overwrite=True: a fresh run into a used out_dir starts a new metrics.jsonl and
    checkpoint."""
    out = copy_run(base_run, tmp_path)
    ok(
        run_train(
            [
                *TINY,
                *data_args(synth),
                f"--out_dir={out}",
                "--max_iters=2",
                "--eval_interval=2",
                "--overwrite=True",
            ]
        )
    )
    recs = read_metrics(out)
    # none of the old run's evals
    assert [r["iter"] for r in recs if r["type"] == "eval"] == [0, 2]
    assert load_ckpt(out)["iter_num"] == 2


# --------------------------------------------------------------------------------------------------
# one writer per run folder

def wait_for_train_line(proc, out, after=0, seconds=120):
    """Wait until out/metrics.jsonl holds a train record past iteration `after` (proc running)."""
    deadline = time.time() + seconds
    while time.time() < deadline and proc.poll() is None:
        path = out / "metrics.jsonl"
        records = [train.parse_record(line) for line in open(path)] if path.exists() else []
        if any(r is not None and r.get("type") == "train" and r["iter"] > after for r in records):
            return
        time.sleep(0.1)
    raise RuntimeError(f"no train line from {proc.args} (exit {proc.poll()})")


@pytest.fixture(scope="module")
def held_run(base_run, tmp_path_factory):
    """A copy of base_run resumed for 'ever' (the lock holder), and its checkpoint's bytes."""
    out = tmp_path_factory.mktemp("held") / "out"
    shutil.copytree(base_run.out, out)
    ckpt = (out / "ckpt.pt").read_bytes()
    proc = start_train([*base_run.args, f"--out_dir={out}", "--init_from=resume",
                        "--max_iters=1000000", "--eval_interval=1000000"],
                       stdout=subprocess.DEVNULL)          # (a full pipe would stall it)
    try:
        wait_for_train_line(proc, out, after=6)
        yield SimpleNamespace(out=out, proc=proc, ckpt=ckpt)
    finally:
        stop(proc)


@pytest.mark.xdist_group('held_run')
@pytest.mark.parametrize("second", ["resume", "overwrite_spelled_otherwise"])
def test_a_second_writer_is_refused_while_a_run_holds_the_folder(held_run, base_run, synth, second):
    """While a run trains in out_dir, a resume or a fresh --overwrite=True run into it exits 2 with
    one line naming the folder and the holder's host and PID, and touches nothing: the checkpoint
    and the holder's metrics file (the same file, not a replaced one) are still there."""
    out, holder = held_run.out, held_run.proc
    args = {"resume": [*base_run.args, f"--out_dir={out}", "--init_from=resume", "--max_iters=100"],
            "overwrite_spelled_otherwise": [*TINY, *data_args(synth), f"--out_dir={out}/../out/",
                                            "--max_iters=2", "--overwrite=True"]}[second]
    metrics_inode = os.stat(out / "metrics.jsonl").st_ino
    r = run_train(args)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert r.stderr.count("\n") == 1 and r.stdout == "", r.stdout + r.stderr
    assert r.stderr.startswith(f"error: out_dir {out}"), r.stderr
    assert f"is in use by another run (PID {holder.pid} on {socket.gethostname()}," in r.stderr, \
        r.stderr
    assert holder.poll() is None                                  # the holder goes on
    assert (out / "ckpt.pt").read_bytes() == held_run.ckpt
    assert os.stat(out / "metrics.jsonl").st_ino == metrics_inode
    last = max(r["iter"] for r in read_metrics(out) if r["type"] == "train")
    wait_for_train_line(holder, out, after=last)


def test_a_killed_holder_leaves_the_folder_free(base_run, tmp_path):
    """The lock dies with its holder, even by SIGKILL: the run resumes at once from its
    checkpoint."""
    out = copy_run(base_run, tmp_path)
    resume = [*base_run.args, f"--out_dir={out}", "--init_from=resume"]
    proc = start_train([*resume, "--max_iters=1000000", "--eval_interval=1000000"],
                       stdout=subprocess.DEVNULL)
    try:
        wait_for_train_line(proc, out, after=6)
        refused = run_train([*resume, "--max_iters=8"])
        assert refused.returncode == 2 and f"PID {proc.pid}" in refused.stderr, refused.stderr
        proc.kill()
        proc.wait(timeout=30)
    finally:
        stop(proc)
    r = ok(run_train([*base_run.args, f"--out_dir={out}", "--init_from=resume", "--max_iters=8"]))
    assert "done: 8 iterations" in r.stdout
    assert not (out / ".lock").exists()      # released (and removed) by the run that finished


def test_a_refused_run_leaves_no_folder_or_lock_behind(synth, tmp_path):
    """The lock is taken before the inputs are checked; a run refused after it (here: missing data)
    leaves no out_dir, as before."""
    out = tmp_path / "new"
    with pytest.raises(train.TrainError):
        train.main([*TINY, f"--data_dir={tmp_path}", "--dataset=absent", f"--out_dir={out}"])
    assert not out.exists()


# --------------------------------------------------------------------------------------------------
# resume bookkeeping

def test_resuming_a_finished_run_says_so_and_writes_nothing(base_run, tmp_path):
    out = copy_run(base_run, tmp_path)
    before = snapshot(out)
    r = ok(run_train([*base_run.args, f"--out_dir={out}", "--init_from=resume"]))
    finished = (f"the run in {out} is already finished (iteration 6, max_iters=6, its summary "
                f"recorded): nothing to do. Train it further with a larger --max_iters, or "
                f"evaluate it with --eval_only=True")
    assert r.stdout.splitlines() == [finished], r.stdout
    assert "done:" not in r.stdout and r.stderr == ""
    assert snapshot(out) == before
    assert [m["type"] for m in read_metrics(out)].count("summary") == 1


def test_a_run_killed_before_its_summary_is_not_finished(base_run, tmp_path):
    """Checkpoint at max_iters but no summary (killed in between): the resume writes the summary."""
    out = copy_run(base_run, tmp_path)
    lines = (out / "metrics.jsonl").read_text().splitlines(keepends=True)
    assert json.loads(lines[-1])["type"] == "summary"
    (out / "metrics.jsonl").write_text("".join(lines[:-1]))
    r = ok(run_train([*base_run.args, f"--out_dir={out}", "--init_from=resume"]))
    assert "done: 6 iterations" in r.stdout
    recs = read_metrics(out)
    assert [m["type"] for m in recs].count("summary") == 1 and recs[-1]["type"] == "summary"
    assert recs[-1]["iter"] == 6 and "routing" in recs[-1]


def test_an_eval_only_summary_does_not_finish_a_run_killed_before_its_summary(base_run, tmp_path):
    """Checkpoint at max_iters, no summary, then an eval-only run (its eval and summary marked
    eval_only): the training is still unfinished, and the resume writes its summary after them."""
    out = copy_run(base_run, tmp_path)
    lines = (out / "metrics.jsonl").read_text().splitlines(keepends=True)
    (out / "metrics.jsonl").write_text("".join(lines[:-1]))
    ok(run_train([*base_run.args, f"--out_dir={out}", "--init_from=resume", "--eval_only=True"]))
    r = ok(run_train([*base_run.args, f"--out_dir={out}", "--init_from=resume"]))
    assert "done: 6 iterations" in r.stdout
    summaries = [m for m in read_metrics(out) if m["type"] == "summary"]
    assert [(m["iter"], m.get("eval_only")) for m in summaries] == [(6, True), (6, None)]


def test_eval_only_resume_evaluates_once_and_records_it_once(base_run, synth, tmp_path):
    """--init_from=resume --eval_only=True: one eval of the checkpoint (the same losses the run's
    last eval measured), one 'eval' and one 'summary' record marked eval_only, appended; the
    checkpoint, config.json and run_info.json unchanged; no 'done:'."""
    out = copy_run(base_run, tmp_path)
    before, old = snapshot(out), read_metrics(out)
    r = ok(run_train([*base_run.args, f"--out_dir={out}", "--init_from=resume",
                      "--eval_only=True"]))
    recs = read_metrics(out)
    assert recs[:len(old)] == old and len(recs) == len(old) + 2
    ev, summary = recs[-2:]
    last_eval = [m for m in old if m["type"] == "eval"][-1]
    assert ev["type"] == "eval" and ev["eval_only"] is True and ev["iter"] == 6
    assert ev["val_loss"] == pytest.approx(last_eval["val_loss"], rel=1e-6)
    assert ev["train_loss"] == pytest.approx(last_eval["train_loss"], rel=1e-6)
    assert summary["type"] == "summary" and summary["eval_only"] is True and summary["iter"] == 6
    assert summary["best_val_loss"] == pytest.approx(old[-1]["best_val_loss"], rel=1e-6)
    assert "routing" in summary and summary["wall_s"] <= old[-1]["wall_s"]   # the training's
    line = f"iter 6: train loss {ev['train_loss']:.4f}, val loss {ev['val_loss']:.4f}"
    assert r.stdout.count(line) == 1, r.stdout
    assert f"evaluated {out} at iteration 6 (eval only: nothing trained)" in r.stdout
    assert "done:" not in r.stdout
    after = snapshot(out)
    assert {k: v for k, v in after.items() if k != "metrics.jsonl"} == \
        {k: v for k, v in before.items() if k != "metrics.jsonl"}


def test_max_iters_0_names_only_files_written(synth, tmp_path):
    r = ok(run_train([*TINY, *data_args(synth), f"--out_dir={tmp_path / 'o'}", "--max_iters=0"]))
    done = next(l for l in r.stdout.splitlines() if l.startswith("done:"))
    assert "ckpt.pt" not in done and not (tmp_path / "o" / "ckpt.pt").exists()
    assert "metrics.jsonl" in done


def test_family_options_from_a_config_file_are_noted_not_refused(synth, tmp_path):
    """A study's shared base file may set options of the family other arms use: noted, not an
    error."""
    cfg = tmp_path / "base.py"
    cfg.write_text("ffn_gate = 'jepa'\nffn_budget = 0.25\n")
    r = ok(
        run_train(
            [
                str(cfg),
                *TINY,
                *data_args(synth),
                f"--out_dir={tmp_path / 'o'}",
                "--route=halt",
                "--max_iters=1",
                "--eval_interval=1",
            ]
        )
    )
    assert "note: route=halt does not read ffn_budget, ffn_gate" in r.stdout


def test_token_ids_beyond_the_vocabulary_are_refused(synth, tmp_path):
    """A meta.json whose vocab_size is below the ids in the files: one error before training."""
    data = tmp_path / "syn"
    shutil.copytree(synth, data)
    meta = json.loads((data / "meta.json").read_text())
    meta["vocab_size"] = 20
    (data / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(train.TrainError, match="vocab"):
        train.main(
            [*TINY, f"--data_dir={tmp_path}", "--dataset=syn", f"--out_dir={tmp_path / 'o'}"]
        )
    assert not (tmp_path / "o").exists()


def test_same_size_corrupted_data_is_refused(synth, tmp_path):
    data = tmp_path / "syn"
    shutil.copytree(synth, data)
    raw = bytearray((data / "train.bin").read_bytes())
    raw[100:104] = b"\xff\xff\xff\xff"
    (data / "train.bin").write_bytes(bytes(raw))
    with pytest.raises(train.TrainError, match="train.bin"):
        train.main(
            [*TINY, f"--data_dir={tmp_path}", "--dataset=syn", f"--out_dir={tmp_path / 'o'}"]
        )


@pytest.mark.xdist_group('nan_runs')
def test_nonfinite_eval_does_not_overwrite_checkpoint(nan_runs, synth):
    run = nan_runs["resume_eval_every_step"]
    require(run.result.returncode == 2, run.result.stderr)
    assert math.isfinite(eval_loss_of_ckpt(run.out, synth, "val")), (
        "ckpt.pt holds a model whose val loss is not finite"
    )


# --------------------------------------------------------------------------------------------------
# 8. bad input: a clear message, exit code 2, nothing written to out_dir

def bad_input_cases(synth, text_data, base_copy):
    d = data_args(synth)
    return {
        "unknown_dataset": (
            [*TINY, f"--data_dir={synth.parent}", "--dataset=nope"],
            "python data/prepare.py",
        ),
        "unknown_key": ([*TINY, *d, "--n_layers=3"], "n_layer'"),
        "wrong_type": ([*TINY, *d, "--batch_size=abc"], "batch_size"),
        "float16_on_cpu": ([*TINY, *d, "--dtype=float16"], "float16"),
        "bad_init_from": ([*TINY, *d, "--init_from=nonsense"], "init_from"),
        "resume_no_ckpt": ([*TINY, *d, "--init_from=resume"], "no checkpoint"),
        "resume_changed_model": (
            [*TINY, *d, "--init_from=resume", "--n_layer=3", f"--out_dir={base_copy}"],
            "n_layer",
        ),
        # (the base run's optimizer settings given: the data is all that differs)
        "resume_other_data": (
            [
                *TINY,
                f"--data_dir={text_data.parent}",
                f"--dataset={text_data.name}",
                "--init_from=resume",
                "--weight_decay=0.05",
                "--beta2=0.99",
                f"--out_dir={base_copy}",
            ],
            ("vocab_size", "dataset"),
        ),
        "resume_changed_trainable": (
            [*TINY, *d, "--init_from=resume", "--trainable=controller", f"--out_dir={base_copy}"],
            "trainable",
        ),
        # the optimizer's state carries its betas and weight decay: a resume would keep the old
        # ones while config.json recorded the new
        "resume_changed_beta2": (
            [*TINY, *d, "--init_from=resume", "--max_iters=7", "--weight_decay=0.05",
             "--beta2=0.95", f"--out_dir={base_copy}"],
            "config field 'beta2' differs from the checkpoint: checkpoint has 0.99, config has "
            "0.95; resume with the run's original value",
        ),
        "bad_lm_thresholds": ([*TINY, *d, "--lm_thresholds=2.5;2.0"], "lm_thresholds"),
        # a draft is distilled from a trained model, which it must not change
        "draft_from_scratch": ([*TINY, *d, "--trainable=draft", "--ffn_draft_rank=4"],
                               "--init_from=<out_dir>/ckpt.pt"),
        "draft_without_draft_modules": (
            [*TINY, *d, "--trainable=draft", f"--init_from={base_copy / 'ckpt.pt'}"],
            "has none: e.g. route='ffn' with ffn_draft_rank > 0",
        ),
        "draft_of_another_budget": (
            [*TINY, *d, "--trainable=draft", "--ffn_draft_rank=4", "--ffn_budget=0.25",
             f"--init_from={base_copy / 'ckpt.pt'}"],
            "'ffn_budget' differs from the checkpoint: checkpoint has 0.5, config has 0.25; "
            "give --ffn_budget=0.5, as the checkpoint's run had it",
        ),
        "draft_of_another_gate_grad": (
            [*TINY, *d, "--trainable=draft", "--ffn_draft_rank=4", "--ffn_gate_grad=scale",
             f"--init_from={base_copy / 'ckpt.pt'}"],
            "'ffn_gate_grad' differs from the checkpoint",
        ),
        "draft_with_dropout": (
            [*TINY, *d, "--trainable=draft", "--ffn_draft_rank=4", "--dropout=0.1",
             f"--init_from={base_copy / 'ckpt.pt'}"],
            "distils without dropout",
        ),
        "draft_nothing_trains": ([*TINY, *d, "--ffn_draft_rank=4", "--ffn_draft_weight=0"],
                                 "ffn_draft_rank > 0 needs ffn_draft_weight > 0"),
        "draft_under_controller_training": (
            [*TINY, *d, "--trainable=controller", "--ffn_draft_rank=4",
             f"--init_from={base_copy / 'ckpt.pt'}"],
            "trains with trainable=all or draft",
        ),
        "draft_fsdp_partial_layers": (
            [*TINY, *d, "--ffn_draft_rank=4", "--ffn_layers=1", "--parallel=fsdp"],
            "parallel=fsdp shards each block on its own",
        ),
        # a fresh run never replaces or appends to the run already in out_dir
        "fresh_over_existing_run": (
            [*TINY, *d, f"--out_dir={base_copy}"],
            ("already holds a run", "--overwrite"),
        ),
        # the same tokenizer and vocabulary, other data: recognised by its sha256
        "resume_same_vocab_other_data": (
            [
                *TINY,
                f"--data_dir={synth.parent}",
                "--dataset=syn_other",
                "--init_from=resume",
                "--weight_decay=0.05",
                "--beta2=0.99",
                f"--out_dir={base_copy}",
            ],
            "sha256",
        ),
        "stage2_same_vocab_other_data": (
            [
                *TINY,
                f"--data_dir={synth.parent}",
                "--dataset=syn_other",
                f"--init_from={base_copy / 'ckpt.pt'}",
            ],
            "sha256",
        ),
        "resume_changed_cheap_rank": (
            [*TINY, *d, "--init_from=resume", "--ffn_cheap_rank=8", f"--out_dir={base_copy}"],
            "ffn_cheap_rank",
        ),
        # numeric fields, each refused before anything is written
        "n_head_0": ([*TINY, *d, "--n_head=0"], "n_head"),
        "block_size_0": ([*TINY, *d, "--block_size=0"], "block_size"),
        "batch_size_0": ([*TINY, *d, "--batch_size=0"], "batch_size"),
        "accumulation_0": (
            [*TINY, *d, "--gradient_accumulation_steps=0"],
            "gradient_accumulation_steps",
        ),
        "negative_lr": ([*TINY, *d, "--learning_rate=-1e-3"], "learning_rate"),
        "min_lr_above_lr": ([*TINY, *d, "--learning_rate=1e-2", "--min_lr=1e-1"], "--min_lr <="),
        "dropout_above_1": ([*TINY, *d, "--dropout=1.5"], "dropout"),
        "negative_max_iters": ([*TINY, *d, "--max_iters=-1"], "max_iters"),
        # a model vocabulary below the data's 34 symbols: refused, not an embedding index error
        # mid-run
        "vocab_below_data": ([*TINY, *d, "--vocab_size=20"], "vocab_size"),
        "bogus_device": ([*TINY, *d, "--device=bogus"], "device"),
        "mps_device": ([*TINY, *d, "--device=mps"], "device"),
        "out_dir_is_a_file": ([*TINY, *d, f"--out_dir={synth / 'meta.json'}"], "out_dir"),
        "data_dir_is_a_file": (
            [*TINY, f"--data_dir={synth / 'meta.json'}", "--dataset=syn"],
            "data_dir",
        ),
        # options of another routing family, given on the command line
        "halt_with_gate": (
            [*TINY, *d, "--route=halt", "--ffn_gate=jepa"],
            ("--ffn_gate", "route=halt"),
        ),
        "exit_with_gate": (
            [*TINY, *d, "--route=exit", "--ffn_gate=jepa"],
            ("--ffn_gate", "route=exit"),
        ),
        "halt_with_jepa_weight": (
            [*TINY, *d, "--route=halt", "--ffn_jepa_weight=5"],
            "--ffn_jepa_weight",
        ),
    }


CASES = [
    "unknown_dataset",
    "unknown_key",
    "wrong_type",
    "float16_on_cpu",
    "bad_init_from",
    "resume_no_ckpt",
    "resume_changed_model",
    "resume_other_data",
    "resume_changed_trainable",
    "resume_changed_beta2",
    "bad_lm_thresholds",
    "fresh_over_existing_run",
    "resume_same_vocab_other_data",
    "stage2_same_vocab_other_data",
    "resume_changed_cheap_rank",
    "n_head_0",
    "block_size_0",
    "batch_size_0",
    "accumulation_0",
    "negative_lr",
    "min_lr_above_lr",
    "dropout_above_1",
    "negative_max_iters",
    "vocab_below_data",
    "bogus_device",
    "mps_device",
    "out_dir_is_a_file",
    "data_dir_is_a_file",
    "halt_with_gate",
    "exit_with_gate",
    "halt_with_jepa_weight",
    "draft_from_scratch",
    "draft_without_draft_modules",
    "draft_of_another_budget",
    "draft_of_another_gate_grad",
    "draft_with_dropout",
    "draft_nothing_trains",
    "draft_under_controller_training",
    "draft_fsdp_partial_layers",
]


@pytest.fixture(scope="session")
def synth_other(synth):
    """Another synthetic corpus beside `synth`: the same tokenizer and vocabulary, other tokens."""
    folder = synth.parent / "syn_other"
    P.prepare("synthetic", out_dir=folder, num_tokens=60000, seed=7)
    return folder


def bad_case(case, synth, text_data, base_run, tmp_path):
    """(args, needles, fresh out_dir, the base run's copy, its snapshot) for one bad-input case."""
    base_copy = copy_run(base_run, tmp_path)
    args, needle = bad_input_cases(synth, text_data, base_copy)[case]
    fresh = tmp_path / "fresh_out"
    if not any(a.startswith("--out_dir=") for a in args):
        args = [*args, f"--out_dir={fresh}"]
    needles = needle if isinstance(needle, tuple) else (needle,)
    return args, needles, fresh, base_copy, snapshot(base_copy)


@pytest.mark.parametrize("case", CASES)
def test_bad_input_in_process(case, synth, synth_other, text_data, base_run, tmp_path):
    args, needles, fresh, base_copy, before = bad_case(case, synth, text_data, base_run, tmp_path)
    with pytest.raises(train.TrainError) as e:
        train.main(args)
    msg = str(e.value)
    assert any(n in msg for n in needles), msg
    if case == "unknown_key":
        assert "n_layers" in msg                   # names the bad key and the close match
    assert not fresh.exists()
    assert snapshot(base_copy) == before


@pytest.mark.parametrize("args,needle", [
    (["--route=ffn", "--trainable=last_layers"], "(route='none'); got route='ffn'"),
    (["--route=none", "--trainable=last_layers", "--ens_layers=5"],       # of 2 layers
     "got route='none', ens_layers=5"),
    (["--route=none", "--trainable=controller"], "=controller trains a routing controller"),
    (["--route=none", "--trainable=controller+lora"], "+lora trains a routing controller"),
    (["--lm_thresholds=2.5,nan"], "lm_thresholds must be comma-separated losses > 0"),
    (["--lm_thresholds=0"], "lm_thresholds must be comma-separated losses > 0"),
    (["--init_from={ckpt}", "--n_embd=64"], "config field 'n_embd' differs from the checkpoint"),
    (["--init_from=resume", "--out_dir={run}", "--n_embd=64"], "config field 'n_embd' differs"),
    (["--init_from=resume", "--out_dir={run}", "--batch_size=3"],
     "config field 'batch_size' differs"),
])
def test_a_run_refused_by_its_options_prepares_no_data(args, needle, base_run, tmp_path):
    """Options the config (or the checkpoint it starts from) refuses are refused before the data is
    prepared: a fresh --data_dir stays without a corpus, and the run resumed is as it was."""
    run = copy_run(base_run, tmp_path)
    fresh, before = tmp_path / "data", snapshot(run)
    args = [a.format(ckpt=base_run.out / "ckpt.pt", run=run) for a in args]
    with pytest.raises(train.TrainError, match=re.escape(needle)):
        train.main([*TINY, f"--data_dir={fresh}", "--dataset=synthetic",
                    f"--out_dir={tmp_path / 'o'}", *args])
    assert not (fresh / "synthetic").exists()
    assert snapshot(run) == before


def test_resuming_a_run_not_finished_below_its_iteration_is_refused(base_run, tmp_path):
    """A run stopped at iteration 6 (here: its summary gone) resumed with --max_iters=5 would train
    nothing, write its summary at 6 and record max_iters=5 in config.json over the run's own:
    refused, naming the iteration, before anything is written."""
    run = copy_run(base_run, tmp_path)
    metrics = run / "metrics.jsonl"
    metrics.write_text("".join(line for line in metrics.read_text().splitlines(True)
                               if '"type": "summary"' not in line))
    before = snapshot(run)
    with pytest.raises(train.TrainError, match=re.escape(
            "--max_iters=5 is below the iteration the checkpoint reached (6); give "
            "--max_iters=6 to end the run there")):
        train.main([*base_run.args, "--init_from=resume", f"--out_dir={run}", "--max_iters=5"])
    assert snapshot(run) == before


@pytest.mark.parametrize("case", ["unknown_key", "resume_other_data", "fresh_over_existing_run",
                                  "n_head_0", "draft_of_another_gate_grad"])
def test_bad_input_cli_exit_code(case, synth, synth_other, text_data, base_run, tmp_path):
    args, needles, fresh, base_copy, before = bad_case(case, synth, text_data, base_run, tmp_path)
    r = run_train(args)
    assert r.returncode == 2
    assert r.stderr.startswith("error: ") and "Traceback" not in r.stderr, r.stderr
    assert any(n in r.stderr for n in needles), r.stderr
    assert not fresh.exists() and snapshot(base_copy) == before


# --------------------------------------------------------------------------------------------------
# 9. quickstart

def test_quickstart_prepares_trains_and_samples(tmp_path):
    data, out = tmp_path / "data", tmp_path / "out"
    r = ok(run_train(["--max_iters=2", "--eval_iters=1", f"--data_dir={data}", f"--out_dir={out}"]))
    assert (data / "synthetic" / "meta.json").is_file()
    P.check_prepared(data / "synthetic")
    assert "sample.py" in r.stdout.strip().splitlines()[-1]
    assert load_ckpt(out)["iter_num"] == 2
    # the routed quickstart's summary: causal routing calibrated on train batches, judged on val
    summary = [m for m in read_metrics(out) if m["type"] == "summary"][-1]
    routing = summary["routing"]
    assert abs(float(np.mean(routing["val_loss"]["full_frac"])) - routing["budget"]) <= 0.05
    assert set(routing["full_frac_by_class"]) == set(P.DIFFICULTY_CLASSES)
    assert routing["val_loss_cheap"] > 0 and routing["val_loss_full"] > 0
    # absolute eval FLOPs per token, with the vocabulary the model was built with (config.json
    # stores 0)
    built = GPTConfig.from_dict(load_ckpt(out)["model_args"])
    assert json.loads((out / "config.json").read_text())["vocab_size"] == 0 and built.vocab_size > 0
    assert summary["eval_flops"] == pytest.approx(
        summary["eval_flops_vs_dense"]
        * flops.dense_forward_flops(built, built.block_size)
        / built.block_size
    )
    # eval.py in the documented form (--ckpt=PATH --json) prints one JSON object; a bad key is a
    # clean error
    e = ok(
        run_py(
            "eval.py",
            [f"--ckpt={out / 'ckpt.pt'}", "--json", f"--data_dir={data}", "--eval_iters=1"],
        )
    )
    res = json.loads(e.stdout.strip().splitlines()[-1])
    assert abs(float(np.mean(res["val_loss"]["full_frac"])) - res["budget"]) <= 0.05
    bad = run_py("eval.py", [f"--ckpt={out / 'ckpt.pt'}", "--eval_iter=1"])
    assert bad.returncode == 2 and "error:" in bad.stderr and "Traceback" not in bad.stderr
    # --room: one JSON object; its all-full loss is the summary's forced-full one (same batches)
    rm = ok(
        run_py(
            "eval.py",
            [
                f"--ckpt={out / 'ckpt.pt'}",
                "--room",
                "--json",
                f"--data_dir={data}",
                "--eval_iters=1",
            ],
        )
    )
    assert len(rm.stdout.strip().splitlines()) == 1
    room = json.loads(rm.stdout)
    assert room["full"] == pytest.approx(routing["val_loss_full"], rel=1e-6)
    assert room["room"] == pytest.approx(room["cheap"] - room["full"]) and room["oracle_full_frac"]
    both = run_py("eval.py", [f"--ckpt={out / 'ckpt.pt'}", "--room", "--routing_map"])
    assert both.returncode == 2 and "--room" in both.stderr and "Traceback" not in both.stderr
    s = ok(
        run_py(
            "sample.py",
            [f"--out_dir={out}", "--num_samples=1", "--max_new_tokens=10", f"--data_dir={data}"],
        )
    )
    first = s.stdout.splitlines()[0]
    symbols = set(P.SYMBOLS)
    # 1 prompt token + 10 new, all corpus symbols
    assert len(first) == 11 and set(first) <= symbols, first


# --------------------------------------------------------------------------------------------------
# 10. LR schedule

@settings(max_examples=100, deadline=None)
@given(lr=st.floats(1e-5, 1.0), frac=st.floats(0.0, 1.0), warmup=st.integers(0, 40),
       span=st.integers(1, 300), lr_decay_iters=st.booleans())
def test_lr_schedule(lr, frac, warmup, span, lr_decay_iters):
    """Warmup rises strictly to learning_rate at it == warmup_iters, cosine falls to min_lr at
    lr_decay_iters (or max_iters when it is 0), then min_lr; compared with an independent
    formula."""
    min_lr = lr * frac
    decay = warmup + span
    cfg = SimpleNamespace(
        learning_rate=lr,
        min_lr=min_lr,
        warmup_iters=warmup,
        decay_lr=True,
        lr_decay_iters=decay if lr_decay_iters else 0,
        max_iters=decay if not lr_decay_iters else 10**6,
    )
    lrs = [train.lr_at(cfg, it) for it in range(decay + 20)]
    for it, v in enumerate(lrs):
        assert math.isclose(
            v, expected_lr(it, lr, min_lr, warmup, decay), rel_tol=1e-9, abs_tol=1e-15
        ), it
        assert 0 <= v <= lr * (1 + 1e-12)
        if it >= warmup:
            assert min_lr * (1 - 1e-12) <= v
    warm = lrs[:warmup + 1]
    assert all(a < b for a, b in zip(warm, warm[1:])), "warmup must increase strictly"
    assert math.isclose(lrs[warmup], lr, rel_tol=1e-12)
    decay_part = lrs[warmup:decay + 1]
    assert all(a >= b * (1 - 1e-12) for a, b in zip(decay_part, decay_part[1:])), (
        "cosine must not increase"
    )
    assert lrs[decay] == min_lr and all(v == min_lr for v in lrs[decay:])
    off = SimpleNamespace(**{**vars(cfg), "decay_lr": False})
    assert all(train.lr_at(off, it) == lr for it in (0, warmup, decay, decay + 100))




# --------------------------------------------------------------------------------------------------
# --help

def help_groups_of(text):
    """{group title: its lines} of a --help text."""
    return {block.splitlines()[0].rstrip(':'): block.splitlines()[1:]
            for block in text.split('\n\n') if block.splitlines()[0].endswith(':')}


def test_help_lists_every_option_with_default_and_description(tmp_path, monkeypatch, capsys):
    """--help and -h exit 0 before any work (nothing written, whatever else is given), on stdout:
    every config key once as --key=default with its comment, the families' options under their
    route's group, and no option UNDOCUMENTED (a new global needs its comment)."""
    monkeypatch.chdir(tmp_path)
    assert train.main(['--help']) == 0
    out, err = capsys.readouterr()
    assert train.main(['-h', '--max_iters=oops', 'missing.py']) == 0
    assert capsys.readouterr().out == out and err == '' and list(tmp_path.iterdir()) == []
    assert out.startswith('Train a nanodepth model.') and 'UNDOCUMENTED' not in out
    assert re.search(r"^  --batch_size=16 +sequences per micro-batch per process$", out, re.M)
    listed = re.findall(r"^  --(\w+)=", out, re.M)
    assert sorted(listed) == sorted(train.DEFAULTS)        # each key once, none missing
    groups = help_groups_of(out)
    assert any(re.match(r"  --ffn_budget=0\.5 +fraction of tokens", line)
               for line in groups['route=ffn options (route_ffn.py)'])
    assert any(line.startswith('  --mod_capacity=0.5 ')
               for line in groups['route=mod options (route_mod.py)'])
    assert any(line.startswith('  --n_layer=4 ') for line in groups['model options (model.py)'])
    described = {k: d.get(k) for _, defaults, d in train.help_groups() for k in defaults}
    assert not [k for k, d in described.items() if not d]
