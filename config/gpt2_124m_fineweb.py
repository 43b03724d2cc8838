# GPT-2 small (124M) on FineWeb-Edu, GPU-sized. With 8 GPUs: ~0.5M tokens per step.
#   python data/prepare.py fineweb_edu --max_docs=2000000  # needs `pip install datasets`, network
#   torchrun --standalone --nproc_per_node=8 train.py config/gpt2_124m_fineweb.py
out_dir = 'out/gpt2_124m_fineweb'
dataset = 'fineweb_edu'
route = 'none'               # dense GPT-2 small
batch_size = 32
block_size = 1024
gradient_accumulation_steps = 16      # total over all processes: 32 * 1024 * 16 = 524,288 tokens
                                      # per step
n_layer = 12
n_head = 12
n_embd = 768
dropout = 0.0
bias = False
learning_rate = 6e-4
min_lr = 6e-5
max_iters = 20000
warmup_iters = 700
weight_decay = 0.1
eval_interval = 1000
eval_iters = 100
log_interval = 10
compile = True
