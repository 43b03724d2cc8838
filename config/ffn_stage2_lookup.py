# Stage 2 on the corpus with room (config/ffn_stage1_lookup.py first): gates only, the backbone
# frozen. The default arm is the standard recipe for G1 (util + rank from off-policy oracle labels);
# arms override gate and weights as in config/ffn_stage2_synthetic.py:
#   python train.py config/ffn_stage2_lookup.py [--ffn_gate=jepa] \
#       [--ffn_util_weight=0 --ffn_rank_weight=0]
init_from = 'out/ffn_stage1_lookup/ckpt.pt'
out_dir = 'out/ffn_stage2_lookup'
dataset = 'synthetic_lookup'
trainable = 'controller'
route = 'ffn'
ffn_gate = 'mlp'
ffn_budget = 0.5
ffn_layers = 'all'
ffn_cheap_rank = 2
n_layer = 4
n_head = 4
n_embd = 128
block_size = 128
batch_size = 16
ffn_gate_grad = 'ste'
ffn_util_weight = 1.0
ffn_rank_weight = 1.0
ffn_oracle_policy = 'off'
ffn_oracle_layers_per_step = 1
ffn_jepa_weight = 1.0
max_iters = 300
eval_interval = 100
log_interval = 10
learning_rate = 3e-3
min_lr = 3e-4
warmup_iters = 20
weight_decay = 0.0
avg_lm_until = 0.5
