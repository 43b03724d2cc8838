# The CPU benchmark config (docs/results.md): a 4-layer d=512 model, every FFN routed (ffn) or every
# other block routed (--route=mod), GPT-2's vocabulary, prefill batches of 4096 tokens.
#   python bench.py config/bench_cpu.py --budgets=1.0,0.75,0.5,0.25,0.125 --profile=True
#   python bench.py config/bench_cpu.py --route=mod --budgets=1.0,0.75,0.5,0.25,0.125
route = 'ffn'
ffn_gate = 'mlp'
ffn_layers = 'auto'
ffn_cheap_rank = 32
n_layer = 4
n_head = 8
n_embd = 512
block_size = 1024
vocab_size = 50304
batch_size = 4
prefill_shapes = '8x512,4x1024'
decode_batches = '1,8,64'
decode_tokens = 32
bench_steps = 3
bench_warmup = 1
device = 'cpu'
dtype = 'float32'
decode_prompt = 64
