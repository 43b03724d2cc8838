import statistics, sys, time, torch
import speculative
from checkpoint import load_checkpoint, load_model
name, K, P = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
ck = load_checkpoint(f'out/gpu/{name}/ckpt.pt')
models = {v: load_model(ck, torch.device('cpu')).eval() for v in ('region', 'unrolled')}
passes = {'region': speculative.one_pass, 'unrolled': speculative.whole_pass}
g = torch.Generator().manual_seed(0)
idx = torch.randint(0, models['region'].config.vocab_size, (1, 64), generator=g)
draft = speculative.resolve_draft(models['region'].config, models['region'].family, None,
                                  2 if 'exit' in name else None)
def run(v):
    speculative.one_pass = passes[v]
    return speculative.generate(models[v], idx, 60, K, draft[0], draft[1], temperature=0.0,
                                compile=True, passes_per_graph=P)
outs = {v: run(v) for v in models}
print('same tokens', torch.equal(outs['region'], outs['unrolled']))
times = {v: [] for v in models}
for _ in range(15):
    for v in models:
        t = time.perf_counter(); run(v); times[v].append(time.perf_counter() - t)
for v in models:
    print(v, 'median ms', round(statistics.median(times[v]) * 1e3, 2),
          'min', round(min(times[v]) * 1e3, 2), 'max', round(max(times[v]) * 1e3, 2))
