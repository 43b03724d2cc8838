# Mixture-of-Depths Ensemble (Luo & Specia, arXiv 2410.13077) as a tuning method on a frozen
# backbone: start from a trained dense checkpoint, train only the k=3 late-layer norms and the
# router (LM loss on the mixture + λ·KL from the final layer as teacher). Compare with plain
# fine-tuning of the last 3 blocks:
#   python train.py config/families_synthetic.py --route=none --out_dir=out/dense_synthetic
#   python train.py config/ensemble_tune_synthetic.py
#   python train.py config/ensemble_tune_synthetic.py --route=none --trainable=last_layers \
#       --out_dir=out/lastlayers_tune_synthetic
# Both print the trainable-parameter count at the start.
out_dir = 'out/ensemble_tune_synthetic'
init_from = 'out/dense_synthetic/ckpt.pt'
route = 'ensemble'
trainable = 'controller'
ens_layers = 3
ffn_cheap_rank = 4               # as the dense checkpoint was built (unused by its dense blocks)
ens_router_input = 'final'
ens_mix = 'logprob'
ens_kl = 'forward'
ens_kl_weight = 1.0
dataset = 'synthetic'
n_layer = 4
n_head = 4
n_embd = 128
block_size = 128
batch_size = 16
max_iters = 300
eval_interval = 100
log_interval = 25
learning_rate = 1e-3
min_lr = 1e-4
warmup_iters = 20
