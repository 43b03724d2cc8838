# TSA's lambda sweep against the dense baseline (SPEC §2 table), CPU-sized; each run's summary also
# reports validation loss under hard skipping at tau in {0.3, 0.5, 0.7, 0.9} beside the soft loss.
# (The early-exit baseline at matched alpha needs route='exit', not yet implemented.)
#   python data/prepare.py shakespeare_char && python sweep.py config/study_tsa.py
base = 'config/tsa_shakespeare_cpu.py'
out_root = 'out/study_tsa'
seeds = [1]
arms = {
    'dense': ['--route=none'],
    'tsa_l0': ['--halt_lambda=0'],
    'tsa_l0.001': ['--halt_lambda=0.001'],
    'tsa_l0.05': ['--halt_lambda=0.05'],
    'tsa_l0.5': ['--halt_lambda=0.5'],
}
reference = 'dense'
