"""bench.py --json prints exactly one JSON object whose numbers come from this run: positive speeds,
no MFU on CPU, and the step FLOPs the analytic accountant gives for this config."""
import contextlib
import io
import json
import math
import os
import re
import shutil
import signal
import sys
import tarfile
import time
from types import SimpleNamespace

import pytest
import torch

import bench
import flops
import train
from configurator import ConfigError, UserError, load_config
from conftest import NO_CPU_GROUPED_MM, finish, grouped_mm_on_cpu, run_group, start, stop
from dataclasses import replace
from model import FAMILIES, controlled_layer_ids

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = [
    '--n_layer=3',
    '--n_head=2',
    '--n_embd=32',
    '--block_size=32',
    '--batch_size=2',
    '--vocab_size=50',
    '--bench_steps=1',
    '--bench_warmup=0',
    '--decode_tokens=4',
    '--decode_batches=1,2',
    '--json',
]


def bench_json(args, timeout=None):
    """bench.main(args) in this process, on one thread (tests/test_cli_errors.py runs bench.py from
    the shell): the one JSON object it prints on stdout, once it has returned 0. (timeout: unused,
    kept for the callers' record of what each run may take.)"""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with contextlib.redirect_stdout(io.StringIO()) as out:
            assert bench.main(args) == 0
    finally:
        torch.set_num_threads(threads)
    lines = [l for l in out.getvalue().splitlines() if l.strip()]
    assert len(lines) == 1, out.getvalue()
    return json.loads(lines[0])


@pytest.mark.parametrize('route', list(FAMILIES))
def test_bench_json(route):
    """Every family in the registry: training step, prefill and decode timed, step FLOPs the
    accountant's."""
    args = [*TINY, f'--route={route}']
    res = bench_json(args, 120)
    assert res['device'] == 'cpu' and res['train_mfu'] is None and res['route'] == route
    assert res['torch'] == torch.__version__ and res['git_sha'] == train.code_version()['git_sha']
    assert res['train_tokens_per_s'] > 0 and res['prefill_tokens_per_s'] > 0
    assert set(res['decode_tokens_per_s']) == {'1', '2'}
    cfg = load_config(
        {
            **train.DEFAULTS,
            'bench_steps': 0,
            'bench_warmup': 0,
            'decode_tokens': 0,
            'decode_batches': '',
        },
        [a for a in args if a != '--json'],
    )
    mcfg = train.model_config(SimpleNamespace(**cfg), vocab_size=50)
    assert res['train_flops_per_step'] == 2 * flops.train_step_flops(mcfg, 32)['total']
    assert res['repeats'] == 1 and set(res['spread']['decode']) == {'1', '2'}



def test_bench_decode_vs_hf(tmp_path):
    """--decode_vs_hf: one row per decode batch, eager (compiled rows only with --compile=True),
    each with our tokens/s, transformers' tokens/s and ratio = ours / theirs; --out writes the
    same JSON with the command."""
    pytest.importorskip('transformers')
    out = tmp_path / 'vs_hf.json'
    args = ['--decode_vs_hf=True', '--n_layer=2', '--n_head=2', '--n_embd=32', '--block_size=64',
            '--vocab_size=50', '--decode_prompt=8', '--decode_tokens=4', '--decode_batches=1,3',
            '--bench_steps=2', '--device=cpu', '--dtype=float32', f'--out={out}', '--json']
    res = bench_json(args, 180)
    assert torch.is_grad_enabled()      # the interleaved decoders leave autograd as they found it
    assert res['kind'] == 'decode_vs_hf' and res['prompt_tokens'] == 8
    assert (res['decode_tokens'], res['n_layer'], res['vocab_size']) == (4, 2, 50)
    assert [(row['batch'], row['ours']) for row in res['rows']] == [(1, 'eager'), (3, 'eager')]
    for row in res['rows']:
        assert set(row) == {'batch', 'ours', 'ours_tokens_per_s', 'hf_tokens_per_s', 'ratio',
                            'weights_floor_tokens_per_s', 'best_ratio_possible', 'spreads',
                            'repeats', 'noisy', 'repeats_ms'}
        assert row['ours_tokens_per_s'] > 0 and row['hf_tokens_per_s'] > 0
        assert row['best_ratio_possible'] == pytest.approx(
            row['weights_floor_tokens_per_s'] / row['hf_tokens_per_s'], rel=1e-12)
        assert row['repeats'] == 2 and row['noisy']          # 2 repeats: too few to mean much
        assert row['ratio'] == pytest.approx(row['ours_tokens_per_s'] / row['hf_tokens_per_s'],
                                             rel=1e-12)
    saved = json.loads(out.read_text())
    assert saved['rows'] == res['rows'] and saved['command'].startswith('python bench.py ')
    assert '--decode_vs_hf=True' in saved['command']



def test_bench_times_the_tokens_generate_decodes():
    """The decoding bench_decode_vs_hf times step by step is generate's greedy decoding: the same
    tokens, each step's logits the full forward's at its position (the steps cross a bucket)."""
    import bench
    from model import GPT, GPTConfig
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=96, vocab_size=13)).eval()
    prompt = torch.randint(0, 13, (2, 60))
    want = model.generate(prompt, 9, temperature=0)
    tokens, logits, steps = [], [], bench.our_greedy_steps(model, prompt, 8, compile=False)
    for i, _ in enumerate(steps):
        tokens.append(steps.gi_frame.f_locals['nxt'].clone())
        if i:
            logits.append(steps.gi_frame.f_locals['logits'].clone())
    assert torch.equal(torch.cat(tokens, 1), want[:, 60:])
    with torch.no_grad():
        full = model(want, last_only=False)[0]
    torch.testing.assert_close(torch.stack(logits, 1), full[:, 60:68], rtol=1e-4, atol=1e-4)


def test_the_weights_floor_applies_every_linear_once_per_token():
    """weights_floor_steps runs each Linear of the model (the LM head too) once per decode step on
    a (batch, 1, in) input, and nothing else: counted with forward hooks."""
    import bench
    from model import GPT, GPTConfig
    model = GPT(GPTConfig(n_layer=3, n_head=2, n_embd=16, block_size=32, vocab_size=13)).eval()
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert len(linears) == 3 * 4 + 1                # qkv, out, fc, proj per block; the head
    shapes = []
    for m in linears:
        m.register_forward_hook(lambda m, args, out: shapes.append((m, tuple(args[0].shape))))
    steps = bench.weights_floor_steps(model, 5, 4)
    next(steps)
    assert shapes == []                             # the first next() is the untimed prefill
    for _ in steps:
        pass
    assert len(shapes) == 4 * len(linears)
    assert [m for m, _ in shapes[:len(linears)]] == linears
    assert all(shape == (5, 1, m.in_features) for m, shape in shapes)


def test_bench_decode_vs_hf_prompt_must_fit_the_context(capsys):
    """A prompt plus the decoded tokens past block_size is refused before any model is built (a
    UserError: run_cli prints it as one line and exits 2, tests/test_cli_errors.py)."""
    with pytest.raises(ConfigError, match='decode_tokens=8'):
        bench.main(['--decode_vs_hf=True', '--block_size=64', '--decode_prompt=60',
                    '--decode_tokens=8'])
    assert capsys.readouterr().out == ''


def test_bench_bad_key_is_a_clean_error():
    with pytest.raises(ConfigError, match='n_layer'):
        bench.main(['--n_layers=2'])


@pytest.mark.parametrize('route', ['ffn', 'mod', 'halt', 'exit'])
def test_bench_routed_table(route, tmp_path):
    """--budgets: one prefill row per (budget, shape) and one decode row per (budget, batch); the
    FLOPs ratio is the analytic one at the realised routing (recomputed here), last-position logits
    only; TSA and the exits hold the budget by their bisected threshold (at least it, and all of it
    at 1.0); one joint-training row per training config, its FLOPs ratio the accountant's; --out
    writes the JSON."""
    args = [
        '--n_layer=2',
        '--n_head=2',
        '--n_embd=32',
        '--block_size=32',
        '--batch_size=2',
        '--vocab_size=50',
        '--bench_steps=1',
        '--bench_warmup=0',
        '--decode_tokens=2',
        '--decode_batches=1,2',
        f'--route={route}',
        '--budgets=1.0,0.5',
        '--prefill_shapes=2x16,1x32',
        *family_args(route, exit_layers=1),
        f'--out={tmp_path / "bench.json"}',
        '--json',
    ]
    res = bench_json(args, 120)
    pre = [x for x in res['rows'] if x['kind'] == 'prefill']
    dec = [x for x in res['rows'] if x['kind'] == 'decode']
    assert [(x['budget'], x['batch'], x['seq']) for x in pre] == [
        (1.0, 2, 16),
        (1.0, 1, 32),
        (0.5, 2, 16),
        (0.5, 1, 32),
    ]
    assert [(x['budget'], x['batch']) for x in dec] == [(1.0, 1), (1.0, 2), (0.5, 1), (0.5, 2)]
    for x in pre:
        assert x['time_ratio'] > 0 and math.isclose(
            x['ideal_realised'], x['flops_ratio'] / x['time_ratio']
        )
        cfg = load_config(
            {
                **train.DEFAULTS,
                'bench_steps': 0,
                'bench_warmup': 0,
                'decode_tokens': 0,
                'decode_batches': '',
                'budgets': '',
                'prefill_shapes': '',
                'sparse': True,
                'profile': False,
                'out': '',
            },
            [a for a in args if a != '--json'],
        )
        mcfg = FAMILIES[route].bench_config(
            train.model_config(SimpleNamespace(**cfg), vocab_size=50), x['budget']
        )
        if route == 'mod':
            assert mcfg.mod_router == 'random'
        if route in ('halt', 'exit') and (x['budget'] == 1.0 or (x['batch'], x['seq']) == (2, 16)):
            assert x['budget'] - 1e-9 <= x['realised_frac']     # bisected on the first shape's
                                                                # batch
        if route in ('ffn', 'mod'):            # TSA gates blocks 1.., the exits count the running
                                               # tokens per block
            assert len(x['layer_fracs']) == len(controlled_layer_ids(mcfg))
        assert math.isclose(x['realised_frac'], sum(x['layer_fracs']) / len(x['layer_fracs']))
        head = (x['seq'] - 1) * 2 * 32 * 50
        want = (
            flops.forward_flops(mcfg, x['seq'], 'sparse', full_frac=x['layer_fracs']) - head
        ) / (flops.dense_forward_flops(mcfg, x['seq']) - head)
        assert math.isclose(x['flops_ratio'], want, rel_tol=1e-6)
        if x['budget'] == 1.0:
            assert x['realised_frac'] == 1.0 or route == 'mod'
    assert res['train']['ratio'] > 0
    # one repeat: no spread to judge a ratio by, so every ratio is flagged
    assert all(x['noisy'] and x['repeats'] == 1 for x in [*res['rows'], res['train']])
    assert res['torch'] == torch.__version__ and res['git_sha'] == train.code_version()['git_sha']
    trains = [x for x in res['rows'] if x['kind'] == 'train']
    assert [x['budget'] for x in trains] == ([1.0] if route in ('halt', 'exit') else [1.0, 0.5])
    for x in trains:
        mcfg = FAMILIES[route].bench_config(
            train.model_config(SimpleNamespace(**cfg), vocab_size=50), x['budget']
        )
        want = (
            flops.train_step_flops(mcfg, 32)['total']
            / flops.train_step_flops(replace(mcfg, route='none'), 32)['total']
        )
        assert math.isclose(x['flops_ratio'], want, rel_tol=1e-9) and x['time_ratio'] > 0
    saved = json.loads((tmp_path / 'bench.json').read_text())
    assert saved['rows'] == res['rows'] and saved['command'].startswith(
        'python bench.py --n_layer=2'
    )


# --------------------------------------------------------------------------------------------------
# the GPU suite (bench_suite.py), on the CPU with --smoke=True

SUITE_KEYS = ('kind', 'route', 'budget', 'path', 'dtype', 'compiled', 'ms', 'dense_ms', 'speedup',
              'ideal', 'realised', 'baseline')


