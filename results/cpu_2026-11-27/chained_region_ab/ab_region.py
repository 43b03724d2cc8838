"""A/B in one process: chained passes unrolled vs one region, decode time alternating."""
import sys, time, statistics
sys.path.insert(0, '/work/main')
import numpy as np
import torch
import speculative
from checkpoint import load_checkpoint, load_model
name, K, draft = sys.argv[1], int(sys.argv[2]), (sys.argv[3] or None)
torch.set_num_threads(2)
model = load_model(load_checkpoint(f'/work/main/out/gpu/{name}/ckpt.pt'), 'cpu').eval()
val = np.memmap('/work/main/data/shakespeare_char/val.bin', dtype=np.uint16, mode='r')
prompt = torch.from_numpy(val[1000:1064].astype(np.int64))[None]
region = speculative.repeated_pass
kinds = {'unrolled': speculative.whole_pass, 'region': region}
outs, times = {}, {k: [] for k in kinds}
def run(kind):
    speculative.repeated_pass = kinds[kind]
    t = time.perf_counter()
    y = speculative.generate(model, prompt, 60, K, draft, temperature=0, compile=True,
                             passes_per_graph=4)
    return time.perf_counter() - t, y
for kind in kinds:
    dt, outs[kind] = run(kind)
    print(kind, 'first call', round(dt, 1), 's', flush=True)
assert torch.equal(outs['unrolled'], outs['region'])
for i in range(15):
    for kind in (kinds if i % 2 == 0 else list(kinds)[::-1]):
        times[kind].append(run(kind)[0] * 1e3)
for kind, ts in times.items():
    print(kind, 'median ms', round(statistics.median(ts), 2), 'min', round(min(ts), 2),
          'max', round(max(ts), 2))
print('region / unrolled', round(statistics.median(times['region']) / statistics.median(times['unrolled']), 3))
