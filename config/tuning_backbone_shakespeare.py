# The backbone of config/study_tuning.py: a dense 8-layer model pretrained on Tiny Shakespeare
# characters, so that the ensemble's k = 3 late layers are a minority of its depth. The same shape
# and recipe as the dense drafter of config/exit_drafter_shakespeare.py.
#   python data/prepare.py shakespeare_char && python train.py config/tuning_backbone_shakespeare.py
out_dir = 'out/tuning_backbone_shakespeare'
dataset = 'shakespeare_char'
route = 'none'
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
