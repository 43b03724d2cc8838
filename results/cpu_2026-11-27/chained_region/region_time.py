import sys, time, torch
import speculative
from checkpoint import load_checkpoint, load_model
name, K, P = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
model = load_model(load_checkpoint(f'out/gpu/{name}/ckpt.pt'), torch.device('cpu')).eval()
g = torch.Generator().manual_seed(0)
idx = torch.randint(0, model.config.vocab_size, (1, 64), generator=g)
draft = speculative.resolve_draft(model.config, model.family, None, 2 if 'exit' in name else None)
t = time.time()
out = speculative.generate(model, idx, 60, K, draft[0], draft[1], temperature=0.0,
                           compile=True, passes_per_graph=P)
print('first call s', round(time.time() - t, 1))
t = time.time()
out2 = speculative.generate(model, idx, 60, K, draft[0], draft[1], temperature=0.0,
                           compile=True, passes_per_graph=P)
print('second call s', round(time.time() - t, 2), 'same', torch.equal(out, out2))
torch.save(out, sys.argv[4])
