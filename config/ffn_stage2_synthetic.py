# Stage 2, CPU-sized: gates only (controller-only training), backbone from stage 1 frozen.
# The default arm is the seed paper's "standard recipe" for G1: util + rank supervision from
# off-policy oracle labels (one controlled layer sampled per step). Arms override gate / weights:
#   python train.py config/ffn_stage2_synthetic.py --ffn_gate=jepa \
#       --out_dir=out/ffn_stage2_synthetic_g3                                    # G3 standard
#   python train.py config/ffn_stage2_synthetic.py --ffn_util_weight=0 --ffn_rank_weight=0 \
#       --out_dir=out/ffn_stage2_synthetic_a3                                    # A3
init_from = 'out/ffn_stage1_synthetic/ckpt.pt'
out_dir = 'out/ffn_stage2_synthetic'
dataset = 'synthetic'
trainable = 'controller'
route = 'ffn'
ffn_gate = 'mlp'
ffn_budget = 0.5
ffn_layers = 'all'
ffn_cheap_rank = 4
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
lm_thresholds = '1.91,1.90,1.89'
avg_lm_until = 0.5
