"""The README's decode column for exit, mod, halt and ensemble: per family, batch 1, K = 4, the
plain time over the speculative time summed over the prompts run (the table's and prompts/, seeds
1-3, where they exist), and the share of first drafts kept, per prompt and its mean:
    python results/cpu_2026-11-26/speculative_all/first_kept.py > first_kept.txt"""
import glob
import json
import os

here = os.path.dirname(os.path.abspath(__file__))
SETS = {
    'exit E=2': 'speculative_exit_w4d2_E2.json', 'exit E=4': 'speculative_exit_w4d2.json',
    'mod': 'speculative_mod.json', 'halt': 'speculative_halt.json',
    'ensemble': 'speculative_ensemble.json', 'dense': 'speculative_dense.json',
    'ffn (rank 16, not imitating)': 'speculative_ffn.json',
}
PROMPTS = {'exit E=2': 'speculative_exit_w4d2_E2', 'exit E=4': 'speculative_exit_w4d2_E4',
           'mod': 'speculative_mod', 'halt': 'speculative_halt'}
for name, table in SETS.items():
    files = [os.path.join(here, table)] + sorted(
        glob.glob(os.path.join(here, 'prompts', f'{PROMPTS[name]}_seed*.json'))
        if name in PROMPTS else [])
    rows = [r for f in files for r in json.load(open(f))['rows'] if r['batch'] == 1 and r['K'] == 4]
    first = [r['accept_rate'][0] for r in rows]
    plain, spec = sum(r['plain_ms'] for r in rows), sum(r['spec_ms'] for r in rows)
    print(f"{name}: {len(rows)} prompts, pooled {plain / spec:.3f}x, first draft kept "
          f"{' '.join('%.2f' % a for a in first)} (mean {sum(first) / len(first):.2f}), "
          f"{sum(bool(r['noisy']) for r in rows)} NOISY")
