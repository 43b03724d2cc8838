# The eval forward FLOPs per token of the dense model and of the ensemble (k = 3 LM heads), counted
# by torch FlopCounterMode at T = 128, random weights:
#   python results/cpu_2026-11-25/study_tuning/ensemble_inference_flops.py
import json
import os
import sys

import torch
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
from torch.utils.flop_counter import FlopCounterMode
from model import GPT, GPTConfig
out = {}
for name, shape in [('shakespeare_8L_d128', dict(n_layer=8, n_head=4, n_embd=128, vocab_size=65)),
                    ('gpt2_124m', dict(n_layer=12, n_head=12, n_embd=768, vocab_size=50257))]:
    row = {}
    for route in ('none', 'ensemble'):
        kw = dict(ens_layers=3) if route == 'ensemble' else {}
        m = GPT(GPTConfig(block_size=128, route=route, **shape, **kw)).eval()
        idx = torch.randint(0, shape['vocab_size'], (1, 128))
        with torch.no_grad(), FlopCounterMode(display=False) as fc:
            m(idx, last_only=False)
        row[route] = fc.get_total_flops() / 128
    row['ratio'] = row['ensemble'] / row['none']
    out[name] = row
print(json.dumps(out, indent=1))
