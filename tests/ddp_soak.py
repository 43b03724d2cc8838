"""Soak test of DDP teardown: N consecutive 2-process `torchrun` runs of a tiny model on CPU
(gloo), each of which must exit 0 within a timeout and leave no process behind. Before DDP workers
ended with os._exit, about one run in ten hung after printing `done:` (gloo's worker thread joined
under the GIL at interpreter exit).

    python tests/ddp_soak.py --runs=20 --timeout=120   # one line per run; exit 1 on a failure

tests/test_train.py runs it with a smaller count (a slow test)."""
import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:0] = [str(HERE), str(REPO)]
from conftest import run_group  # noqa: E402  (each run in its own group, ended with all it started)
from data import prepare  # noqa: E402

TINY = ["--n_layer=1", "--n_head=2", "--n_embd=16", "--block_size=16", "--batch_size=2",
        "--eval_iters=1", "--route=none", "--log_interval=1", "--warmup_iters=0", "--device=cpu",
        "--gradient_accumulation_steps=2", "--max_iters=2", "--eval_interval=2"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--timeout", type=float, default=120, help="seconds one run may take")
    args = ap.parse_args()
    launcher_vars = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                     "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in launcher_vars}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    failures = 0
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data" / "syn"
        prepare.prepare("synthetic", out_dir=data, num_tokens=20000)
        for i in range(args.runs):
            t0 = time.time()
            cmd = [*torchrun, "train.py", *TINY, f"--data_dir={data.parent}",
                   f"--dataset={data.name}", f"--out_dir={Path(tmp) / f'run{i}'}"]
            try:
                r = run_group(cmd, args.timeout, cwd=REPO, env=env)
                done = r.returncode == 0 and "done:" in r.stdout
                verdict = "ok" if done else f"exit {r.returncode}"
            except Exception as e:      # a timeout (the hang), or processes left running
                r, verdict = None, f"FAILED: {type(e).__name__}: {str(e)[:300]}"
            failures += verdict != "ok"
            print(f"run {i + 1}/{args.runs}: {verdict} in {time.time() - t0:.1f} s", flush=True)
            if r is not None and verdict != "ok":
                print(r.stdout[-2000:] + r.stderr[-2000:], flush=True)
    print(f"{args.runs - failures} of {args.runs} runs exited 0")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
