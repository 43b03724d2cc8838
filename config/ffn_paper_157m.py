# Paper-scale (seed paper: 157.5M-parameter decoder, 12 controlled layers, 50% budget,
# controller-only, 20k steps, fineweb-edu), for one GPU. n_embd=864 with 12 layers and cheap rank
# 256 gives 157.8M parameters with the G1 gate (156.97M without position embeddings, as train.py
# prints; the paper does not give its shape). Stage 1 (backbone, random routing):
#   python data/prepare.py fineweb_edu --max_docs=2000000
#   python train.py config/ffn_paper_157m.py --ffn_gate=random --trainable=all --init_from=scratch \
#       --ffn_util_weight=0 --ffn_rank_weight=0 --out_dir=out/ffn157m_stage1 --max_iters=50000 \
#       --learning_rate=6e-4
# Stage 2 (this file: controller-only, G1 standard recipe; --ffn_gate=jepa for G3, util/rank 0 for
# A3):
#   python train.py config/ffn_paper_157m.py --seed=1
init_from = 'out/ffn157m_stage1/ckpt.pt'
out_dir = 'out/ffn157m_stage2'
dataset = 'fineweb_edu'
trainable = 'controller'
route = 'ffn'
ffn_gate = 'mlp'
ffn_budget = 0.5
ffn_layers = 'all'
ffn_cheap_rank = 256
ffn_gate_hidden = 64
ffn_jepa_latent = 64
n_layer = 12
n_head = 12
n_embd = 864
block_size = 1024
batch_size = 16
gradient_accumulation_steps = 2
ffn_util_weight = 1.0
ffn_rank_weight = 1.0
ffn_oracle_policy = 'off'
max_iters = 20000
eval_interval = 1000
eval_iters = 50
log_interval = 50
learning_rate = 1e-3
min_lr = 1e-4
warmup_iters = 200
weight_decay = 0.0
compile = True
lm_thresholds = '4.0,3.8,3.6'
avg_lm_until = 0.5
