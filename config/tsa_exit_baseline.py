# TSA's early-exit baseline (arXiv 2605.05222) for the matched-α comparison, CPU-sized like
# config/tsa_shakespeare_cpu.py: one exit after every block, shared norm + head, loss = mean CE over
# every exit and the final layer. The summary's threshold sweep gives loss at each TLOps saved, to
# set beside TSA's hard-skip rows at the same α. GPU paper setting: add the overrides of
# config/tsa_shakespeare.py (d=256, H=8, batch 64, 5000 steps, lr 3e-4).
#   python train.py config/tsa_exit_baseline.py
out_dir = 'out/tsa_exit_baseline'
dataset = 'shakespeare_char'
route = 'exit'
exit_layers = 'every'
exit_head = 'shared'
exit_schedule = 'mean'
exit_threshold = 0.9
n_layer = 6
n_head = 4
n_embd = 128
block_size = 128
batch_size = 32
dropout = 0.1
max_iters = 800
learning_rate = 1e-3
min_lr = 1e-4
warmup_iters = 50
eval_interval = 200
eval_iters = 20
log_interval = 25
