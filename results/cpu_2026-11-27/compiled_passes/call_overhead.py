"""The host cost of calling a compiled function on this CPU, beside a compiled decoding step: the
median over 300 calls (after 20) of GPT.compiled(f) for f(model, x) = x + 1 (the model handed in,
as the speculative passes take it), for the same without the model, and for the exit model's
decode step, compiled and eager (batch 1, 64 attended slots, 1 thread). From the repo root:
PYTHONPATH=. python results/cpu_2026-11-27/compiled_passes/call_overhead.py"""
import statistics
import time

import torch

from checkpoint import load_checkpoint, load_model

torch.manual_seed(0)
torch.set_num_threads(1)
dev = torch.device('cpu')
model = load_model(load_checkpoint('out/gpu/spec_exit_w4d2/ckpt.pt'), dev).eval()
cache = model.new_cache(1, dev, True)
cache.attend_to(64)
tok, pos = torch.zeros(1, 1, dtype=torch.long), torch.full((1, 1), 10)


def median_us(f, n=300):
    for _ in range(20):
        f()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def add_one_given_model(model, x):
    return x + 1


def add_one(x):
    return x + 1


x = torch.zeros(1)
with torch.no_grad():
    step = model.compiled(model.decode_step, dev)
    given = model.compiled(add_one_given_model, dev)
    rows = [('compiled x + 1, model handed in', given, (model, x)),
            ('compiled x + 1', model.compiled(add_one, dev), (x,)),
            ('compiled decode step (exit model)', step, (tok, pos, cache)),
            ('eager decode step (exit model)', model.decode_step, (tok, pos, cache))]
    print(f'torch {torch.__version__}, 1 thread; median us per call over 300 calls')
    for name, f, args in rows:
        print(f'{name}: {median_us(lambda: f(*args)):.1f}')