def test_gpu_suite_smoke_writes_every_row(tmp_path):
    """The whole suite on tiny shapes: the correctness check passes on every path; every kind,
    route, budget, shape, batch and available path has its rows, each with the schema's keys and
    speedup = dense_ms / ms, realised = speedup / ideal; routed prefill's ideal lies in
    (1, 1/budget] below budget 1 (<= 1 at 1.0: ffn's gate and cheap path cost FLOPs); suite.md has
    one table line per row; the header names this commit, torch and the command."""
    import routed_rows
    out = tmp_path / 'suite'
    r = run_group([sys.executable, 'bench.py', '--suite=gpu', '--smoke=True', f'--out_dir={out}'],
                  180, cwd=REPO, env={**os.environ, 'OMP_NUM_THREADS': '1'})
    assert r.returncode == 0, r.stderr
    res = json.loads((out / 'suite.json').read_text())
    rows = res['rows']
    assert res['failed'] == [] and res['skipped'] == []
    assert res['git_sha'] == train.code_version()['git_sha'] and res['torch'] == torch.__version__
    assert res['gpu'] == 'cpu' and res['command'] == (
        f'python bench.py --suite=gpu --smoke=True --out_dir={out}')
    assert res['default_path']['float32'] == dict(eager='compact', compiled='reference')
    paths = routed_rows.available_paths(torch.device('cpu'), torch.float32)
    assert {(c['route'], c['dtype'], c['path']) for c in res['check']} == {
        (route, dt, p) for route in ('ffn', 'mod')
        for dt, ps in (('float32', paths), ('bfloat16', ['compact'])) for p in ps}
    assert all(c['masks_equal'] and c['max_diff'] <= c['tolerance'] for c in res['check'])
    for x in rows:
        assert all(k in x for k in SUITE_KEYS), x
        assert ('batch' in x) == (x['kind'] == 'decode') == ('tokens_per_s' in x)
        assert ('shape' in x) == (x['kind'] != 'decode')
        assert x['ms'] > 0 and x['speedup'] == x['dense_ms'] / x['ms']
        assert x['realised'] == x['speedup'] / x['ideal']
    assert {x['kind'] for x in rows} == {'prefill', 'decode', 'train'}
    prefill = [x for x in rows if x['kind'] == 'prefill']
    assert {(x['route'], x['budget'], x['shape'], x['dtype'], x['path']) for x in prefill} == {
        (route, b, s, dt, p) for route in ('ffn', 'mod') for b in (1.0, 0.5, 0.25, 0.125)
        for s in ('2x64', '4x32') for dt, ps in (('float32', paths), ('bfloat16', ['compact']))
        for p in ps}
    for x in prefill:
        if x['budget'] < 1 and x['path'] != 'reference':
            assert 1 < x['ideal'] <= 1 / x['budget'], x
        else:                       # the reference computes every row: nothing to save
            assert 0.8 < x['ideal'] <= 1 + 1e-12, x
    reference = {(x['route'], x['budget'], x['shape']): x['ideal'] for x in prefill
                 if x['path'] == 'reference'}
    assert reference[('ffn', 0.5, '2x64')] == reference[('ffn', 1.0, '2x64')]
    decode = [x for x in rows if x['kind'] == 'decode']
    assert {(x['route'], x['batch']) for x in decode} == {
        (route, b) for route in ('none', 'ffn', 'mod') for b in (1, 8, 64)}
    assert {x['path'] for x in decode if x['route'] != 'none'} == set(paths)
    for x in decode:
        assert math.isclose(x['tokens_per_s'], x['batch'] / x['ms'] * 1e3)
        assert x['budget'] == (1.0 if x['route'] == 'none' else 0.5)
    trains = {(x['route'], x['budget'], x['baseline']) for x in rows if x['kind'] == 'train'}
    assert trains == {('none', 1.0, 'nanogpt'), ('ffn', 0.5, 'dense'), ('mod', 0.125, 'dense')}
    table = [l for l in (out / 'suite.md').read_text().splitlines() if l.startswith('|')]
    assert len(table) == 2 + len(rows) and table[0].startswith('| kind | route | budget')


def test_gpu_suite_compiles_only_the_prefill_paths_torch_compile_traces(tmp_path, monkeypatch):
    """--compile=True on the CPU (fp32 main dtype): the reference path's prefill rows compiled,
    compact and grouped_mm (whose meta kernel refuses fp32) eager, in both dtypes; timing is
    stubbed, so this checks which rows would compile, not their speed."""
    import bench_suite
    import routed_rows
    runs = []

    def fake_seconds(m, x, seed, dtype, path, plan, compiled):
        runs.append((path, dtype, compiled))
        return 1e-3
    monkeypatch.setattr(bench_suite, 'forward_seconds', fake_seconds)
    monkeypatch.setattr(bench_suite.Record, 'write', lambda self: None)
    plan = dict(bench_suite.PLANS['smoke'], prefill_shapes=((2, 16),))
    rec = bench_suite.Record({}, str(tmp_path), 0)
    bench_suite.prefill_section(rec, tiny_suite_base(), torch.device('cpu'), plan, 0, True)
    assert rec.res['failed'] == [] and rec.res['rows']
    rows = {(x['route'], x['path'], x['dtype'], x['compiled']) for x in rec.res['rows']}
    paths = routed_rows.available_paths(torch.device('cpu'), torch.float32)
    assert ('grouped_mm' in paths) == grouped_mm_on_cpu()   # (2.9+: the case that stays eager)
    assert rows == {(route, p, 'float32', p == 'reference') for route in ('ffn', 'mod')
                    for p in paths} | {(route, 'compact', 'bfloat16', False)
                                       for route in ('ffn', 'mod')}
    # each row's dense baseline timed alike (dtype, compiled or not)
    assert {(d, c) for p, d, c in runs if p} == {(d, c) for p, d, c in runs if p is None}


def tiny_suite_base():
    from bench_suite import PLANS
    cfg = SimpleNamespace(**{**train.DEFAULTS, **PLANS['smoke']['model']})
    return replace(train.model_config(cfg), route='none')


@pytest.mark.skipif(not grouped_mm_on_cpu(), reason=NO_CPU_GROUPED_MM)
@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
@pytest.mark.parametrize('route', ['ffn', 'mod'])
def test_gpu_suite_check_catches_a_wrong_path(route, dtype, monkeypatch):
    """A grouped-GEMM path that leaves one selected row unwritten fails the correctness check,
    naming path, family and difference, also within bf16's wider tolerance; the same check passes
    on the unbroken kernels."""
    import bench_suite
    import routed_rows
    cpu, base, passes = torch.device('cpu'), tiny_suite_base(), [(dtype, ['grouped_mm'])]
    check = lambda: bench_suite.check_paths(base, cpu, passes, (2, 32), 0, routes=[route])
    assert check()[0]['masks_equal']
    right = routed_rows.mlp_rows_grouped

    def one_row_short(x, order, lo, hi, *rest):
        return right(x, order, lo, torch.clamp(hi - 1, min=lo), *rest)
    monkeypatch.setattr(routed_rows, 'mlp_rows_grouped', one_row_short)
    with pytest.raises(bench_suite.PathMismatch,
                       match=rf"path 'grouped_mm', route={route}, {dtype}: logits differ .* by "
                             r"up to"):
        check()


@pytest.mark.parametrize('route', ['ffn', 'mod'])
def test_gpu_suite_decode_ideal_counts_every_row_on_the_reference(route):
    """Decode rows' ideal is the dense FLOPs over the routed FLOPs as executed, as for prefill: the
    reference path computes every row (the all-full fractions), whatever the decisions were;
    another path saves the realised fractions' rows."""
    import bench_suite
    from bench import eval_model
    base = tiny_suite_base()
    torch.manual_seed(0)
    m = eval_model(bench_suite.check_config(base, route), torch.device('cpu'))
    prompt = torch.randint(0, base.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    stats = {}
    m.exec_mode = 'reference'
    torch.manual_seed(0)
    with torch.no_grad():
        ideal = bench_suite.decode_ideal(m, base, prompt, 3, 'float32', False, 'reference')
        m.generate(prompt, 3, temperature=0, stats=stats)
    layers = len(stats['full_frac'])
    assert 0 < min(stats['full_frac']) and max(stats['full_frac']) < 1
    assert ideal == 1 / bench.prefill_flops_ratio(m.config, base, 1, [1.0] * layers)
    assert ideal <= 1 + 1e-12
    m.exec_mode = 'compact'
    torch.manual_seed(0)
    with torch.no_grad():
        saved = bench_suite.decode_ideal(m, base, prompt, 3, 'float32', False, 'compact')
    assert saved > 1


def test_gpu_suite_mismatch_exits_1_with_one_line(tmp_path, monkeypatch, capsys):
    """A mismatch stops the suite before any row: one 'error:' line, exit code 1, the error kept in
    suite.json."""
    import bench_suite

    def mismatch(*args):
        raise bench_suite.PathMismatch("path 'triton', route=ffn, bfloat16: logits differ")
    monkeypatch.setattr(bench_suite, 'check_paths', mismatch)
    argv = ['--suite=gpu', '--smoke=True', f'--out_dir={tmp_path}']
    assert bench.main(argv) == 1
    err = [l for l in capsys.readouterr().err.splitlines() if l.startswith('error:')]
    assert err == ["error: path 'triton', route=ffn, bfloat16: logits differ"]
    res = json.loads((tmp_path / 'suite.json').read_text())
    assert res['rows'] == [] and 'triton' in res['check_error']


@pytest.mark.parametrize('argv, message', [
    (['--suite=cpu'], "--suite must be one of gpu"),
    (['--suite='], "--suite is empty"),
    (['--suite=gpu', '--smoke=True', '--budgets=0.5'], "--budgets is not read by --suite=gpu"),
    (['--suite=gpu', '--n_layer=2'], "--n_layer is not read by --suite=gpu"),
    (['--suite=gpu', 'config/bench_cpu.py'], "takes no config file"),
    (['--smoke=True'], "--smoke is an option of --suite=gpu"),
    (['--suite=gpu', '--suite_seconds=-1'], "suite_seconds must be >= 0"),
])
def test_gpu_suite_bad_input_is_a_config_error(argv, message, tmp_path):
    """Refused before any work with a ConfigError (one line, exit 2 through run_cli)."""
    with pytest.raises(ConfigError, match=re.escape(message)):
        bench.parse_args(argv + [f'--out_dir={tmp_path}'])


def test_gpu_suite_keeps_an_earlier_result(tmp_path):
    """An out_dir that already holds suite.json is refused unless --overwrite=True."""
    (tmp_path / 'suite.json').write_text('{}')
    with pytest.raises(ConfigError, match='already holds suite.json'):
        bench.parse_args(['--suite=gpu', f'--out_dir={tmp_path}'])
    assert bench.parse_args(['--suite=gpu', f'--out_dir={tmp_path}', '--overwrite=True'])


def test_gpu_suite_default_folder_and_gpu_names(monkeypatch):
    import bench_suite
    cfg, _, argv = bench.parse_args(['--suite=gpu', '--smoke=True', '--device=cpu'])
    folder = bench_suite.out_folder(cfg, argv)
    assert re.fullmatch(r'cpu_\d{4}-\d\d-\d\d_smoke', os.path.basename(folder))
    assert os.path.dirname(folder) == os.path.join(REPO, 'results')
    for name, short in [('NVIDIA H100 80GB HBM3', 'h100'), ('Tesla V100-SXM2-16GB', 'v100'),
                        ('NVIDIA A100-SXM4-40GB', 'a100'), ('NVIDIA GeForce RTX 4090', 'rtx4090'),
                        ('Tesla T4', 't4'), ('NVIDIA H200', 'h200')]:
        monkeypatch.setattr(torch.cuda, 'get_device_name', lambda dev, n=name: n)
        assert bench_suite.gpu_name(torch.device('cuda')) == short


# --------------------------------------------------------------------------------------------------
# --speculate: self-speculative decode timed beside plain decode

SPEC_TINY = ['--n_layer=3', '--n_head=2', '--n_embd=32', '--block_size=64', '--vocab_size=50',
             '--bench_steps=2', '--bench_warmup=0', '--decode_tokens=8', '--decode_batches=1,2',
             '--decode_prompt=8', '--device=cpu', '--dtype=float32']
SPEC_KEYS = {'route', 'batch', 'K', 'speedup', 'draft', 'draft_layers', 'draft_stop',
             'plain_tokens_per_s',
             'spec_tokens_per_s', 'plain_ms', 'spec_ms', 'accept_rate', 'tokens_per_pass',
             'mean_accepted', 'passes', 'calls', 'plain_ms_per_step', 'one_graph',
             'passes_per_graph',
             'pass_ms',
             'draft_ms_per_pass', 'verify_ms_per_pass', 'draft_share', 'alpha',
             'predicted_speedup', 'spreads', 'repeats', 'noisy', 'repeats_ms', 'plain_warmup_s',
             'warmup_s'}


def check_spec_rows(res, route, ks, batches, chains=(1,)):
    """One row per (batch, K, passes per graph), every key, speedup = plain_ms / spec_ms = the
    tokens/s ratio, the acceptance per draft position in [0, 1] and the mean accepted length their
    sum, fewer host round trips (calls) than passes only where passes are chained."""
    assert [(r['batch'], r['K'], r['passes_per_graph']) for r in res['rows']] == [
        (b, k, p) for b in batches for k in ks for p in chains]
    for r in res['rows']:
        assert set(r) == SPEC_KEYS and r['route'] == route
        assert r['speedup'] == pytest.approx(r['plain_ms'] / r['spec_ms'], rel=1e-9)
        assert r['speedup'] == pytest.approx(r['spec_tokens_per_s'] / r['plain_tokens_per_s'],
                                             rel=1e-9)
        assert r['plain_tokens_per_s'] == pytest.approx(r['batch'] * 8 / r['plain_ms'] * 1e3)
        assert len(r['accept_rate']) == r['K']
        assert all(0 <= a <= 1 for a in r['accept_rate'] if a is not None)
        # eagerly the 8 tokens after the first need at most 7 drafted ones a pass
        assert (None in r['accept_rate']) == (not res['compiled'] and r['K'] > 7)
        # compiled, every pass drafts all K (the window stays below block_size): tokens per pass
        # and row = 1 + the kept share of each position; eagerly the last passes draft only what
        # their rows still need, so positions they leave out count in no share
        if res['compiled']:
            assert r['tokens_per_pass'] == pytest.approx(1 + sum(r['accept_rate']))
        else:
            assert r['tokens_per_pass'] <= 1 + sum(a or 0 for a in r['accept_rate']) + 1e-9
        assert 1 <= r['tokens_per_pass'] <= r['K'] + 1 and 0 <= r['alpha'] <= 1
        # 8 tokens after the first: at least ceil(8 / (K + 1)) verifier passes, at most 8
        assert -(-8 // (r['K'] + 1)) <= r['passes'] <= 8
        per_pass = 1 if r['one_graph'] else 2 if not r['draft_stop'] else None
        if r['passes_per_graph'] > 1:
            assert 1 <= r['calls'] < r['passes']
        elif per_pass:
            assert r['calls'] == per_pass * r['passes']
        # (the prediction scales the plain step, a difference of timings that noise can make <= 0)
        if r['one_graph']:          # a pass timed whole: no split, so no prediction
            assert r['draft_share'] is None and r['predicted_speedup'] is None
            assert r['draft_ms_per_pass'] is None and r['verify_ms_per_pass'] is None
        else:
            assert 0 < r['draft_share'] < 1 and math.isfinite(r['predicted_speedup'])
            assert r['pass_ms'] == pytest.approx(r['draft_ms_per_pass'] + r['verify_ms_per_pass'])
        assert r['pass_ms'] > 0
        # bench_steps=2 paired repeats per side: too few for a ratio that means anything
        assert r['repeats'] == 2 and r['noisy'] and len(r['spreads']) == 2


def test_bench_speculate_json(tmp_path):
    """--speculate=1,3,8 on a random exit model: the rows check_spec_rows asks for (K = 8 drafts
    past the 7 tokens a pass can need here, so its last position is never drafted), printed as
    one JSON object and written with the command by --out."""
    out = tmp_path / 'spec.json'
    args = [*SPEC_TINY, '--route=exit', '--speculate=1,3,8', f'--out={out}', '--json']
    res = bench_json(args, 180)
    assert res['kind'] == 'speculative' and res['decode_tokens'] == 8
    check_spec_rows(res, 'exit', [1, 3, 8], [1, 2])
    assert all(r['draft'] == 'exit' for r in res['rows'])
    saved = json.load(open(out))
    assert saved['rows'] == res['rows'] and '--speculate=1,3,8' in saved['command']


def test_bench_speculate_keeps_and_shows_each_batch_as_it_is_done(tmp_path, capsys, monkeypatch):
    """Each decode batch's rows are printed and written to --out (complete: false) once timed, so
    a run stopped in a later batch keeps them; a finished run's file says complete: true. Each row
    carries the seconds of its sides' warm-up rounds: here every timed call takes 1 s (a stand-in
    clock), and a round is a decode of 1 + N tokens and one of 1, so --bench_warmup=2 rounds are
    4 s a side."""
    import bench_speculative
    out, timings = tmp_path / 'spec.json', bench_speculative.decode_timings

    def one_second_each(fn, *args, **kw):
        fn()
        return 1.0
    monkeypatch.setattr(bench, 'timed', one_second_each)
    args = [*SPEC_TINY, '--route=exit', '--speculate=1,2', '--bench_warmup=2', f'--out={out}']
    assert bench.main(args) == 0
    done = json.loads(out.read_text())
    assert done['complete'] is True and len(done['rows']) == 4
    assert all(r['warmup_s'] == r['plain_warmup_s'] == 4.0 for r in done['rows'])
    printed = capsys.readouterr().out
    assert printed.count('| batch | K |') == 1 and printed.count('| 4.0 / 4.0 |') == 4

    def stopped_in_the_second_batch(runs, *args, **kw):
        if len(runs[0].args[0]) == 2:       # plain decoding's prompt: batch 2
            raise KeyboardInterrupt
        return timings(runs, *args, **kw)
    monkeypatch.setattr(bench_speculative, 'decode_timings', stopped_in_the_second_batch)
    with pytest.raises(KeyboardInterrupt):
        bench.main(args)
    # the finished run's file stays as it was; the stopped run's rows are beside it
    assert json.loads(out.read_text()) == done
    kept = json.loads((tmp_path / 'spec.partial.json').read_text())
    assert kept['complete'] is False
    assert [(r['batch'], r['K']) for r in kept['rows']] == [(1, 1), (1, 2)]
    assert all(set(r) == SPEC_KEYS for r in kept['rows'])
    assert '--speculate=1,2' in kept['command']
    assert sorted(p.name for p in tmp_path.iterdir()) == ['spec.json', 'spec.partial.json']
    printed = capsys.readouterr().out.splitlines()
    assert [line.split(' | ')[:2] for line in printed if line.startswith('| 1 |')] == [
        ['| 1', '1'], ['| 1', '2']]
    monkeypatch.setattr(bench_speculative, 'decode_timings', timings)
    assert bench.main(args) == 0        # a finished run replaces both
    assert json.loads(out.read_text())['complete'] is True
    assert not (tmp_path / 'spec.partial.json').exists()


COMPILE_AND_KEEP = """
import sys, torch, bench
from torch._dynamo.utils import counters
path, names = sys.argv[1], sys.argv[2].split(',')
bench.load_compile_cache(path)
functions = {'affine': lambda x: x * 2 + 1, 'tanh': lambda x: torch.tanh(x) - x}
for name in names:
    torch.compile(functions[name])(torch.randn(8))
bench.save_compile_cache(path)
print(counters['inductor']['fxgraph_cache_hit'], counters['inductor']['fxgraph_cache_miss'])
"""


def test_compile_cache_keeps_every_run_s_compiled_code(tmp_path):
    """--compile_cache's file, carried to a machine whose caches are empty (a fresh cache folder
    each process here), spares it compiling what any earlier run compiled: torch saves only what a
    process used, so a run that compiles one function must not drop another's code saved before,
    and a run that used both leaves one blob holding them. Its folder is made where missing."""
    cache = tmp_path / 'new' / 'compiled.bin'
    made = []

    def run(names, folder):
        # each folder starts with the earlier ones' C++ kernel builds, not their compiled graphs
        # (fxgraph, aotautograd: what the file carries): on a CPU the file holds no built kernels,
        # and building them again cost each process here 10-15 s while testing nothing of the file
        for earlier in made:
            shutil.copytree(earlier, tmp_path / folder, dirs_exist_ok=True,
                            ignore=shutil.ignore_patterns('fxgraph', 'aotautograd'))
        made.append(tmp_path / folder)
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / folder),
                   TORCHINDUCTOR_COMPILE_THREADS='1', PYTHONPATH=str(REPO))
        r = finish(start([sys.executable, '-c', COMPILE_AND_KEEP, cache, names], env=env,
                         cwd=REPO), timeout=240)
        assert r.returncode == 0, r.stderr[-2000:]
        return tuple(int(n) for n in r.stdout.split()[-2:])
    assert run('affine', 'a') == (0, 1)
    assert run('tanh', 'b') == (0, 1)
    assert len(bench.compile_cache_entries(cache)) == 2
    assert run('affine,tanh', 'c') == (2, 0)
    assert len(bench.compile_cache_entries(cache)) == 1
    assert run('tanh,affine', 'd') == (2, 0)


