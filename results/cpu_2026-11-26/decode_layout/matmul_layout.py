"""One Linear of the GPT-2 124M shape applied to 1 and 8 rows (a decoding step at batch 1 and 8),
its weight stored row-major (nn.Linear's (out, in), contiguous) and column-major (the same tensor,
its transpose contiguous: what GPT.decode_layout makes, and how transformers' Conv1D stores its
weights). Median of 30 after 3 warm-ups, 2 threads. Run from the repository root:
    python results/cpu_2026-11-26/decode_layout/matmul_layout.py"""
import time

import torch
import torch.nn.functional as F


def median_s(f, n=30):
    for _ in range(3):
        f()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[n // 2]


torch.set_num_threads(2)
torch.manual_seed(0)
print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
print("| weight (out x in) | rows | row-major ms | column-major ms | column-major speedup |")
print("|---|---|---|---|---|")
for name, (o, i) in dict(c_attn=(2304, 768), attn_c_proj=(768, 768), c_fc=(3072, 768),
                         mlp_c_proj=(768, 3072), lm_head=(50257, 768)).items():
    w = torch.randn(o, i)
    w_col = w.t().contiguous().t()
    assert torch.equal(w, w_col) and w_col.stride() == (1, o)
    for rows in (1, 8):
        x = torch.randn(rows, i)
        a, b = median_s(lambda: F.linear(x, w)), median_s(lambda: F.linear(x, w_col))
        print(f"| {name} {o} x {i} | {rows} | {a * 1e3:.3f} | {b * 1e3:.3f} | {a / b:.2f} |")
