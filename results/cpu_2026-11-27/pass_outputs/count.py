"""How many tensors one verification (speculative.verify_pass) and one plain decoding step
(GPT.decode_step) return, for the four trained models the H200 runs used (out/gpu/). Run from the
root of a checkout; count.txt has it at ea2c3fe (before the verification returned only what is
read) and at 264a1ea (after; its plain step as generate calls it when recording):
python results/cpu_2026-11-27/pass_outputs/count.py"""
import inspect
import sys

import torch
from torch.utils._pytree import tree_leaves

sys.path.insert(0, '.')
from checkpoint import load_checkpoint, load_model  # noqa: E402
import speculative  # noqa: E402


def tensors(out):
    return sum(isinstance(x, torch.Tensor) for x in tree_leaves(out))


dev = torch.device('cpu')
for name in ('spec_exit_w4d2', 'ffn_distilled_drafter_shakespeare', 'spec_mod', 'spec_halt'):
    model = load_model(load_checkpoint(f'out/gpu/{name}/ckpt.pt'), dev).eval()
    cache = model.new_cache(1, dev)
    cache.attend_to(64)
    window, base_active = torch.zeros(1, 5, dtype=torch.long), torch.tensor([[3], [1]])
    with torch.no_grad():
        verify = speculative.verify_pass(model, window, None, base_active, cache, 0, None, None,
                                         False)
        step = model.decode_step(window[:, :1], base_active[:1].T, cache)
    print(f'{name}: verification {tensors(verify)} tensors, plain step {tensors(step)}'
          f" (decode_step{inspect.signature(model.decode_step)})")