def cache_file(path, version, blob):
    """A --compile_cache file of one blob saved by torch `version`."""
    import zipfile
    with zipfile.ZipFile(path, 'w') as z:
        z.writestr('index.json', json.dumps([[version, ['some-key']]]))
        z.writestr('0.bin', blob)


def test_compile_cache_refuses_a_file_that_is_not_one(tmp_path):
    """A --compile_cache file this torch cannot read (no zip, or a blob of this torch's that it
    cannot load) is refused before any work and left as it was; a blob saved by another torch is
    not read, and a save keeps it. --compile_cache without --compile=True, or not a .bin, is
    refused by the option check."""
    bad = tmp_path / 'compiled.bin'
    bad.write_bytes(b'not a cache')
    cache_file(tmp_path / 'unreadable.bin', torch.__version__, b'not torch artifacts')
    for path in (bad, tmp_path / 'unreadable.bin'):
        before = path.read_bytes()
        with pytest.raises(ConfigError, match='is not a compile cache that this torch reads'):
            bench.main([*SPEC_TINY, '--speculate=2', '--compile=True', f'--compile_cache={path}'])
        assert path.read_bytes() == before
    foreign = tmp_path / 'foreign.bin'
    cache_file(foreign, '0.0.0', b'another torch artifacts')
    bench.load_compile_cache(str(foreign))
    torch.compile(lambda x: x * 3 - 1)(torch.randn(4))
    bench.save_compile_cache(str(foreign))
    saved = bench.compile_cache_entries(foreign)
    assert saved[0] == ('0.0.0', {'some-key'}, b'another torch artifacts')
    assert len(saved) == 2 and saved[1][0] == torch.__version__ and saved[1][1]
    with pytest.raises(ConfigError, match='--compile_cache keeps what --compile=True compiles'):
        bench.parse_args([*SPEC_TINY, f'--compile_cache={bad}'])
    with pytest.raises(ConfigError, match='must end in .bin'):
        bench.parse_args([*SPEC_TINY, '--compile=True', f'--compile_cache={tmp_path}/c.zip'])


def bench_run_with_cache(tmp_path, monkeypatch, speculative, raises=SystemExit):
    """bench.main --speculate with --compile_cache, bench_speculative replaced by `speculative`
    and the cache's save recorded, SIGTERM's handler restored after: (the exception info of
    what ended it, the paths saved to, the cache's path)."""
    import signal
    import bench_speculative
    saved = []
    monkeypatch.setattr(bench, 'save_compile_cache', saved.append)
    monkeypatch.setattr(bench_speculative, 'bench_speculative', speculative)
    handler = signal.getsignal(signal.SIGTERM)
    cache = str(tmp_path / 'compiled.bin')
    try:
        with pytest.raises(raises) as ended:
            bench.main([*SPEC_TINY, '--speculate=2', '--compile=True', f'--compile_cache={cache}'])
    finally:
        signal.signal(signal.SIGTERM, handler)
    return ended, saved, cache


def test_a_stopped_run_still_saves_its_compiled_code(tmp_path, monkeypatch):
    """With --compile_cache, SIGTERM (a timeout's) ends bench.py as SystemExit(143), and whatever
    ends the run, the compile cache is saved on the way out: cold compiles are what a run cut
    short would otherwise lose."""
    import signal

    def terminated(cfg, *args, **kw):
        os.kill(os.getpid(), signal.SIGTERM)
        raise AssertionError('SIGTERM did not stop the run')
    stopped, saved, cache = bench_run_with_cache(tmp_path, monkeypatch, terminated)
    assert stopped.value.code == 143 and saved == [cache]


def test_a_stop_inside_a_compile_is_reported_as_a_stop(tmp_path, monkeypatch, capsys):
    """SIGTERM raised inside torch.compile can come out as a compiler error (inductor wraps what
    its passes raise; seen on a GPU as BackendCompilerFailed after a timeout): bench.py still
    ends as the stop it was, SystemExit(143) with one line saying so, the cache saved."""
    import signal

    def compiling(cfg, *args, **kw):
        try:
            os.kill(os.getpid(), signal.SIGTERM)
        except BaseException as e:
            raise RuntimeError('trying to set the current FakeTensorMode, but one already '
                               'exists') from e
    stopped, saved, cache = bench_run_with_cache(tmp_path, monkeypatch, compiling)
    assert stopped.value.code == 143 and saved == [cache]
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f'bench.py: stopped by SIGTERM (a time limit\'s?), which surfaced as '
                   f'RuntimeError; compiled code kept in {cache}']

    def failing(cfg, *args, **kw):      # a compiler error with no stop is the error it is
        raise RuntimeError('a real compiler error')
    failed, saved, cache = bench_run_with_cache(tmp_path, monkeypatch, failing, RuntimeError)
    assert 'a real compiler error' in str(failed.value) and saved == [cache]

    def stopped_while_saving(path):     # ... also when a SIGTERM comes while the cache is saved,
        os.kill(os.getpid(), signal.SIGTERM)        # which finishes
        saved.append(path)
    monkeypatch.setattr(bench, 'save_compile_cache', stopped_while_saving)
    import bench_speculative
    monkeypatch.setattr(bench_speculative, 'bench_speculative', failing)
    handler = signal.getsignal(signal.SIGTERM)
    saved.clear()
    try:
        with pytest.raises(RuntimeError, match='a real compiler error'):
            bench.main([*SPEC_TINY, '--speculate=2', '--compile=True', f'--compile_cache={cache}'])
    finally:
        signal.signal(signal.SIGTERM, handler)
    assert saved == [cache] and 'stopped by SIGTERM' not in capsys.readouterr().err


def test_a_run_stopped_while_saving_its_compiled_code_keeps_its_figures(tmp_path, monkeypatch):
    """Saving a large compile cache takes seconds: a run stopped then (a timeout's SIGTERM after
    the last row) has already written its final --out file, complete, with no partial beside it."""
    import bench_speculative
    out, cache = tmp_path / 'spec.json', str(tmp_path / 'compiled.bin')

    def stopped_while_saving(path):
        raise SystemExit(143)
    monkeypatch.setattr(bench, 'save_compile_cache', stopped_while_saving)
    monkeypatch.setattr(bench_speculative, 'bench_speculative',
                        lambda cfg, *args, **kw: {'rows': [{'K': 2, 'speedup': 1.5}]})
    with pytest.raises(SystemExit):
        bench.main([*SPEC_TINY, '--speculate=2', '--compile=True', f'--compile_cache={cache}',
                    f'--out={out}'])
    assert json.loads(out.read_text())['rows'] == [{'K': 2, 'speedup': 1.5}]
    assert sorted(p.name for p in tmp_path.iterdir()) == ['spec.json']


def test_the_last_batchs_rows_come_complete_before_its_compiled_code_is_saved(monkeypatch):
    """bench.py saves the compile cache after each batch's rows (seconds for a large model): the
    last batch's are handed over complete, so --out is then the final file, and a stop during
    that save leaves the whole result, not a partial one the GPU scripts would time again."""
    import bench_speculative
    monkeypatch.setattr(bench, 'timed', lambda fn, *a, **k: [fn(), 1.0][1])
    cfg = bench.parse_args([*SPEC_TINY, '--route=exit', '--speculate=1', '--bench_warmup=0',
                            '--bench_steps=1', '--decode_tokens=2'])[0]
    handed = []
    res = bench_speculative.bench_speculative(
        cfg, lambda res, rows: handed.append((res['complete'], len(res['rows']), len(rows))))
    assert handed == [(False, 1, 1), (True, 2, 1)] and res['complete'] is True


