"""Kernels (aten ops other than views) and bytes they write (counted as bf16) in one eval prefill
of the GPU suite's GPT-2 124M shape at 2x256, dense and routed (ffn's calibrated G1 gate and MoD's
random router at budgets 1.0 and 0.5, bench.routed_model) on each path that runs on a CPU. Run from
the repository root:
    python results/cpu_2026-11-26/prefill_kernels.py
"""
import sys
from contextlib import nullcontext
from dataclasses import replace
from types import SimpleNamespace

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, '.')
import train  # noqa: E402
from bench import eval_model, routed_model  # noqa: E402
from model import FAMILIES  # noqa: E402

VIEWS = ('view', 'unsqueeze', 'select', 't.default', '_unsafe_view', 'transpose', 'expand',
         'split', 'slice', 'squeeze', 'permute', 'alias', 'detach', 'lift_fresh', 'as_strided',
         'unbind')


class Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.kernels, self.bytes = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not any(v in str(func) for v in VIEWS):
            self.kernels += 1
            outs = out if isinstance(out, (tuple, list)) else [out]
            self.bytes += sum(2 * o.numel() for o in outs if isinstance(o, torch.Tensor))
        return out


def count(m, path):
    c = Count()
    with torch.no_grad(), c:
        m(x, exec_mode=path)
    return c.kernels, c.bytes / 1e6


shape = dict(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50304,
             ffn_cheap_rank=64)
base = train.model_config(SimpleNamespace(**{**train.DEFAULTS, **shape}))
base = replace(base, route='none', dropout=0.0)
x = torch.randint(0, 50304, (2, 256), generator=torch.Generator().manual_seed(0))
torch.manual_seed(0)
dense = eval_model(base, 'cpu')
n, mb = count(dense, None)
print(f'dense: {n} kernels, {mb:.0f} MB written')
for route in ('ffn', 'mod'):
    for budget in (1.0, 0.5):
        mcfg = FAMILIES[route].bench_config(replace(base, route=route), budget)
        m = routed_model(mcfg, dense.state_dict(), {(2, 256): x}, 0, 'cpu', nullcontext(), budget)
        for path in ('compact', 'reference', 'grouped_mm'):
            k, b = count(m, path)
            print(f'{route} budget {budget} {path}: {k} kernels (+{k - n}), '
                  f'{b:.0f} MB (+{b - mb:.0f})')
