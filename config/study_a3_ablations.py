# The seed paper's other ablations at CPU scale: A1 (G3 without JEPA alignment: does the predictor
# collapse?), A4 (lambda_JEPA in {0.25, 1, 2}), and the 25% budget check. Same stage 1 as study_a3.
#   python sweep.py config/study_a3_ablations.py
base = 'config/ffn_stage2_synthetic.py'
# whole-sequence oracle labels: the setting docs/results.md reports this study under
overrides = ['--ffn_oracle_label=sequence']
out_root = 'out/study_a3_ablations'
before = [['config/ffn_stage1_synthetic.py', '--out_dir=out/ffn_stage1_synthetic']]
seeds = [1, 2, 3]
# G3 arms pin the G3 these results were reported with: a score read from forecasts whose action
# embeddings start 0.02 apart, which util, rank and the LM loss could not move (docs/families.md)
G3_LEGACY = ['--ffn_jepa_readout=distance', '--ffn_jepa_action_std=0.02']
arms = {
    'G3_std': ['--ffn_gate=jepa', *G3_LEGACY],
    'G3_A1_nojepa': ['--ffn_gate=jepa', *G3_LEGACY, '--ffn_jepa_weight=0'],
    'G3_A4_0.25': ['--ffn_gate=jepa', *G3_LEGACY, '--ffn_jepa_weight=0.25'],
    'G3_A4_2.0': ['--ffn_gate=jepa', *G3_LEGACY, '--ffn_jepa_weight=2.0'],
    'G1_budget25': ['--ffn_gate=mlp', '--ffn_budget=0.25'],
    'G3_budget25': ['--ffn_gate=jepa', *G3_LEGACY, '--ffn_budget=0.25'],
}
reference = 'G3_std'
