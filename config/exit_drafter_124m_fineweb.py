# The exit drafter of config/exit_drafter_shakespeare.py at the GPT-2 124M shape (12 layers, 12
# heads, d = 768, GPT-2 BPE), for one GPU: exits after {2, 6, 9} blocks sharing the final norm and
# LM head, LayerSkip's depth-growing exit-loss weights (exit_weight 4) and layer dropout (0.2 at
# the last block). On the FineWeb sample in ../shared/data (4.34M training tokens), 1,200
# iterations of 32 x 256 tokens are 2.3 epochs: enough for the first blocks to learn to draft,
# short enough not to memorise the sample. results/gpu_124m.sh trains it and times its decoding:
#   python data/prepare.py fineweb_edu --input=../shared/data/fineweb_sample_legal.parquet
#   python train.py config/exit_drafter_124m_fineweb.py
#   python bench.py --init_from=out/exit_drafter_124m_fineweb --draft_layers=6 --speculate=2,4
out_dir = 'out/exit_drafter_124m_fineweb'
dataset = 'fineweb_edu'
route = 'exit'
exit_layers = 'auto'
exit_head = 'shared'
exit_schedule = 'layerskip'
exit_weight = 4.0
layer_dropout = 0.2
n_layer = 12
n_head = 12
n_embd = 768
block_size = 256
batch_size = 32
dropout = 0.0
learning_rate = 1e-3
min_lr = 1e-4
weight_decay = 0.1
warmup_iters = 100
max_iters = 1200
eval_interval = 400
eval_iters = 20
log_interval = 50
compile = True
