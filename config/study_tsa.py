# TSA (arXiv 2605.05222), CPU-sized: the λ sweep against the dense baseline, and TSA against its early-exit
# baseline (one exit per block, mean CE) at matched α. Every TSA run's summary reports validation loss
# under soft gating and under hard skipping at τ in {0.3, 0.5, 0.7, 0.9}; the exit run's summary sweeps
# its confidence threshold, so the two are compared at the same TLOps saved.
# 400 iterations per run (half of config/tsa_shakespeare_cpu.py's 800) keep the study under an hour.
#   python data/prepare.py shakespeare_char && python sweep.py config/study_tsa.py   (~30 min on 2 CPU cores)
# GPU paper setting: config/study_tsa_gpu.py.
base = 'config/tsa_shakespeare_cpu.py'
out_root = 'out/study_tsa'
overrides = ['--max_iters=400', '--eval_interval=200']
seeds = [1]
arms = {
    'dense': ['--route=none'],
    'tsa_l0.001': ['--halt_lambda=0.001'],
    'tsa_l0.05': ['--halt_lambda=0.05'],
    'exit_mean': ['--route=exit', '--exit_layers=every', '--exit_schedule=mean', '--exit_head=shared'],
}
reference = 'dense'
