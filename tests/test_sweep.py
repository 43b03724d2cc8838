"""sweep.py: grid expansion, skip/resume decisions, summary statistics against hand computation, the
mixed-code-version flag, threshold hits, and --jobs. Runs are faked as folders of metrics (no
training); the --jobs test runs a fake train.py (a few lines of Python, no torch) as real
processes."""
import contextlib
import glob
import io
import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import textwrap
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

import sweep


def fake_run(
    path, max_iters, summary=None, evals=(), norms=(), sha='abc123', dirty=False, lms=(), tlops=()
):
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, 'config.json'), 'w') as f:
        json.dump(dict(max_iters=max_iters), f)
    with open(os.path.join(path, 'run_info.json'), 'w') as f:
        json.dump(dict(git_sha=sha, git_dirty=dirty), f)
    with open(os.path.join(path, 'metrics.jsonl'), 'w') as f:
        for i, n in enumerate(norms):
            f.write(json.dumps(dict(type='train', iter=i, ctrl_grad_norm=n)) + '\n')
        for i, (lm, t) in enumerate(zip(lms, tlops or [None] * len(lms))):
            f.write(
                json.dumps(dict(type='train', iter=10 * (i + 1), lm_loss=lm, tlops_saved=t)) + '\n'
            )
        for i, v in enumerate(evals):
            f.write(json.dumps(dict(type='eval', iter=i, val_loss=v)) + '\n')
        if summary is not None:
            f.write(json.dumps(dict(type='summary', **summary)) + '\n')


def test_finished_requires_a_summary_at_max_iters(tmp_path):
    fake_run(tmp_path / 'a', 100, summary=dict(iter=100))
    fake_run(tmp_path / 'b', 100, summary=dict(iter=40))          # stopped by a signal
    fake_run(tmp_path / 'c', 100)                                 # killed: no summary
    # stopped by a signal during its final eval: its checkpoint at 100 has no final eval yet
    fake_run(tmp_path / 'd', 100, summary=dict(iter=100, stopped=True))
    assert sweep.finished(str(tmp_path / 'a'))
    assert not sweep.finished(str(tmp_path / 'b'))
    assert not sweep.finished(str(tmp_path / 'c'))
    assert not sweep.finished(str(tmp_path / 'd'))
    assert not sweep.finished(str(tmp_path / 'missing'))


def test_an_eval_only_summary_is_not_a_finished_training(tmp_path):
    """An eval-only run of a checkpoint at max_iters (e.g. one killed between its last checkpoint
    and its summary) appends an eval and a summary marked eval_only: the training is still
    unfinished, so the sweep resumes it. After a training summary the same records change
    nothing."""
    evaluated = [dict(type='eval', iter=100, val_loss=2.0, eval_only=True),
                 dict(type='summary', iter=100, eval_only=True)]
    fake_run(tmp_path / 'killed', 100, evals=[2.5])
    fake_run(tmp_path / 'done', 100, summary=dict(iter=100))
    for run in ('killed', 'done'):
        with open(tmp_path / run / 'metrics.jsonl', 'a') as f:
            f.writelines(json.dumps(r) + '\n' for r in evaluated)
    assert not sweep.finished(str(tmp_path / 'killed'))
    assert sweep.finished(str(tmp_path / 'done'))


def test_a_record_cut_short_is_skipped(tmp_path):
    """A run whose last metrics line was cut short (a full disk, a kill mid-write) reads as
    unfinished, not as a JSON error, so the sweep resumes it (train.py drops the line on resume)."""
    fake_run(tmp_path / 'a', 100, lms=[2.0])
    with open(tmp_path / 'a' / 'metrics.jsonl', 'a') as f:
        f.write('{"type": "summary", "it')
    assert sweep.read_metrics(str(tmp_path / 'a')) == [
        dict(type='train', iter=10, lm_loss=2.0, tlops_saved=None)
    ]
    assert not sweep.finished(str(tmp_path / 'a'))


def fake_popen(calls, what=lambda args, kw: args):
    """A stand-in for subprocess.Popen that records what(args, kwargs) and exits 0 at once."""
    def popen(args, **kw):
        calls.append(what(args, kw))
        return SimpleNamespace(pid=-1, wait=lambda: 0)
    return popen


def test_run_one_skips_finished_and_resumes_interrupted(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(sweep.subprocess, 'Popen', fake_popen(calls))
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
    # lower avg LM is better in seeds 1 and 3
    assert vs['wins'] == 2 and vs['n'] == 3
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
    fake_run(
        tmp_path,
        5,
        summary=dict(
            iter=5,
            avg_lm=2.0,
            best_val_lm=1.4,
            flops_proxy=1.5,
            wall_s=3.0,
            hit_2=3,
            routing=routing,
        ),
        evals=[1.8, 1.6],
        norms=[1.0, 3.0],
    )
    m = sweep.run_metrics(str(tmp_path))
    assert m['final_val_loss'] == 1.6 and m['ctrl_grad_norm'] == 2.0 and m['hit_2'] == 3
    assert m['causal_val_loss'] == 1.5 and m['realised_full_frac'] == pytest.approx(0.5)


def test_run_metrics_are_the_trainings_not_a_later_eval_only_runs(tmp_path):
    """An eval-only run of a finished run's checkpoint appends its eval and summary records
    (marked eval_only): the run's numbers in the summary stay its training's."""
    routing = dict(val_loss=dict(loss=1.5, full_frac=[0.4, 0.6]))
    fake_run(tmp_path, 5, summary=dict(iter=5, avg_lm=2.0, best_val_lm=1.4, routing=routing),
             evals=[1.8, 1.6])
    with open(tmp_path / 'metrics.jsonl', 'a') as f:
        for rec in (dict(type='eval', iter=5, val_loss=9.0, eval_only=True),
                    dict(type='summary', iter=5, avg_lm=None, best_val_lm=9.0, eval_only=True,
                         routing=dict(val_loss=dict(loss=9.5, full_frac=[1.0, 1.0])))):
            f.write(json.dumps(rec) + '\n')
    m = sweep.run_metrics(str(tmp_path))
    assert (m['final_val_loss'], m['best_val_lm'], m['avg_lm']) == (1.6, 1.4, 2.0)
    assert m['causal_val_loss'] == 1.5 and m['realised_full_frac'] == pytest.approx(0.5)


def study_runs(study, path):
    """What sweep.main checks before the first run: (name, argv) of every run, and the folders the
    'before' runs write."""
    before = sweep.before_runs(study, path)
    runs = [('before', argv) for stage in before for argv, _ in stage]
    runs += [(f'arm {arm!r} seed {s}',
              sweep.with_seed([study['base'], *study['overrides'], *ov, f'--seed={s}'], s))
             for arm, ov in study['arms'].items() for s in study['seeds']]
    made_later = [a.split('=', 1)[1] for stage in before for argv, _ in stage for a in argv
                  if a.startswith('--out_dir=')]
    return runs, made_later


def test_study_files_parse():
    """Every study in config/ passes the check sweep.py makes before its first run: each run's
    whole configuration through train.py's own parsing (another family's option on the command
    line, a typo); not their inputs, which this machine may lack (prepared data, a GPU)."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for name in sorted(os.listdir(os.path.join(here, 'config'))):
        if name.startswith('study_'):
            study = sweep.load_study(os.path.join(here, 'config', name))
            assert study['reference'] in study['arms'] and len(study['seeds']) >= 1
            assert os.path.exists(os.path.join(here, study['base']))
            sweep.check_configs(*study_runs(study, name), inputs=False)


def test_run_metrics_reads_tlops_saved_and_final_train_lm(tmp_path):
    fake_run(tmp_path / 'tsa', 5, summary=dict(iter=5), lms=[3.0, 2.5], tlops=[0.1, 0.3])
    fake_run(tmp_path / 'ffn', 5, summary=dict(iter=5), lms=[3.0, 2.0])
    tsa, ffn = sweep.run_metrics(str(tmp_path / 'tsa')), sweep.run_metrics(str(tmp_path / 'ffn'))
    assert tsa['tlops_saved'] == 0.3 and tsa['final_train_lm'] == 2.5      # the last logged values
    assert ffn['tlops_saved'] is None and ffn['final_train_lm'] == 2.0


def test_threshold_hit_default_and_from_the_study(tmp_path):
    curves = {
        ('ref', 1): [3.0, 2.2, 2.0],
        ('ref', 2): [3.0, 2.3, 2.2],
        ('arm', 1): [2.2, 2.05, 1.9],
        ('arm', 2): [3.0, 3.0, 3.0],
    }
    results = {}
    for (arm, s), lms in curves.items():
        fake_run(tmp_path / arm / f'seed{s}', 5, summary=dict(iter=5), lms=lms)
        results[(arm, s)] = sweep.run_metrics(str(tmp_path / arm / f'seed{s}'))
    study = dict(arms={'ref': [], 'arm': []}, seeds=[1, 2], reference='ref')
    th, source = sweep.lm_threshold(study, results)
    assert th == pytest.approx(1.05 * (2.0 + 2.2) / 2) and 'reference' in source      # 2.205
    hits = {k: sweep.threshold_hit(str(tmp_path / k[0] / f'seed{k[1]}'), th) for k in curves}
    # iters 10, 20, 30
    assert hits == {('ref', 1): 20, ('ref', 2): 30, ('arm', 1): 10, ('arm', 2): None}
    assert sweep.lm_threshold(dict(study, threshold=2.1), results) == (2.1, 'study file')
    assert sweep.threshold_hit(str(tmp_path / 'arm' / 'seed1'), 2.1) == 20


FAKE_TRAIN = textwrap.dedent("""
    # A stand-in for train.py: writes a finished run's files from its --seed and --shift
    # arguments. With FAKE_BARRIER set, it first waits (up to 20 s) until a second run has started:
    # it can finish only if two runs are in flight at the same time.
    import json, os, sys, time
    args = dict(a[2:].split('=', 1) for a in sys.argv[2:])
    out, seed, shift = args['out_dir'], int(args['seed']), float(args.get('shift', 0))
    barrier = os.environ.get('FAKE_BARRIER')
    if barrier:
        open(os.path.join(barrier, str(os.getpid())), 'w').close()
        deadline = time.time() + 20
        while len(os.listdir(barrier)) < 2 and time.time() < deadline:
            time.sleep(0.02)
        if len(os.listdir(barrier)) < 2:
            sys.exit(3)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, 'argv.jsonl'), 'a') as f:       # every start, for the tests
        f.write(json.dumps(sys.argv[1:]) + '\\n')
    json.dump(dict(max_iters=4), open(os.path.join(out, 'config.json'), 'w'))
    json.dump(dict(git_sha='fake', git_dirty=False), open(os.path.join(out, 'run_info.json'), 'w'))
    with open(os.path.join(out, 'metrics.jsonl'), 'w') as f:
        for it in (1, 2, 3, 4):
            f.write(json.dumps(dict(type='train', iter=it,
                                    lm_loss=3 - 0.3 * it + shift + 0.01 * seed,
                                    ctrl_grad_norm=0.1 * seed)) + '\\n')
        f.write(json.dumps(dict(type='eval', iter=4, val_loss=2 + shift + 0.01 * seed)) + '\\n')
        f.write(json.dumps(dict(type='summary', iter=4, avg_lm=2.5 + shift + 0.01 * seed,
                                best_val_lm=2 + shift, flops_proxy=1 + shift,
                                wall_s=1.0)) + '\\n')
