# config/study_tsa.py at the paper's GPU setting (config/tsa_shakespeare.py: d=256, H=8, batch 64,
# 5000 steps), with the full λ sweep and the early-exit baseline.
#   python sweep.py config/study_tsa_gpu.py
base = 'config/tsa_shakespeare.py'
out_root = 'out/study_tsa_gpu'
seeds = [1, 2, 3]
arms = {
    'dense': ['--route=none'],
    'tsa_l0': ['--halt_lambda=0'],
    'tsa_l0.001': ['--halt_lambda=0.001'],
    'tsa_l0.05': ['--halt_lambda=0.05'],
    'tsa_l0.5': ['--halt_lambda=0.5'],
    'exit_mean': [
        '--route=exit',
        '--exit_layers=every',
        '--exit_schedule=mean',
        '--exit_head=shared',
    ],
}
reference = 'dense'
