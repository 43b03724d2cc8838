# Tuning the Shakespeare backbone (config/tuning_backbone_shakespeare.py) on two-digit addition
# written in its characters, operands and answers zero-padded to fixed widths and the answers
# reversed (07+35=240: data/prepare.py arith --pad=True --answer=reversed): the recipe every arm of
# config/study_tuning.py shares; the arms choose what trains and their learning rates. Loss on the
# answer tokens only; score with python arith.py --ckpt=<out_dir>/ckpt.pt.
#   python data/prepare.py shakespeare_char && python train.py config/tuning_backbone_shakespeare.py
#   python data/prepare.py arith --vocab_from=data/shakespeare_char --digits=2 --ops=+ \
#       --num_problems=6000 --answer=reversed --pad=True --out_dir=data/arith_add2rp_sc
#   python train.py config/tuning_arith_shakespeare.py --trainable=lora
out_dir = 'out/tuning_arith_shakespeare'
dataset = 'arith_add2rp_sc'
init_from = 'out/tuning_backbone_shakespeare/ckpt.pt'
route = 'none'
trainable = 'all'
# the ensemble arms (route='ensemble'): the paper's k = 3 late layers, router on the final hidden
# state, log-probability mixture, KL to the final layer; 'last_layers' trains as many blocks
ens_layers = 3
ens_router_input = 'final'
ens_mix = 'logprob'
ens_kl = 'forward'
ens_kl_weight = 1.0
lora_rank = 8
lora_alpha = 16.0
n_layer = 8
n_head = 4
n_embd = 128
block_size = 128
batch_size = 16
dropout = 0.0
learning_rate = 1e-3         # full fine-tuning's; the study gives the other arms theirs
min_lr = 1e-4
warmup_iters = 30
max_iters = 1000
eval_interval = 250
eval_iters = 10
log_interval = 100