""")


def fake_study(tmp_path, name):
    path = tmp_path / f'{name}.py'
    path.write_text(f"base = 'cfg.py'\nout_root = {str(tmp_path / name)!r}\nseeds = [1, 2]\n"
                    f"arms = {{'A': [], 'B': ['--shift=0.5']}}\nreference = 'A'\n")
    return str(path)


def test_parallel_runs_share_the_cores_instead_of_each_taking_all(tmp_path, monkeypatch):
    envs = []
    monkeypatch.setattr(sweep.subprocess, 'Popen', fake_popen(envs, lambda args, kw: kw['env']))
    monkeypatch.setattr(sweep.os, 'cpu_count', lambda: 8)
    monkeypatch.delenv('OMP_NUM_THREADS', raising=False)
    sweep.run_one(['cfg.py'], str(tmp_path / 'a'), str(tmp_path / 'log'), jobs=2)
    sweep.run_one(['cfg.py'], str(tmp_path / 'b'), str(tmp_path / 'log'), jobs=3)
    sweep.run_one(['cfg.py'], str(tmp_path / 'c'), str(tmp_path / 'log'))
    assert (
        envs[0]['OMP_NUM_THREADS'] == '4'
        and envs[1]['OMP_NUM_THREADS'] == '2'
        and 'OMP_NUM_THREADS' not in envs[2]
    )
    monkeypatch.setenv('OMP_NUM_THREADS', '3')                  # the user's own setting wins
    sweep.run_one(['cfg.py'], str(tmp_path / 'd'), str(tmp_path / 'log'), jobs=2)
    assert envs[3]['OMP_NUM_THREADS'] == '3'


def test_jobs_2_runs_two_at_once_and_summarises_as_sequential(tmp_path, monkeypatch):
    (tmp_path / 'fake_train.py').write_text(FAKE_TRAIN)
    monkeypatch.setattr(sweep, 'TRAIN', str(tmp_path / 'fake_train.py'))
    monkeypatch.setattr(sweep, 'check_configs', lambda *args, **kw: None)  # no train.py keys
    (tmp_path / 'barrier').mkdir()
    monkeypatch.setenv('FAKE_BARRIER', str(tmp_path / 'barrier'))
    assert sweep.main([fake_study(tmp_path, 'par'), '--jobs=2', '--no_plots']) == 0
    assert all(
        sweep.finished(str(tmp_path / 'par' / arm / f'seed{s}')) for arm in 'AB' for s in (1, 2)
    )
    monkeypatch.delenv('FAKE_BARRIER')
    assert sweep.main([fake_study(tmp_path, 'seq'), '--no_plots']) == 0
    par, seq = (json.loads((tmp_path / n / 'summary.json').read_text()) for n in ('par', 'seq'))
    assert par.pop('study') != seq.pop('study') and par == seq
    a, b = par['table']['A'], par['table']['B']
    assert a['avg_lm']['per_seed'] == pytest.approx([2.51, 2.52]) and b['avg_lm'][
        'per_seed'
    ] == pytest.approx([3.01, 3.02])
    # default threshold: 1.05 × A's final train LM (1.81, 1.82) -> 1.90575; A gets there at iter 4,
    # B never
    assert par['threshold']['value'] == pytest.approx(1.05 * 1.815)
    assert a['threshold_hit']['per_seed'] == [4, 4] and b['threshold_hit']['per_seed'] == [
        None,
        None,
    ]
    assert not (tmp_path / 'par' / 'plots').exists()
    assert 'threshold_hit' in (tmp_path / 'par' / 'summary.md').read_text()


def test_a_relative_out_root_is_the_same_folder_from_any_working_directory(tmp_path,
                                                                           monkeypatch):
    """The runs start in the sweep's folder (train.py's cwd), so a relative out_root, a 'before'
    run's --out_dir and room_ckpt name places there: a sweep started elsewhere finds, locks and
    summarises the runs where they are, and a second start skips the finished ones instead of
    starting them over with --overwrite=True."""
    here, elsewhere = tmp_path / 'repo', tmp_path / 'elsewhere'
    here.mkdir()
    elsewhere.mkdir()
    (tmp_path / 'fake_train.py').write_text(FAKE_TRAIN)
    monkeypatch.setattr(sweep, 'HERE', str(here))
    monkeypatch.setattr(sweep, 'TRAIN', str(tmp_path / 'fake_train.py'))
    monkeypatch.setattr(sweep, 'check_configs', lambda *args, **kw: None)
    monkeypatch.delenv('FAKE_BARRIER', raising=False)
    measured = []
    monkeypatch.setattr(sweep.subprocess, 'run', lambda args, **kw: measured.append(args) or
                        SimpleNamespace(returncode=0, stdout=json.dumps(dict(room=0.5)), stderr=''))
    study = tmp_path / 'rel.py'
    study.write_text("base = 'cfg.py'\nout_root = 'out/rel'\nseeds = [1]\n"
                     "arms = {'A': []}\nbefore = [['cfg.py', '--seed=7', '--out_dir=out/bb']]\n"
                     "room_ckpt = 'out/bb/ckpt.pt'\n")
    monkeypatch.chdir(elsewhere)
    for _ in range(2):
        with contextlib.redirect_stdout(io.StringIO()):
            assert sweep.main([str(study), '--no_plots']) == 0
    (here / 'out' / 'bb' / 'ckpt.pt').write_bytes(b'x')
    with contextlib.redirect_stdout(io.StringIO()):
        assert sweep.main([str(study), '--no_plots']) == 0
    run = here / 'out' / 'rel' / 'A' / 'seed1'
    assert len(starts(run)) == 1 and len(starts(here / 'out' / 'bb')) == 1
    summary = json.loads((here / 'out' / 'rel' / 'summary.json').read_text())
    assert summary['table']['A']['avg_lm']['per_seed'] == [pytest.approx(2.51)]
    assert len(measured) == 1 and summary['room']['values']['room']['mean'] == 0.5
    assert not (elsewhere / 'out').exists()


@pytest.mark.parametrize('n', [2, 3, 11, 12, 31, 32, 60])
def test_paired_interval_is_students_t_never_narrower(n):
    """The 95% half-width of the per-seed differences: Student's t at n - 1 degrees of freedom
    (scipy's, to 3 decimals) up to 31 seeds, a wider bound beyond, never the normal's 1.96."""
    stats = pytest.importorskip('scipy.stats')
    d = [0.01 * ((7 * i) % 5 - 2) + 0.003 * i for i in range(n)]
    got = sweep.paired([x + 1.0 for x in d], [1.0] * n, lower_better=True)
    spread = float(np.std(d, ddof=1)) / math.sqrt(n)
    t = float(stats.t.ppf(0.975, n - 1))
    half = got['ci95'][1] - got['mean_diff']
    if n <= 31:
        assert half == pytest.approx(t * spread, abs=1e-3 * spread)
    else:
        assert t * spread <= half <= 1.03 * t * spread


def test_sign_test_against_the_binomial_by_hand():
    assert sweep.sign_test(3, 0) == pytest.approx(2 / 8)          # 2 · P(3 of 3) = 2 · 1/8
    assert sweep.sign_test(0, 5) == pytest.approx(2 / 32)
    assert sweep.sign_test(4, 1) == pytest.approx(2 * (1 + 5) / 32)
    assert sweep.sign_test(2, 1) == 1.0 and sweep.sign_test(0, 0) == 1.0


def test_threshold_hits_are_censored_not_dropped():
    """A seed that never reaches the threshold counts as reaching it at infinity: 'G3 hits at 10 ±
    0' must not hide that 2 of 3 seeds never got there."""
    seeds = [1, 2, 3, 4]
    ref = {1: 20, 2: None, 3: 30, 4: None}
    arm = {1: 10, 2: 40, 3: None, 4: None}
    results = {
        (a, s): dict(threshold_hit=v[s], code='x')
        for a, v in (('ref', ref), ('arm', arm))
        for s in seeds
    }
    table = sweep.summarize(
        dict(arms={'ref': [], 'arm': []}, seeds=seeds, reference='ref'), results
    )['table']
    e = table['arm']['threshold_hit']
    # the mean is over the 2 that hit
    assert (e['hits'], e['runs']) == (2, 4) and e['mean'] == 25.0
    assert table['ref']['threshold_hit']['hits'] == 2
    # seed 1: 10 < 20 win; seed 2: 40 < never win; seed 3: never > 30 loss; seed 4: both never, tie
    assert e['vs_reference'] == dict(n=4, wins=2, losses=1, ties=1, sign_p=1.0)
    md = sweep.markdown(
        dict(
            table=table,
            seeds=seeds,
            reference='ref',
            code_versions=['x'],
            mixed_code_versions=False,
        )
    )
    assert '2/4 hit, 25 ± 21 (2–1–1, p=1)' in md


def test_a_missing_run_is_not_a_never_hit():
    results = {
        ('ref', 1): dict(threshold_hit=5),
        ('arm', 1): dict(threshold_hit=None),
        ('ref', 2): dict(threshold_hit=5),
    }
    e = sweep.summarize(dict(arms={'ref': [], 'arm': []}, seeds=[1, 2], reference='ref'), results)[
        'table'
    ]['arm']['threshold_hit']
    assert (
        (e['hits'], e['runs']) == (0, 1)
        and e['vs_reference']['n'] == 1
        and e['vs_reference']['losses'] == 1
    )


def test_seed_placeholders_give_each_seed_its_own_backbone(tmp_path):
    study = dict(
        seeds=[1, 2, 3],
        before=[['s1.py', '--out_dir=out/s1/seed{seed}'], ['data.py', '--out_dir=out/d']],
    )
    stages = sweep.before_runs(study, 'study.py')
    assert stages == [
        [
            (['s1.py', f'--out_dir=out/s1/seed{s}', f'--seed={s}'], f'before_seed{s}.log')
            for s in (1, 2, 3)
        ],
        [(['data.py', '--out_dir=out/d'], 'before.log')],
    ]
    assert sweep.with_seed(['--init_from=out/s1/seed{seed}/ckpt.pt', '--x=1'], 2) == [
        '--init_from=out/s1/seed2/ckpt.pt',
        '--x=1',
    ]
    with pytest.raises(sweep.ConfigError, match='--out_dir'):
        sweep.before_runs(dict(seeds=[1], before=[['s1.py']]), 'study.py')


def test_room_verdict_against_the_seed_spread():
    """The room against the spread of the reference endpoint relative to each seed's own backbone
    (its all-full loss): independent backbones differ in level, which paired differences cancel."""
    room = {s: dict(full=f, cheap=f + r, random=f + 0.5, oracle=f + 0.5 - g, room=r, gate_room=g)
            for s, f, r, g in ((1, 1.0, 0.5, 0.11), (2, 1.2, 0.7, 0.09))}

    def ref(ends):
        return dict(
            causal_val_loss=dict(
                mean=float(np.mean(ends)), std=float(np.std(ends, ddof=1)), per_seed=ends
            ),
            final_val_loss=dict(mean=None, std=None, per_seed=[None, None]),
        )

    # levels 0.13 apart, relative 0.0071
    v = sweep.room_verdict(dict(seeds=[1, 2]), room, ref([1.01, 1.2]))
    assert v['key'] == 'gate_room' and v['size'] == pytest.approx(0.10) and v['verdict'] == 'room'
    assert v['seed_std'] == pytest.approx(np.std([0.01, 0.0], ddof=1)) and v[
        'seed_std_raw'
    ] == pytest.approx(np.std([1.01, 1.2], ddof=1))
    assert v['values']['room']['mean'] == pytest.approx(0.6)
    # relative 0.0141: 0.10 < 10×
    no = sweep.room_verdict(dict(seeds=[1, 2]), room, ref([1.0, 1.22]))
    assert no['verdict'] == 'no room'
    assert (
        sweep.room_verdict(dict(seeds=[1, 2], room_key='room'), room, ref([1.0, 1.22]))['verdict']
        == 'room'
    )
    md = sweep.room_markdown(no)
    assert md.startswith('**Room: no room.**') and 'not evidence' in md and 'all-full' in md


def test_too_few_seeds_are_flagged():
    results = {('ref', 1): dict(avg_lm=1.0), ('arm', 1): dict(avg_lm=0.9)}
    summary = sweep.summarize(
        dict(arms={'ref': [], 'arm': []}, seeds=[1], reference='ref'), results
    )
    assert 'too few' in sweep.markdown(summary)


def test_no_threshold_means_no_hit_column_and_room_seeds_stay_aligned():
    """Without a threshold (or for a hit_<x> a run did not set) runs are not counted as never-hits;
    the room's per-seed lists follow the study's seeds, None where a backbone was not measured."""
    results = {(a, s): dict(avg_lm=1.0 + s / 10) for a in ('ref', 'arm') for s in (1, 2)}
    summary = sweep.summarize(
        dict(arms={'ref': [], 'arm': []}, seeds=[1, 2], reference='ref'), results
    )
    e = summary['table']['arm']['threshold_hit']
    assert (e['hits'], e['runs']) == (0, 0) and e['vs_reference'] is None
    assert 'threshold_hit' not in sweep.markdown(summary)
    room = {2: dict(full=1.0, random=1.5, oracle=1.4, gate_room=0.1)}
    ref_row = dict(causal_val_loss=dict(mean=1.0, std=0.0, per_seed=[None, 1.0]),
                   final_val_loss=dict(mean=None, std=None, per_seed=[None, None]))
    v = sweep.room_verdict(dict(seeds=[1, 2]), room, ref_row)
    assert v['values']['gate_room']['per_seed'] == [None, 0.1] and v['size'] == pytest.approx(0.1)
    assert sweep.room_verdict(dict(seeds=[1, 2]), {}, ref_row)['verdict'] == 'unknown'


def test_room_is_measured_again_for_a_retrained_backbone(tmp_path, monkeypatch):
    ckpt = tmp_path / 'seed1.pt'
    ckpt.write_bytes(b'x')
    calls = []

    def fake_run(args, **kw):
        calls.append(args)
        return SimpleNamespace(
            returncode=0, stdout=json.dumps(dict(full=1.0, cheap=1.5, room=0.5)), stderr=''
        )

    monkeypatch.setattr(sweep.subprocess, 'run', fake_run)
    study = dict(room_ckpt=str(tmp_path / 'seed{seed}.pt'), seeds=[1, 2])
    # seed 2: no backbone
    assert sweep.measure_room(study, str(tmp_path))[1]['room'] == 0.5 and len(calls) == 1
    sweep.measure_room(study, str(tmp_path))
    assert len(calls) == 1                                       # cached
    os.utime(ckpt, (1, 1))
    sweep.measure_room(study, str(tmp_path))
    # the backbone changed: measured again
    assert len(calls) == 2


def test_frontier_is_interpolated_in_log_cost_and_never_extrapolated():
    pts = [(4.0, 2.0), (1.0, 3.0), (16.0, 1.5)]           # unsorted on purpose
    # halfway in log between 1 and 4
    assert sweep.frontier_at(pts, 2.0) == pytest.approx(2.5)
    assert sweep.frontier_at(pts, 8.0) == pytest.approx(1.75)         # halfway between 4 and 16
    assert sweep.frontier_at(pts, 4.0) == pytest.approx(2.0)
    assert sweep.frontier_at(pts, 1.0) == pytest.approx(3.0)
    assert sweep.frontier_at(pts, 0.5) is None and sweep.frontier_at(pts, 17.0) is None
    assert sweep.frontier_at(pts[:1], 4.0) is None                     # one size is no frontier
    # a zero cost is dropped, not log(0)
    assert sweep.frontier_at([(0.0, 3.0), (4.0, 2.0)], 2.0) is None


def test_matched_compute_pairs_each_seed_with_its_own_frontier():
    """Hand computation: frontier losses 3.0 at cost 1 and 2.0 at cost 4 (+0.2·seed); an arm at cost
    2 has the frontier at 2.5 + 0.2·seed there; one seed of a second arm lies outside the range."""
    results = {}
    for s in (1, 2, 3):
        results[('small', s)] = dict(final_val_loss=3.0 + 0.2 * s, train_flops=1.0, eval_flops=10.0)
        results[('big', s)] = dict(final_val_loss=2.0 + 0.2 * s, train_flops=4.0, eval_flops=40.0)
        results[('routed', s)] = dict(
            final_val_loss=2.5 + 0.2 * s + [-0.1, -0.2, 0.0][s - 1],
            train_flops=2.0,
            eval_flops=20.0,
        )
        results[('odd', s)] = dict(
            final_val_loss=2.0, train_flops=[2.0, 2.0, 8.0][s - 1], eval_flops=40.0
        )
    study = dict(
        arms={'big': [], 'small': [], 'routed': [], 'odd': []},
        seeds=[1, 2, 3],
        reference='big',
        frontier=['small', 'big'],
    )
    summary = sweep.summarize(study, results)
    fr = summary['frontier']
    r = fr['axes']['train_flops']['routed']
    d = [-0.1, -0.2, 0.0]
    half = 4.303 * np.std(d, ddof=1) / math.sqrt(3)
    assert r['mean_diff'] == pytest.approx(-0.1) and r['ci95'] == pytest.approx(
        [-0.1 - half, -0.1 + half]
    )
    assert (r['wins'], r['n'], r['inside']) == (2, 3, 3)
    assert fr['axes']['eval_flops']['routed']['mean_diff'] == pytest.approx(-0.1)
    odd = fr['axes']['train_flops']['odd']
    # seed 3 at cost 8: outside, counted
    assert (odd['n'], odd['inside'], odd['missing'], odd['runs']) == (2, 2, 0, 3)
    # a failed run: not measured, not "outside"
    del results[('routed', 2)]
    r = sweep.summarize(study, results)['frontier']['axes']['eval_flops']['routed']
    assert (r['n'], r['inside'], r['missing']) == (
        2,
        2,
        1,
    ) and 'not measured 1/3' in sweep.frontier_markdown(sweep.summarize(study, results)['frontier'])
    # frontier arms are not compared with themselves
    assert set(fr['axes']['train_flops']) == {'routed', 'odd'}
    assert (
        fr['span'] == pytest.approx(1.0)
        and fr['seed_std'] == pytest.approx(0.2)
        and fr['verdict'] == 'no room'
    )
    md = sweep.markdown(summary)
    assert '**Matched compute: no room.**' in md and '| odd |' in md and 'inside 2/3' in md


def test_absolute_flops_from_the_stored_config(tmp_path):
    """A dense run is the reference point of the ratio axes; eval_flops is the eval forward per
    token at the realised routing, so two dense sizes differ by their own FLOPs; runs without a
    route get none."""
    import torch
    import flops
    from model import GPTConfig
    shape = dict(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=20)
    for name, route, ratio in (('dense', 'none', None), ('routed', 'mod', 0.6)):
        cfg = dict(shape, route=route, max_iters=5)
        summ = dict(
            iter=5, train_flops=123.0, **({} if ratio is None else dict(eval_flops_vs_dense=ratio))
        )
        fake_run(tmp_path / name, 5, summary=summ, evals=[2.0])
        (tmp_path / name / 'config.json').write_text(json.dumps(cfg))
    per_token = flops.dense_forward_flops(GPTConfig(**shape), 16) / 16
    dense, routed = (
        sweep.run_metrics(str(tmp_path / 'dense')),
        sweep.run_metrics(str(tmp_path / 'routed')),
    )
    assert dense['eval_flops_vs_dense'] == 1.0 and dense['eval_tlops_saved'] == 0.0
    assert dense['eval_flops'] == pytest.approx(per_token) and routed[
        'eval_flops'
    ] == pytest.approx(0.6 * per_token)
    assert dense['train_flops'] == routed['train_flops'] == 123.0
    # a config.json without a route
    fake_run(tmp_path / 'bare', 5, summary=dict(iter=5), evals=[2.0])
    assert 'eval_flops' not in sweep.run_metrics(str(tmp_path / 'bare'))
    # a scratch run stores vocab_size 0 (taken from the data): the checkpoint's built vocabulary
    # counts
    (tmp_path / 'dense' / 'config.json').write_text(
        json.dumps(dict(shape, vocab_size=0, route='none', max_iters=5))
    )
    # no checkpoint: no guess
    assert sweep.run_metrics(str(tmp_path / 'dense')).get('eval_flops') is None
    torch.save(
        dict(model={}, config={}, model_args=dict(shape, route='none')),
        tmp_path / 'dense' / 'ckpt.pt',
    )
    assert sweep.run_metrics(str(tmp_path / 'dense'))['eval_flops'] == pytest.approx(per_token)
    # a summary that records eval_flops itself is taken as it is
    fake_run(
        tmp_path / 'new', 5, summary=dict(iter=5, eval_flops=7.0, train_flops=1.0), evals=[2.0]
    )
    (tmp_path / 'new' / 'config.json').write_text(
        json.dumps(dict(shape, route='none', max_iters=5))
    )
    assert sweep.run_metrics(str(tmp_path / 'new'))['eval_flops'] == 7.0


# ------------------------------------------------------------------------------------------------
# checked before the first run; stopped by a signal

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize('bad,key', [
    (['--mod_capacityy=0.5'], 'mod_capacityy'), (['--max_iters=many'], 'max_iters'),
    (['--ffn_gate=jepa'], 'ffn_gate'), (['config/missing.py'], 'missing.py')])
def test_a_bad_option_in_any_arm_refuses_the_study_before_any_run(tmp_path, monkeypatch, bad, key):
    """A typo, a wrong type, another family's option or a missing config file in the last arm
    refuses the whole study (train.py's own checks), naming the arm and the key; no run starts and
    nothing is written."""
    started = []
    monkeypatch.setattr(sweep.subprocess, 'Popen', fake_popen(started))
    study = tmp_path / 'study.py'
    study.write_text(f"base = 'config/mod_synthetic.py'\nout_root = {str(tmp_path / 'out')!r}\n"
                     f"seeds = [1, 2]\narms = {{'ok': ['--mod_capacity=0.25'], 'bad': {bad!r}}}\n")
    with pytest.raises(sweep.ConfigError) as e:
        sweep.main([str(study), '--no_plots'])
    assert "arm 'bad' seed 1" in str(e.value) and key in str(e.value)
    assert 'no run was started' in str(e.value)
    assert started == [] and not (tmp_path / 'out').exists()
    study.write_text(study.read_text().replace(repr(bad), "['--mod_capacity=0.5']"))
    # the same study without the bad option passes (its time estimate, a measured training step at
    # the unprepared dataset's GPT-2 vocabulary, is tested elsewhere and costs seconds here)
    monkeypatch.setattr(sweep, 'estimate_seconds', lambda runs, measured: ([None] * len(runs), ''))
    assert sweep.main([str(study), '--dry_run']) == 0


@pytest.mark.parametrize('finished_run', [True, False])
def test_a_run_made_under_other_options_refuses_the_study_before_any_run(tmp_path, monkeypatch,
                                                                         finished_run):
    """A run folder whose config.json says it computed something else than the study now asks
    (an arm's option edited since) would be skipped or resumed, and summarised as the study's: the
    study is refused, naming the folder and the key. Where and how it runs may differ."""
    import train
    started = []
    monkeypatch.setattr(sweep.subprocess, 'Popen', fake_popen(started))
    monkeypatch.setattr(train, 'check_run_inputs', lambda cfg: None)   # (an empty ckpt.pt here)
    out = tmp_path / 'out'
    study = tmp_path / 'study.py'
    study.write_text(f"base = 'config/mod_synthetic.py'\nout_root = {str(out)!r}\n"
                     "seeds = [1]\narms = {'A': ['--mod_capacity=0.25']}\n")
    argv = ['config/mod_synthetic.py', '--mod_capacity=0.25', '--seed=1',
            f'--out_dir={out}/A/seed1']
    with contextlib.chdir(REPO):
        _, ran = train.read_config(argv)
    fake_run(out / 'A' / 'seed1', ran['max_iters'],
             summary=dict(iter=ran['max_iters']) if finished_run else None)
    open(out / 'A' / 'seed1' / 'ckpt.pt', 'w').close()
    config = out / 'A' / 'seed1' / 'config.json'
    config.write_text(json.dumps(dict(ran, mod_capacity=0.5, device='cuda', init_from='resume')))
    with pytest.raises(sweep.ConfigError, match=r"arm 'A' seed 1: .*A/seed1 ran with "
                                                r"mod_capacity=0\.5, the study now gives 0\.25; "
                                                r".*remove that folder"):
        sweep.main([str(study), '--no_plots'])
    assert started == []
    # the options it computed with agree: only where and how it ran differ (and a stopped run's
    # max_iters, to which train.py resumes it)
    config.write_text(json.dumps(dict(ran, device='cuda', init_from='resume',
                                      max_iters=ran['max_iters'] + (0 if finished_run else 5))))
    sweep.main([str(study), '--no_plots'])
    assert len(started) == (0 if finished_run else 1)
    if finished_run:                # finished at fewer iterations than the study now gives
        fake_run(out / 'A' / 'seed1', 5, summary=dict(iter=5))
        config.write_text(json.dumps(dict(ran, max_iters=5)))
        with pytest.raises(sweep.ConfigError, match=r"ran with max_iters=5, the study now gives"):
            sweep.main([str(study), '--no_plots'])


@pytest.mark.parametrize('bad,says', [
    ('--dataset=shakespeare_char', r'shakespeare_char is not a prepared dataset'),
    ('--dtype=float16', r'float16'),
    ('--init_from=resume', r'init_from=resume but there is no checkpoint at .*b/seed1/ckpt\.pt'),
    ('--batch_size=100000000', r'batch_size'),
    ('--init_from={notes}', r'notes\.pt is a text file, not a checkpoint'),
    ('--init_from={narrow}', r"config field 'n_head' differs from the checkpoint"),
])
def test_an_arm_whose_inputs_train_py_refuses_refuses_the_study_before_any_run(tmp_path,
                                                                              monkeypatch, bad,
                                                                              says):
    """What train.py refuses only once it looks at its inputs (the data, the device's dtypes, the
    checkpoint it resumes or starts from, the batch against memory) refuses the whole study before
    its first run: before, the arms before it trained, then that arm failed."""
    from dataclasses import asdict
    import torch
    import data.prepare as prep
    from model import GPTConfig
    started = []
    monkeypatch.setattr(sweep.subprocess, 'Popen', fake_popen(started))
    prep.prepare('synthetic', out_dir=str(tmp_path / 'data' / 'synthetic'))
    (tmp_path / 'notes.pt').write_text('not a checkpoint')
    torch.save(dict(model={}, model_args=asdict(GPTConfig(n_embd=8, n_head=1)), config={}),
               tmp_path / 'narrow.pt')
    bad = bad.format(notes=tmp_path / 'notes.pt', narrow=tmp_path / 'narrow.pt')
    study = tmp_path / 'study.py'
    study.write_text(f"base = 'config/mod_synthetic.py'\nout_root = {str(tmp_path / 'out')!r}\n"
                     f"seeds = [1]\narms = {{'a': [], 'b': [{bad!r}]}}\n"
                     f"overrides = ['--data_dir={tmp_path / 'data'}']\n")
    with pytest.raises(sweep.ConfigError, match=f"^arm 'b' seed 1: .*{says}.*no run was started"):
        sweep.main([str(study), '--no_plots'])
    assert started == []


def test_a_bad_option_refuses_the_study_in_one_line(tmp_path):
    study = tmp_path / 'study.py'
    study.write_text(f"base = 'config/mod_synthetic.py'\nout_root = {str(tmp_path / 'out')!r}\n"
                     f"seeds = [1]\narms = {{'A': [], 'B': ['--mod_capacityy=0.5']}}\n")
    r = subprocess.run([sys.executable, 'sweep.py', str(study)], cwd=REPO, capture_output=True,
                       text=True, timeout=120, start_new_session=True)
    assert r.returncode == 2 and r.stderr.count('\n') == 1 and 'Traceback' not in r.stderr, r.stderr
    assert r.stderr.startswith("error: arm 'B' seed 1: unknown config key 'mod_capacityy'")
    assert r.stdout == '' and not (tmp_path / 'out').exists()


def test_a_study_that_cannot_run_here_says_why_in_one_line_and_runs_nothing(tmp_path):
    body = (f"base = 'config/mod_synthetic.py'\nout_root = {str(tmp_path / 'out')!r}\n"
            f"seeds = [1]\narms = {{'A': []}}\n")
    study = tmp_path / 'study.py'
    for skip, code in (("'no weights here'", 0), ("'two\\nlines'", 2), ("3", 2)):
        study.write_text(body + f"skip = {skip}\n")
        r = subprocess.run([sys.executable, 'sweep.py', str(study)], cwd=REPO, capture_output=True,
                           text=True, timeout=120, start_new_session=True)
        assert r.returncode == code, r.stderr
        if code == 0:
            assert r.stdout == f"{study}: skipped: no weights here\n" and r.stderr == ''
        else:
            assert r.stderr.count('\n') == 1 and 'skip must be one line' in r.stderr
        assert not (tmp_path / 'out').exists()


def test_the_gpt2_study_runs_where_the_weights_are_and_is_skipped_elsewhere(tmp_path,
                                                                            monkeypatch):
    monkeypatch.setenv('NANODEPTH_GPT2', str(tmp_path / 'absent'))
    study = sweep.load_study(os.path.join(REPO, 'config', 'study_tuning_gpt2.py'))
    assert 'no GPT-2 weights' in study['skip'] and str(tmp_path / 'absent') in study['skip']
    saved = tmp_path / 'gpt2_local'                 # what save_pretrained writes, in outline
    saved.mkdir()
    (saved / 'config.json').write_text('{}')
    monkeypatch.setenv('NANODEPTH_GPT2', str(saved))
    study = sweep.load_study(os.path.join(REPO, 'config', 'study_tuning_gpt2.py'))
    assert study['skip'] is None and study['overrides'] == [f'--init_from={saved}']
    cpu_study = sweep.load_study(os.path.join(REPO, 'config', 'study_tuning.py'))
    assert set(study['arms']) == set(cpu_study['arms'])


def test_help_lists_the_options_and_flags_before_any_work(capsys):
    """--help exits 0 without a study file, on stdout: --jobs with its default and comment, the
    flags with theirs, nothing UNDOCUMENTED."""
    assert sweep.main(['--help']) == 0
    out, err = capsys.readouterr()
    assert out.startswith('Run a study') and err == '' and 'UNDOCUMENTED' not in out
    assert '  --jobs=1                          train.py processes at a time' in out
    assert all(f'  {flag} ' in out for flag in sweep.FLAGS)


# A stand-in for train.py that runs until a signal: it records its pid and arguments, writes
# ckpt.pt, and on SIGINT/SIGTERM writes 'stopped' (the signal's number) and exits 0, as train.py
# does. FAKE_IGNORE=1: it ignores both and starts a grandchild (in its process group) that must die
# with it. FAKE_FINISH=1: it writes a finished run's files at once instead.
STOPPABLE_TRAIN = textwrap.dedent("""
    import json, os, signal, subprocess, sys, time
    args = dict(a[2:].split('=', 1) for a in sys.argv[2:] if a.startswith('--'))
    out = args['out_dir']
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, 'calls'), 'a') as f:
        f.write(json.dumps(sys.argv[1:]) + '\\n')
    if os.environ.get('FAKE_FINISH'):
        json.dump(dict(max_iters=4), open(os.path.join(out, 'config.json'), 'w'))
        with open(os.path.join(out, 'metrics.jsonl'), 'w') as f:
            f.write(json.dumps(dict(type='summary', iter=4, avg_lm=2.0)) + '\\n')
        sys.exit(0)
    def stop(signum, frame):
        open(os.path.join(out, 'stopped'), 'w').write(str(signum))
        sys.exit(0)
    handler = signal.SIG_IGN if os.environ.get('FAKE_IGNORE') else stop
    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
    pids = [os.getpid()]
    if os.environ.get('FAKE_IGNORE'):
        pids.append(subprocess.Popen(['sleep', '300']).pid)
    open(os.path.join(out, 'ckpt.pt'), 'w').close()
    # written whole, then renamed: the test waits for the file, and a signal between its creation
    # and its write would leave it empty
    with open(os.path.join(out, 'pids.part'), 'w') as f:
        f.write(' '.join(map(str, pids)))
    os.replace(os.path.join(out, 'pids.part'), os.path.join(out, 'pids'))
    while True:
        time.sleep(0.05)
""")


def alive(pid):
    """Running (a zombie, dead but not yet reaped by its parent, is not)."""
    try:
        with open(f'/proc/{pid}/stat') as f:
            return f.read().rsplit(')', 1)[1].split()[0] != 'Z'
    except FileNotFoundError:
        return False


def processes_under(folder):
    """Pids of the processes whose command line names folder (a sweep's runs name their out_dir)."""
    pids = []
    for pid in filter(str.isdigit, os.listdir('/proc')):
        try:
            with open(f'/proc/{pid}/cmdline', 'rb') as f:
                if str(folder).encode() in f.read() and alive(int(pid)):
                    pids.append(int(pid))
        except OSError:            # gone meanwhile
            pass
    return pids


def kill_all(proc, pid_files, folder):
    """The sweep's group, every process a fake run recorded and any process naming folder (a run in
    its own process group): SIGTERM, then SIGKILL."""
    pids = [int(p) for f in pid_files if f.exists() for p in f.read_text().split()]
    pids += processes_under(folder)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        time.sleep(0.2)
    proc.wait()


def start_fake_sweep(tmp_path, jobs, grace=120, env=()):
    (tmp_path / 'train.py').write_text(STOPPABLE_TRAIN)
    study = tmp_path / 'study.py'
    study.write_text(f"base = 'cfg.py'\nout_root = {str(tmp_path / 'out')!r}\nseeds = [1, 2, 3]\n"
                     f"arms = {{'A': []}}\n")
    boot = (f"import sys; sys.path.insert(0, {REPO!r}); import sweep; "
            f"sweep.TRAIN = {str(tmp_path / 'train.py')!r}; sweep.STOP_GRACE_S = {grace}; "
            f"sweep.check_configs = lambda *args, **kw: None; "
            f"from configurator import run_cli; run_cli(sweep.main)")
    argv = [str(study), f'--jobs={jobs}', '--no_plots']
    proc = subprocess.Popen([sys.executable, '-c', boot, *argv], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, 'OMP_NUM_THREADS': '1', **dict(env)})
    return proc, argv


