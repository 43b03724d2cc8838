"""Speedups pooled over the four prompts of run.sh (--seed=0..3): per model, K and passes per
graph, the summed plain decode time over the summed speculative one, with the per-prompt range,
and each variant's warm-up seconds (compiling included) on the first prompt, whose compile was
cold. From the repo root: python results/cpu_2026-11-27/compiled_ffn_halt/pooled.py"""
import json
import os

here = os.path.dirname(os.path.abspath(__file__))
for model in ('ffn', 'halt'):
    files = [f'prompt{seed}_{model}_apart_chained.json' for seed in (0, 1, 2, 3)]
    files = [f for f in files if os.path.exists(os.path.join(here, f))]
    rows = [dict(r, first=i == 0) for i, f in enumerate(files)
            for r in json.load(open(os.path.join(here, f)))['rows']]
    for K in sorted({r['K'] for r in rows}):
        for P in (1, 4):
            mine = [r for r in rows if r['K'] == K and r['passes_per_graph'] == P]
            plain, spec = sum(r['plain_ms'] for r in mine), sum(r['spec_ms'] for r in mine)
            each = [r['speedup'] for r in mine]
            noisy = sum(r['noisy'] for r in mine)
            cold = [r['warmup_s'] for r in mine if r['first']]
            print(f'{model} K={K} passes_per_graph={P}: pooled {plain / spec:.2f}x over '
                  f'{len(mine)} prompts ({min(each):.2f}-{max(each):.2f}x each, {noisy} NOISY); '
                  f'tokens/pass {mine[0]["tokens_per_pass"]:.2f} on the first; '
                  f'cold warm-up {cold[0]:.0f} s')
