"""Median ms of one dense decoding step at the GPT-2 124M shape (fp32, random weights, 64-token
prompt, 8 steps after a warm-up), eager and compiled (GPT.decode_step_fn(compile=True): inductor on
the CPU), at batch 1 and 8, for the checkout given (default: the current directory):
    python results/cpu_2026-11-26/compiled_decode_step.py [repo]
"""
import os
import sys
import time

import torch

sys.path.insert(0, os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else '.'))
from model import GPT, GPTConfig  # noqa: E402

torch.manual_seed(0)
m = GPT(GPTConfig(n_layer=12, n_head=12, n_embd=768, vocab_size=50257, block_size=1024)).eval()
T = 64


def median_step_ms(step, B, n=8):
    idx = torch.randint(0, 50257, (B, T))
    cache = m.new_cache(B, idx.device)
    with torch.no_grad():
        cache.attend_to(T)
        tok = m(idx, pos=torch.arange(T).expand(B, T), cache=cache)[0][:, -1].argmax(-1, True)
        times = []
        for i in range(n):
            cache.attend_to(T + i + 1)
            t0 = time.perf_counter()
            logits, _ = step(tok, torch.full((B, 1), T + i), cache)
            times.append(time.perf_counter() - t0)
            tok = logits.argmax(-1, keepdim=True)
    return sorted(times)[n // 2] * 1e3


compiled = m.decode_step_fn(torch.device('cpu'), True)
for B in (1, 8):
    median_step_ms(compiled, B, 2)                  # compile (one bucket: positions 64..72)
    print(f'batch {B}: eager {median_step_ms(m.decode_step, B):.1f} ms, '
          f'compiled {median_step_ms(compiled, B):.1f} ms')
