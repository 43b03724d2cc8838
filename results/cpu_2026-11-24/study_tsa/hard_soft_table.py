"""The soft and hard rows of the study_tsa table in docs/results.md, from each run's end-of-run report
(the summary record of its metrics.jsonl): per arm and seed, soft loss, α, hard loss and TLOps saved
at every τ in both modes, the exits' threshold sweep.
    python results/cpu_2026-11-24/study_tsa/hard_soft_table.py out/study_tsa results/cpu_2026-11-24/study_tsa/hard_soft_table.json
"""
import json, sys, os, numpy as np
root = sys.argv[1]
arms = ['dense', 'tsa_l0_b-1', 'tsa_l0_b0', 'tsa_l0.001', 'tsa_l0.05', 'exit_mean']
def recs(d):
    return [json.loads(l) for l in open(os.path.join(d, 'metrics.jsonl')) if l.strip()]
out = {}
for arm in arms:
    rows = {}
    for s in (1, 2, 3):
        d = f'{root}/{arm}/seed{s}'
        if not os.path.exists(os.path.join(d, 'metrics.jsonl')): continue
        r = recs(d)
        summ = next((x for x in reversed(r) if x.get('type') == 'summary'), None)
        if summ is None: continue
        tr = [x for x in r if x.get('type') == 'train']
        ev = [x for x in r if x.get('type') == 'eval']
        row = dict(final_val=ev[-1]['val_loss'])
        rt = summ.get('routing') or {}
        if 'halt' in rt:
            h = rt['halt']
            row['soft'] = h['soft']['loss']; row['soft_alpha'] = h['soft']['alpha']; row['soft_tlops'] = h['soft']['tlops_saved']
            for x in h['hard']:
                row[f"{x['mode']}_{x['tau']:.1f}"] = x['loss']; row[f"{x['mode']}_{x['tau']:.1f}_tlops"] = x['tlops_saved']
            row['alpha_first'] = tr[0].get('alpha'); row['alpha_last'] = tr[-1].get('alpha')
        if 'exit' in rt:
            for x in rt['exit']['thresholds']:
                row[f"exit_{x['threshold']}"] = x['loss']; row[f"exit_{x['threshold']}_tlops"] = x['tlops_saved']
        if rt.get('val_loss'):
            row['causal'] = rt['val_loss']['loss']; row['eval_tlops'] = rt['val_loss'].get('tlops_saved')
        rows[s] = row
    out[arm] = rows
json.dump(out, open(sys.argv[2], 'w'), indent=1)
for arm, rows in out.items():
    keys = sorted({k for r in rows.values() for k, v in r.items() if isinstance(v, (int, float))})
    print(arm, len(rows), {k: (round(float(np.mean([r[k] for r in rows.values() if r.get(k) is not None])), 4), round(float(np.std([r[k] for r in rows.values() if r.get(k) is not None], ddof=1)), 4) if len(rows) > 1 else 0) for k in keys})
