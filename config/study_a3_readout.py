# G3's score readout (unstated in the paper): 'distance' (as in study_a3) vs 'linear',
# each with and without util/rank, against G1's standard recipe. Same stage 1 as study_a3.
#   python sweep.py config/study_a3_readout.py
base = 'config/ffn_stage2_synthetic.py'
# whole-sequence oracle labels: the setting docs/results.md reports this study under
overrides = ['--ffn_oracle_label=sequence']
out_root = 'out/study_a3_readout'
before = [['config/ffn_stage1_synthetic.py', '--out_dir=out/ffn_stage1_synthetic']]
seeds = [1, 2, 3]
# G3 arms pin the G3 these results were reported with: a score read from forecasts whose action
# embeddings start 0.02 apart, which util, rank and the LM loss could not move (docs/families.md)
G3_LINEAR_LEGACY = ['--ffn_jepa_readout=linear', '--ffn_jepa_action_std=0.02']
arms = {
    'G1_std': ['--ffn_gate=mlp'],
    'G3lin_std': ['--ffn_gate=jepa', *G3_LINEAR_LEGACY],
    'G3lin_A3': ['--ffn_gate=jepa', *G3_LINEAR_LEGACY, '--ffn_util_weight=0',
                 '--ffn_rank_weight=0'],
}
reference = 'G1_std'
