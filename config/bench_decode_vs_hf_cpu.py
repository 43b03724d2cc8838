# Dense greedy decode beside Hugging Face transformers' GPT-2 at the GPT-2 124M shape, fp32 on the
# CPU: 64-token prompt, 64 new tokens, batch 1 and 8, decode alone (docs/results.md).
#   python bench.py config/bench_decode_vs_hf_cpu.py --json
#   python bench.py config/bench_decode_vs_hf_cpu.py --compile=True   # adds the compiled step
decode_vs_hf = True
n_layer = 12
n_head = 12
n_embd = 768
block_size = 1024
vocab_size = 50257
decode_prompt = 64
decode_tokens = 64
decode_batches = '1,8'
bench_steps = 5
device = 'cpu'
dtype = 'float32'
