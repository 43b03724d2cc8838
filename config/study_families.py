# Every routing family on one model, one corpus, one schedule, one FLOPs accountant (CPU-sized),
# beside a dense frontier: dense models of four widths (d=64, 96, 128, 160; 0.29–1.52× the d=128
# model's FLOPs), so each routed arm is read against dense at equal training FLOPs and at equal eval
# FLOPs (sweep.py interpolates each seed's frontier), not against a single dense point. The room is
# how far the frontier spans in loss against the seed spread.
#   python sweep.py config/study_families.py --jobs=2            (~35 min on 2 CPU cores)
# GPU-sized variant: config/study_families_gpu.py.
base = 'config/families_synthetic.py'
out_root = 'out/study_families'
seeds = [1, 2, 3]
arms = {
    'dense': ['--route=none'],
    'dense_d64': ['--route=none', '--n_embd=64'],
    'dense_d96': ['--route=none', '--n_embd=96'],
    'dense_d160': ['--route=none', '--n_embd=160'],
    'ffn_G1_b0.5': ['--route=ffn', '--ffn_gate=mlp', '--ffn_budget=0.5', '--ffn_layers=all'],
    'mod_c0.125': ['--route=mod', '--mod_capacity=0.125'],
    'mod_c0.25': ['--route=mod', '--mod_capacity=0.25'],
    'halt_l0.05': ['--route=halt', '--halt_lambda=0.05'],
    'exit_ls': ['--route=exit', '--exit_schedule=layerskip', '--exit_threshold=0.9'],
    # from scratch the teacher (ln_f) trains only through its own LM loss
    'ensemble_joint': ['--route=ensemble', '--ens_teacher_lm_weight=1.0'],
}
reference = 'dense'
frontier = ['dense_d64', 'dense_d96', 'dense', 'dense_d160']   # the dense frontier, smallest first
