"""Speedups pooled over the four prompts (run2.sh's `together_*_apart_chained` and run3.sh's
`prompt{1,2,3}_*`): per model, K and passes per graph, the summed plain decode time over the
summed speculative one, with the per-prompt range. From the repo root:
python results/cpu_2026-11-27/compiled_passes/pooled.py"""
import json
import os

here = os.path.dirname(os.path.abspath(__file__))
for model in ('exit_E2', 'mod'):
    files = [f'together_{model}_apart_chained.json'] + [
        f'prompt{seed}_{model}_apart_chained.json' for seed in (1, 2, 3)]
    rows = [r for f in files for r in json.load(open(os.path.join(here, f)))['rows']]
    for K in sorted({r['K'] for r in rows}):
        for P in (1, 4):
            mine = [r for r in rows if r['K'] == K and r['passes_per_graph'] == P]
            plain, spec = sum(r['plain_ms'] for r in mine), sum(r['spec_ms'] for r in mine)
            each = [r['speedup'] for r in mine]
            noisy = sum(r['noisy'] for r in mine)
            print(f'{model} K={K} passes_per_graph={P}: pooled {plain / spec:.2f}x over '
                  f'{len(mine)} prompts ({min(each):.2f}-{max(each):.2f}x each, {noisy} NOISY)')
