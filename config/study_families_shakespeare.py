# config/study_families.py on Tiny Shakespeare (character level): the same arms on the CPU-sized TSA
# setup (config/tsa_shakespeare_cpu.py: d=128, L=6, ctx 128), 400 iterations each. Not yet run.
#   python data/prepare.py shakespeare_char && python sweep.py config/study_families_shakespeare.py
base = 'config/tsa_shakespeare_cpu.py'
out_root = 'out/study_families_shakespeare'
overrides = ['--max_iters=400', '--eval_interval=200']
seeds = [1, 2]
arms = {
    'dense': ['--route=none'],
    # the cheap-path rank is an FFN-family option: the other routes refuse it on the command line
    'ffn_G1_b0.5': ['--route=ffn', '--ffn_gate=mlp', '--ffn_budget=0.5', '--ffn_layers=all',
                    '--ffn_cheap_rank=4'],
    'mod_c0.125': ['--route=mod', '--mod_capacity=0.125'],
    'halt_l0.05': ['--route=halt', '--halt_lambda=0.05'],
    'exit_ls': ['--route=exit', '--exit_schedule=layerskip', '--exit_threshold=0.9'],
    'ensemble': ['--route=ensemble'],
}
reference = 'dense'
