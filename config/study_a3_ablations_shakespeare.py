# study_a3_ablations on Tiny Shakespeare (char level), CPU-sized: A1, A4 and the 25% budget check.
#   python data/prepare.py shakespeare_char && \
#       python sweep.py config/study_a3_ablations_shakespeare.py
base = 'config/ffn_stage2_shakespeare.py'
out_root = 'out/study_a3_ablations_shakespeare'
before = [['config/ffn_stage1_shakespeare.py', '--out_dir=out/ffn_stage1_shakespeare']]
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