def wait_for(ready, proc, timeout=30):
    """Until ready() (a list of paths: until they all exist); a sweep that exits first or a timeout
    fails (the caller's finally ends the processes)."""
    check = ready if callable(ready) else lambda: all(p.exists() for p in ready)
    deadline = time.time() + timeout
    while not check():
        assert proc.poll() is None, proc.stderr.read()
        assert time.time() < deadline, 'timed out'
        time.sleep(0.05)


@pytest.mark.parametrize('signame,jobs', [('SIGTERM', 1), ('SIGINT', 2)])
def test_a_signal_stops_the_runs_in_flight_and_starts_none_of_the_queued(tmp_path, monkeypatch,
                                                                         signame, jobs):
    """SIGTERM/SIGINT to the sweep alone reaches each run in flight (it checkpoints and stops), the
    queued run never starts, the sweep exits 143/130 with one line giving the command that resumes,
    and that command resumes the stopped runs from their checkpoints and starts the rest."""
    sig = getattr(signal, signame)
    proc, argv = start_fake_sweep(tmp_path, jobs)
    runs = [tmp_path / 'out' / 'A' / f'seed{s}' for s in (1, 2, 3)]
    try:
        wait_for([r / 'pids' for r in runs[:jobs]], proc)
        os.kill(proc.pid, sig)
        out, err = proc.communicate(timeout=30)
    finally:
        kill_all(proc, [r / 'pids' for r in runs], tmp_path)
    assert proc.returncode == {'SIGTERM': 143, 'SIGINT': 130}[signame], err
    assert err == (f"stopped by {signame}; the runs in flight saved a checkpoint and nothing new "
                   f"was started; resume with: python sweep.py {' '.join(argv)}\n")
    for r in runs[:jobs]:
        assert (r / 'stopped').read_text() == str(int(sig)) and (r / 'ckpt.pt').exists()
        assert not alive(int((r / 'pids').read_text())) and f'stopped: {r}' in out
    assert processes_under(tmp_path) == []
    assert not runs[jobs].exists()                                   # queued: never started
    # the printed command resumes: the stopped runs from their checkpoints, the queued one afresh
    monkeypatch.setattr(sweep, 'TRAIN', str(tmp_path / 'train.py'))   # as the boot line set it
    monkeypatch.setattr(sweep, 'check_configs', lambda *args, **kw: None)
    monkeypatch.setenv('FAKE_FINISH', '1')
    assert sweep.main(err.split('resume with: python sweep.py ')[1].split()) == 0
    calls = {run: [json.loads(line) for line in (run / 'calls').read_text().splitlines()]
             for run in runs}
    for run in runs[:jobs]:
        assert len(calls[run]) == 2 and calls[run][1][-1] == '--init_from=resume'
    assert len(calls[runs[jobs]]) == 1 and calls[runs[jobs]][0][-1] == '--overwrite=True'
    assert all(sweep.finished(str(run)) for run in runs)


