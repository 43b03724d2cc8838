# Mixture-of-Depths (Raposo et al., arXiv 2404.02258), CPU-sized: a linear router per routed block
# (every other block), capacity ceil(0.125·T) tokens per sequence in training, x + σ(r)·f(x̃) on the
# selected tokens, attention among them at their real positions. Causal sampling by the router BCE
# rule (σ(r) > 0.5); --mod_infer_rule=predictor uses the stop-gradient MLP predictor instead. The
# end-of-run summary reports the causal rule's agreement with top-k on validation.
#   python train.py config/mod_synthetic.py
out_dir = 'out/mod_synthetic'
route = 'mod'
mod_capacity = 0.125
mod_layers = 'every_other'
mod_infer_rule = 'threshold'
mod_bce_weight = 1.0
dataset = 'synthetic'
n_layer = 4
n_head = 4
n_embd = 128
block_size = 128
batch_size = 16
max_iters = 600
eval_interval = 200
log_interval = 25
learning_rate = 2e-3
min_lr = 2e-4
warmup_iters = 50
