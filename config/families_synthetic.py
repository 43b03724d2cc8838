# The shared CPU-sized setup of the family comparison (config/study_families.py): one model shape,
# one corpus (the built-in synthetic one, with difficulty classes), one schedule; each family is a
# set of overrides. Alone it trains a Mixture-of-Depths model (capacity 12.5%, every other block
# routed).
#   python train.py config/families_synthetic.py [--route=none|ffn|halt|mod|exit|ensemble ...]
out_dir = 'out/families_synthetic'
dataset = 'synthetic'
route = 'mod'
mod_router = 'learned'
mod_capacity = 0.125
mod_layers = 'auto'
ffn_cheap_rank = 4
n_layer = 4
n_head = 4
n_embd = 128
block_size = 128
batch_size = 16
max_iters = 600
eval_interval = 200
eval_iters = 20
log_interval = 25
learning_rate = 2e-3
min_lr = 2e-4
warmup_iters = 50