@pytest.mark.parametrize('signame,during', [('SIGTERM', 'score'), ('SIGINT', 'plots')])
def test_a_signal_while_summarising_stops_the_sweep_in_one_line(tmp_path, monkeypatch, capsys,
                                                                 signame, during):
    """Every run finished: a signal while the runs are scored or the plots drawn ends the sweep
    there, exit 143/130 with one line, the score commands not yet started never start, and a
    summary already written is not replaced by one that lacks the scores."""
    sig = getattr(signal, signame)
    root = tmp_path / 'st'
    for s in (1, 2, 3):
        fake_run(root / 'A' / f'seed{s}', 4, summary=dict(iter=4, avg_lm=2.0))
        (root / 'A' / f'seed{s}' / 'ckpt.pt').write_bytes(b'x')
    (root / 'summary.json').write_text('{"kept": true}')
    (tmp_path / 'cfg.py').write_text('max_iters = 4\n')       # what the runs were made with
    study = tmp_path / 'st.py'
    study.write_text(f"base = {str(tmp_path / 'cfg.py')!r}\nout_root = {str(root)!r}\n"
                     "seeds = [1, 2, 3]\n"
                     "arms = {'A': []}\nscore = ['arith.py', '{run}']\n"
                     "score_metrics = {'acc': False}\n")
    scored = []

    def score(args, **kw):
        scored.append(args)
        if during == 'score':
            os.kill(os.getpid(), sig)
            children = signal.getsignal(sig).__self__      # the sweep's handler: Children.stop
            deadline = time.time() + 10
            while children.signum is None and time.time() < deadline:    # handled (main thread)
                time.sleep(0.01)
        return SimpleNamespace(returncode=0, stdout='{"acc": 1.0}', stderr='')

    def plots(*a, **kw):
        os.kill(os.getpid(), sig)

    monkeypatch.setattr(sweep.subprocess, 'run', score)
    monkeypatch.setattr(sweep, 'write_plots', plots)
    code = sweep.main([str(study), '--summarize_only'])
    err = capsys.readouterr().err
    assert code == {'SIGTERM': 143, 'SIGINT': 130}[signame]
    assert err.count('\n') == 1 and f'stopped by {signame}' in err, err
    assert f'python sweep.py {study} --summarize_only' in err
    if during == 'score':
        assert len(scored) == 1 and (root / 'summary.json').read_text() == '{"kept": true}'