RECORD_ARGS = """#!/bin/sh
# stands in for python3: asked whether torch sees a GPU (-c), says yes where $FAKE_GPU is set;
# otherwise records its arguments, one per line, each call ending in a blank line;
# the first call for $STOP_ONCE's output exits as if stopped at its time limit;
# $SAVED_THEN_STOPPED's writes its output, then exits so (stopped while saving its compile cache),
# the output's time set to the stage's start mark's: written within one tick of the file system's
# clock, as a fast stage's can be
case "$1" in -c) [ -n "$FAKE_GPU" ]; exit;; esac
for a in "$@"; do printf '%s\\n' "$a"; done >> "$CALLS"
printf '\\n' >> "$CALLS"
case "$*" in *"speculative_$STOP_ONCE.json"*)
  [ -e "$CALLS.stopped" ] || { touch "$CALLS.stopped"; exit 124; };;
esac
case "$*" in *"speculative_$SAVED_THEN_STOPPED.json"*)
  for a in "$@"; do case "$a" in --out=*)
    out=${a#--out=}
    echo '{"command": "python bench.py"}' > "$out"
    touch -r "$(dirname "$out")/.started_$SAVED_THEN_STOPPED" "$out";;
  esac; done; exit 124;;
esac
"""
SCRIPT_MODELS = {'spec_exit_w4d2': dict(route='exit'), 'spec_mod': dict(route='mod'),
                 'spec_halt': dict(route='halt'),
                 'ffn_distilled_drafter_shakespeare': dict(route='ffn', ffn_draft_rank=8),
                 'spec_ensemble': dict(route='ensemble'), 'spec_dense': dict(route='none')}


def family_args(route, exit_layers=None):
    """The tiny models' family options: only those `route` reads (bench.py, as train.py, refuses
    another family's option given on the command line)."""
    return {'ffn': ['--ffn_cheap_rank=4'],
            'exit': [f'--exit_layers={exit_layers}'] if exit_layers else []}.get(route, [])


def script_checkpoints(root):
    """out/gpu/<name> and data/shakespeare_char under root, as results/gpu_checkpoints.sh and
    data/prepare.py leave them: small models of each family with the block_size of the real ones."""
    from dataclasses import asdict
    from model import GPT, GPTConfig
    for name, fields in SCRIPT_MODELS.items():
        run = root / 'out' / 'gpu' / name
        run.mkdir(parents=True)
        mcfg = GPTConfig(n_layer=4, n_head=2, n_embd=32, block_size=128, vocab_size=65, **fields)
        torch.save(dict(model=GPT(mcfg).state_dict(), model_args=asdict(mcfg), config={}),
                   run / 'ckpt.pt')
    shakespeare_data(root)


def shakespeare_data(root, name='shakespeare_char', vocab_size=65):
    """data/<name> under root, as data/prepare.py leaves it (contents made up)."""
    data = root / 'data' / name
    data.mkdir(parents=True)
    for split in ('train.bin', 'val.bin'):
        (data / split).write_bytes(bytes(1000))
    (data / 'meta.json').write_text(json.dumps({'vocab_size': vocab_size}))


def fake_python3(tmp_path, script):
    """tmp_path/bin/python3, the shell script given, standing in for python3 on PATH."""
    fake = tmp_path / 'bin' / 'python3'
    fake.parent.mkdir()
    fake.write_text(script)
    fake.chmod(0o755)
    return fake


def gpu_script(tmp_path, *args, **env):
    """results/gpu_speculative.sh run in tmp_path with python3 standing in (RECORD_ARGS): the
    finished process and the bench.py calls it made, each call's argument list."""
    fake = fake_python3(tmp_path, RECORD_ARGS)
    calls = tmp_path / 'calls.txt'
    env = {**os.environ, 'PATH': f"{fake.parent}:{os.environ['PATH']}", 'CALLS': str(calls),
           'STOP_ONCE': '', 'SAVED_THEN_STOPPED': '', 'FAKE_GPU': '', **env}
    r = finish(start(['bash', os.path.join(REPO, 'results', 'gpu_speculative.sh'), *args],
                     env=env, cwd=tmp_path), timeout=60)
    text = calls.read_text() if calls.exists() else ''
    return r, [c.split('\n') for c in text.split('\n\n') if c.startswith(('bench.py', 'train.py'))]


def test_the_gpu_speculative_script_runs_only_options_bench_accepts(tmp_path):
    """results/gpu_speculative.sh as written: every stage runs, in the order given, a stage stopped
    at its limit (mod's) runs again after the last, one stopped after writing its JSON (halt's,
    stopped while saving its compile cache) does not, and each stage's bench.py command passes
    bench.py's option check with the checkpoint it names, so a GPU run does not fail on an option
    once its machine has started."""
    script_checkpoints(tmp_path)
    r, commands = gpu_script(tmp_path, tmp_path / 'results', '600',
                             COMPILE_CACHE=str(tmp_path / 'cache.bin'), STOP_ONCE='mod_b1_K4',
                             SAVED_THEN_STOPPED='halt_b1_K4')
    assert r.returncode == 0, r.stderr
    stages = [next(a for a in argv if a.startswith('--out=')) for argv in commands]
    assert [os.path.basename(o) for o in stages] == [
        f'speculative_{name}.json' for name in ('mod_b1_K4', 'exit_b1_K2', 'ensemble_b1_K4',
                                                'dense_b1_K4', 'ffn_b1_K4', 'halt_b1_K4',
                                                'exit_b8_K2', 'exit_b1_K4_one_graph',
                                                'mod_b1_K4')]
    assert commands[0] == commands[-1]
    assert 'mod_b1_K4: rc=124' in r.stdout and 'mod_b1_K4: rc=0' in r.stdout
    assert 'halt_b1_K4: rc=124' in r.stdout and r.stdout.count('halt_b1_K4, limit') == 1
    assert not [f for f in os.listdir(tmp_path / 'results') if f.startswith('.started')]
    for argv in commands:
        argv = [f'--init_from={tmp_path / a.partition("=")[2]}' if a.startswith('--init_from=')
                else a for a in argv[1:]]
        cfg, _, _ = bench.parse_args([*argv, '--device=cpu'])
        assert cfg['compile'] and cfg['compile_cache'] == str(tmp_path / 'cache.bin')


@pytest.mark.parametrize('remove, gpu', [('out/gpu/spec_halt/ckpt.pt', ''),
                                         ('data/shakespeare_char/val.bin', ''),
                                         ('data/shakespeare_char/val.bin', '1')])
def test_the_gpu_speculative_script_stops_before_any_work_without_its_inputs(tmp_path, remove,
                                                                             gpu):
    """The prompts' data missing, or a checkpoint where no GPU can train it: exit 2 before the
    first stage (a GPU's time is not spent on a run that would fail or decode random prompts),
    naming the file and the command that makes it."""
    script_checkpoints(tmp_path)
    (tmp_path / remove).unlink()
    r, commands = gpu_script(tmp_path, tmp_path / 'results', '600', FAKE_GPU=gpu)
    assert r.returncode == 2 and commands == []
    how = 'results/gpu_checkpoints.sh' if 'ckpt' in remove else 'data/prepare.py shakespeare_char'
    assert f'no {remove};' in r.stderr and how in r.stderr
    assert not (tmp_path / 'results').exists()


def test_the_gpu_speculative_script_trains_missing_checkpoints_on_a_gpu(tmp_path):
    """Where torch sees a GPU, a missing checkpoint is trained there first, by
    results/gpu_checkpoints.sh with its own command (here python3 stands in, so it makes none):
    then the stage that needs it is skipped, naming it, and every other stage runs."""
    script_checkpoints(tmp_path)
    (tmp_path / 'config').symlink_to(os.path.join(REPO, 'config'))
    shutil.rmtree(tmp_path / 'out' / 'gpu' / 'spec_halt')
    r, commands = gpu_script(tmp_path, tmp_path / 'results', '600', FAKE_GPU='1')
    assert r.returncode == 0, r.stderr
    trained = [argv for argv in commands if argv[0] == 'train.py']
    assert trained == [['train.py', 'config/exit_drafter_shakespeare.py', '--route=halt',
                        '--halt_lambda=0.05', '--layer_dropout=0.0', '--out_dir=out/spec_halt',
                        '--overwrite=True']]
    assert '6 at a time' in (tmp_path / 'results' / 'train_log.txt').read_text()
    assert 'halt_b1_K4: skipped, no out/gpu/spec_halt/ckpt.pt' in r.stdout
    stages = [os.path.basename(next(a for a in argv if a.startswith('--out=')))
              for argv in commands if argv[0] == 'bench.py']
    assert len(stages) == 7 and 'speculative_halt_b1_K4.json' not in stages


FAKE_TRAIN = """
import json, os, shutil, sys
with open(os.environ['CALLS'], 'a') as f:
    f.write(json.dumps(sys.argv[1:]) + '\\n')
if sys.argv[1] == '-c':                # the script's question: does torch see a GPU?
    sys.exit(0 if os.environ.get('FAKE_GPU') else 1)
if sys.argv[1] == 'train.py':          # a checkpoint in out_dir (the options: checked by the test)
    if os.environ.get('FAKE_GPU'):     # wait (20 s at most) until six trainings are in flight
        import time
        open(os.path.join(os.environ['FAKE_GPU'], str(os.getpid())), 'w').close()
        deadline = time.time() + 20
        while len(os.listdir(os.environ['FAKE_GPU'])) < 6 and time.time() < deadline:
            time.sleep(0.05)
        with open(os.environ['CALLS'] + '.together', 'a') as f:
            f.write(f"{len(os.listdir(os.environ['FAKE_GPU']))}\\n")
    out = next((a.split('=', 1)[1] for a in reversed(sys.argv) if a.startswith('--out_dir=')), None)
    if out is None:                    # the config file's
        config = {}
        exec(open(sys.argv[2]).read(), config)
        out = config['out_dir']
    os.makedirs(out, exist_ok=True)
    if os.environ.get('HOLD'):         # in flight until a SIGTERM, then a second to save
        import signal, time
        signal.signal(signal.SIGTERM, lambda *a: None)
        open(os.path.join(os.environ['HOLD'], f'started{os.getpid()}'), 'w').close()
        signal.pause()
        time.sleep(1)
        open(os.path.join(os.environ['HOLD'], f'saved{os.getpid()}'), 'w').close()
    shutil.copy(os.environ['CKPT'], os.path.join(out, 'ckpt.pt'))
    # the run's records: finished (a summary at max_iters), or, for the one named, stopped
    stopped = os.environ.get('STOPPED') == out
    with open(os.path.join(out, 'config.json'), 'w') as f:
        json.dump({'max_iters': 1}, f)
    with open(os.path.join(out, 'metrics.jsonl'), 'w') as f:
        f.write(json.dumps({'type': 'summary', 'iter': 1, **({'stopped': True} if stopped else {})})
                + '\\n')
elif sys.argv[1] == '-':               # the script's copying code, run as written
    sys.path.insert(0, os.environ['REPO'])
    sys.argv = sys.argv[1:]
    exec(sys.stdin.read())
"""


def trained_run(argv):
    """Which run a recorded train.py command trains: its --out_dir, or 'distilled' (the distilled
    draft's config file gives its folder)."""
    if 'config/ffn_distilled' in argv[1]:
        return 'distilled'
    return next(o for o in argv if o.startswith('--out_dir='))


def test_the_gpu_checkpoints_script_trains_each_missing_model_once(tmp_path, monkeypatch):
    """results/gpu_checkpoints.sh with train.py standing in (a checkpoint with optimizer state in
    its out_dir, without importing torch: seven trainings), each command's options then put
    through train.py's real config check here: each of the six models is trained with options
    train.py accepts, into the folder the script copies from (the distilled one from the ffn run
    it needs, first), copied to out/gpu without its optimizer state; a second run trains nothing;
    a model whose copy is gone is made again by resuming its finished run, not by training it
    anew. Two train at once on the CPU."""
    fake = fake_python3(tmp_path, f'#!/bin/sh\nexec {sys.executable} {tmp_path / "fake.py"} "$@"\n')
    (tmp_path / 'fake.py').write_text(FAKE_TRAIN)
    (tmp_path / 'config').symlink_to(os.path.join(REPO, 'config'))
    shakespeare_data(tmp_path)
    template = tmp_path / 'template.pt'
    torch.save(dict(model={'w': torch.full((3,), 2.0)}, optimizer={'m': torch.ones(3)},
                    model_args={}, config={}), template)
    calls = tmp_path / 'calls.jsonl'
    env = {**os.environ, 'PATH': f"{fake.parent}:{os.environ['PATH']}", 'CALLS': str(calls),
           'REPO': REPO, 'CKPT': str(template)}
    env.pop('JOBS', None)
    monkeypatch.chdir(tmp_path)        # (the commands' relative paths, as the script ran them)

    def run_script(**more):
        calls.write_text('')
        r = finish(start(['bash', os.path.join(REPO, 'results', 'gpu_checkpoints.sh')],
                         env={**env, **more}, cwd=tmp_path), timeout=170)
        assert r.returncode == 0, (tmp_path / 'out' / 'gpu' / 'train_log.txt').read_text()
        argvs = [json.loads(line) for line in calls.read_text().splitlines()]
        for argv in argvs:             # train.py's own check, where the script ran it
            if argv[0] == 'train.py':
                cfg, _ = train.read_config(argv[1:])
                assert (tmp_path / cfg.out_dir / 'ckpt.pt').exists(), argv
        return argvs

    def trained(argvs):
        return [a for a in argvs if a[0] == 'train.py']

    names = list(SCRIPT_MODELS)
    first = trained(run_script())
    assert len(first) == 7 and all(a[-1] == '--overwrite=True' for a in first)
    outs = [trained_run(a) for a in first]
    assert outs.index('--out_dir=out/spec_ffn') < outs.index('distilled')
    assert outs.index('--out_dir=out/spec_exit_w4d2') < outs.index('--out_dir=out/spec_mod')
    assert outs.index('--out_dir=out/spec_mod') < outs.index('--out_dir=out/spec_ensemble')
    assert outs.index('--out_dir=out/spec_halt') < outs.index('--out_dir=out/spec_dense')
    assert sorted(os.listdir(tmp_path / 'out' / 'gpu')) == sorted([*names, 'train_log.txt'])
    for name in names:
        copy = torch.load(tmp_path / 'out' / 'gpu' / name / 'ckpt.pt', weights_only=False)
        assert copy['optimizer'] is None and torch.equal(copy['model']['w'], torch.full((3,), 2.))
    assert trained(run_script()) == []
    os.remove(tmp_path / 'out' / 'gpu' / 'spec_mod' / 'ckpt.pt')
    again = trained(run_script())
    assert len(again) == 1 and '--out_dir=out/spec_mod' in again[0]
    assert again[0][-1] == '--init_from=resume'
    assert not os.path.exists(f'{calls}.together')
    assert '2 at a time' in (tmp_path / 'out' / 'gpu' / 'train_log.txt').read_text()


