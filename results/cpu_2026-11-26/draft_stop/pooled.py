"""Pool the bench runs of a folder's run.sh: per draft_stop and K, the plain time over the
speculative time summed over every prompt and round, each run's speedup, tokens per pass and NOISY
rows. From the repository root:
    python results/cpu_2026-11-26/draft_stop/pooled.py          # this folder: exit 2, K = 4, 8
    python results/cpu_2026-11-26/draft_stop/pooled.py results/cpu_2026-11-26/draft_stop_ffn \
        ffn_stop 0,0.3 2,4,8
"""
import glob
import json
import os
import sys

here = os.path.dirname(os.path.abspath(__file__))
folder, prefix, stops, ks = (sys.argv[1:] if len(sys.argv) > 1
                             else (here, 'exit_w4d2_E2_stop', '0,0.25', '4,8'))
for stop in stops.split(','):
    files = sorted(glob.glob(os.path.join(folder, f'{prefix}{stop}_seed*_round*.json')))
    for K in map(int, ks.split(',')):
        rows = [r for f in files for r in json.load(open(f))['rows'] if r['K'] == K]
        plain, spec = sum(r['plain_ms'] for r in rows), sum(r['spec_ms'] for r in rows)
        speedups = ' '.join('%.2f' % r['speedup'] for r in rows)
        per_pass = ' '.join('%.2f' % r['tokens_per_pass'] for r in rows)
        noisy = sum(bool(r['noisy']) for r in rows)
        print(f"draft_stop={stop} K={K}: pooled {plain / spec:.3f}x over {len(rows)} runs "
              f"(per run {speedups}; tokens per pass {per_pass}; {noisy} NOISY)")
