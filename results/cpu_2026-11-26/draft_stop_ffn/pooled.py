"""Pool the runs of run.sh: per draft_stop and K, the plain time over the speculative time summed
over eight prompts and two rounds, each run's speedup, tokens per pass and NOISY rows."""
import glob
import json
import os

here = os.path.dirname(os.path.abspath(__file__))
for stop in ('0', '0.3'):
    files = sorted(glob.glob(os.path.join(here, f'ffn_stop{stop}_seed*_round*.json')))
    for K in (2, 4, 8):
        rows = [r for f in files for r in json.load(open(f))['rows'] if r['K'] == K]
        plain, spec = sum(r['plain_ms'] for r in rows), sum(r['spec_ms'] for r in rows)
        speedups = ' '.join('%.2f' % r['speedup'] for r in rows)
        per_pass = ' '.join('%.2f' % r['tokens_per_pass'] for r in rows)
        noisy = sum(bool(r['noisy']) for r in rows)
        print(f"draft_stop={stop} K={K}: pooled {plain / spec:.3f}x over {len(rows)} runs "
              f"(per run {speedups}; tokens per pass {per_pass}; {noisy} NOISY)")
