# Token-Selective Attention (TSA, arXiv 2605.05222) with the paper's Tiny-Shakespeare settings, for
# a GPU: d=256, L=6, H=8, d_ff=1024, ctx 128, batch 64, 5000 steps, AdamW (0.9, 0.95), lr 3e-4
# cosine to 0.1·lr, wd 0.1, dropout 0.1, tied embeddings, residual init N(0, (0.02/sqrt(2L))^2),
# lambda=0.001. Differences: nanodepth's shakespeare_char split is 90/10 (the paper: 80/10/10);
# warmup is not stated (100 here). Dense baseline: --route=none. lambda sweep: --halt_lambda=0 /
# 0.05 / 0.5.
#   python data/prepare.py shakespeare_char && python train.py config/tsa_shakespeare.py
out_dir = 'out/tsa_shakespeare'
dataset = 'shakespeare_char'
route = 'halt'
halt_lambda = 0.001
halt_tau = 0.5
n_layer = 6
n_head = 8
n_embd = 256
block_size = 128
batch_size = 64
dropout = 0.1
max_iters = 5000
learning_rate = 3e-4
min_lr = 3e-5
warmup_iters = 100
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.95
eval_interval = 500
eval_iters = 40
log_interval = 100
compile = True
