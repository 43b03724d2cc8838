"""Each ffn draft beside its model on 20 fixed validation batches (16 x 128 characters, seed 123):
the model's and the draft's LM loss (nats per character), the mean KL(model || draft), the mean
chance a sampled draft token is kept (1 - TV) and how often the two argmaxes agree, teacher-forced
(both read the true prefix; in speculative decoding the draft reads the kept one). The draft runs
as a whole model (its own K/V at every position); the distilled one also in the model's context
('in context': the model's K/V before each position, its own at it, as a pass's first draft).
    python results/cpu_2026-11-26/ffn_distilled/draft_quality.py [distilled model's out_dir]
(the first recipe's, whole_model_b5980a9/draft_quality.txt: out/ffn_distilled_all_draft)"""
import sys

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, '.')
import route_ffn  # noqa: E402
from checkpoint import load_checkpoint, load_model  # noqa: E402

DISTILLED = sys.argv[1] if len(sys.argv) > 1 else 'out/ffn_distilled_drafter_shakespeare'
RUNS = [('out/spec_ffn', 'cheap'), ('out/ffn_drafter_shakespeare', 'cheap'),
        (DISTILLED, 'distilled'), (DISTILLED, 'distilled in context')]
val = np.memmap('data/shakespeare_char/val.bin', dtype=np.uint16, mode='r')
torch.set_num_threads(2)

def measures(p, q, y, sums):
    sums['draft'] += F.nll_loss(q.flatten(0, 1), y.flatten()).item() / 20
    sums['kl'] += (p.exp() * (p - q)).sum(-1).mean().item() / 20
    sums['kept'] += torch.minimum(p.exp(), q.exp()).sum(-1).mean().item() / 20
    sums['agree'] += (p.argmax(-1) == q.argmax(-1)).float().mean().item() / 20


def line(name, sums):
    return (f"{name}: model {sums['model']:.3f}, draft {sums['draft']:.3f}, KL {sums['kl']:.3f}, "
            f"kept when sampled {sums['kept']:.3f}, argmax agrees {sums['agree']:.3f}")


for path, draft in RUNS:
    model = load_model(load_checkpoint(f'{path}/ckpt.pt'), 'cpu').eval()
    g = torch.Generator().manual_seed(123)
    sums = dict(model=0.0, draft=0.0, kl=0.0, kept=0.0, agree=0.0)
    in_context = draft.endswith('in context')
    with torch.no_grad():
        for _ in range(20):
            ix = torch.randint(len(val) - 129, (16,), generator=g)
            x = torch.stack([torch.from_numpy(val[i:i + 128].astype(np.int64)) for i in ix])
            y = torch.stack([torch.from_numpy(val[i + 1:i + 129].astype(np.int64)) for i in ix])
            cache = model.new_cache(16, x.device)
            p = model(x, last_only=False, cache=cache)[0].log_softmax(-1)
            if in_context:
                kv = [(cache.k[i][:, :, :128], cache.v[i][:, :, :128])
                      for i in range(model.config.n_layer)]
                q = route_ffn.draft_logits_in_model_context(model, x, None, kv)
            else:
                q = model.family.draft_logits(model, draft, x, None, None, None)
            sums['model'] += F.nll_loss(p.flatten(0, 1), y.flatten()).item() / 20
            measures(p, q.log_softmax(-1), y, sums)
    print(line(f'{path} draft={draft}', sums))