def test_the_gpu_checkpoints_script_copies_only_finished_runs_and_waits_for_stopped_ones(
        tmp_path, monkeypatch):
    """results/gpu_checkpoints.sh with train.py standing in, where torch sees a GPU: all six
    models train at once, and a run stopped by a signal (its summary says so) is not copied to
    out/gpu, and the script fails naming it (its next run resumes it); on the CPU, a SIGTERM to the
    script's process group, as `timeout` sends, while two trainings are in flight: the script stops
    them and returns only once both have saved, exit 143."""
    fake = fake_python3(tmp_path, f'#!/bin/sh\nexec {sys.executable} {tmp_path / "fake.py"} "$@"\n')
    (tmp_path / 'fake.py').write_text(FAKE_TRAIN)
    (tmp_path / 'config').symlink_to(os.path.join(REPO, 'config'))
    shakespeare_data(tmp_path)
    template = tmp_path / 'template.pt'
    torch.save(dict(model={}, optimizer={}, model_args={}, config={}), template)
    env = {**os.environ, 'PATH': f"{fake.parent}:{os.environ['PATH']}", 'JOBS': '2',
           'CALLS': str(tmp_path / 'calls.jsonl'), 'REPO': REPO, 'CKPT': str(template)}
    log = tmp_path / 'out' / 'gpu' / 'train_log.txt'
    (tmp_path / 'barrier').mkdir()
    on_gpu = {**env, 'STOPPED': 'out/spec_mod', 'FAKE_GPU': str(tmp_path / 'barrier')}
    del on_gpu['JOBS']
    r = finish(start(['bash', os.path.join(REPO, 'results', 'gpu_checkpoints.sh')],
                     env=on_gpu, cwd=tmp_path), timeout=170)
    assert r.returncode != 0
    calls = [json.loads(line) for line in (tmp_path / 'calls.jsonl').read_text().splitlines()]
    monkeypatch.chdir(tmp_path)        # (the commands' relative paths, as the script ran them)
    for argv in (a for a in calls if a[0] == 'train.py'):
        train.read_config(argv[1:])    # train.py's own check of what the GPU mode runs
    outs = {trained_run(a) for a in calls if a[0] == 'train.py'}
    assert outs == {*(f'--out_dir=out/{n}' for n in SCRIPT_MODELS if n.startswith('spec_')),
                    '--out_dir=out/spec_ffn', 'distilled'}
    together = (tmp_path / 'calls.jsonl.together').read_text().split()    # none waited 20 s
    assert len(together) == 7 and min(map(int, together)) >= 6
    assert '6 at a time' in log.read_text()
    assert 'out/spec_mod: the run did not finish: not copied' in log.read_text()
    assert not (tmp_path / 'out' / 'gpu' / 'spec_mod').exists()
    assert (tmp_path / 'out' / 'gpu' / 'spec_halt' / 'ckpt.pt').exists()

    shutil.rmtree(tmp_path / 'out')
    hold = tmp_path / 'hold'
    hold.mkdir()
    script = start(['bash', os.path.join(REPO, 'results', 'gpu_checkpoints.sh')],
                   env={**env, 'HOLD': str(hold)}, cwd=tmp_path)
    try:
        deadline = time.time() + 60
        while len(os.listdir(hold)) < 2 and time.time() < deadline and script.poll() is None:
            time.sleep(0.1)
        assert len(os.listdir(hold)) == 2, log.read_text()
        os.killpg(script.pid, signal.SIGTERM)
        deadline = time.time() + 60
        while script.poll() is None and time.time() < deadline:
            time.sleep(0.02)
        names = sorted(os.listdir(hold))         # as the script returned
        r = finish(script, timeout=60)
    finally:
        stop(script)
    assert r.returncode == 143 and [n[:5] for n in names] == ['saved'] * 2 + ['start'] * 2, names
    assert 'stopped by a signal' in log.read_text()
    assert not (tmp_path / 'out' / 'gpu' / 'spec_exit_w4d2').exists()


FAKE_TRAIN_124M = """
import json, os, sys
sys.path.insert(0, os.environ['REPO'])
with open(os.environ['CALLS'], 'a') as f:
    f.write(json.dumps(sys.argv[1:]) + '\\n')
if sys.argv[1] == 'train.py':          # the real config check, then a small model of its routing
    from dataclasses import asdict
    import torch
    import train
    from model import GPT, GPTConfig
    cfg, _ = train.read_config(sys.argv[2:])
    mcfg = GPTConfig(n_layer=cfg.n_layer, n_head=2, n_embd=32, block_size=cfg.block_size,
                     vocab_size=50257, route=cfg.route, exit_layers=cfg.exit_layers)
    os.makedirs(cfg.out_dir, exist_ok=True)
    torch.save(dict(model=GPT(mcfg).state_dict(), model_args=asdict(mcfg),
                    config={'dataset': cfg.dataset}), f'{cfg.out_dir}/ckpt.pt')
    for name in ('metrics.jsonl', 'run_info.json'):
        open(f'{cfg.out_dir}/{name}', 'w').write('{}\\n')
"""


def test_the_gpu_124m_script_trains_then_runs_only_options_bench_accepts(tmp_path):
    """results/gpu_124m.sh with python3 standing in (train.py's real config check, then a small
    model with the config's depth and exits): the 124M config trained once, its metrics copied,
    then each stage's bench.py command passes bench.py's option check with that checkpoint (the
    drafts of 6 and 2 blocks are exits of it); a second run resumes that checkpoint (train.py
    stops at once where it is finished) instead of training anew; without the data it stops with
    exit 2 before any work, naming the command that makes it."""
    fake = fake_python3(tmp_path, f'#!/bin/sh\nexec {sys.executable} {tmp_path / "fake.py"} "$@"\n')
    (tmp_path / 'fake.py').write_text(FAKE_TRAIN_124M)
    (tmp_path / 'config').symlink_to(os.path.join(REPO, 'config'))
    calls = tmp_path / 'calls.jsonl'
    env = {**os.environ, 'PATH': f"{fake.parent}:{os.environ['PATH']}", 'CALLS': str(calls),
           'REPO': REPO, 'COMPILE_CACHE': str(tmp_path / 'cache.bin')}

    def run_script(folder, **more):
        calls.write_text('')
        r = finish(start(['bash', os.path.join(REPO, 'results', 'gpu_124m.sh'), str(folder),
                          '600'], env={**env, **more}, cwd=tmp_path), timeout=120)
        return r, [json.loads(line) for line in calls.read_text().splitlines()]

    r, argvs = run_script(tmp_path / 'none')
    assert r.returncode == 2 and argvs == [] and not (tmp_path / 'none').exists()
    assert 'no data/fineweb_edu/train.bin' in r.stderr
    assert 'python data/prepare.py fineweb_edu --input=../shared/data/' in r.stderr
    shakespeare_data(tmp_path, 'fineweb_edu', 50257)
    r, argvs = run_script(tmp_path / 'r', PACK=str(tmp_path / 'r.tgz'))
    assert r.returncode == 0, r.stdout + r.stderr
    trained = [a for a in argvs if a[0] == 'train.py']
    assert trained == [['train.py', 'config/exit_drafter_124m_fineweb.py', '--overwrite=True']]
    with tarfile.open(tmp_path / 'r.tgz') as packed:    # PACK: the folder, as one file
        assert set(packed.getnames()) == {'r', 'r/log.txt', 'r/train_log.txt', 'r/metrics.jsonl',
                                          'r/run_info.json'}
    benches = [a for a in argvs if a[0] == 'bench.py']
    assert [next(o for o in a if o.startswith('--out=')).rsplit('/', 1)[1] for a in benches] == [
        f'speculative_exit124m_{name}.json' for name in ('E6_b1_K4', 'E2_b1_K4', 'E6_b1_K2')]
    for argv in benches:
        argv = [f'--init_from={tmp_path / a.partition("=")[2]}' if a.startswith('--init_from=')
                else a for a in argv[1:]]
        cfg, _, _ = bench.parse_args([*argv, '--device=cpu'])
        assert cfg['compile'] and cfg['draft_layers'] in (2, 6)
    r, argvs = run_script(tmp_path / 'r2')          # the checkpoint there: resumed, not replaced
    assert r.returncode == 0
    assert [a for a in argvs if a[0] == 'train.py'] == [
        ['train.py', 'config/exit_drafter_124m_fineweb.py', '--init_from=resume']]
    assert len([a for a in argvs if a[0] == 'bench.py']) == 3


def test_bench_speculate_draft_stop():
    """--draft_stop=1: every pass stops drafting after its first token (no draft is that sure), so
    positions 2..K are never drafted, a pass makes at most 2 tokens, and the rows carry draft_stop
    with no prediction (the formula assumes K drafts a pass)."""
    res = bench_json([*SPEC_TINY, '--route=exit', '--speculate=1,3', '--draft_stop=1.0',
                      '--json'], 180)
    for r in res['rows']:
        assert set(r) == SPEC_KEYS and r['draft_stop'] == 1.0
        assert r['alpha'] is None and r['predicted_speedup'] is None
        assert r['accept_rate'][1:] == [None] * (r['K'] - 1) and r['tokens_per_pass'] <= 2


def trace_compiled_steps(monkeypatch):
    """GPT.compiled traced whole and run without code generation; returns the list of the names
    of the steps it compiles."""
    from model import GPT
    made = []

    def compiled(step, device):
        made.append(step.__name__)
        return torch.compile(step, backend='eager', fullgraph=True, dynamic=False)
    monkeypatch.setattr(GPT, 'compiled', staticmethod(compiled))
    return made


def test_bench_speculate_compiled(capsys, monkeypatch):
    """--compile=True compiles both sides: plain decoding's step, and the draft pass and verifier
    pass of speculative decoding (GPT.compiled; here traced whole and run without code generation),
    and the JSON says so."""
    made = trace_compiled_steps(monkeypatch)
    try:
        assert bench.main([*SPEC_TINY, '--route=exit', '--speculate=2', '--compile=True',
                           '--json']) == 0
    finally:
        torch._dynamo.reset()
    res = json.loads(capsys.readouterr().out)
    assert res['compiled'] is True
    check_spec_rows(res, 'exit', [2], [1, 2])
    assert sorted(set(made)) == ['decode_step', 'draft_pass', 'verify_pass']


def test_device_ms_sums_the_gpus_events_only(monkeypatch):
    """bench_speculative.device_ms adds the durations of the events the profiler recorded on CUDA
    (kernels, copies) and leaves out the host's ops, whose device_time_total counts their kernels
    again, and user annotations' spans; off CUDA it is None, without profiling."""
    import bench_speculative
    import speculative
    import torch.profiler
    from torch.autograd import DeviceType
    def event(device_type, ms, annotation=False):
        return SimpleNamespace(device_type=device_type, device_time_total=ms * 1e3,
                               is_user_annotation=annotation)
    events = [event(DeviceType.CUDA, 0.25)] * 3 + [event(DeviceType.CPU, 0.75),
                                                   event(DeviceType.CUDA, 0.5, annotation=True)]

    class FakeProfile:
        def __init__(self, activities):
            self.activities = activities

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def events(self):
            return events
    monkeypatch.setattr(torch.profiler, 'profile', FakeProfile)
    monkeypatch.setattr(speculative, 'sync', lambda dev: None)
    calls = []
    assert bench_speculative.device_ms(calls.append, 7, torch.device('cuda')) == 0.75
    assert calls == [7]
    assert bench_speculative.device_ms(calls.append, 7, torch.device('cpu')) is None
    assert calls == [7]


