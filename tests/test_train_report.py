"""Tests for train_report.py: run_info's code version (a commit sha or none, also outside git), the
summary's optimisation metrics from a known log, and parameters counted once when tied."""
import re
from types import SimpleNamespace

import pytest
import torch

import train_report
from conftest import run_group


def require(cond, msg=""):
    """A precondition: fails with RuntimeError rather than AssertionError, so it reads as a broken
    setup."""
    if not cond:
        raise RuntimeError(msg)


def test_run_info_git_sha_is_a_sha_or_none(tmp_path, monkeypatch):
    require(run_group(["git", "init", "-q", tmp_path], 60).returncode == 0, "git init failed")
    monkeypatch.setattr(train_report, "HERE", str(tmp_path))
    info = train_report.run_info(None, torch.device("cpu"), "float32", 1)
    assert info["git_sha"] is None or re.fullmatch(r"[0-9a-f]{40}", info["git_sha"]), info[
        "git_sha"
    ]


def test_run_info_outside_git(tmp_path, monkeypatch):
    monkeypatch.setattr(train_report, "HERE", str(tmp_path))
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    info = train_report.run_info(None, torch.device("cpu"), "float32", 1)
    assert info["git_sha"] is None and info["git_dirty"] is False


def test_run_summary_from_a_known_log():
    """avg LM over the first avg_lm_until of the run, the best train and val LM, and the first
    logged iteration below each threshold (None when never)."""
    log_lines = [dict(iter=10, lm_loss=3.0), dict(iter=20, lm_loss=2.4),
                 dict(iter=30, lm_loss=1.9), dict(iter=40, lm_loss=2.1)]
    evals = [dict(val_loss=2.6), dict(val_loss=2.2)]
    cfg = SimpleNamespace(avg_lm_until=0.5, max_iters=40, lm_thresholds='2.5, 2.0,1.0')
    out = train_report.run_summary(log_lines, evals, cfg, 12.5)
    assert out == {'avg_lm': pytest.approx((3.0 + 2.4) / 2), 'best_train_lm': 1.9,
                   'best_val_lm': 2.2, 'wall_s': 12.5, 'hit_2.5': 20, 'hit_2': 30, 'hit_1': None}
    empty = train_report.run_summary([], [], SimpleNamespace(**{**vars(cfg), 'lm_thresholds': ''}),
                                     0.0)
    assert empty == dict(avg_lm=None, best_train_lm=None, best_val_lm=None, wall_s=0.0)


def test_count_params_counts_a_tied_weight_once():
    shared, bias = torch.nn.Parameter(torch.zeros(5, 4)), torch.nn.Parameter(torch.zeros(3))
    assert train_report.count_params([shared, bias, shared]) == 5 * 4 + 3


@pytest.mark.parametrize("init_from", ["scratch", "resume"])
def test_open_run_files_drops_the_old_runs_sharded_checkpoint(tmp_path, init_from):
    """A fresh run (--overwrite=True) removes the old run's ckpt.pt, metrics.jsonl and its DCP
    folder ckpt_dcp/ (its shards belong to the old run alone); a resume keeps all three."""
    shards = tmp_path / "ckpt_dcp" / "iter_0000010"
    shards.mkdir(parents=True)
    (shards / ".metadata").write_bytes(b"old shards")
    (tmp_path / "ckpt.pt").write_bytes(b"old checkpoint")
    (tmp_path / "metrics.jsonl").write_text('{"type": "eval", "iter": 10}\n')
    cfg = SimpleNamespace(out_dir=str(tmp_path), eval_only=False, init_from=init_from,
                          overwrite=init_from != "resume")
    proc = SimpleNamespace(dev=torch.device("cpu"), dt="float32", world=1)
    train_report.open_run_files(cfg, {"out_dir": str(tmp_path)}, proc, 10).close()
    fresh = init_from != "resume"
    assert (tmp_path / "ckpt_dcp").exists() is not fresh
    assert (tmp_path / "ckpt.pt").exists() is not fresh
    assert (tmp_path / "metrics.jsonl").read_text() == (
        "" if fresh else '{"type": "eval", "iter": 10}\n')
    assert (tmp_path / "config.json").exists() and (tmp_path / "run_info.json").exists()
