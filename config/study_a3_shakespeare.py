# study_a3 on Tiny Shakespeare (char level), CPU-sized. Needs: python data/prepare.py
# shakespeare_char
#   python sweep.py config/study_a3_shakespeare.py
base = 'config/ffn_stage2_shakespeare.py'
out_root = 'out/study_a3_shakespeare'
before = [['config/ffn_stage1_shakespeare.py', '--out_dir=out/ffn_stage1_shakespeare']]
seeds = [1, 2, 3]
# G3 arms pin the G3 these results were reported with: a score read from forecasts whose action
# embeddings start 0.02 apart, which util, rank and the LM loss could not move (docs/families.md)
G3_LEGACY = ['--ffn_jepa_readout=distance', '--ffn_jepa_action_std=0.02']
arms = {
    'G1_std': ['--ffn_gate=mlp'],
    'G1_A3': ['--ffn_gate=mlp', '--ffn_util_weight=0', '--ffn_rank_weight=0'],
    'G3_std': ['--ffn_gate=jepa', *G3_LEGACY],
    'G3_A3': ['--ffn_gate=jepa', *G3_LEGACY, '--ffn_util_weight=0', '--ffn_rank_weight=0'],
    'G1_onpolicy': ['--ffn_gate=mlp', '--ffn_oracle_policy=on'],
}
reference = 'G1_std'