def test_bench_speculate_profile(capsys, monkeypatch):
    """--profile=True puts each side's GPU busy time in a decode alone (device_ms of 1 + N tokens
    minus that of 1, as timed) and its share of the side's timed median in every row; off CUDA
    they are None, and the table says so."""
    import bench_speculative
    assert bench.main([*SPEC_TINY, '--route=exit', '--speculate=2', '--profile=True',
                       '--json']) == 0
    res = json.loads(capsys.readouterr().out)
    for r in res['rows']:
        assert r['plain_device_ms'] is None and r['spec_device_share'] is None
    assert bench.main([*SPEC_TINY, '--route=exit', '--speculate=2', '--profile=True']) == 0
    assert [line for line in capsys.readouterr().out.splitlines() if 'GPU busy' in line] == [
        'GPU busy: measured on CUDA only']
    seen = []

    def device_ms(run, new, dev):       # busy 0.5 ms a token plain (a partial), 0.25 speculative
        run(new)
        seen.append(new)
        return (0.5 if hasattr(run, 'func') else 0.25) * new
    monkeypatch.setattr(bench_speculative, 'device_ms', device_ms)
    assert bench.main([*SPEC_TINY, '--route=exit', '--speculate=2', '--decode_batches=1',
                       '--profile=True', '--json']) == 0
    res = json.loads(capsys.readouterr().out)
    (r,) = res['rows']
    N = res['decode_tokens']
    assert sorted(seen) == [1, 1, 1 + N, 1 + N]
    for side, per_token in (('plain', 0.5), ('spec', 0.25)):
        assert r[f'{side}_device_ms'] == pytest.approx(per_token * N)
        assert r[f'{side}_device_share'] == pytest.approx(per_token * N / r[f'{side}_ms'])
    assert bench.main([*SPEC_TINY, '--route=exit', '--speculate=2', '--decode_batches=1',
                       '--profile=True', '--passes_per_graph=1,2']) == 0
    busy = [line for line in capsys.readouterr().out.splitlines() if 'GPU busy' in line]
    assert [line.partition(':')[0] for line in busy] == [
        'GPU busy, batch 1, K 2', 'GPU busy, batch 1, K 2, 2 passes a graph']
    assert all(re.search(r'plain \d+\.\d\d of \d+\.\d\d ms \(\d+%\); spec ', line) for line in busy)


@pytest.mark.parametrize('route,option,chains,steps', [
    ('mod', '--one_graph=True', (1,), ['decode_step', 'whole_pass']),
    ('exit', '--passes_per_graph=1,3', (1, 3),
     ['chained_passes', 'decode_step', 'draft_pass', 'verify_pass', 'whole_pass']),
])
def test_bench_speculate_one_graph(route, option, chains, steps, capsys, monkeypatch):
    """--one_graph=True --compile=True compiles plain decoding's step and one function a pass
    (whole_pass), whose rows time passes whole: pass_ms, no draft/verify split, no prediction.
    --passes_per_graph=1,3 times, in one process, passes apart (draft_pass, verify_pass) and three
    passes chained in one function (chained_passes, whole_pass for the last ones)."""
    made = trace_compiled_steps(monkeypatch)
    try:
        assert bench.main([*SPEC_TINY, f'--route={route}', '--speculate=1', '--compile=True',
                           option, '--json']) == 0
    finally:
        torch._dynamo.reset()
    res = json.loads(capsys.readouterr().out)
    check_spec_rows(res, route, [1], [1, 2], chains)
    for r in res['rows']:
        assert r['one_graph'] == (route == 'mod' or r['passes_per_graph'] > 1)
    assert sorted(set(made)) == steps


def test_bench_speculate_sampled(capsys, monkeypatch):
    """--temperature=1.0 samples on both sides, and each row's acceptance and tokens per pass pool
    the counts of its timed decodes (bench_steps of them; the warm-up's are left out)."""
    import bench_speculative
    import speculative
    calls, generate, pool, pooled_lists = [], speculative.generate, bench_speculative.pooled, []

    def recording(*args, stats=None, temperature=0, **kw):
        out = generate(*args, stats=stats, temperature=temperature, **kw)
        if stats is not None:
            calls.append((args[1].size(0), args[3], temperature, stats))
        return out

    def pooled(decodes):
        pooled_lists.append(list(decodes))
        return pool(decodes)
    from model import GPT
    plain, plain_generate = [], GPT.generate

    def plain_recording(self, *args, temperature=1.0, **kw):
        plain.append(temperature)
        return plain_generate(self, *args, temperature=temperature, **kw)
    monkeypatch.setattr(speculative, 'generate', recording)
    monkeypatch.setattr(bench_speculative, 'pooled', pooled)
    monkeypatch.setattr(GPT, 'generate', plain_recording)
    assert bench.main([*SPEC_TINY, '--route=exit', '--speculate=1,3', '--temperature=1.0',
                       '--json']) == 0
    res = json.loads(capsys.readouterr().out)
    assert res['temperature'] == 1.0 and res['timing'].startswith('sampled')
    check_spec_rows(res, 'exit', [1, 3], [1, 2])
    assert {t for _, _, t, _ in calls} == {1.0}
    assert plain and set(plain) == {1.0}        # the plain side samples at the same temperature
    for r in res['rows']:
        runs = [st for b, K, _, st in calls if (b, K) == (r['batch'], r['K'])]
        assert len(runs) == 3                   # one warm-up round, then bench_steps=2 timed
        timed = runs[1:]
        assert any(all(a is b for a, b in zip(got, timed)) and len(got) == 2
                   for got in pooled_lists)
        for j, rate in enumerate(r['accept_rate']):
            drafted = sum(st['spec_drafted'][j] for st in timed)
            kept = sum(st['spec_kept'][j] for st in timed)
            assert rate == (kept / drafted if drafted else None)
        made = sum(st['spec_tokens_per_pass'] * st['spec_row_passes'] for st in timed)
        rows = sum(st['spec_row_passes'] for st in timed)
        assert r['tokens_per_pass'] == pytest.approx(made / rows)
        assert r['passes'] == sum(st['spec_passes'] for st in timed) / 2


def test_pooled_speculative_figures():
    """Two decodes' figures pooled: rates and tokens per pass from summed counts (not the mean of
    the rates), times and steps summed, passes per decode."""
    from bench_speculative import pooled
    one = dict(spec_draft='exit', spec_depth=2, spec_draft_stop=0.0, spec_passes=4,
               spec_draft_steps=8, spec_draft_s=0.5, spec_verify_s=1.0, spec_made=10,
               spec_row_passes=4, spec_drafted=[4, 4], spec_kept=[3, 1], spec_passes_run=5,
               spec_calls=2)
    two = dict(one, spec_passes=2, spec_draft_steps=3, spec_made=3, spec_row_passes=2,
               spec_drafted=[2, 1], spec_kept=[0, 0], spec_passes_run=2, spec_calls=1)
    got = pooled([one, two])
    assert got['spec_accept_rate'] == [3 / 6, 1 / 5]
    assert got['spec_tokens_per_pass'] == 13 / 6
    assert (got['spec_passes'], got['decodes'], got['spec_draft_steps']) == (6, 2, 11)
    assert (got['spec_draft_s'], got['spec_verify_s']) == (1.0, 2.0)
    assert (got['spec_passes_run'], got['spec_calls']) == (7, 3)
    assert pooled([dict(one, spec_drafted=[4, 0])])['spec_accept_rate'] == [3 / 4, None]


def test_bench_speculate_init_from(tmp_path, capsys):
    """--init_from=<run folder> times the checkpoint's model (its route and shape, not the
    config's), with the draft --draft names; a model option given on the command line that the
    run does not have is refused, one it has is taken."""
    import torch
    from dataclasses import asdict
    from model import GPT, GPTConfig
    mcfg = GPTConfig(n_layer=4, n_head=2, n_embd=32, block_size=64, vocab_size=50, route='none')
    torch.manual_seed(0)
    m = GPT(mcfg)
    torch.save(dict(model=m.state_dict(), model_args=asdict(mcfg), config={}),
               tmp_path / 'ckpt.pt')
    argv = [a for a in SPEC_TINY if not a.startswith('--n_layer=')]
    for clash in ('--route=exit', '--n_layer=3'):    # the run's own route and shape hold
        with pytest.raises(ConfigError, match=f'{clash}: the run {tmp_path} has .* drop --'):
            bench.parse_args([*argv, clash, f'--init_from={tmp_path}', '--speculate=2'])
    assert bench.main([*argv, '--n_layer=4', f'--init_from={tmp_path}', '--speculate=2',
                       '--draft=layers', '--draft_layers=2', '--json']) == 0
    res = json.loads(capsys.readouterr().out)
    assert res['n_layer'] == 4 and res['init_from'] == str(tmp_path)
    assert res['prompt_source'] == 'random tokens'         # the run names no dataset
    check_spec_rows(res, 'none', [2], [1, 2])
    assert {(r['draft'], r['draft_layers']) for r in res['rows']} == {('layers', 2)}


def test_bench_speculate_prompts_are_windows_of_the_runs_val_split(tmp_path):
    """A trained run's prompts are seeded windows of its own val.bin (consecutive tokens of the
    file here); a run whose data folder is absent gets random tokens, and the source says which
    files were missing; no run, random tokens."""
    import numpy as np
    import torch
    from bench_speculative import decode_prompts
    folder = tmp_path / 'counting'
    folder.mkdir()
    np.arange(1000, dtype=np.uint16).tofile(folder / 'val.bin')
    (folder / 'meta.json').write_text(json.dumps(dict(dtype='uint16')))
    run_cfg = dict(dataset='counting', data_dir=str(tmp_path))
    prompts, source = decode_prompts(run_cfg, 50, 3, 16, torch.Generator().manual_seed(0))
    assert source == 'counting val.bin' and prompts.shape == (3, 16)
    assert torch.equal(prompts - prompts[:, :1], torch.arange(16).expand(3, 16))
    assert len(set(prompts[:, 0].tolist())) == 3 and int(prompts.max()) < 1000
    again, _ = decode_prompts(run_cfg, 50, 3, 16, torch.Generator().manual_seed(0))
    assert torch.equal(prompts, again)
    prompts, source = decode_prompts(dict(run_cfg, dataset='elsewhere'), 50, 3, 16,
                                     torch.Generator().manual_seed(0))
    missing = tmp_path / 'elsewhere' / 'val.bin'
    assert source.startswith(f'random tokens: no {missing} ') and int(prompts.max()) < 50
    assert source.endswith('(python data/prepare.py elsewhere)')
    prompts, source = decode_prompts({}, 50, 3, 16, torch.Generator().manual_seed(0))
    assert source == 'random tokens' and int(prompts.max()) < 50


def test_bench_speculate_predicted():
    """Leviathan et al.'s expected tokens per pass (1 - a^(K+1)) / (1 - a) at the maximum-likelihood
    a of the kept shares, over the pass's cost in plain steps."""
    from bench_speculative import predicted_speedup
    # kept shares 0.5, 0.25: a = 0.75 / (0.75 + 0.75) = 0.5, 1.75 tokens per pass
    assert predicted_speedup([0.5, 0.25], 1.0, 0.25, 0.75) == pytest.approx((0.5, 1.75))
    assert predicted_speedup([0.5, 0.25], 2.0, 0.5, 1.5) == pytest.approx((0.5, 1.75))
    assert predicted_speedup([0.5, 0.25], 1.0, 0.5, 0.5) == pytest.approx((0.5, 1.75))
    assert predicted_speedup([1.0, 1.0, 1.0], 1.0, 1.0, 1.0) == pytest.approx((1.0, 2.0))
    assert predicted_speedup([0.0], 1.0, 0.1, 0.9) == pytest.approx((0.0, 1.0))
    # K = 4 where no pass drafted positions 3 and 4 (an eager decode of few tokens): a from the
    # positions drafted, the tokens of a pass of all K drafts, (1 - 0.5^5) / 0.5, as its cost is
    assert predicted_speedup([0.5, 0.25, None, None], 1.0, 0.25, 0.75) == pytest.approx(
        (0.5, 1.9375))
    assert predicted_speedup([None, None], 1.0, 0.5, 0.5) == pytest.approx((0.0, 1.0))


@pytest.mark.parametrize('argv,message', [
    (['--speculate=0'], "speculate must be draft lengths K >= 1"),
    (['--speculate=4,-1'], "speculate must be draft lengths K >= 1"),
    (['--speculate=x'], "speculate must be draft lengths K >= 1"),
    (['--speculate=2', '--draft=nope'], "draft 'nope' is not one of route='ffn''s drafts"),
    (['--speculate=2', '--route=none', '--draft_layers=9'], "draft_layers=9 is not a depth"),
    (['--speculate=2', '--budgets=0.5'], "--speculate times decoding alone; drop --budgets"),
    (['--speculate=2', '--decode_vs_hf=True'], "drop --decode_vs_hf"),
    (['--draft=layers'], "--draft is an option of --speculate=K"),
    (['--draft_stop=0.5'], "--draft_stop is an option of --speculate=K"),
    (['--speculate=2', '--draft_stop=1.5'], "draft_stop must be in [0, 1] (0: off), got 1.5"),
    (['--speculate=2', '--draft_stop=-0.5'], "draft_stop must be in [0, 1] (0: off), got -0.5"),
    (['--temperature=1'], "--temperature is an option of --speculate=K"),
    (['--one_graph=True'], "--one_graph is an option of --speculate=K"),
    (['--speculate=2', '--one_graph=True', '--draft_stop=0.3'],
     "--one_graph drafts whole passes, --draft_stop a step at a time: drop one of them"),
    (['--passes_per_graph=2'], "--passes_per_graph is an option of --speculate=K"),
    (['--speculate=2', '--passes_per_graph=0'], "passes_per_graph must be passes per function"),
    (['--speculate=2', '--passes_per_graph=1,x'], "such as '1' or '1,4' (1: a pass at a time)"),
    (['--speculate=2', '--one_graph=True', '--passes_per_graph=0'], "passes_per_graph must be"),
    (['--speculate=2', '--passes_per_graph=2', '--draft_stop=0.3'],
     "--passes_per_graph drafts whole passes, --draft_stop a step at a time"),
    (['--speculate=2', '--temperature=-1'], "temperature must be >= 0 (0: greedy), got -1.0"),
    (['--speculate=2', '--init_from=no/such/run'], "init_from=no/such/run: no checkpoint at"),
    (['--speculate=2', '--decode_tokens=60'], "exceeds the model's block_size=64"),
    (['--speculate=2,99999999999999999999'], "speculate must be draft lengths K >= 1"),
    (['--speculate=2,65'], "speculate=2,65: K=65 exceeds the model's block_size=64"),
    (['--speculate=2', '--passes_per_graph=1,99999999999999999999'],
     "passes_per_graph must be passes per function"),
    (['--decode_batches=1,99999999999999999999'], "decode_batches is too large"),
    (['--budgets=0.5', '--prefill_shapes=1x8,99999999999999999999x8'],
     "prefill_shapes is too large"),
])
def test_bench_speculate_refused(argv, message):
    """Refused before any work with a ConfigError naming the option."""
    with pytest.raises(ConfigError, match=re.escape(message)):
        bench.parse_args([*SPEC_TINY, *argv])


