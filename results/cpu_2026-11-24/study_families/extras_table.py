"""The figures of the family comparison in docs/results.md that sweep.py's summary does not hold, from
each run's end-of-run report (the summary record of its metrics.jsonl): TSA's soft loss and its hard
evals at every tau, the exits' threshold sweep, and the ensemble's final layer alone; mean and std
over seeds, and every seed's value.
    python results/cpu_2026-11-24/study_families/extras_table.py out/study_families results/cpu_2026-11-24/study_families/extras_table.json
"""
import json
import os
import sys

import numpy as np

root, out_path = sys.argv[1], sys.argv[2]
out = {}
for arm in sorted(os.listdir(root)):
    rows = {}
    for s in (1, 2, 3):
        path = os.path.join(root, arm, f'seed{s}', 'metrics.jsonl')
        if not os.path.exists(path):
            continue
        recs = [json.loads(line) for line in open(path) if line.strip()]
        summ = next((r for r in reversed(recs) if r.get('type') == 'summary'), None)
        if summ is None:
            continue
        rt, row = summ.get('routing') or {}, {}
        if 'halt' in rt:
            h = rt['halt']
            row.update(soft=h['soft']['loss'], soft_alpha=h['soft']['alpha'], soft_tlops=h['soft']['tlops_saved'])
            for x in h['hard']:
                row[f"{x['mode']}_{x['tau']:.1f}"] = x['loss']
                row[f"{x['mode']}_{x['tau']:.1f}_tlops"] = x['tlops_saved']
        if 'exit' in rt:
            for x in rt['exit']['thresholds']:
                row[f"exit_{x['threshold']}"] = x['loss']
                row[f"exit_{x['threshold']}_tlops"] = x['tlops_saved']
        for k in ('val_loss_full', 'val_loss_cheap'):
            if rt.get(k) is not None:
                row[k] = rt[k]
        if row:
            rows[s] = row
    if rows:
        keys = sorted({k for r in rows.values() for k in r})
        out[arm] = {k: dict(mean=float(np.mean([r[k] for r in rows.values() if k in r])),
                            std=float(np.std([r[k] for r in rows.values() if k in r], ddof=1)) if len(rows) > 1 else 0.0,
                            per_seed={s: r.get(k) for s, r in rows.items()}) for k in keys}
json.dump(out, open(out_path, 'w'), indent=1)
for arm, cols in out.items():
    print(arm, {k: f"{v['mean']:.4f} ± {v['std']:.4f}" for k, v in cols.items()})
