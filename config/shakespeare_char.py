# Tiny Shakespeare, character level, CPU-sized: a few minutes on 2 cores.
#   python data/prepare.py shakespeare_char && python train.py config/shakespeare_char.py
out_dir = 'out/shakespeare_char'
dataset = 'shakespeare_char'
route = 'none'               # dense baseline (train.py's quickstart default is a routed model)
eval_interval = 250
eval_iters = 20
log_interval = 25
batch_size = 32
block_size = 128
n_layer = 4
n_head = 4
n_embd = 128
dropout = 0.1
learning_rate = 2e-3
max_iters = 1000
warmup_iters = 50
min_lr = 2e-4
