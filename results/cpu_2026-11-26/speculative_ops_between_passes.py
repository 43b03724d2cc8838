"""Aten ops per verifier pass outside the draft steps and verifier passes (the prefill, the
acceptance rule and the bookkeeping between passes), greedy speculative decoding of 41 tokens at
K = 4, draft E = 2, batch 1, with the trained exit model (out/spec_exit), counted with a dispatch
mode; through model.generate(stats=...) and through speculative.generate(stats=...) (what
bench.py --speculate timed before and after 2026-11-26). Run from the checkout to count:
    python results/cpu_2026-11-26/speculative_ops_between_passes.py [checkout]
"""
import collections
import os
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else '.'))
import speculative  # noqa: E402
from checkpoint import load_model  # noqa: E402


class Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.phase, self.ops = 'other', collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[self.phase] += 1
        return func(*args, **(kwargs or {}))


count = Count()
for name in ('draft_step', 'verify_pass'):
    if hasattr(speculative, name):              # the module functions the passes call
        inner = getattr(speculative, name)

        def phased(*a, _inner=inner, _name=name):
            count.phase = _name
            try:
                return _inner(*a)
            finally:
                count.phase = 'other'
        setattr(speculative, name, phased)
ckpt = torch.load('out/spec_exit/ckpt.pt', map_location='cpu', weights_only=False)
model = load_model(ckpt, 'cpu').eval()
idx = torch.randint(0, 65, (1, 64), generator=torch.Generator().manual_seed(0))
for via in ('model.generate', 'speculative.generate'):
    count.ops.clear()
    stats = {}
    with torch.no_grad(), count:
        if via == 'model.generate':
            model.generate(idx, 41, temperature=0, speculate=4, draft_layers=2, stats=stats)
        else:
            speculative.generate(model, idx, 41, 4, None, 2, temperature=0, stats=stats)
    p = stats['spec_passes']
    print(f'{via}: {p} passes; aten ops per pass: ' +
          ', '.join(f'{k} {v / p:.0f}' for k, v in sorted(count.ops.items())))
