"""The greedy continuations the bench times, as text: the 60 tokens after the first (decode alone)
plus that first one, for the 8 prompts of the greedy rows (seeds 1337 and 1..7, batch 1).
    python results/cpu_2026-11-26/ffn_drafter/greedy_texts.py out/ffn_drafter_shakespeare"""
import json
import sys

import torch

sys.path.insert(0, '.')
from bench_speculative import decode_prompts  # noqa: E402
from checkpoint import load_checkpoint, load_model  # noqa: E402

path = sys.argv[1]
ckpt = load_checkpoint(f'{path}/ckpt.pt')
model = load_model(ckpt, 'cpu').eval()
chars = json.load(open('data/shakespeare_char/meta.json'))['chars']
for seed in (1337, 1, 2, 3, 4, 5, 6, 7):
    prompt, _ = decode_prompts(ckpt['config'], model.config.vocab_size, 1, 64,
                               torch.Generator().manual_seed(seed))
    y = model.generate(prompt, 61, temperature=0)
    print(seed, repr(''.join(chars[i] for i in y[0, 64:].tolist())))
