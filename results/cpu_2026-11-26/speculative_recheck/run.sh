#!/bin/bash
# The exit, mod and halt drafters' greedy batch-1 rows again after the operator trims (88e6e16
# onwards), on the table's prompt (seed 1337) and three more, as docs/results.md pooled them before;
# run from the repository root with nothing else running. The models: out/spec_exit_w4d2
# (config/exit_drafter_shakespeare.py), out/spec_mod and out/spec_halt
# (results/cpu_2026-11-26/speculative_all/models/).
set -e
E=results/cpu_2026-11-26/speculative_recheck
for s in 1337 1 2 3; do
  python bench.py --init_from=out/spec_exit_w4d2 --speculate=2,4,8 --draft_layers=2 --decode_batches=1 --decode_prompt=64 --decode_tokens=60 --bench_steps=15 --seed=$s --out=$E/speculative_exit_w4d2_E2_seed$s.json | tee $E/speculative_exit_w4d2_E2_seed$s.log
  for f in mod halt; do
    python bench.py --init_from=out/spec_$f --speculate=2,4 --decode_batches=1 --decode_prompt=64 --decode_tokens=60 --bench_steps=15 --seed=$s --out=$E/speculative_${f}_seed$s.json | tee $E/speculative_${f}_seed$s.log
  done
done
python - <<'PY'
import glob, json
rows = [r for f in sorted(glob.glob('results/cpu_2026-11-26/speculative_recheck/*.json'))
        for r in json.load(open(f))['rows']]
for route, K in sorted({(r['route'], r['K']) for r in rows}):
    rs = [r for r in rows if (r['route'], r['K']) == (route, K)]
    pooled = sum(r['plain_ms'] for r in rs) / sum(r['spec_ms'] for r in rs)
    each = ' '.join('%.2f' % r['speedup'] for r in rs)
    noisy = sum(r['noisy'] for r in rs)
    print(f'{route} K={K}: pooled {pooled:.3f}x (per prompt {each}; {noisy} of {len(rs)} NOISY)')
PY
