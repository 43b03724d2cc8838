"""The speedup pooled over prompts (their plain time over their speculative time, batch 1) of the
runs in this folder, or in its subfolder named (whole_model_b5980a9: the first recipe's):
    python results/cpu_2026-11-26/ffn_distilled/pooled.py [whole_model_b5980a9]"""
import glob
import json
import os
import sys

D = os.path.join(os.path.dirname(os.path.abspath(__file__)), *sys.argv[1:])
GROUPS = {
    'distilled draft, greedy, 8 prompts': ['speculative_ffn_distilled.json', 'prompts/*.json'],
    'distilled draft, sampled at temperature 1, 4 prompts':
        ['sampled/speculative_ffn_distilled_T1_seed*.json'],
    'cheap-path drafter (config/ffn_drafter_shakespeare.py), sampled at temperature 1, the same 4 '
    'prompts': ['sampled/speculative_ffn_drafter_T1_seed*.json'],
    'distilled draft at rank 128 (rank128/), greedy, the same 8 prompts':
        ['rank128/prompts/*.json'],
    'distilled draft at rank 128 (rank128/), sampled at temperature 1, the same 4 prompts':
        ['rank128/sampled/*.json'],
}
for name, patterns in GROUPS.items():
    files = sorted(f for p in patterns for f in glob.glob(os.path.join(D, p)))
    rows = [r for f in files for r in json.load(open(f))['rows'] if r['batch'] == 1]
    print(f'{name} ({len(files)} files):')
    for K in sorted({r['K'] for r in rows}):
        rs = [r for r in rows if r['K'] == K]
        plain, spec = sum(r['plain_ms'] for r in rs), sum(r['spec_ms'] for r in rs)
        each = ' '.join(f"{r['speedup']:.2f}" for r in rs)
        noisy = sum(r['noisy'] for r in rs)
        kept = ' '.join(f'{sum(r["accept_rate"][j] for r in rs) / len(rs):.2f}' for j in range(K))
        print(f'  K={K}: pooled {plain / spec:.3f}x (per prompt {each}; {noisy} of {len(rs)} '
              f'NOISY), tokens per pass {sum(r["tokens_per_pass"] for r in rs) / len(rs):.2f}, '
              f'kept per position (mean over prompts) {kept}')
