"""Tests for run_state.py: the metrics records a resume keeps (a record cut short dropped, the kept
lines ending in a newline), a metrics line read back, the RNG streams a checkpoint saves and
restores, and the first and second Ctrl-C. (Exact resume end to end: test_train.py.)"""
import json
import random
import signal
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from run_state import (StopFlag, drop_records_after, evaluated_at, finished_already, parse_record,
                       rng_state, seed_rngs, set_rng_state)


def read_metrics(out_dir):
    lines = Path(out_dir, "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def test_resume_drops_metrics_lines_cut_short(tmp_path):
    """A record cut short by a full disk or a kill mid-write is dropped on resume, and the kept
    lines end in a newline, so the resumed run's records start on lines of their own."""
    path = tmp_path / "metrics.jsonl"
    path.write_text(
        '{"type": "train", "iter": 1}\n{"type": "eval", "iter": 2}\n{"type": "train", "it'
    )
    drop_records_after(str(path), 5)
    assert path.read_text() == '{"type": "train", "iter": 1}\n{"type": "eval", "iter": 2}\n'
    # the newline was lost
    path.write_text('{"type": "train", "iter": 1}\n{"type": "train", "iter": 2}')
    drop_records_after(str(path), 5)
    assert path.read_text() == '{"type": "train", "iter": 1}\n{"type": "train", "iter": 2}\n'
    drop_records_after(str(path), 1)
    assert read_metrics(tmp_path) == [{"type": "train", "iter": 1}]


def test_resume_redoes_an_eval_its_checkpoint_lacks(tmp_path):
    """Resumed at iteration 4 from a checkpoint without the eval of 4 (a signal saved it before or
    during the eval): a training eval record at 4 (logged by a run killed before its save) goes,
    as the resume evaluates 4 again; the train record and an eval-only record at 4 stay. With the
    eval in the checkpoint, everything at 4 stays."""
    records = [dict(type="eval", iter=2), dict(type="train", iter=4), dict(type="eval", iter=4),
               dict(type="eval", iter=4, eval_only=True), dict(type="train", iter=5)]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    drop_records_after(str(path), 4, evaluated=True)
    assert read_metrics(tmp_path) == records[:4]
    drop_records_after(str(path), 4, evaluated=False)
    assert read_metrics(tmp_path) == [records[0], records[1], records[3]]
    history = dict(eval=[dict(type="eval", iter=2)])
    assert not evaluated_at(history, 4) and evaluated_at(history, 2)


def test_parse_record_reads_a_record_and_drops_anything_else():
    assert parse_record('{"type": "eval", "iter": 4, "val_loss": 2.5}\n') == dict(
        type="eval", iter=4, val_loss=2.5
    )
    for line in ('{"type": "train", "it', '', '[1, 2]', '3.5', 'null'):
        assert parse_record(line) is None, line


def draws():
    return torch.rand(3).tolist(), np.random.rand(2).tolist(), random.random()


def test_rng_state_restores_every_stream_a_run_draws_from():
    """torch, numpy and Python's random, as a checkpoint saves them: restoring the state gives the
    same draws again; seeding gives the same draws as the same seed before."""
    seed_rngs(3)
    seeded = draws()
    saved = rng_state()
    after = draws()
    draws()
    set_rng_state(saved)
    assert draws() == after != seeded
    seed_rngs(3)
    assert draws() == seeded


def test_stop_flag_records_the_first_signal_and_a_second_ctrl_c_aborts():
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        stop = StopFlag()
        assert all(signal.getsignal(s) == stop._handle for s in handlers)
        assert stop.signum is None
        stop._handle(signal.SIGTERM, None)
        assert stop.signum == signal.SIGTERM
        stop._handle(signal.SIGTERM, None)        # a second SIGTERM: still a clean stop
        with pytest.raises(KeyboardInterrupt):
            stop._handle(signal.SIGINT, None)
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)


def test_an_eval_only_summary_does_not_finish_the_training(tmp_path):
    """A resume to max_iters is already finished only when the training wrote its summary there;
    the summary of an eval-only run of that checkpoint does not count, so the resume writes it."""
    cfg = SimpleNamespace(init_from="resume", eval_only=False, max_iters=4, out_dir=str(tmp_path))
    evaluated = [dict(type="eval", iter=4, val_loss=2.0, eval_only=True),
                 dict(type="summary", iter=4, eval_only=True)]
    lines = [json.dumps(r) for r in [dict(type="train", iter=4, lm_loss=2.1), *evaluated]]
    Path(tmp_path, "metrics.jsonl").write_text("\n".join(lines) + "\n")
    assert finished_already(cfg, dict(iter_num=4)) is False
    lines.insert(1, json.dumps(dict(type="summary", iter=4)))
    Path(tmp_path, "metrics.jsonl").write_text("\n".join(lines) + "\n")
    assert finished_already(cfg, dict(iter_num=4)) is True


def test_a_float16_resume_of_a_checkpoint_without_scaler_state_starts_the_scaler_afresh(capsys):
    """A run trained in bfloat16 or float32 (its GradScaler disabled: state {}) resumed where
    dtype=auto means float16 (a V100): the scaler starts at its initial scale, with a note, instead
    of GradScaler.load_state_dict's RuntimeError (a traceback, or under DDP a false 'a DDP process
    stopped responding')."""
    from run_state import start_progress
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    ckpt = dict(optimizer=optimizer.state_dict(), scaler={}, iter_num=4, best_val_loss=2.5,
                history=dict(train=[], eval=[]), flops_state=dict(exact=1.0), rng=None)
    scaler = torch.amp.GradScaler('cpu', enabled=True)
    progress = start_progress(SimpleNamespace(init_from='resume'), ckpt, optimizer, scaler, True)
    assert progress['iter_num'] == 4 and progress['best_val'] == 2.5
    assert scaler.get_scale() == 2.0 ** 16
    assert capsys.readouterr().out == (
        "note: the checkpoint has no GradScaler state (trained without float16): float16's "
        "scaler starts afresh\n")
