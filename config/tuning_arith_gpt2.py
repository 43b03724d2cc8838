# Tuning GPT-2 124M on two-digit addition in GPT-2's own BPE, operands and answers zero-padded and
# the answers reversed: the recipe of config/study_tuning_gpt2.py (the shape comes from the
# weights; k = 3 late layers of 12). Not run here: no GPT-2 weights and no GPU on the machine that
# wrote it; the learning rates are common choices for GPT-2 fine-tuning, not probed.
#   python data/prepare.py arith --tokenizer=gpt2 --digits=2 --ops=+ --num_problems=6000 \
#       --answer=reversed --pad=True --out_dir=data/arith_add2rp_gpt2
#   python train.py config/tuning_arith_gpt2.py --trainable=lora
out_dir = 'out/tuning_arith_gpt2'
dataset = 'arith_add2rp_gpt2'
init_from = 'gpt2'            # or a folder saved by transformers' save_pretrained
route = 'none'
trainable = 'all'
ens_layers = 3
ens_router_input = 'final'
ens_mix = 'logprob'
ens_kl = 'forward'
ens_kl_weight = 1.0
lora_rank = 8
lora_alpha = 16.0
block_size = 128
batch_size = 16
dropout = 0.0
learning_rate = 1e-4          # full fine-tuning's; the study gives the other arms theirs
min_lr = 1e-5
warmup_iters = 30
max_iters = 1000
eval_interval = 250
eval_iters = 10
log_interval = 100
