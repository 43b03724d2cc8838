# The family comparison at GPU scale: GPT-2-small shape on FineWeb-Edu
# (config/gpt2_124m_fineweb.py), shortened to 2000 steps per arm, bf16 + compile. Not run in this
# repository yet (see README).
#   python data/prepare.py fineweb_edu && python sweep.py config/study_families_gpu.py
base = 'config/gpt2_124m_fineweb.py'
out_root = 'out/study_families_gpu'
overrides = ['--max_iters=2000', '--eval_interval=500', '--warmup_iters=200',
             '--gradient_accumulation_steps=4']
seeds = [1, 2]
arms = {
    'dense': ['--route=none'],
    # the cheap-path rank is an FFN-family option: the other routes refuse it on the command line
    'ffn_G1_b0.5': ['--route=ffn', '--ffn_gate=mlp', '--ffn_budget=0.5', '--ffn_layers=all',
                    '--ffn_cheap_rank=64'],
    'mod_c0.125': ['--route=mod', '--mod_capacity=0.125'],
    'halt_l0.001': ['--route=halt', '--halt_lambda=0.001'],
    'exit_ls': ['--route=exit', '--exit_schedule=layerskip'],
    'ensemble': ['--route=ensemble'],
}
reference = 'dense'
