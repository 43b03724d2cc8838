"""bench.py --json prints exactly one JSON object whose numbers come from this run: positive speeds,
no MFU on CPU, and the step FLOPs the analytic accountant gives for this config."""
import json
import math
import os
import sys
from types import SimpleNamespace

import pytest
import torch

import flops
import train
from configurator import load_config
from conftest import run_group
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


@pytest.mark.parametrize('route', list(FAMILIES))
def test_bench_json(route):
    """Every family in the registry: training step, prefill and decode timed, step FLOPs the
    accountant's."""
    args = [*TINY, f'--route={route}']
    r = run_group([sys.executable, 'bench.py', *args], 120, cwd=REPO,
                  env={**os.environ, 'OMP_NUM_THREADS': '1'})
    assert r.returncode == 0, r.stderr
    lines = [l for l in r.stdout.splitlines() if l.strip()]
    assert len(lines) == 1
    res = json.loads(lines[0])
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



def test_bench_decode_vs_hf(tmp_path):
    """--decode_vs_hf: one row per decode batch, eager (compiled rows only with --compile=True),
    each with our tokens/s, transformers' tokens/s and ratio = ours / theirs; --out writes the
    same JSON with the command."""
    pytest.importorskip('transformers')
    out = tmp_path / 'vs_hf.json'
    args = ['--decode_vs_hf=True', '--n_layer=2', '--n_head=2', '--n_embd=32', '--block_size=64',
            '--vocab_size=50', '--decode_prompt=8', '--decode_tokens=4', '--decode_batches=1,3',
            '--bench_steps=2', '--device=cpu', '--dtype=float32', f'--out={out}', '--json']
    r = run_group([sys.executable, 'bench.py', *args], 180, cwd=REPO,
                  env={**os.environ, 'OMP_NUM_THREADS': '1'})
    assert r.returncode == 0, r.stderr
    lines = [l for l in r.stdout.splitlines() if l.strip()]
    assert len(lines) == 1
    res = json.loads(lines[0])
    assert res['kind'] == 'decode_vs_hf' and res['prompt_tokens'] == 8
    assert (res['decode_tokens'], res['n_layer'], res['vocab_size']) == (4, 2, 50)
    assert [(row['batch'], row['ours']) for row in res['rows']] == [(1, 'eager'), (3, 'eager')]
    for row in res['rows']:
        assert set(row) == {'batch', 'ours', 'ours_tokens_per_s', 'hf_tokens_per_s', 'ratio'}
        assert row['ours_tokens_per_s'] > 0 and row['hf_tokens_per_s'] > 0
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


def test_bench_decode_vs_hf_prompt_must_fit_the_context():
    """A prompt plus the decoded tokens past block_size is refused before any model is built."""
    r = run_group([sys.executable, 'bench.py', '--decode_vs_hf=True', '--block_size=64',
                   '--decode_prompt=60', '--decode_tokens=8'], 60, cwd=REPO)
    assert r.returncode == 2 and 'decode_tokens=8' in r.stderr and 'Traceback' not in r.stderr

def test_bench_bad_key_is_a_clean_error():
    r = run_group([sys.executable, 'bench.py', '--n_layers=2'], 60, cwd=REPO)
    assert r.returncode == 2 and "n_layer" in r.stderr and 'Traceback' not in r.stderr


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
        '--ffn_cheap_rank=4',
        '--exit_layers=1',
        f'--out={tmp_path / "bench.json"}',
        '--json',
    ]
    r = run_group([sys.executable, 'bench.py', *args], 120, cwd=REPO,
                  env={**os.environ, 'OMP_NUM_THREADS': '1'})
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout.strip().splitlines()[-1])
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
