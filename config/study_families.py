# Every routing family on one model, one corpus, one schedule, one FLOPs accountant (CPU-sized): val
# loss against the eval forward FLOPs at the realised routing (eval_flops_vs_dense) and against TLOps
# saved. Budgets are set so the routed families run well under the dense FLOPs; the summary gives
# each arm's measured figure, so the comparison is read on the Pareto plot, not assumed matched.
#   python sweep.py config/study_families.py            (~25 min on 2 CPU cores)
# GPU-sized variant: config/study_families_gpu.py.
base = 'config/families_synthetic.py'
out_root = 'out/study_families'
seeds = [1, 2]
arms = {
    'dense': ['--route=none'],
    'ffn_G1_b0.5': ['--route=ffn', '--ffn_gate=mlp', '--ffn_budget=0.5', '--ffn_layers=all'],
    'mod_c0.125': ['--route=mod', '--mod_capacity=0.125'],
    'mod_c0.25': ['--route=mod', '--mod_capacity=0.25'],
    'halt_l0.05': ['--route=halt', '--halt_lambda=0.05'],
    'exit_ls': ['--route=exit', '--exit_schedule=layerskip', '--exit_threshold=0.9'],
    'ensemble': ['--route=ensemble'],
}
reference = 'dense'
