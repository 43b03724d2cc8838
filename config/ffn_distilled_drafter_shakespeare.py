# The ffn model's speculative drafter, distilled after training: each routed layer gets a draft-only
# low-rank FFN (ffn_draft_rank), trained with everything else frozen (trainable='draft') to make
# the model with its routed FFNs replaced by them (the 'distilled' draft) match the model's
# next-token distribution, L_draft = KL(p_model || q_draft). The routed model itself is unchanged,
# where the cheap path's imitation (config/ffn_drafter_shakespeare.py) costs it 0.14 nats. Each
# position of the draft reads the model's K/V before it, as a speculative pass's first draft token
# does. Batch-1 speculative decode against plain decode (2-core CPU, pooled over prompts): 1.21x
# greedy at K = 2 over eight prompts, 1.21x sampled at temperature 1 at K = 4 over four (the
# cheap-path drafter 1.21x in the same run); 1,000 iterations: 3 min 9 s (wall_s) with 2 threads
# (results/cpu_2026-11-26/ffn_distilled, docs/results.md).
# Stage 1, the routed model (half the tokens of every layer on the full FFN, G1 gate), then stage 2:
#   python data/prepare.py shakespeare_char
#   python train.py config/exit_drafter_shakespeare.py --route=ffn --ffn_gate=mlp --ffn_budget=0.5 \
#       --ffn_layers=all --layer_dropout=0.0 --out_dir=out/ffn_shakespeare
#   python train.py config/ffn_distilled_drafter_shakespeare.py
#   python bench.py --init_from=out/ffn_distilled_drafter_shakespeare --speculate=1,2,3,4 \
#       --decode_batches=1
out_dir = 'out/ffn_distilled_drafter_shakespeare'
init_from = 'out/ffn_shakespeare/ckpt.pt'
trainable = 'draft'
dataset = 'shakespeare_char'
# the stage-1 model, as it was trained (the draft must be built on the same one)
route = 'ffn'
ffn_gate = 'mlp'
ffn_budget = 0.5
ffn_layers = 'all'
n_layer = 8
n_head = 4
n_embd = 128
block_size = 128
# the draft, and its distillation
ffn_draft_rank = 64
ffn_draft_weight = 1.0
batch_size = 16
dropout = 0.0
learning_rate = 2e-3
min_lr = 2e-4
weight_decay = 0.0
warmup_iters = 50
max_iters = 1000
eval_interval = 500
eval_iters = 20
log_interval = 50
