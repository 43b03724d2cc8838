"""bench.py --json prints exactly one JSON object whose numbers come from this run: positive speeds,
no MFU on CPU, and the step FLOPs the analytic accountant gives for this config."""
import json
import os
import subprocess
import sys

import pytest

import flops
import train
from configurator import load_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ['--n_layer=1', '--n_head=2', '--n_embd=32', '--block_size=32', '--batch_size=2', '--vocab_size=50',
        '--bench_steps=1', '--bench_warmup=0', '--decode_tokens=4', '--decode_batches=1,2', '--json']


@pytest.mark.parametrize('route', ['none', 'ffn', 'halt'])
def test_bench_json(route):
    args = [*TINY, f'--route={route}'] + (['--n_layer=2'] if route == 'halt' else [])
    r = subprocess.run([sys.executable, 'bench.py', *args], cwd=REPO, capture_output=True, text=True, timeout=120,
                       env={**os.environ, 'OMP_NUM_THREADS': '1'})
    assert r.returncode == 0, r.stderr
    lines = [l for l in r.stdout.splitlines() if l.strip()]
    assert len(lines) == 1
    res = json.loads(lines[0])
    assert res['device'] == 'cpu' and res['train_mfu'] is None and res['route'] == route
    assert res['train_tokens_per_s'] > 0 and res['prefill_tokens_per_s'] > 0
    assert set(res['decode_tokens_per_s']) == {'1', '2'}
    cfg = load_config({**train.DEFAULTS, 'bench_steps': 0, 'bench_warmup': 0, 'decode_tokens': 0, 'decode_batches': ''},
                      [a for a in args if a != '--json'])
    mcfg = train.model_config(type('C', (), cfg)(), vocab_size=50)
    assert res['train_flops_per_step'] == 2 * flops.train_step_flops(mcfg, 32)['total']


def test_bench_bad_key_is_a_clean_error():
    r = subprocess.run([sys.executable, 'bench.py', '--n_layers=2'], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "n_layer" in r.stderr and 'Traceback' not in r.stderr
