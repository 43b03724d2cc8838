# G1 against a G3 whose score its losses can move (ffn_jepa_readout='utility', the default: a
# utility MLP on [h, P(h,full) - P(h,cheap)]), the seed paper's comparisons (arXiv 2604.17228) on
# the backbones of config/study_a3_lookup.py (its stage-1 lookup backbones, one per seed, reused:
# the same 'before' runs and out_dirs, skipped when they are already there), 3 seeds:
#   standard recipe (util + rank from off-policy oracle labels) for G1 (the reference) and G3;
#   A3 (util/rank removed) for both; A1 (G3 without JEPA alignment: does its predictor collapse?
#   see jepa_pred_std, the spread of its forecasts across tokens at the end); A4 (lambda_JEPA 0.25
#   and 2; 1 is G3_std). The summary gives the mean controller grad norm per arm (ctrl_grad_norm:
#   G1_std / G3_std is the ratio the paper puts at ~10.3x) and each backbone's room.
#   python sweep.py config/study_g3.py --jobs=2
# Time (2 cores, --jobs=2, backbones already trained): one stage-2 run measured at ~0.85 s/iter with
# util/rank and ~0.5 s/iter without (OMP_NUM_THREADS=1, the machine shared), plus ~40 s of start-up
# and end-of-run evaluation: 15 runs x ~300 s + 6 runs x ~190 s over 2 jobs ~ 47 min, plus ~2 min of
# room evaluation: ~50 min. Without the stage-1 backbones, their 3 x 2000 iterations come first.
base = 'config/ffn_stage2_lookup.py'
out_root = 'out/study_g3'
before = [['config/ffn_stage1_lookup.py', '--out_dir=out/study_a3_lookup/stage1/seed{seed}']]
# whole-sequence oracle labels, as study_a3_lookup reports its G1 and (legacy) G3 under
overrides = ['--init_from=out/study_a3_lookup/stage1/seed{seed}/ckpt.pt',
             '--ffn_oracle_label=sequence']
room_ckpt = 'out/study_a3_lookup/stage1/seed{seed}/ckpt.pt'
seeds = [1, 2, 3]
G3 = ['--ffn_gate=jepa', '--ffn_jepa_readout=utility', '--ffn_jepa_action_std=1.0']   # pinned:
# a later change of the defaults does not change what this study ran
A3 = ['--ffn_util_weight=0', '--ffn_rank_weight=0']
arms = {
    'G1_std': ['--ffn_gate=mlp'],
    'G3_std': G3,
    'G1_A3': ['--ffn_gate=mlp', *A3],
    'G3_A3': [*G3, *A3],
    'G3_A1_nojepa': [*G3, '--ffn_jepa_weight=0'],
    'G3_A4_0.25': [*G3, '--ffn_jepa_weight=0.25'],
    'G3_A4_2.0': [*G3, '--ffn_jepa_weight=2.0'],
}
reference = 'G1_std'