@pytest.mark.parametrize('argv,message', [
    (['--route=none', '--ffn_budget=0.3'], '--ffn_budget is an option of route=ffn'),
    (['--route=ffn', '--exit_layers=2'], '--exit_layers is an option of route=exit'),
    (['--route=exit', '--speculate=2', '--ffn_cheap_rank=4'],
     '--ffn_cheap_rank is an option of route=ffn'),
])
def test_bench_refuses_an_option_of_another_family(argv, message):
    """As train.py does: an option the timed model's family does not read would change nothing,
    so it is refused, naming it, before any work."""
    with pytest.raises(UserError, match=re.escape(message)):
        bench.parse_args([*SPEC_TINY, *argv])


def test_a_config_files_option_of_another_family_is_noted_on_stderr_not_in_the_json(
        tmp_path, capsys):
    """A shared config file may set another family's option (config/bench_cpu.py sets
    ffn_cheap_rank, read by route=ffn alone): noted, as train.py notes it, but on stderr, so that
    --json's stdout stays one JSON object."""
    conf = tmp_path / 'shared.py'
    conf.write_text('ffn_cheap_rank = 8\n')
    res = bench_json([str(conf), '--n_layer=2', '--n_head=2', '--n_embd=16', '--block_size=16',
                      '--batch_size=1', '--vocab_size=50', '--bench_steps=1', '--bench_warmup=0',
                      '--decode_tokens=2', '--decode_batches=1', '--route=mod', '--budgets=0.5',
                      '--prefill_shapes=1x8', '--json'])
    assert {r['kind'] for r in res['rows']} >= {'prefill', 'decode'}
    assert 'note: route=mod does not read ffn_cheap_rank' in capsys.readouterr().err


@pytest.mark.parametrize('extra', [[], ['--budgets=0.5'], ['--decode_vs_hf=True']])
def test_bench_init_from_without_speculate_is_refused(tmp_path, extra):
    """Only --speculate times a checkpoint's model; the other timings build a random model of the
    config's shape, so an --init_from given beside them is refused, not silently ignored."""
    (tmp_path / 'ckpt.pt').write_bytes(b'')
    for init_from in (tmp_path, tmp_path / 'ckpt.pt'):
        with pytest.raises(ConfigError, match=r'--init_from=.* add --speculate=K'):
            bench.parse_args([*SPEC_TINY, *extra, f'--init_from={init_from}'])
    assert bench.parse_args([*SPEC_TINY, *extra, '--init_from=scratch'])


@pytest.mark.parametrize('speculate', [[], ['--speculate=2']])
def test_bench_takes_a_training_config_that_starts_from_a_checkpoint(tmp_path, speculate):
    """A stage-2 or draft-distilling config names the checkpoint its training starts from; bench.py
    trains from none, so it times the config's shape without that checkpoint being there, and
    with --speculate times the run that config names (no such run: refused, naming it)."""
    stage1 = tmp_path / 'stage1' / 'ckpt.pt'
    for extra in ('', "trainable = 'draft'\nroute = 'ffn'\nffn_draft_rank = 8\n"):
        conf = tmp_path / 'stage2.py'
        conf.write_text(f"init_from = {str(stage1)!r}\n{extra}")
        argv = [*SPEC_TINY, str(conf), *speculate]
        if not speculate:
            assert bench.parse_args(argv)[0]['init_from'] == str(stage1)
            continue
        with pytest.raises(ConfigError, match=re.escape(f'init_from={stage1}: no checkpoint at')):
            bench.parse_args(argv)


def test_bench_speculate_refused_before_any_work(capsys):
    """bench.main itself refuses (one UserError line and exit 2 from run_cli), printing nothing."""
    for extra, message in ((['--speculate=0'], 'speculate'),
                           (['--speculate=2', '--suite=gpu'], 'suite')):
        with pytest.raises(ConfigError, match=message):
            bench.main([*SPEC_TINY, *extra, '--json'])
        assert capsys.readouterr().out == ''


def test_bench_help_lists_its_options_then_train_and_family_ones(capsys):
    """--help exits 0 before any work, on stdout: bench.py's own options (--speculate's from
    bench_speculative.py too), then train.py's, the model's and each family's, each with its
    default and comment; nothing UNDOCUMENTED; every key bench.py accepts is listed."""
    assert bench.main(['-h', '--bench_steps=0']) == 0
    out, err = capsys.readouterr()
    assert out.startswith('Speed of a config') and err == '' and 'UNDOCUMENTED' not in out
    assert re.search(r"^  --bench_steps=10 +timed repeats", out, re.M)
    assert re.search(r"^  --speculate='' +comma-separated draft lengths K", out, re.M)
    assert re.search(r"^  --json +print one JSON object$", out, re.M)
    listed = re.findall(r"^  --(\w+)=", out, re.M)
    assert sorted(listed) == sorted({**train.DEFAULTS, **bench.BENCH_DEFAULTS})
    assert out.index('bench.py options:') < out.index('train.py options:') \
        < out.index('route=halt options (route_halt.py):')


# --------------------------------------------------------------------------------------------------
# repeats, spread and noisy ratios; the quick preset

def fake_clock(monkeypatch, durations):
    """time.perf_counter advanced by hand: calls(name) returns a function that, each call, moves
    the clock on by the next of durations[name]."""
    now = [0.0]
    monkeypatch.setattr(bench.time, 'perf_counter', lambda: now[0])
    its = {k: iter(v) for k, v in durations.items()}

    def calls(name):
        def fn():
            now[0] += next(its[name])
        return fn
    return calls


def test_timed_keeps_every_repeat_and_its_median_and_spread(monkeypatch):
    calls = fake_clock(monkeypatch, dict(f=[9.0, 1.0, 1.2, 0.8]))
    t = bench.timed(calls('f'), 3, 1, torch.device('cpu'))      # the 9 s warm-up is not timed
    assert t == pytest.approx(1.0) and t.times == pytest.approx([1.0, 1.2, 0.8])
    assert t.spread == pytest.approx(0.4) and t * 2 == pytest.approx(2.0)      # still a float


def test_a_difference_is_paired_per_repeat_so_shared_load_cancels(monkeypatch):
    """Decode alone = long minus short in each repeat: load that doubles both in one repeat leaves
    the difference alone (spread 0), where the difference of two medians would not be paired."""
    calls = fake_clock(monkeypatch, dict(long=[3.0, 3.0, 6.0, 3.0], short=[1.0, 1.0, 4.0, 1.0]))
    d = bench.timed_difference(calls('long'), calls('short'), 3, 1, torch.device('cpu'))
    assert d.times == pytest.approx([2.0, 2.0, 2.0]) and d.spread == 0


@pytest.mark.parametrize('a,b,noisy', [
    ([1.0, 1.1, 1.2], [2.0, 2.1, 2.2], False),      # spreads 20% and 10%
    ([1.0, 1.3, 1.2], [2.0, 2.1, 2.2], True),       # 25% is the limit: 0.3 / 1.2 = 25%, over
    ([1.0, 1.0], [2.0, 2.0], True),                 # two repeats: no spread to judge by
    ([1.0, 1.0, 1.0], [0.5, 2.0, 1.0], True)])      # the other side 150%
