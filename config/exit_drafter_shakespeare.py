# A drafter-friendly model for self-speculative decoding (LayerSkip, arXiv 2404.16710), CPU-sized:
# 8 layers on Tiny Shakespeare characters, exits after {2, 4, 6} blocks sharing the final norm and
# LM head, LayerSkip's depth-growing exit-loss weights and its layer dropout (rate rising with
# depth to layer_dropout at the last block). The exits are what make the first blocks a draft the
# full model agrees with; the layer dropout makes the upper blocks lean less on each other.
# exit_weight 4 and layer_dropout 0.2 (from 1 and 0.1) made the exits far better drafters at the
# same final loss: exit 2 alone 1.96 nats against 2.14, exit 4 1.74 against 1.78, the full model
# 1.726 against 1.729; greedy speculative decode with exit 2 at K = 4 runs 1.63x plain decoding at
# batch 1 against 1.31x on one prompt, 1.50x against 1.24x pooled over four
# (results/cpu_2026-11-26/speculative_all, docs/results.md).
# 2,000 iterations: 8 minutes 37 seconds end to end with one thread while another training shared
# the 2 CPU cores (results/cpu_2026-11-26/speculative_all/models/exit_w4d2); 12 minutes 20 seconds
# alone on the slower 2-core machine of results/cpu_2026-11-26/exit_drafter_timing (exit_weight 1).
#   python data/prepare.py shakespeare_char && python train.py config/exit_drafter_shakespeare.py
#   python bench.py --init_from=out/exit_drafter_shakespeare --speculate=1,2,4,8 --json
out_dir = 'out/exit_drafter_shakespeare'
dataset = 'shakespeare_char'
route = 'exit'
exit_layers = 'auto'
exit_head = 'shared'
exit_schedule = 'layerskip'
exit_weight = 4.0
layer_dropout = 0.2
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