def test_a_run_that_ignores_the_signal_is_killed_with_its_group_after_the_grace_period(tmp_path):
    proc, argv = start_fake_sweep(tmp_path, 1, grace=1, env={'FAKE_IGNORE': '1'})
    run = tmp_path / 'out' / 'A' / 'seed1'
    try:
        wait_for([run / 'pids'], proc)
        t0 = time.time()
        os.kill(proc.pid, signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
        took = time.time() - t0
    finally:
        kill_all(proc, [run / 'pids'], tmp_path)
    assert proc.returncode == 143 and 'resume with: python sweep.py' in err
    assert 'Traceback' not in err and 1 <= took < 10 and not (run / 'stopped').exists()
    pids = [int(p) for p in (run / 'pids').read_text().split()]
    assert len(pids) == 2 and not any(alive(p) for p in pids)       # the run and its grandchild
    assert not (tmp_path / 'out' / 'A' / 'seed2').exists()


@pytest.mark.slow
def test_sigterm_to_a_real_sweep_checkpoints_its_run_and_the_printed_command_resumes(tmp_path):
    """The real train.py under sweep.py: SIGTERM to the sweep alone stops the run in flight with a
    checkpoint, no train.py process is left, the queued seed never starts; the printed command
    (with max_iters a few past the stop, by the study's environment variable) resumes seed 1 and
    runs seed 2."""
    from data import prepare
    prepare.prepare('synthetic', out_dir=tmp_path / 'data' / 'syn', num_tokens=20000)
    study = tmp_path / 'study.py'
    study.write_text(textwrap.dedent(f"""
        import os
        base = 'config/mod_synthetic.py'
        out_root = {str(tmp_path / 'out')!r}
        overrides = ['--n_layer=2', '--n_head=2', '--n_embd=32', '--block_size=32',
                     '--batch_size=4', '--eval_iters=1', '--log_interval=1',
                     '--eval_interval=100000', '--device=cpu',
                     '--data_dir={tmp_path / 'data'}', '--dataset=syn',
                     '--max_iters=' + os.environ.get('TEST_MAX_ITERS', '1000000')]
        seeds = [1, 2]
        arms = {{'mod': []}}
    """))
    env = {**os.environ, 'OMP_NUM_THREADS': '1'}
    proc = subprocess.Popen([sys.executable, 'sweep.py', str(study), '--no_plots'], cwd=REPO,
                            env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    seed1, seed2 = tmp_path / 'out' / 'mod' / 'seed1', tmp_path / 'out' / 'mod' / 'seed2'
    try:
        metrics = seed1 / 'metrics.jsonl'         # training: a signal now stops it after this step
        wait_for(lambda: metrics.exists() and '"type": "train"' in metrics.read_text(), proc,
                 timeout=120)
        os.kill(proc.pid, signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        kill_all(proc, [], tmp_path)
    assert proc.returncode == 143 and err.count('\n') == 1 and 'Traceback' not in err, err
    log = (seed1.parent / 'seed1.log').read_text()
    stopped_at = int(log.split('stopped by signal at iteration ')[1].split(';')[0])
    assert not seed2.exists() and f'stopped: {seed1}' in out
    assert processes_under(tmp_path) == []                          # no train.py left behind
    resume = shlex.split(err.split('resume with: ')[1])
    assert resume[:2] == ['python', 'sweep.py']
    r = subprocess.run([sys.executable, *resume[1:]], cwd=REPO, capture_output=True, text=True,
                       timeout=300, env={**env, 'TEST_MAX_ITERS': str(stopped_at + 3)},
                       start_new_session=True)
    assert r.returncode == 0, r.stderr
    summaries = [rec['iter'] for rec in sweep.read_metrics(str(seed1)) if rec['type'] == 'summary']
    assert summaries == [stopped_at, stopped_at + 3]
    resumed = (seed1.parent / 'seed1.log').read_text().split('stopped by signal')[1]
    assert 'init_from=resume' in resumed
    assert sweep.finished(str(seed1)) and sweep.finished(str(seed2))


# ------------------------------------------------------------------------------------------------
# steering a study from the command line: overrides, progress, the dry run's estimate

def fake_sweep(tmp_path, monkeypatch, name, *args):
    """sweep.main on a fake study (FAKE_TRAIN runs, no train.py checks); its stdout."""
    (tmp_path / 'fake_train.py').write_text(FAKE_TRAIN)
    monkeypatch.setattr(sweep, 'TRAIN', str(tmp_path / 'fake_train.py'))
    monkeypatch.setattr(sweep, 'check_configs', lambda *args, **kw: None)
    monkeypatch.delenv('FAKE_BARRIER', raising=False)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert sweep.main([fake_study(tmp_path, name), '--no_plots', *args]) == 0
    return buf.getvalue()


def starts(run):
    """The argument lists train.py was started with in this run folder."""
    path = run / 'argv.jsonl'
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_overrides_reach_every_run_after_the_arm_and_live_in_their_own_folder(tmp_path,
                                                                               monkeypatch):
    """--key=value overrides go to every run after the study's and the arm's own options (so they
    win), are recorded in the summary, and send the runs to a folder named by them: the study with
    other overrides (or none) never reuses these runs; the same overrides in another order do."""
    out = fake_sweep(tmp_path, monkeypatch, 'st', '--log_interval=3', '--eval_iters=2')
    plain = tmp_path / 'st'
    root = tmp_path / os.path.basename(sweep.variant_root(str(plain),
                                                          ['--log_interval=3', '--eval_iters=2']))
    assert root.name.startswith('st+eval_iters=2,log_interval=3-') and not plain.exists()
    for arm in 'AB':
        for s in (1, 2):
            (argv,) = starts(root / arm / f'seed{s}')
            assert argv[-5:] == ['--log_interval=3', '--eval_iters=2', f'--seed={s}',
                                 f'--out_dir={root}/{arm}/seed{s}', '--overwrite=True'], argv
            assert argv[:2] == (['cfg.py', '--shift=0.5'] if arm == 'B' else ['cfg.py', argv[1]])
    summary = json.loads((root / 'summary.json').read_text())
    assert summary['overrides'] == ['--log_interval=3', '--eval_iters=2']
    assert '`--log_interval=3 --eval_iters=2`' in (root / 'summary.md').read_text()
    assert f'runs in {root}' in out
    # the same overrides in another order: the same folder, every run already finished
    fake_sweep(tmp_path, monkeypatch, 'st', '--eval_iters=2', '--log_interval=3')
    assert all(len(starts(root / a / f'seed{s}')) == 1 for a in 'AB' for s in (1, 2))
    # no overrides: the study's own out_root, fresh runs, no overrides in its summary
    fake_sweep(tmp_path, monkeypatch, 'st')
    assert len(starts(plain / 'A' / 'seed1')) == 1
    assert json.loads((plain / 'summary.json').read_text())['overrides'] == []


def test_variant_folders_tell_override_sets_apart():
    v = sweep.variant_root
    assert v('out/s', []) == 'out/s'
    assert v('out/s', ['--a=1', '--b=2']) == v('out/s/', ['--b=2', '--a=1'])
    assert v('out/s', ['--a=2', '--a=1']) == v('out/s', ['--a=1'])       # the last value counts
    assert v('out/s', ['--a=1']) != v('out/s', ['--a=2'])
    # unsafe characters are replaced in the readable part; the digest still tells them apart
    x, y = v('out/s', ['--data_dir=/a/b']), v('out/s', ['--data_dir=_a_b'])
    assert x != y and '/a/b' not in x[len('out/s'):]


@pytest.mark.parametrize('arg,needle', [
    ('--max_iter=5', "unknown config key 'max_iter' (did you mean 'max_iters'?)"),
    ('--max_iters=many', "'max_iters' from '--max_iters=many' must be int"),
    ('--seed=3', 'change seeds in the study file'),
    ('--out_dir=x', 'change out_root in the study file'),
    ('--quiet=maybe', '--quiet must be True or False'),
    ('max_iters=5', 'unknown option max_iters=5')])
def test_a_bad_override_refuses_the_sweep_before_any_work(tmp_path, monkeypatch, arg, needle):
    started = []
    monkeypatch.setattr(sweep.subprocess, 'Popen', fake_popen(started))
    with pytest.raises(sweep.ConfigError) as e:
        sweep.main([fake_study(tmp_path, 'bad'), arg])
    assert needle in str(e.value) and '\n' not in str(e.value)
    assert started == [] and not any(p.name.startswith('bad') and p.is_dir()
                                     for p in tmp_path.iterdir())


def test_progress_lines_count_runs_and_give_an_eta_from_the_runs_this_sweep_ran(tmp_path,
                                                                                monkeypatch):
    root = tmp_path / 'p'
    fake_run(root / 'A' / 'seed1', 4, summary=dict(iter=4))           # finished before the sweep
    grid = [(a, s, []) for a in 'AB' for s in (1, 2)]
    clock = iter([100.0, 100.0, 160.0, 200.0, 210.0])
    monkeypatch.setattr(sweep.time, 'time', lambda: next(clock))
    line = sweep.ProgressLine(grid, str(root), quiet=True)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        for arm, s, status in (('A', 1, 'done'), ('A', 2, 'done'), ('B', 1, 'FAILED (exit 1)'),
                               ('B', 2, 'stopped')):
            line.done(f'{root}/{arm}/seed{s}', status)
    assert buf.getvalue().splitlines() == [
        f'done: {root}/A/seed1 [1/4 runs, 0s, ETA ?]',             # skipped: no rate yet
        f'done: {root}/A/seed2 [2/4 runs, 1m00s, ETA 2m00s]',      # 60 s per run, 2 left
        f'FAILED (exit 1): {root}/B/seed1 [3/4 runs, 1m40s, ETA 50s]',
        f'stopped: {root}/B/seed2 [4/4 runs, 1m50s]',
    ]
    assert sweep.duration(3 * 3600 + 7 * 60 + 20) == '3h07m'


def test_the_progress_lines_of_a_real_sweep_come_as_runs_end(tmp_path, monkeypatch):
    out = fake_sweep(tmp_path, monkeypatch, 'pl', '--quiet=True')
    done = [line for line in out.splitlines() if line.startswith('done: ')]
    assert [line.split('[')[1].split(' runs')[0] for line in done] == ['1/4', '2/4', '3/4', '4/4']
    assert 'ETA' in done[0] and 'ETA' not in done[-1]
    assert out.index(done[-1]) < out.index('| arm |')             # before the summary


def test_dry_run_estimates_each_run_from_its_flops_and_a_measured_step(tmp_path, monkeypatch,
                                                                       capsys):
    """Each run's estimate is its FLOPs over the FLOP/s of the reference run's measured step (here
    a stand-in that takes 0.5 s): a run of the reference's config takes 0.5 s x (max_iters + its
    evals' forwards in steps); a cheaper arm less; finished runs are not counted; the 'before' run
    is shown without the command line's overrides; nothing is written."""
    import bench
    import flops
    import train
    measured = []
    monkeypatch.setattr(bench, 'time_train_step',
                        lambda cfg, mcfg, *a, **k: measured.append(mcfg) or 0.5)
    shape = ['--n_layer=2', '--n_head=2', '--n_embd=32', '--block_size=32', '--batch_size=4',
             '--device=cpu', '--eval_interval=20', '--eval_iters=3', '--vocab_size=64']
    study = tmp_path / 'study.py'
    study.write_text(f"base = 'config/mod_synthetic.py'\nout_root = {str(tmp_path / 'out')!r}\n"
                     f"overrides = {shape!r}\nseeds = [1, 2]\n"
                     f"before = [['config/mod_synthetic.py', '--out_dir={tmp_path / 'pre'}']]\n"
                     f"arms = {{'small': ['--mod_capacity=0.125'], "
                     f"'ref': ['--mod_capacity=0.5']}}\n"
                     f"reference = 'ref'\n")
    root = sweep.variant_root(str(tmp_path / 'out'), ['--max_iters=40'])
    fake_run(f'{root}/ref/seed2', 40, summary=dict(iter=40))
    assert sweep.main([str(study), '--dry_run', '--max_iters=40']) == 0
    out = capsys.readouterr().out
    assert len(measured) == 1 and (measured[0].n_layer, measured[0].n_embd) == (2, 32)
    assert measured[0].route == 'mod' and measured[0].mod_capacity == 0.5     # the ref arm's
    cfg = train.load_config(train.DEFAULTS, ['config/mod_synthetic.py', *shape,
                                             '--mod_capacity=0.5'])
    step, fwd = (flops.train_step_flops(measured[0], 32)['total'],
                 flops.forward_flops(measured[0], 32, 'train'))
    evals = (40 // 20 + 1) * 2 * 3
    ref_s = 0.5 * (40 * cfg['gradient_accumulation_steps'] + evals * fwd / step)
    lines = {line.split(':')[0]: line for line in out.splitlines()}
    assert lines['ref seed 2'].endswith('[finished]')
    assert lines['ref seed 1'].endswith(f'[~{sweep.duration(ref_s)}]') and 20 < ref_s < 30
    small = float(lines['small seed 1'].split('[~')[1].rstrip('s]'))
    assert 0.3 * ref_s < small < ref_s
    assert '--max_iters=40' not in lines['before'] and '--max_iters=40' in lines['ref seed 1']
    assert 'measured training step of 2L d32 T=32 B=4' in out and '1000 ms' not in out
    assert not os.path.exists(tmp_path / 'out') or os.listdir(tmp_path / 'out') == [
        os.path.basename(root)]


def test_a_study_score_joins_the_table_with_paired_comparisons_and_is_cached(tmp_path,
                                                                             monkeypatch):
    """score: a command per finished run ('{run}', '{ckpt}' filled in; a 0-step run is scored on
    its init_from), its JSON cached with the checkpoint's mtime; score_metrics name the columns
    (higher-is-better accuracy: a win is a higher value)."""
    backbone = tmp_path / 'backbone.pt'
    backbone.write_bytes(b'x')
    acc = {('zero', 1): 0.0, ('zero', 2): 0.0, ('lora', 1): 0.5, ('lora', 2): 0.6,
           ('full', 1): 0.7, ('full', 2): 0.6}
    calls = []

    def fake_score(args, **kw):
        calls.append(args)
        run = args[2].split('=', 1)[1]
        arm, seed = run.split(os.sep)[-2], int(run[-1])
        return SimpleNamespace(returncode=0, stderr='',
                               stdout=json.dumps(dict(accuracy=acc[(arm, seed)], n=100)))

    monkeypatch.setattr(sweep.subprocess, 'run', fake_score)
    study = dict(arms={'lora': [], 'zero': [], 'full': []}, seeds=[1, 2], reference='lora',
                 score=['arith.py', '--run={run}', '--ckpt={ckpt}'],
                 score_metrics={'accuracy': False}, room_arms=('zero', 'full', 'accuracy'))
    results = {}
    for arm, s in acc:
        out = tmp_path / arm / f'seed{s}'
        fake_run(out, 0 if arm == 'zero' else 10, summary=dict(iter=10))
        if arm == 'zero':
            (out / 'config.json').write_text(json.dumps(dict(max_iters=0,
                                                             init_from=str(backbone))))
        else:
            (out / 'ckpt.pt').write_bytes(b'y')
        results[(arm, s)] = sweep.score_run(study, str(out))
    assert results[('full', 1)] == dict(accuracy=0.7)            # n is not a score metric
    assert calls[0][0] == sys.executable and calls[0][1].endswith('arith.py')
    zero = [c for c in calls if '/zero/' in c[2]]
    assert zero and all(c[3] == f'--ckpt={backbone}' for c in zero)
    assert all(c[3].endswith('ckpt.pt') for c in calls if '/zero/' not in c[2])
    n = len(calls)
    sweep.score_run(study, str(tmp_path / 'full' / 'seed1'))
    assert len(calls) == n                                            # cached
    os.utime(tmp_path / 'full' / 'seed1' / 'ckpt.pt', (1, 1))
    sweep.score_run(study, str(tmp_path / 'full' / 'seed1'))
    assert len(calls) == n + 1                                        # retrained: scored again
    summary = sweep.summarize(study, results)
    full = summary['table']['full']['accuracy']
    assert full['mean'] == pytest.approx(0.65)
    assert full['vs_reference']['wins'] == 1 and full['vs_reference']['n'] == 2   # ties seed 2
    assert full['vs_reference']['mean_diff'] == pytest.approx(0.1)
    room = summary['room']
    assert room['size'] == pytest.approx(0.65) and room['seed_std'] == pytest.approx(
        np.std([0.5, 0.6], ddof=1))
    assert room['verdict'] == 'no room'                     # 0.65 < 10 × 0.0707
    assert 'The two arms' in sweep.room_markdown(room)



def test_score_commands_run_jobs_at_a_time_each_with_its_share_of_threads(tmp_path, monkeypatch):
    """With --jobs=2 the finished runs' score commands run two at once (each with cpu_count // 2
    threads, as train.py runs get), and the scores come back in the runs' order."""
    running, peak, envs, lock = [0], [0], [], threading.Lock()

    def fake_score(args, env=None, **kw):
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
            envs.append(env.get('OMP_NUM_THREADS'))
        time.sleep(0.3)                 # long enough for the other worker to start its own
        with lock:
            running[0] -= 1
        return SimpleNamespace(returncode=0, stderr='', stdout=json.dumps(dict(accuracy=float(
            args[2].rsplit('seed', 1)[1]))))
    monkeypatch.setattr(sweep.subprocess, 'run', fake_score)
    monkeypatch.delenv('OMP_NUM_THREADS', raising=False)
    monkeypatch.setattr(sweep.os, 'cpu_count', lambda: 4)
    study = dict(score=['arith.py', '--run={run}', '--ckpt={ckpt}'],
                 score_metrics={'accuracy': False})
    runs = []
    for s in range(1, 6):
        out = tmp_path / 'arm' / f'seed{s}'
        fake_run(out, 10, summary=dict(iter=10))
        (out / 'ckpt.pt').write_bytes(b'y')
        runs.append(str(out))
    assert sweep.score_runs(study, runs, jobs=2) == [dict(accuracy=float(s)) for s in range(1, 6)]
    assert peak[0] == 2 and envs == ['2'] * 5
    assert sweep.score_runs(study, runs, jobs=2) == [dict(accuracy=float(s)) for s in range(1, 6)]
    assert len(envs) == 5                                          # cached: none scored again


def test_a_failed_score_is_named_and_leaves_the_run_unscored(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sweep.subprocess, 'run', lambda args, **kw: SimpleNamespace(
        returncode=0, stdout='not json', stderr='boom'))
    out = tmp_path / 'a' / 'seed1'
    fake_run(out, 10, summary=dict(iter=10))
    (out / 'ckpt.pt').write_bytes(b'y')
    study = dict(score=['arith.py', '--ckpt={ckpt}'], score_metrics={'accuracy': False})
    assert sweep.score_run(study, str(out)) == {}
    assert 'score: ' in capsys.readouterr().err and not (out / 'score.json').exists()


@pytest.mark.parametrize('line,needle', [
    ("score = 'arith.py'", 'score must be a command'),
    ("score_metrics = {'accuracy': 'higher'}", 'score_metrics must be'),
    ("room_arms = ('a', 'nope', 'accuracy')", 'room_arms must be'),
])
def test_bad_score_options_refuse_the_study(tmp_path, line, needle):
    path = tmp_path / 'study.py'
    path.write_text(f"base = 'x.py'\narms = {{'a': []}}\nseeds = [1]\nout_root = 'o'\n{line}\n")
    with pytest.raises(sweep.ConfigError, match=needle):
        sweep.load_study(str(path))


def test_run_metrics_reads_trainable_params_and_the_median_step_time(tmp_path):
    fake_run(tmp_path, 10, summary=dict(iter=10, trainable_params=1234))
    with open(tmp_path / 'metrics.jsonl', 'a') as f:
        for i, ms in enumerate((900.0, 10.0, 30.0, 20.0)):     # the first (warm-up) is left out
            f.write(json.dumps(dict(type='train', iter=i, ms_per_iter=ms)) + '\n')
    m = sweep.run_metrics(str(tmp_path))
    assert m['trainable_params'] == 1234 and m['ms_per_step'] == pytest.approx(20.0)


def test_a_smoke_run_of_a_study_runs_its_first_seed_only(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv('NANODEPTH_SMOKE', '1')
    fake_sweep(tmp_path, monkeypatch, 'st')
    ran = {(a, s): len(starts(tmp_path / 'st' / a / f'seed{s}')) for a in 'AB' for s in (1, 2)}
    assert ran == {('A', 1): 1, ('B', 1): 1, ('A', 2): 0, ('B', 2): 0}
    assert 'smoke run of seed 1 only' in capsys.readouterr().err
    assert json.loads((tmp_path / 'st' / 'summary.json').read_text())['seeds'] == [1]


@pytest.mark.parametrize('line,needle', [
    ("threshold = 'low'", 'threshold must be a finite number > 0'),
    ("threshold = True", 'threshold must be a finite number > 0'),
    ("threshold = float('nan')", 'threshold must be a finite number > 0'),
    ("threshold = 0", 'threshold must be a finite number > 0'),
    ("room_arms = ('a', 'b', 'acuracy')", "room_arms' metric 'acuracy' is not a column"),
    ("room_arms = 5", 'room_arms must be'),
])
def test_a_bad_threshold_or_room_metric_is_refused_before_any_run(tmp_path, line, needle):
    """The summary reads these only after every run: a bad one must refuse the study at once."""
    path = tmp_path / 'study.py'
    path.write_text(f"base = 'x.py'\narms = {{'a': [], 'b': []}}\nseeds = [1]\nout_root = 'o'\n"
                    f"{line}\n")
    with pytest.raises(sweep.ConfigError, match=needle):
        sweep.load_study(str(path))


def test_every_arm_name_of_the_studies_shipped_is_a_folder_name():
    """The arm-name rule admits every arm the config files' studies use."""
    for path in sorted(glob.glob(os.path.join(REPO, 'config', 'study_*.py'))):
        sweep.load_study(path)


def test_bad_room_args_refuse_the_study_before_any_run(tmp_path, monkeypatch):
    """room_args go to eval.py after the last run: eval.py's parsing checks them before the first
    (a typo, a value of the wrong type), naming the field; no run starts."""
    started = []
    monkeypatch.setattr(sweep.subprocess, 'Popen', fake_popen(started))
    study = tmp_path / 'study.py'
    for bad, key in ((['--bogus=1'], 'bogus'), (['--eval_iters=many'], 'eval_iters')):
        study.write_text(f"base = 'config/mod_synthetic.py'\nout_root = "
                         f"{str(tmp_path / 'out')!r}\nseeds = [1]\narms = {{'a': []}}\n"
                         f"room_ckpt = 'out/backbone/ckpt.pt'\nroom_args = {bad!r}\n")
        with pytest.raises(sweep.ConfigError, match=f"^room_args: .*{key}") as e:
            sweep.main([str(study), '--no_plots'])
        assert 'no run was started' in str(e.value)
        assert started == [] and not (tmp_path / 'out').exists()


def test_a_good_threshold_and_room_metric_are_taken(tmp_path):
    path = tmp_path / 'study.py'
    path.write_text("base = 'x.py'\narms = {'a': [], 'b': []}\nseeds = [1]\nout_root = 'o'\n"
                    "threshold = 2\nscore_metrics = {'accuracy': False}\n"
                    "room_arms = ('a', 'b', 'accuracy')\n")
    study = sweep.load_study(str(path))
    assert sweep.lm_threshold(study, {}) == (2.0, 'study file')
    path.write_text("base = 'x.py'\narms = {'a': [], 'b': []}\nseeds = [1]\nout_root = 'o'\n"
                    "room_arms = ['a', 'b', 'final_val_loss']\n")
    assert sweep.load_study(str(path))['room_arms'] == ['a', 'b', 'final_val_loss']


@pytest.mark.parametrize('line,needle', [
    ("seeds = 3", 'seeds a non-empty list'),
    ("seeds = [1, 1]", r'seeds must differ: 1 is given twice'),
    ("arms = {'a': '--lr=1e-3'}", r"arm 'a' must be a list of train.py arguments"),
    ("arms = {'a': None}", r"arm 'a' must be a list of train.py arguments"),
    ("overrides = '--max_iters=5'", 'overrides must be a list of train.py arguments'),
    ("room_args = '--eval_iters=2'", 'room_args must be a list of eval.py arguments'),
    ("base = 123", "base must name a config file"),
    ("base = ''", "base must name a config file"),
    ("room_ckpt = 5", "room_ckpt must be a string or None"),
    ("room_key = ['gate_room']", "room_key must be a string or None"),
    ("score = ['no_such_script.py', '--ckpt={ckpt}']", "'no_such_script.py' is no script"),
    ("score = ['no-such-program-here', '{ckpt}']", "'no-such-program-here' is no script"),
    ("arms = {'a': ['--seed=7']}",
     r"arm 'a' gives --seed=7, but the sweep sets each run's seed itself; drop it and change "
     "seeds in the study file"),
    ("overrides = ['--out_dir=/tmp/x']",
     r"overrides gives --out_dir=/tmp/x, but the sweep sets each run's out_dir itself"),
    *[(f"arms = {{{name!r}: []}}", f"arm name {re.escape(repr(name))} must be letters")
      for name in ('../../escape', 'a/b', '', '.', '..', '.hidden', '-x', 'a b', 5)],
])
def test_a_study_field_of_the_wrong_shape_is_refused(tmp_path, line, needle):
    """A string where a list is meant would be spread into one argument per character, a seed
    given twice would count one run as two seeds, seeds = 3 crashed, and a seed or out_dir in an
    arm or the overrides was overridden by the sweep's own in silence."""
    path = tmp_path / 'study.py'
    path.write_text(f"base = 'x.py'\narms = {{'a': []}}\nseeds = [1]\nout_root = 'o'\n{line}\n")
    with pytest.raises(sweep.ConfigError, match=needle):
        sweep.load_study(str(path))


def test_a_finished_run_of_0_steps_made_under_other_options_refuses_the_study(tmp_path,
                                                                               monkeypatch):
    """A run of 0 steps (a zero-shot arm) saves no checkpoint but is finished, so it is skipped
    and summarised: its config.json is compared as any finished run's is."""
    import train
    started = []
    monkeypatch.setattr(sweep.subprocess, 'Popen', fake_popen(started))
    out = tmp_path / 'out'
    study = tmp_path / 'study.py'
    study.write_text(f"base = 'config/mod_synthetic.py'\nout_root = {str(out)!r}\n"
                     "seeds = [1]\narms = {'A': ['--max_iters=0', '--eval_iters=3']}\n")
    argv = ['config/mod_synthetic.py', '--max_iters=0', '--eval_iters=3', '--seed=1',
            f'--out_dir={out}/A/seed1']
    with contextlib.chdir(REPO):
        _, ran = train.read_config(argv)
    fake_run(out / 'A' / 'seed1', 0, summary=dict(iter=0))
    config = out / 'A' / 'seed1' / 'config.json'
    config.write_text(json.dumps(dict(ran, eval_iters=7)))
    with pytest.raises(sweep.ConfigError, match=r"arm 'A' seed 1: .*A/seed1 ran with "
                                                r"eval_iters=7, the study now gives 3"):
        sweep.main([str(study), '--no_plots'])
    config.write_text(json.dumps(ran))          # the same options: skipped, not run again
    assert sweep.main([str(study), '--no_plots']) == 0 and started == []


def test_a_mean_over_fewer_seeds_than_the_study_says_how_many():
    """The table's note says 'mean ± std over seeds [1, 2, 3]': a cell whose runs did not all
    finish (a failed seed) says over how many it is, and one value is not a spread of 0."""
    results = {('ref', s): dict(avg_lm=v, code='x') for s, v in ((1, 2.0), (2, 3.0), (3, 2.5))}
    results[('arm', 1)] = dict(avg_lm=1.5, code='x')
    summ = sweep.summarize(dict(arms={'ref': [], 'arm': []}, seeds=[1, 2, 3], reference='ref'),
                           results)
    md = sweep.markdown(dict(summ, code_versions=['x']))
    row = [line for line in md.splitlines() if line.startswith('| arm |')][1]   # (the header's)
    assert row.split(' | ')[1] == '1.5 (1 of 3 seeds) (wins 1/1, Δ -0.5) |'
    row = next(line for line in md.splitlines() if line.startswith('| ref |'))
    assert row.split(' | ')[1] == '2.5 ± 0.5 |'


@pytest.mark.parametrize('line,needle', [
    ("before = [['--out_dir=x', 5]]", r"before must be a list of train.py argument lists"),
    ("before = ['--out_dir=x']", r"before must be a list of train.py argument lists"),
    ("frontier = 'ab'", r"frontier must be a list of 2 or more dense arms"),
    ("frontier = ['a']", r"frontier must be a list of 2 or more dense arms"),
])
def test_a_bad_before_or_frontier_is_refused(tmp_path, line, needle):
    """frontier = 'ab' was read as the arms 'a' and 'b', and a frontier of one arm was dropped
    from the summary without a word; a 'before' run with a non-string argument crashed."""
    path = tmp_path / 'study.py'
    path.write_text("base = 'x.py'\narms = {'a': [], 'b': []}\nseeds = [1]\nout_root = 'o'\n"
                    f"{line}\n")
    with pytest.raises(sweep.ConfigError, match=needle):
        sweep.load_study(str(path))
    path.write_text("base = 'x.py'\narms = {'a': [], 'b': []}\nseeds = [1]\nout_root = 'o'\n"
                    "frontier = ['a', 'b']\nbefore = [['--out_dir=x']]\n")
    assert sweep.load_study(str(path))['frontier'] == ['a', 'b']


def test_room_and_scores_are_computed_again_when_their_command_changes(tmp_path, monkeypatch):
    """The room cache and score.json hold what computed them: other room_args or another score
    command measure again (the checkpoint unchanged); a 0-step run whose init_from is not a file
    (a hub name) is scored once, not on every sweep."""
    calls = []

    def fake(args, **kw):
        calls.append(args)
        return SimpleNamespace(returncode=0, stderr='', stdout=json.dumps(
            dict(full=1.0, room=0.5 if '--eval_iters=2' in args else 0.25, accuracy=len(calls))))
    monkeypatch.setattr(sweep.subprocess, 'run', fake)
    (tmp_path / 'bb.pt').write_bytes(b'x')
    study = dict(room_ckpt=str(tmp_path / 'bb.pt'), seeds=[1], room_args=['--eval_iters=2'])
    assert sweep.measure_room(study, str(tmp_path))[1]['room'] == 0.5
    assert sweep.measure_room(study, str(tmp_path))[1]['room'] == 0.5 and len(calls) == 1
    assert sweep.measure_room(dict(study, room_args=[]), str(tmp_path))[1]['room'] == 0.25
    assert len(calls) == 2
    run, zero = tmp_path / 'a' / 'seed1', tmp_path / 'zero' / 'seed1'
    fake_run(run, 10, summary=dict(iter=10))
    (run / 'ckpt.pt').write_bytes(b'y')
    fake_run(zero, 0, summary=dict(iter=0))
    (zero / 'config.json').write_text(json.dumps(dict(max_iters=0, init_from='gpt2')))
    study = dict(score=['arith.py', '--ckpt={ckpt}'], score_metrics={'accuracy': False})
    assert sweep.score_run(study, str(run)) == dict(accuracy=3)
    assert sweep.score_run(study, str(run)) == dict(accuracy=3) and len(calls) == 3
    other = dict(study, score=['arith.py', '--ckpt={ckpt}', '--split=test'])
    assert sweep.score_run(other, str(run)) == dict(accuracy=4) and calls[-1][-1] == '--split=test'
    assert sweep.score_run(study, str(zero)) == dict(accuracy=5) and calls[-1][-1] == '--ckpt=gpt2'
    assert sweep.score_run(study, str(zero)) == dict(accuracy=5) and len(calls) == 5
    # eval figures drawn from other eval windows (another EVAL_WINDOWS) are computed again
    monkeypatch.setattr(sweep, 'EVAL_WINDOWS', sweep.EVAL_WINDOWS + 1)
    assert sweep.score_run(study, str(zero)) == dict(accuracy=6) and len(calls) == 6
    room = sweep.measure_room(dict(study, room_ckpt=str(tmp_path / 'bb.pt'), seeds=[1]),
                              str(tmp_path))[1]
    assert len(calls) == 7 and 'eval_windows' in room
    no_metric = {m: dict(mean=None) for m in ('causal_val_loss', 'final_val_loss')}
    assert 'eval_windows' not in sweep.room_verdict(dict(seeds=[1]), {1: room},
                                                    no_metric)['values']


@pytest.mark.parametrize('line,name,close', [
    ('treshold = 2.0', 'treshold', 'threshold'), ('seed = [1]', 'seed', 'seeds'),
    ('room_arg = []', 'room_arg', 'room_args'), ('zzz = 1', 'zzz', None)])
def test_a_misspelt_field_is_refused_naming_it_and_the_close_match(tmp_path, line, name, close):
    """A misspelt lower-case field was ignored without a word (the study ran on the default);
    UPPER_CASE and _names, imported modules and functions stay allowed as helpers."""
    body = "base = 'x.py'\narms = {'a': []}\nseeds = [1]\nout_root = 'o'\n"
    path = tmp_path / 'study.py'
    path.write_text(body + line + '\n')
    with pytest.raises(sweep.ConfigError) as e:
        sweep.load_study(str(path))
    hint = f" (did you mean '{close}'?)" if close else ''
    assert f"unknown field '{name}'{hint}; the fields are base, arms, seeds" in str(e.value)
    assert 'threshold' in str(e.value) and '\n' not in str(e.value)
    path.write_text("import os\nfrom math import sqrt\n" + body.replace('seeds = [1]', '')
                    + "LR = ['--learning_rate=1e-3']\n_n = 2\nseeds = list(range(1, _n))\n"
                    "def helper(x):\n    return x\n")
    study = sweep.load_study(str(path))
    assert study['seeds'] == [1] and study['LR'] == ['--learning_rate=1e-3']


def test_a_room_against_one_seed_is_unknown_whichever_way_it_is_measured():
    """One seed has no spread (mean_std's 0.0 is not a measured one): room_arms said 'room' for
    any difference while room_verdict says 'unknown'; both say 'unknown' now."""
    results = {('zero', 1): dict(accuracy=0.0), ('full', 1): dict(accuracy=0.8),
               ('lora', 1): dict(accuracy=0.5)}
    study = dict(arms={'lora': [], 'zero': [], 'full': []}, seeds=[1], reference='lora',
                 score_metrics={'accuracy': False}, room_arms=('zero', 'full', 'accuracy'))
    room = sweep.summarize(study, results)['room']
    assert room['size'] == pytest.approx(0.8) and room['seed_std'] == 0.0
    assert room['verdict'] == 'unknown'
    assert sweep.room_markdown(room).startswith('**Room: unknown.**')
    ref_row = dict(causal_val_loss=dict(mean=1.0, std=0.0, per_seed=[1.0]),
                   final_val_loss=dict(mean=None, std=None, per_seed=[None]))
    backbone = {1: dict(full=0.9, random=1.5, oracle=1.0, gate_room=0.5)}
    assert sweep.room_verdict(dict(seeds=[1]), backbone, ref_row)['verdict'] == 'unknown'


def test_summarize_only_refuses_runs_made_under_other_options(tmp_path, capsys):
    """--summarize_only skipped the check that the runs were made under the study's options, so
    runs made under others were summarised as the study's: it refuses them as a sweep does. It
    does not check the inputs of runs not finished, which summarising does not read."""
    out = tmp_path / 'out'
    (tmp_path / 'cfg.py').write_text('max_iters = 4\n')
    study = tmp_path / 'study.py'
    study.write_text(f"base = {str(tmp_path / 'cfg.py')!r}\nout_root = {str(out)!r}\n"
                     "seeds = [1]\narms = {'A': ['--eval_iters=3']}\n")
    fake_run(out / 'A' / 'seed1', 4, summary=dict(iter=4, avg_lm=2.0))
    config = out / 'A' / 'seed1' / 'config.json'
    config.write_text(json.dumps(dict(max_iters=4, eval_iters=7)))
    with pytest.raises(sweep.ConfigError, match=r"arm 'A' seed 1: .*A/seed1 ran with "
                                                r"eval_iters=7, the study now gives 3"):
        sweep.main([str(study), '--summarize_only', '--no_plots'])
    assert not (out / 'summary.json').exists()
    config.write_text(json.dumps(dict(max_iters=4, eval_iters=3, device='cuda')))
    assert sweep.main([str(study), '--summarize_only', '--no_plots']) == 0
    summary = json.loads((out / 'summary.json').read_text())
    assert summary['table']['A']['avg_lm']['per_seed'] == [2.0]
    # a stopped run whose inputs are not here (a study copied off its machine): still summarised
    study.write_text(study.read_text().replace("'--eval_iters=3'", "'--eval_iters=3', "
                                               "'--dataset=not_prepared_here'"))
    fake_run(out / 'A' / 'seed1', 2, summary=None)
    config.write_text(json.dumps(dict(max_iters=4, eval_iters=3, dataset='not_prepared_here')))
    assert sweep.main([str(study), '--summarize_only', '--no_plots']) == 0
    with pytest.raises(sweep.ConfigError, match=r"not_prepared_here is not a prepared dataset"):
        sweep.main([str(study), '--no_plots'])


def test_estimates_cost_each_run_with_its_step_options(monkeypatch):
    """A run whose steps add oracle passes (ffn util labels on 1 of its 2 routed layers a step) is
    estimated at the mean cost of its steps, against a plain step timed at a fixed 0.1 s."""
    import bench
    import flops
    import train
    from configurator import load_config
    from model import GPTConfig
    monkeypatch.setattr(bench, 'time_train_step', lambda *a, **k: 0.1)
    shape = ['--n_layer=2', '--n_head=2', '--n_embd=32', '--block_size=16', '--batch_size=2',
             '--vocab_size=40', '--max_iters=10', '--eval_interval=100', '--eval_iters=1',
             '--device=cpu', '--route=ffn', '--ffn_layers=all']
    oracle = [*shape, '--ffn_util_weight=0.5', '--ffn_oracle_layers_per_step=1']
    (plain_s, oracle_s), _ = sweep.estimate_seconds([shape, oracle], 0)
    mcfg = train.model_config(SimpleNamespace(**load_config(train.DEFAULTS, oracle)))
    per_layer = [flops.train_step_flops(mcfg, 16, 'all', oracle_layers=(l,))['total']
                 for l in (0, 1)]
    plain = flops.train_step_flops(GPTConfig(**{**vars(mcfg), 'ffn_util_weight': 0.0}), 16,
                                   'all')['total']
    evals = 2 * 2 * flops.forward_flops(mcfg, 16, 'train')       # 2 evals x 2 splits, batch 2
    # both layers are drawn over 10 steps, each about half the time: within their spread
    want = (10 * 2 * min(per_layer) + evals, 10 * 2 * max(per_layer) + evals)
    rate = plain * 2 / 0.1
    assert want[0] / rate <= oracle_s <= want[1] / rate
    assert oracle_s > 1.3 * plain_s              # the oracle passes: room to tell them apart
