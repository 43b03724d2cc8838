# Early exits with auxiliary losses (deep supervision, LayerSkip, CALM), CPU-sized: exit heads after
# {2, n/2, 3n/4} blocks sharing the final norm + LM head (LayerSkip), LayerSkip's depth-growing loss
# weights, and per-token early exit at eval when the max softmax probability reaches exit_threshold
# (CALM; an exited token's state is copied upward and later layers still compute its K/V). The
# end-of-run summary sweeps the threshold and reports every exit head's loss alone.
#   python train.py config/exit_synthetic.py \
#       [--exit_schedule=calm --exit_rotation=2 --layer_dropout=0.2]
out_dir = 'out/exit_synthetic'
route = 'exit'
exit_layers = 'auto'
exit_head = 'shared'
exit_schedule = 'layerskip'
exit_weight = 1.0
exit_conf = 'softmax'
exit_threshold = 0.9
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
