"""Sampled decoding with speculative.draw against torch.multinomial, at the GPT-2 124M shape (random
weights, fp32, column-major weights as sample.py decodes, 2 threads): the draw alone over 50,257
ids, and GPT.generate of 32 tokens at temperature 0.8, top_k 200 (sample.py's defaults) from a
64-token prompt, the two samplers taking turns in each of 5 repeats (median). Run from the repo
root: python results/cpu_2026-11-26/draw/draw_vs_multinomial.py"""
import statistics
import sys
import time

import torch

sys.path.insert(0, '.')
import speculative  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402

torch.set_num_threads(2)
draw = speculative.draw


def multinomial(probs):
    return torch.multinomial(probs, 1)[:, 0]


def timed(f, n):
    t = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - t) / n


print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
for B in (1, 8):
    p = torch.softmax(torch.randn(B, 50257), -1)
    for name, f in (('multinomial', multinomial), ('draw', draw)):
        timed(lambda: f(p), 20)
        print(f"draw alone, batch {B}, {name}: {timed(lambda: f(p), 200) * 1e6:.0f} us")

torch.manual_seed(0)
model = GPT(GPTConfig(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50257))
model = model.eval().decode_layout()
for B in (1, 8):
    idx = torch.randint(0, 50257, (B, 64))
    times = {'multinomial': [], 'draw': []}
    with torch.no_grad():
        for rep in range(6):
            for name, f in (('multinomial', multinomial), ('draw', draw)):
                speculative.draw = f            # GPT.sample_next draws through speculative.draw
                t = time.perf_counter()
                model.generate(idx, 32, temperature=0.8, top_k=200)
                if rep:                         # the first round warms up
                    times[name].append(time.perf_counter() - t)
    speculative.draw = draw
    med = {k: statistics.median(v) for k, v in times.items()}
    spreads = ', '.join(f"{k} {(max(v) - min(v)) / med[k]:.0%}" for k, v in times.items())
    print(f"generate 32 tokens, batch {B}: multinomial {B * 32 / med['multinomial']:.1f} tok/s, "
          f"draw {B * 32 / med['draw']:.1f} tok/s, ratio {med['multinomial'] / med['draw']:.3f} "
          f"(spreads {spreads})")
