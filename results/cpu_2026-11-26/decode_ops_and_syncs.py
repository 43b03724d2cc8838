"""Aten ops and host syncs per eager decoding step of the trained 8-layer models (out/spec_<route>),
counted with a dispatch mode: generate of 9 tokens minus generate of 1, over 8 steps, greedy top-1
sampling included. Run from the repository root:
    python results/cpu_2026-11-26/decode_ops_and_syncs.py
"""
import collections
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, '.')
from checkpoint import load_model  # noqa: E402

SYNCS = {'aten._local_scalar_dense.default', 'aten.nonzero.default', 'aten.item.default',
         'aten.is_nonzero.default', 'aten.masked_select.default'}


class Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops, self.syncs = 0, collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        if str(func) in SYNCS:
            self.syncs[str(func)] += 1
        return func(*args, **(kwargs or {}))


for route in ('dense', 'exit', 'mod', 'ffn', 'halt'):
    ckpt = torch.load(f'out/spec_{route}/ckpt.pt', map_location='cpu', weights_only=False)
    model = load_model(ckpt, 'cpu').eval()
    idx = torch.randint(0, 65, (1, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model.generate(idx, 2, top_k=1)
        long, short = Count(), Count()
        with long:
            model.generate(idx, 9, top_k=1)
        with short:
            model.generate(idx, 1, top_k=1)
    syncs = {k: (v - short.syncs[k]) / 8 for k, v in long.syncs.items()}
    print(f'{route}: {(long.ops - short.ops) / 8:.0f} aten ops per step, host syncs {syncs}')
