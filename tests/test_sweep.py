"""sweep.py: grid expansion, skip/resume decisions, summary statistics against hand computation, and
the mixed-code-version flag. Runs are faked as folders of metrics (no training)."""
import json
import math
import os

import numpy as np
import pytest

import sweep


def fake_run(path, max_iters, summary=None, evals=(), norms=(), sha='abc123', dirty=False):
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, 'config.json'), 'w') as f:
        json.dump(dict(max_iters=max_iters), f)
    with open(os.path.join(path, 'run_info.json'), 'w') as f:
        json.dump(dict(git_sha=sha, git_dirty=dirty), f)
    with open(os.path.join(path, 'metrics.jsonl'), 'w') as f:
        for i, n in enumerate(norms):
            f.write(json.dumps(dict(type='train', iter=i, ctrl_grad_norm=n)) + '\n')
        for i, v in enumerate(evals):
            f.write(json.dumps(dict(type='eval', iter=i, val_loss=v)) + '\n')
        if summary is not None:
            f.write(json.dumps(dict(type='summary', **summary)) + '\n')


def test_finished_requires_a_summary_at_max_iters(tmp_path):
    fake_run(tmp_path / 'a', 100, summary=dict(iter=100))
    fake_run(tmp_path / 'b', 100, summary=dict(iter=40))          # stopped by a signal
    fake_run(tmp_path / 'c', 100)                                 # killed: no summary
    assert sweep.finished(str(tmp_path / 'a'))
    assert not sweep.finished(str(tmp_path / 'b'))
    assert not sweep.finished(str(tmp_path / 'c'))
    assert not sweep.finished(str(tmp_path / 'missing'))


def test_run_one_skips_finished_and_resumes_interrupted(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(sweep.subprocess, 'run', lambda args, **kw: calls.append(args) or type('R', (), {'returncode': 0})())
    done, part = tmp_path / 'done', tmp_path / 'part'
    fake_run(done, 10, summary=dict(iter=10))
    fake_run(part, 10)
    open(part / 'ckpt.pt', 'w').close()
    sweep.run_one(['cfg.py'], str(done), str(tmp_path / 'log'))
    assert calls == []
    sweep.run_one(['cfg.py', '--seed=2'], str(part), str(tmp_path / 'log'))
    assert calls[0][-1] == '--init_from=resume' and f'--out_dir={part}' in calls[0]
    sweep.run_one(['cfg.py'], str(tmp_path / 'new'), str(tmp_path / 'log'))
    assert '--init_from=resume' not in calls[1]


def test_summary_statistics_match_hand_computation(tmp_path):
    seeds = [1, 2, 3]
    ref = {1: 2.0, 2: 2.2, 3: 2.1}
    arm = {1: 1.9, 2: 2.25, 3: 1.95}
    results = {}
    for s in seeds:
        results[('ref', s)] = dict(avg_lm=ref[s], code='x')
        results[('arm', s)] = dict(avg_lm=arm[s], code='x')
    study = dict(arms={'ref': [], 'arm': []}, seeds=seeds, reference='ref')
    table = sweep.summarize(study, results)['table']
    a = table['arm']['avg_lm']
    assert a['mean'] == pytest.approx(np.mean(list(arm.values())))
    assert a['std'] == pytest.approx(np.std(list(arm.values()), ddof=1))
    d = [arm[s] - ref[s] for s in seeds]
    vs = a['vs_reference']
    assert vs['wins'] == 2 and vs['n'] == 3                       # lower avg LM is better in seeds 1 and 3
    half = 4.303 * np.std(d, ddof=1) / math.sqrt(3)              # t(0.975, df=2) = 4.303
    assert vs['mean_diff'] == pytest.approx(np.mean(d))
    assert vs['ci95'] == pytest.approx([np.mean(d) - half, np.mean(d) + half])
    assert 'vs_reference' not in table['ref']['avg_lm']


def test_mixed_code_versions_are_flagged(tmp_path):
    fake_run(tmp_path / 'A' / 'seed1', 5, summary=dict(iter=5, avg_lm=1.0), sha='aaaa')
    fake_run(tmp_path / 'A' / 'seed2', 5, summary=dict(iter=5, avg_lm=1.1), sha='bbbb', dirty=True)
    results = {('A', s): sweep.run_metrics(str(tmp_path / 'A' / f'seed{s}')) for s in (1, 2)}
    summ = sweep.summarize(dict(arms={'A': []}, seeds=[1, 2], reference='A'), results)
    assert summ['mixed_code_versions'] and set(summ['code_versions']) == {'aaaa', 'bbbb+dirty'}
    assert 'different code versions' in sweep.markdown(summ)


def test_run_metrics_reads_the_logs(tmp_path):
    routing = dict(val_loss=dict(loss=1.5, full_frac=[0.4, 0.6]))
    fake_run(tmp_path, 5, summary=dict(iter=5, avg_lm=2.0, best_val_lm=1.4, flops_proxy=1.5, wall_s=3.0,
                                       hit_2=3, routing=routing), evals=[1.8, 1.6], norms=[1.0, 3.0])
    m = sweep.run_metrics(str(tmp_path))
    assert m['final_val_loss'] == 1.6 and m['ctrl_grad_norm'] == 2.0 and m['hit_2'] == 3
    assert m['causal_val_loss'] == 1.5 and m['realised_full_frac'] == pytest.approx(0.5)


def test_study_files_parse():
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for name in sorted(os.listdir(os.path.join(here, 'config'))):
        if name.startswith('study_'):
            study = sweep.load_study(os.path.join(here, 'config', name))
            assert study['reference'] in study['arms'] and len(study['seeds']) >= 1
            assert os.path.exists(os.path.join(here, study['base']))
