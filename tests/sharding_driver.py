"""The processes of tests/test_sharding.py's FSDP check: started by torchrun with 2 CPU processes
(gloo), each trains several runs in turn in this one process (one launch: starting torch costs
seconds on a busy machine):

1. `uninterrupted`: the run whose losses the test compares with one process and with a resume;
2. one short run per family configuration given in FAMILY_RUNS (routers and heads included, and
   the configurations whose DDP needs find_unused_parameters);
3. `abandoned`: the run of 1 again, rank 0 alone sent a SIGTERM as its second evaluation starts
   (both ranks evaluate under FSDP: they agree to abandon it before its first batch);
4. `killed`: the run of 1 again, which blocks after logging iteration KILL_AT (its last checkpoint
   is older) and writes `blocked` in its out_dir, for the test to kill the whole group.

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/sharding_driver.py \\
        TMP COMMON_ARGS_JSON FAMILY_RUNS_JSON KILL_AT
"""
import json
import os
import signal
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
import train  # noqa: E402


def run(args):
    """train.py's run in this process (the process group is started by the first and kept)."""
    try:
        train.run_checked(args)
    except train.UserError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        os._exit(2)


def main():
    tmp, common, families, kill_at = Path(sys.argv[1]), *map(json.loads, sys.argv[2:4]), int(
        sys.argv[4])
    run([*common, f"--out_dir={tmp / 'uninterrupted'}"])
    for name, extra in families.items():
        run([*extra, f"--out_dir={tmp / name}"])
    evaluate, evaluations = train.evaluation.evaluate, []

    def signal_rank_0_at_the_second_eval(*a, **kw):     # (each eval: its train split, then val)
        evaluations.append(1)
        if len(evaluations) == 3 and int(os.environ['RANK']) == 0:
            os.kill(os.getpid(), signal.SIGTERM)
        return evaluate(*a, **kw)
    train.evaluation.evaluate = signal_rank_0_at_the_second_eval
    run([*common, f"--out_dir={tmp / 'abandoned'}"])
    train.evaluation.evaluate = evaluate
    log_progress = train.log_progress

    def block_at_kill(r, *a):          # the kill: after logging iteration kill_at, wait for it
        log_progress(r, *a)
        if r.iter_num == kill_at:
            if r.master:
                (tmp / 'killed' / 'blocked').write_text(str(r.iter_num))
            while True:
                time.sleep(1)
    train.log_progress = block_at_kill
    run([*common, f"--out_dir={tmp / 'killed'}"])


if __name__ == '__main__':
    main()
    sys.stdout.flush()
    os._exit(1)                       # never reached: the killed run blocks until the test kills
