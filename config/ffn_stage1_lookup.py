# Stage 1 of the controller-only recipe (arXiv 2604.17228) on a corpus with room: the synthetic
# grammar plus lookup segments, whose values are a memorised 64-entry table that only a full-width
# FFN holds (data/prepare.py synthetic_lookup). Random routing at the budget, as in
# config/ffn_stage1_synthetic.py; a rank-2 cheap FFN, so the cheap path cannot hold the table.
#   python train.py config/ffn_stage1_lookup.py
#   python eval.py --ckpt=out/ffn_stage1_lookup/ckpt.pt --room
# (--room: all-full, all-cheap, random, oracle)
out_dir = 'out/ffn_stage1_lookup'
dataset = 'synthetic_lookup'
route = 'ffn'
ffn_gate = 'random'
ffn_budget = 0.5
ffn_layers = 'all'
ffn_cheap_rank = 2
n_layer = 4
n_head = 4
n_embd = 128
block_size = 128
batch_size = 16
max_iters = 2000
eval_interval = 500
eval_iters = 20
log_interval = 50
learning_rate = 3e-3
min_lr = 3e-4
warmup_iters = 50
