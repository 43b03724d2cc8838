# Stage 1 of the controller-only recipe (arXiv 2604.17228), CPU-sized: train the backbone, cheap
# FFNs included, with RANDOM routing at the budget. Every token randomly takes the full or the cheap
# FFN at every controlled layer, so (a) the cheap FFNs get their own LM gradient and become useful
# on their own, and (b) the backbone learns to work under the mixed-path futures a gate will create.
#   python train.py config/ffn_stage1_synthetic.py
out_dir = 'out/ffn_stage1_synthetic'
dataset = 'synthetic'
route = 'ffn'
ffn_gate = 'random'
ffn_budget = 0.5
ffn_layers = 'all'
ffn_cheap_rank = 4
n_layer = 4
n_head = 4
n_embd = 128
block_size = 128
batch_size = 16
max_iters = 1500
eval_interval = 250
log_interval = 25
learning_rate = 2e-3
min_lr = 2e-4
warmup_iters = 50
