# Stage 1 on Tiny Shakespeare (char level), CPU-sized; see config/ffn_stage1_synthetic.py for why
# random routing.
#   python data/prepare.py shakespeare_char && python train.py config/ffn_stage1_shakespeare.py
out_dir = 'out/ffn_stage1_shakespeare'
dataset = 'shakespeare_char'
route = 'ffn'
ffn_gate = 'random'
ffn_budget = 0.5
ffn_cheap_rank = 16
n_layer = 4
n_head = 4
n_embd = 128
block_size = 128
batch_size = 32
dropout = 0.1
max_iters = 1500
eval_interval = 250
log_interval = 25
learning_rate = 2e-3
min_lr = 2e-4
