# TSA (arXiv 2605.05222), CPU-sized: the λ sweep against the dense baseline, and TSA against its
# early-exit baseline (one exit per block, mean CE) at matched α. Every TSA run's summary reports
# validation loss under soft gating and under hard skipping at τ in {0.3, 0.5, 0.7, 0.9}; the exit
# run's summary sweeps its confidence threshold, so the two are compared at the same TLOps saved.
# The λ = 0 controls ask whether TSA's savings come from the task loss or from the routers' −1 bias
# at init: λ = 0 with the paper's bias −1 (α starts near 0.73) and with bias 0 (α starts near 0.5);
# the train log's alpha shows α over training.
# 400 iterations per run (half of config/tsa_shakespeare_cpu.py's 800); 18 runs.
# (under an hour on 2 CPU cores):
#   python data/prepare.py shakespeare_char && python sweep.py config/study_tsa.py --jobs=2
# GPU paper setting: config/study_tsa_gpu.py.
base = 'config/tsa_shakespeare_cpu.py'
out_root = 'out/study_tsa'
overrides = ['--max_iters=400', '--eval_interval=200']
seeds = [1, 2, 3]
arms = {
    'dense': ['--route=none'],
    'tsa_l0_b-1': ['--halt_lambda=0', '--halt_router_bias=-1'],
    'tsa_l0_b0': ['--halt_lambda=0', '--halt_router_bias=0'],
    'tsa_l0.001': ['--halt_lambda=0.001'],
    'tsa_l0.05': ['--halt_lambda=0.05'],
    'exit_mean': [
        '--route=exit',
        '--exit_layers=every',
        '--exit_schedule=mean',
        '--exit_head=shared',
    ],
}
reference = 'dense'
