# A drafter-friendly model for self-speculative decoding (LayerSkip, arXiv 2404.16710), CPU-sized:
# 8 layers on Tiny Shakespeare characters, exits after {2, 4, 6} blocks sharing the final norm and
# LM head, LayerSkip's depth-growing exit-loss weights and its layer dropout (rate rising with
# depth to layer_dropout at the last block). The exits are what make the first blocks a draft the
# full model agrees with; the layer dropout makes the upper blocks lean less on each other.
# 2,000 iterations: 12 minutes 20 seconds alone on 2 CPU cores
# (results/cpu_2026-11-26/exit_drafter_timing), 30 minutes with one thread while two other
# trainings shared the cores (results/cpu_2026-11-25/speculative_models/exit).
#   python data/prepare.py shakespeare_char && python train.py config/exit_drafter_shakespeare.py
#   python bench.py --init_from=out/exit_drafter_shakespeare --speculate=1,2,4,8 --json
out_dir = 'out/exit_drafter_shakespeare'
dataset = 'shakespeare_char'
route = 'exit'
exit_layers = 'auto'
exit_head = 'shared'
exit_schedule = 'layerskip'
exit_weight = 1.0
layer_dropout = 0.1
n_layer = 8
n_head = 4
n_embd = 128
block_size = 128
batch_size = 16
dropout = 0.0
learning_rate = 2e-3
min_lr = 2e-4
warmup_iters = 100
max_iters = 2000
eval_interval = 500
eval_iters = 20
log_interval = 50
