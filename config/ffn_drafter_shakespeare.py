# A drafter-friendly ffn model for self-speculative decoding, CPU-sized: the shape and schedule of
# config/exit_drafter_shakespeare.py, with half the tokens of every layer on the full FFN (the G1
# gate, threshold routing in decoding) and the rest on a cheap low-rank FFN. The draft is the model
# with every FFN on its cheap path (--draft=cheap), so the cheap FFN is trained to imitate the full
# one as well (ffn_mimic_weight; the imitation trains only the cheap FFN), and given rank 64
# rather than 16: at this width a step costs its operators, not its FLOPs, so a wider cheap FFN
# costs the draft little and makes it agree with the full model more often. Against rank 16 (both
# imitating): the draft's validation loss 2.21 -> 2.02 nats, the routed model's 1.940 -> 1.936;
# the imitation itself costs the routed model 0.14 nats (1.80 with rank 16 and no imitation).
# At ffn_mimic_weight=0.1 it costs 0.05 nats, but the routed model then agrees less with its
# all-cheap draft and speculation barely pays (1.06-1.13x sampled): the drafter is bought with the
# model's quality (docs/results.md).
# Batch-1 speculative decode against plain decode (2-core CPU, pooled over prompts): 1.44x greedy
# at K = 4 over eight prompts, where every greedy continuation ends in a loop the draft repeats
# easily, and 1.19x sampled at temperature 1 over four (results/cpu_2026-11-26/ffn_drafter,
# docs/results.md). 2,000 iterations: 6 minutes 49 seconds (the loop's wall_s) with 2 threads.
#   python data/prepare.py shakespeare_char
#   python train.py config/ffn_drafter_shakespeare.py
#   python bench.py --init_from=out/ffn_drafter_shakespeare --speculate=1,2,3,4 --decode_batches=1
out_dir = 'out/ffn_drafter_shakespeare'
dataset = 'shakespeare_char'
route = 'ffn'
ffn_gate = 'mlp'
ffn_budget = 0.5
ffn_layers = 'all'
ffn_cheap_rank = 64
ffn_mimic_weight = 1.0
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
