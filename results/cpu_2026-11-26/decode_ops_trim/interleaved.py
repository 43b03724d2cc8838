"""Batch-1 cached decoding costs before c975fef and 88e6e16 (fewer operators per step) and after
them (interleaved.txt: at 88e6e16), timed in alternating processes. Run from the repository root
with the commit before checked out beside it:
    git worktree add /tmp/old 8aa2763 && ln -s $PWD/out /tmp/old/out
    python results/cpu_2026-11-26/decode_ops_trim/interleaved.py /tmp/old
Per model and tree: the decode step, the cheap draft step (ffn) and a 4-token verifier pass (ffn),
the best of 5 runs of 60 calls, in ms; and the aten calls of one decode step (torch.profiler)."""
import os
import statistics
import subprocess
import sys

CHILD = r'''
import sys, time, torch
sys.path.insert(0, '.')
from checkpoint import load_model
import speculative
from torch.profiler import profile, ProfilerActivity
name = sys.argv[1]
m = load_model(torch.load(f'out/{name}/ckpt.pt', map_location='cpu', weights_only=False),
               'cpu').eval()
idx = torch.randint(0, 65, (1, 64), generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    cache = m.new_cache(1, idx.device)
    cache.attend_to(69)
    m(idx, pos=torch.arange(64)[None], cache=cache)
    tok, p = idx[:, -1:], torch.full((1, 1), 64)
    fns = {'step': lambda: m.decode_step(tok, p, cache)}
    if m.config.route == 'ffn':
        fns['draft'] = lambda: speculative.draft_step(m, 'cheap', None, tok, p, cache)
        fns['verify4'] = lambda: speculative.verify_pass(m, idx[:, -4:],
                                                         torch.arange(64, 68)[None], cache)
    out = {}
    for k, f in fns.items():
        for _ in range(30):
            f()
        best = 1e9
        for _ in range(5):
            t = time.perf_counter()
            for _ in range(60):
                f()
            best = min(best, (time.perf_counter() - t) / 60 * 1e3)
        out[k] = best
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        m.decode_step(tok, p, cache)
    out['aten_calls'] = sum(e.count for e in prof.key_averages())
print(out)
'''
old_tree, rounds = sys.argv[1], 8
for name in ('spec_dense', 'ffn_drafter_shakespeare'):
    got = {'before': [], 'after': []}
    for _ in range(rounds):
        for side, tree in (('before', old_tree), ('after', '.')):
            res = subprocess.run([sys.executable, '-c', CHILD, name], cwd=tree,
                                 capture_output=True, text=True, check=True)
            got[side].append(eval(res.stdout.strip().splitlines()[-1]))
    for key in got['before'][0]:
        b = statistics.median(r[key] for r in got['before'])
        a = statistics.median(r[key] for r in got['after'])
        print(f'{name} {key}: before {b:.3f}, after {a:.3f}, after/before {a / b:.3f} '
              f'(medians of {rounds} alternating processes)')
