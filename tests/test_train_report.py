"""Tests for train_report.py: run_info's code version (a commit sha or none, also outside git), the
summary's optimisation metrics from a known log, and parameters counted once when tied."""
import io
import json
import re
from types import SimpleNamespace

import pytest
import torch

import train_report
from model import GPTConfig
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


def _logged_lm(steps, accum, saved=None):
    """The lm_loss of the train record log_progress writes after `steps`, each a list of accum
    micro-batches (lm_loss, whether any target was counted), and of the history the summary
    reads. saved: a checkpoint's open interval to resume (start_counters)."""
    cfg = SimpleNamespace(block_size=4, max_fp16_skips=3, gradient_accumulation_steps=accum,
                          batch_size=1)
    run = SimpleNamespace(
        cfg=cfg, dev=torch.device('cpu'), dt='float32', ddp=False, master=True, world=1,
        interval=train_report.new_interval(torch.device('cpu')), iter_num=len(steps), it_last=0,
        t_last=0.0, skipped=torch.zeros(()), last_skipped=0, consecutive_skips=0,
        scaler=torch.amp.GradScaler('cpu', enabled=False), seqs_per_iter=accum, ctrl_params=[],
        flops_state=dict(proxy_num=1.0, dense=1.0, exact=1.0), history=dict(train=[]),
        metrics_f=io.StringIO(),
    )
    if saved is not None:
        run.interval, run.rank, run.fp16_skips = saved, 0, None
        run.raw_model = SimpleNamespace(config=GPTConfig(n_layer=1, n_head=1, n_embd=4))
        run.flops_state['wall_s'] = 0.0
        train_report.start_counters(run)
    for step in steps:
        for lm, counted in step:
            aux = dict(lm_loss=torch.tensor(lm), lm_counted=torch.tensor(counted))
            train_report.accumulate(run.interval, aux, accum, ())
        run.interval['n'] += 1
    train_report.log_progress(run, 1e-3, torch.tensor(1.0), 0.0, dict(total=1.0))
    rec = json.loads(run.metrics_f.getvalue())
    return rec['lm_loss'], [h['lm_loss'] for h in run.history['train']]


def test_interval_lm_mean_leaves_out_micro_batches_without_a_counted_target():
    """A micro-batch whose targets are all −1 has lm_loss 0 by definition, not a loss of 0: the
    logged interval mean is over the micro-batches that counted a target (as eval.evaluate's mean
    over batches), each weighted as the training objective weights it (1/accum)."""
    # one step with no counted target between two that have one
    assert _logged_lm([[(2.0, True)], [(0.0, False)], [(4.0, True)]], 1) == (3.0, [3.0])
    # accumulation: the empty micro-batch of the second step is left out, not averaged in as 0
    assert _logged_lm([[(2.0, True), (4.0, True)], [(3.0, True), (0.0, False)]], 2) == (3.0, [3.0])
    # every micro-batch counted: the plain mean of the steps' means, as before
    assert _logged_lm([[(2.0, True), (4.0, True)], [(1.0, True), (3.0, True)]], 2) == (2.5, [2.5])
    # nothing counted in the whole interval: no LM loss to log (None, as plots and loggers skip),
    # and none for the summary's avg/best LM
    assert _logged_lm([[(0.0, False)], [(0.0, False)]], 1) == (None, [])


def test_interval_lm_mean_resumes_an_interval_saved_without_its_weights():
    """An open interval from a checkpoint that kept only the LM sum and the step count: every one
    of its steps counted, so the resumed mean goes on over them."""
    saved = dict(lm=torch.tensor(6.0), frac=None, ctrl_norm=torch.zeros(()), n=3, aux={})
    assert _logged_lm([[(2.0, True)], [(0.0, False)]], 1, saved) == (2.0, [2.0])


@pytest.mark.parametrize('path', ['reference', 'compact'])
def test_executed_eval_flops_follow_the_path_the_eval_ran_on(path, monkeypatch):
    """The summary's executed eval FLOPs are the sparse forward's at the executed fractions on the
    path the eval ran: on the reference (every row computed) the masked forward's, whatever the
    routing; on compact the fractions' savings."""
    import flops
    from conftest import build
    model = build('ffn', 0, n_layer=2)
    mcfg, T = model.config, 16
    val = dict(loss=2.0, full_frac=[0.5, 0.25], exec_frac=[0.5, 0.25], exec_path=path)
    monkeypatch.setattr(train_report.evaluation, 'report', lambda *a, **k: dict(val_loss=val))
    run = SimpleNamespace(cfg=SimpleNamespace(eval_seed=0, block_size=T, eval_iters=1,
                                              calib_iters=1, trainable='all'),
                          raw_model=model, train_data=None, val_data=None, meta={},
                          autocast=None, dev=torch.device('cpu'), master=False)
    out = train_report.routing_summary(run)
    dense = flops.dense_forward_flops(mcfg, T)
    routed = flops.forward_flops(mcfg, T, 'sparse', full_frac=[0.5, 0.25])
    assert out['eval_flops_vs_dense'] == routed / dense
    masked = flops.forward_flops(mcfg, T, 'eval')
    assert masked > 1.2 * routed                   # room for the two to be told apart
    executed = masked if path == 'reference' else routed
    assert out['eval_flops_executed_vs_dense'] == executed / dense