def test_a_ratio_is_noisy_when_a_side_spreads_past_the_limit_or_has_too_few_repeats(a, b, noisy):
    n = bench.noise(bench.Timing(a), bench.Timing(b))
    assert n['noisy'] == noisy and n['repeats'] == min(len(a), len(b))
    want = [(max(x) - min(x)) / sorted(x)[len(x) // 2] if len(x) % 2 else
            (max(x) - min(x)) / (sum(sorted(x)[len(x) // 2 - 1:len(x) // 2 + 1]) / 2)
            for x in (a, b)]
    assert n['spreads'] == pytest.approx(want, abs=1e-4)
    assert n['repeats_ms'] == [pytest.approx([x * 1e3 for x in side]) for side in (a, b)]
    cell = bench.spread_cell(n)
    assert cell.startswith('**NOISY**') == noisy and f"{want[0] * 100:.0f}%" in cell


def test_the_table_footer_counts_the_noisy_ratios():
    rows = [bench.noise(bench.Timing([1, 1, 1]), bench.Timing([1, 1, 1])),
            bench.noise(bench.Timing([1, 2, 3]), bench.Timing([1, 1, 1]))]
    assert '1 of 2 ratios NOISY' in bench.noise_note(rows)
    assert 'no ratio noisy' in bench.noise_note(rows[:1])


def test_quick_preset_shrinks_what_the_command_line_does_not_set():
    full, _, _ = bench.parse_args(['config/bench_cpu.py', '--budgets=1.0,0.5'])
    quick, _, _ = bench.parse_args(['config/bench_cpu.py', '--budgets=1.0,0.5', '--quick=True',
                                    '--decode_tokens=8'])
    assert (full['prefill_shapes'], full['block_size'], full['bench_steps']) == (
        '8x512,4x1024', 1024, 3)
    assert quick['decode_tokens'] == 8                                 # given: kept
    assert {k: quick[k] for k in ('bench_steps', 'bench_warmup', 'decode_batches',
                                  'prefill_shapes', 'batch_size', 'block_size')} == dict(
        bench_steps=3, bench_warmup=1, decode_batches='1,8', prefill_shapes='4x128',
        batch_size=1, block_size=128)
    assert quick['decode_prompt'] == 32 and quick['n_embd'] == full['n_embd'] == 512
    small, _, _ = bench.parse_args(['--block_size=64', '--quick=True'])   # never past the context
    assert small['block_size'] == 64 and small['prefill_shapes'] == '4x64'


def fixed_timers(monkeypatch, decode_calls=True):
    """bench's timers made instant: timed returns 0.1 s repeats without calling fn; a timed
    difference calls long() once (when decode_calls) and returns 0.05 s repeats."""
    monkeypatch.setattr(bench, 'timed', lambda fn, steps, warmup, dev: bench.Timing([0.1] * 3))

    def difference(long, short, steps, warmup, dev):
        if decode_calls:
            long()
        return bench.Timing([0.05] * 3)
    monkeypatch.setattr(bench, 'timed_difference', difference)


@pytest.mark.parametrize('route', ['ffn', 'halt'])
def test_bench_routed_decodes_the_same_prompts_routed_and_dense(route, monkeypatch):
    """A decode time ratio compares the routed and the dense model on the same prompts (a halted
    or routed token depends on what it reads): each batch's prompt is the dense one's."""
    from model import GPT
    prompts = []
    generate = GPT.generate

    def spy(self, idx, *args, **kwargs):
        prompts.append((self.config.route, idx.shape[0], idx.clone()))
        return generate(self, idx, *args, **kwargs)
    monkeypatch.setattr(GPT, 'generate', spy)
    fixed_timers(monkeypatch)
    monkeypatch.setattr(bench, 'time_train_step', lambda *a, **k: bench.Timing([0.1] * 3))
    bench_json(['--n_layer=2', '--n_head=2', '--n_embd=16', '--block_size=16', '--batch_size=1',
                '--vocab_size=50', '--bench_steps=3', '--decode_tokens=2', '--decode_batches=1,2',
                f'--route={route}', '--budgets=1.0,0.5', '--prefill_shapes=1x8',
                *family_args(route), '--json'])
    dense = {b: p for r, b, p in prompts if r == 'none'}
    routed = [(b, p) for r, b, p in prompts if r == route]
    assert sorted(dense) == [1, 2] and len(routed) == 4        # 2 budgets x 2 batches
    assert all(torch.equal(p, dense[b]) for b, p in routed)


def test_bench_decode_vs_hf_with_budgets_is_refused(capsys):
    """--decode_vs_hf times dense decode alone: --budgets beside it (whose routed table would not
    be made) is refused before any work, not dropped."""
    with pytest.raises(ConfigError, match='--budgets'):
        bench.main(['--decode_vs_hf=True', '--budgets=1.0,0.5'])
    assert capsys.readouterr().out == ''


def test_bench_decodes_from_a_decode_prompt_token_prompt(monkeypatch):
    """The plain bench's decode timing starts from --decode_prompt tokens, as the routed one's
    (block_size - decode_tokens when 0), and a prompt that leaves no room is refused."""
    from model import GPT
    lengths = []
    generate = GPT.generate

    def spy(self, idx, *args, **kwargs):
        lengths.append(idx.shape)
        return generate(self, idx, *args, **kwargs)
    monkeypatch.setattr(GPT, 'generate', spy)
    fixed_timers(monkeypatch)
    tiny = [a for a in TINY if not a.startswith('--decode_batches')] + ['--decode_batches=2']
    bench_json([*tiny, '--decode_prompt=5'])
    bench_json(tiny)
    assert lengths == [(2, 5), (2, 32 - 4)]
    with pytest.raises(ConfigError, match='decode_tokens=4 plus a 29-token prompt'):
        bench.main([*tiny, '--decode_prompt=29'])


@pytest.mark.parametrize('extra', [[], ['--budgets=1.0,0.25'], ['--decode_vs_hf=True']])
def test_bench_profile_with_nothing_to_profile_is_refused(extra, capsys):
    """--profile profiles the routed prefill at budget 0.5 or a --speculate decode: without
    either it would time everything and profile nothing, so it is refused before any work."""
    with pytest.raises(ConfigError, match='--profile'):
        bench.main([*TINY, '--profile=True', *extra])
    assert capsys.readouterr().out == ''


def closure(fn, name):
    """The value of free variable `name` of function fn."""
    return fn.__closure__[fn.__code__.co_freevars.index(name)].cell_contents


def test_bench_routed_figures_are_their_formulas_on_fixed_timings(monkeypatch):
    """Every figure of the routed table from fixed timings, by hand: ms, time ratio = routed /
    dense, ideal realised = FLOPs ratio / time ratio, tokens/s = batch x decode_tokens / decode
    time, spreads = (max - min) / median and noisy past SPREAD_LIMIT."""
    import bench_suite  # noqa: F401 (imported first with the real timers, which it binds)
    dense_pre, routed_pre = [0.30, 0.32, 0.34], [0.10, 0.20, 0.12]
    dense_dec, routed_dec = [0.08, 0.08, 0.08], [0.04, 0.05, 0.045]
    monkeypatch.setattr(bench, 'timed', lambda fn, steps, warmup, dev: bench.Timing(
        dense_pre if closure(fn, 'm').config.route == 'none' else routed_pre))
    monkeypatch.setattr(bench, 'timed_difference', lambda long, short, steps, warmup, dev:
                        bench.Timing(dense_dec if closure(long, 'm').config.route == 'none'
                                     else routed_dec))
    steps = {('none', False): [2.0, 2.0, 2.0], ('ffn', False): [1.5, 1.6, 1.7],
             ('ffn', True): [1.0, 1.0, 1.1]}
    monkeypatch.setattr(bench, 'time_train_step', lambda cfg, mcfg, dev, autocast, controller=False:
                        bench.Timing(steps[mcfg.route, controller]))
    res = bench_json(['--n_layer=2', '--n_head=2', '--n_embd=16', '--block_size=16',
                      '--batch_size=1', '--vocab_size=50', '--bench_steps=3', '--decode_tokens=4',
                      '--decode_batches=1,3', '--route=ffn', '--budgets=0.5',
                      '--prefill_shapes=2x8', '--ffn_cheap_rank=4', '--json'])
    pre, dec1, dec3, tr = ([r for r in res['rows'] if r['kind'] == 'prefill'][0],
                           *[r for r in res['rows'] if r['kind'] == 'decode'],
                           [r for r in res['rows'] if r['kind'] == 'train'][0])
    assert (pre['dense_ms'], pre['routed_ms']) == pytest.approx((320.0, 120.0))
    assert pre['time_ratio'] == pytest.approx(0.375)
    assert pre['ideal_realised'] == pytest.approx(pre['flops_ratio'] / 0.375)
    assert pre['spreads'] == pytest.approx([0.8333, 0.125], abs=1e-4) and pre['noisy']
    assert (dec1['batch'], dec3['batch']) == (1, 3)
    assert (dec1['dense_tokens_per_s'], dec1['routed_tokens_per_s']) == pytest.approx((50, 88.89),
                                                                                       abs=0.01)
    assert (dec3['dense_tokens_per_s'], dec3['routed_tokens_per_s']) == pytest.approx((150, 266.67),
                                                                                       abs=0.01)
    assert dec3['time_ratio'] == pytest.approx(0.5625)
    assert dec3['spreads'] == pytest.approx([0.2222, 0.0], abs=1e-4) and not dec3['noisy']
    assert (tr['dense_ms'], tr['routed_ms'], tr['time_ratio']) == pytest.approx((2000, 1600, 0.8))
    assert tr['ideal_realised'] == pytest.approx(tr['flops_ratio'] / 0.8) and not tr['noisy']
    t = res['train']
    assert (t['dense_joint_ms'], t['g1_controller_ms'], t['ratio']) == pytest.approx((2000, 1000,
                                                                                      0.5))
    assert t['spreads'] == pytest.approx([0.1, 0.0]) and not t['noisy']


def test_gpu_suite_figures_are_their_formulas_on_fixed_timings():
    """A suite row: speedup = dense_ms / ms, realised = speedup / ideal (the decode step itself:
    test_gpu_suite_decode_step_is_paired_per_repeat)."""
    import bench_suite
    r = bench_suite.row('prefill', 'ffn', 0.5, '2x8', 'compact', 'float32', False, 40.0, 50.0,
                        1.6)
    assert (r['speedup'], r['realised'], r['shape']) == (1.25, pytest.approx(0.78125), '2x8')
    d = bench_suite.row('decode', 'mod', 0.5, 3, 'compact', 'float32', False, 0.1025e3, 0.082e3,
                        0.9, tokens_per_s=3 / 0.1025)
    assert (d['speedup'], d['realised']) == pytest.approx((0.8, 0.8 / 0.9))
    assert d['tokens_per_s'] == pytest.approx(29.27, abs=0.01) and d['batch'] == 3


def test_bench_figures_are_their_formulas_on_fixed_timings(monkeypatch):
    """The plain bench from fixed timings (0.1 s a step or prefill, 0.05 s a decode): tokens/s =
    batch x tokens / median seconds."""
    fixed_timers(monkeypatch, decode_calls=False)
    res = bench_json(TINY)          # batch 2 x 32 tokens; decode batches 1, 2 of 4 tokens
    assert res['train_ms_per_step'] == pytest.approx(100.0)
    assert (res['train_tokens_per_s'], res['prefill_tokens_per_s']) == pytest.approx((640, 640))
    assert res['decode_tokens_per_s'] == pytest.approx({'1': 80.0, '2': 160.0})
    assert res['spread'] == dict(train=0.0, prefill=0.0, decode={'1': 0.0, '2': 0.0})


def test_bench_plain_prefill_times_what_budgets_prefill_times(monkeypatch):
    """The plain bench's prefill is inference prefill, as --budgets times it: the eval forward
    without targets (no loss) keeping the last position's logits only, not a training forward in
    eval mode."""
    from model import GPT
    calls = []
    forward = GPT.forward

    def spy(self, idx, targets=None, *args, **kwargs):
        out = forward(self, idx, targets, *args, **kwargs)
        if not self.training:
            calls.append((targets, out[0].shape, out[1]))
        return out
    monkeypatch.setattr(GPT, 'forward', spy)
    fixed_timers(monkeypatch, decode_calls=False)
    monkeypatch.setattr(bench, 'timed', lambda fn, steps, warmup, dev: (
        fn(), bench.Timing([0.1] * 3))[1])                      # each timed function run once
    bench_json(TINY)                # batch 2 x 32 tokens, vocab 50
    assert calls
    for targets, shape, loss in calls:
        assert targets is None and loss is None and tuple(shape) == (2, 1, 50)


def test_gpu_suite_decode_step_is_paired_per_repeat(monkeypatch):
    """The suite's decode step is bench.time_model's subtraction: (1 + N tokens) minus (1 token)
    in each repeat, then the median, so load that hits one repeat's pair cancels (the difference
    of the two medians would give (3.5 - 1) / 4 here)."""
    import bench_suite
    durations = {5: iter([9.0, 3.0, 6.0, 3.5]), 1: iter([9.0, 1.0, 4.0, 1.0])}  # warm-up first
    now = [0.0]
    monkeypatch.setattr(bench.time, 'perf_counter', lambda: now[0])

    class Clocked:
        def generate(self, prompt, k, **kwargs):
            now[0] += next(durations[k])
    prompt = torch.zeros(1, 4, dtype=torch.long)
    step = bench_suite.decode_seconds(Clocked(), prompt, 4, 'float32', False,
                                      dict(decode_steps=3))
    assert step == pytest.approx(2.0 / 4)


def test_gpu_suite_decode_repeats_follow_bench_steps(tmp_path, monkeypatch):
    """--bench_steps sets the decode rows' repeats as it sets prefill's and training's: every
    decode timing of the suite runs that many paired repeats (after one untimed round); without
    it, the plan's decode_steps."""
    import bench_suite
    repeats = []

    def difference(long, short, steps, warmup, dev):
        repeats.append((steps, warmup))
        return bench.Timing([0.01] * steps)
    monkeypatch.setattr(bench_suite, 'timed_difference', difference)
    monkeypatch.setattr(bench_suite, 'check_paths', lambda *a, **k: [])
    monkeypatch.setattr(bench_suite, 'prefill_section',
                        lambda *a: (None, {'ffn': SimpleNamespace(exec_mode=None)}))
    monkeypatch.setattr(bench_suite, 'decode_ideal', lambda *a: 1.0)
    monkeypatch.setattr(bench_suite, 'train_section', lambda *a: None)
    argv = ['--suite=gpu', '--smoke=True', '--device=cpu', f'--out_dir={tmp_path}',
            '--overwrite=True']
    for extra, steps in (([], bench_suite.PLANS['smoke']['decode_steps']),
                         (['--bench_steps=2'], 2), (['--bench_steps=5'], 5)):
        repeats.clear()
        assert bench.main(argv + extra) == 0
        assert repeats and set(repeats) == {(steps, 1)}, extra


@pytest.mark.parametrize('route', ['ffn', 'mod'])
def test_bench_routed_masked_dense_executes_every_path_on_every_token(route, monkeypatch):
    """--sparse=False times the masked-dense forward, which runs every path on every token: its
    executed fractions are all 1 and its executed FLOPs ratio the masked forward's ('eval') over
    dense, not the sparse execution's savings."""
    fixed_timers(monkeypatch, decode_calls=False)
    monkeypatch.setattr(bench, 'time_train_step', lambda *a, **k: bench.Timing([0.1] * 3))
    args = ['--n_layer=2', '--n_head=2', '--n_embd=16', '--block_size=16', '--batch_size=1',
            '--vocab_size=50', '--bench_steps=3', '--decode_tokens=2', '--decode_batches=1',
            f'--route={route}', '--budgets=0.5', '--prefill_shapes=2x8', *family_args(route),
            '--sparse=False', '--json']
    pre = [r for r in bench_json(args)['rows'] if r['kind'] == 'prefill'][0]
    mcfg = FAMILIES[route].bench_config(bench.routed_base(bench.parse_args(args)[0])[0], 0.5)
    head = 7 * 2 * 16 * 50                          # the logits of all but the last position
    want = ((flops.forward_flops(mcfg, 8, 'eval') - head)
            / (flops.dense_forward_flops(mcfg, 8) - head))
    assert pre['executed_fracs'] == [1.0] * len(pre['layer_fracs'])
    assert pre['executed_flops_ratio'] == pytest.approx(want, rel=1e-9)


def test_bench_help_says_what_prompt_each_timing_decodes_from(capsys):
    """--decode_prompt=0's prompt as each timing takes it: block_size - decode_tokens (the plain
    bench), one fewer (--budgets), 64 (--decode_vs_hf and --speculate)."""
    bench.main(['--help'])
    text = ' '.join(capsys.readouterr().out.split())
    assert ('(0: block_size - decode_tokens, one fewer with --budgets; 64 with --decode_vs_hf or '
            '--speculate)') in text


def strict_json(text):
    """text parsed as JSON proper: Python's json reads Infinity and NaN, which JSON has not."""
    def refuse(name):
        raise ValueError(f'{name} is not JSON')
    return json.loads(text, parse_constant=refuse)


def test_a_spread_over_a_zero_median_is_null_in_the_json(tmp_path, monkeypatch):
    """A decode whose long and short runs take equally long has a median of 0 s: its spread (over
    that median) has no finite value, so the JSON printed and written says null, not Infinity;
    the table still flags a ratio with such a side noisy."""
    monkeypatch.setattr(bench, 'timed', lambda fn, steps, warmup, dev: bench.Timing([0.1] * 3))
    monkeypatch.setattr(bench, 'timed_difference', lambda long, short, steps, warmup, dev:
                        bench.Timing([-0.01, 0.0, 0.01]))
    out = tmp_path / 'b.json'
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        assert bench.main([*TINY, f'--out={out}']) == 0
    for res in (strict_json(printed.getvalue()), strict_json(out.read_text())):
        assert res['spread'] == dict(train=0.0, prefill=0.0, decode={'1': None, '2': None})
    n = bench.noise(bench.Timing([-0.01, 0.0, 0.01]), bench.Timing([0.1] * 3))
    assert n['noisy'] and bench.spread_cell(n).startswith('**NOISY**')


def test_the_json_writers_refuse_a_value_json_cannot_hold(tmp_path, capsys, monkeypatch):
    """Any other non-finite figure stops the run with an error (ValueError) instead of printing or
    writing Infinity or NaN; an earlier file at --out is left as it was."""
    out = tmp_path / 'b.json'
    out.write_text('{"earlier": 1}')
    monkeypatch.setattr(bench, 'bench', lambda cfg: dict(train_tokens_per_s=float('nan')))
    with pytest.raises(ValueError):
        bench.main([*TINY, f'--out={out}'])
    assert json.loads(out.read_text()) == {'earlier': 1} and capsys.readouterr().out == ''
    with pytest.raises(ValueError):
        bench.main(TINY)
    assert capsys.readouterr().out == ''
