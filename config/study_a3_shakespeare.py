# study_a3 on Tiny Shakespeare (char level), CPU-sized. Needs: python data/prepare.py shakespeare_char
#   python sweep.py config/study_a3_shakespeare.py
base = 'config/ffn_stage2_shakespeare.py'
out_root = 'out/study_a3_shakespeare'
before = [['config/ffn_stage1_shakespeare.py', '--out_dir=out/ffn_stage1_shakespeare']]
seeds = [1, 2, 3]
arms = {
    'G1_std': ['--gate=mlp'],
    'G1_A3': ['--gate=mlp', '--util_weight=0', '--rank_weight=0'],
    'G3_std': ['--gate=jepa'],
    'G3_A3': ['--gate=jepa', '--util_weight=0', '--rank_weight=0'],
    'G1_onpolicy': ['--gate=mlp', '--oracle_policy=on'],
}
reference = 'G1_std'
