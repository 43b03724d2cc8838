"""
Sample from a trained nanodepth model.

    python sample.py --out_dir=out/quickstart --start="12+34=" --num_samples=3 --max_new_tokens=100

Decodes with the tokenizer recorded in the data's meta.json (char, byte, gpt2 or the synthetic
corpus's symbols) and uses the KV cache unless --use_cache=False. Routed models decode routed (as
model.eval() routes, causal per token) and print the realised full-path fraction per routed layer.
--prompts_file=FILE: one prompt per line, decoded together as one batch of different lengths.
"""
import json
import os
import sys
import time

import torch

from configurator import ConfigError, load_config
from model import GPT, GPTConfig

DEFAULTS = dict(out_dir='out/quickstart', start='\n', num_samples=3, max_new_tokens=200, temperature=0.8,
                top_k=200, seed=1337, device='auto', use_cache=True, data_dir='', prompts_file='')
HERE = os.path.dirname(os.path.abspath(__file__))


def load_tokenizer(meta):
    """(encode, decode) for the tokenizer named in a dataset's meta.json."""
    tok = meta.get('tokenizer')
    if tok == 'gpt2':
        sys.path.insert(0, os.path.join(HERE, 'data'))
        from prepare import ensure_tiktoken_cache
        import tiktoken
        ensure_tiktoken_cache()
        enc = tiktoken.get_encoding('gpt2')
        return (lambda s: enc.encode(s, allowed_special={'<|endoftext|>'})), enc.decode
    if tok == 'byte':
        return (lambda s: list(s.encode('utf-8'))), (lambda ids: bytes(ids).decode('utf-8', errors='replace'))
    itos = meta['chars'] if tok == 'char' else meta['itos']
    stoi = {s: i for i, s in enumerate(itos)}
    if tok == 'char':
        return (lambda s: [stoi[c] for c in s if c in stoi]), (lambda ids: ''.join(itos[i] for i in ids))
    # synthetic: symbols may be multi-character; greedy longest match on encode
    syms = sorted(stoi, key=len, reverse=True)

    def encode(s):
        out, i = [], 0
        while i < len(s):
            m = next((t for t in syms if s.startswith(t, i)), None)
            if m is None:
                i += 1
                continue
            out.append(stoi[m])
            i += len(m)
        return out
    return encode, (lambda ids: ''.join(itos[i] for i in ids))


def main(argv):
    cfg = load_config(DEFAULTS, argv)
    path = os.path.join(cfg['out_dir'], 'ckpt.pt')
    if not os.path.exists(path):
        raise ConfigError(f"no checkpoint at {path}; train one first with: python train.py --out_dir={cfg['out_dir']}")
    dev = torch.device(cfg['device'] if cfg['device'] != 'auto' else ('cuda' if torch.cuda.is_available() else 'cpu'))
    ckpt = torch.load(path, map_location='cpu', weights_only=False)
    if ckpt['model_args'].get('route') == 'ffn' and ckpt['model_args'].get('gate') == 'oracle':
        raise ConfigError("gate='oracle' routes by the targets, so it cannot generate; sample from a model with a causal gate")
    model = GPT(GPTConfig.from_dict(ckpt['model_args']))
    model.load_state_dict(ckpt['model'])
    model.eval().to(dev)
    tcfg = ckpt['config']
    folder = os.path.join(cfg['data_dir'] or tcfg.get('data_dir') or os.path.join(HERE, 'data'), tcfg['dataset'])
    if not os.path.exists(os.path.join(folder, 'meta.json')):
        raise ConfigError(f"no {folder}/meta.json to decode with: run python data/prepare.py {tcfg['dataset']} "
                          f"(or pass --data_dir=...)")
    with open(os.path.join(folder, 'meta.json')) as f:
        encode, decode = load_tokenizer(json.load(f))
    torch.manual_seed(cfg['seed'])
    stats, lengths = {}, None
    if cfg['prompts_file']:            # a batch of prompts of different lengths, right-padded
        with open(cfg['prompts_file']) as f:
            prompts = [encode(line.rstrip('\n')) or [0] for line in f if line.strip()]
        if not prompts:
            raise ConfigError(f"{cfg['prompts_file']} has no prompts")
        lengths = [len(p) for p in prompts]
        if max(lengths) + cfg['max_new_tokens'] > model.config.block_size:
            raise ConfigError(f"the longest prompt ({max(lengths)} tokens) plus max_new_tokens exceeds "
                              f"block_size {model.config.block_size}")
        x = torch.tensor([p + [0] * (max(lengths) - len(p)) for p in prompts], dtype=torch.long, device=dev)
    else:
        ids = encode(cfg['start']) or [0]
        x = torch.tensor(ids, dtype=torch.long, device=dev)[None].repeat(cfg['num_samples'], 1)
    t0 = time.time()
    y = model.generate(x, cfg['max_new_tokens'], temperature=cfg['temperature'], top_k=cfg['top_k'] or None,
                       use_cache=cfg['use_cache'], lengths=lengths, stats=stats)
    dt = time.time() - t0
    for row in y:
        print(decode(row.tolist()))
        print('---------------')
    print(f"{len(y) * cfg['max_new_tokens'] / dt:,.0f} tokens/s ({dev}, cache={cfg['use_cache'] or lengths is not None}, "
          f"route={model.config.route})")
    if 'full_frac' in stats:
        print("realised full-path fraction per routed layer (mean over forwards): " + ' '.join(f"{f:.3f}" for f in stats['full_frac'])
              + (f" | TLOps saved {stats['tlops_saved']:.3f}" if 'tlops_saved' in stats else ''))
    return 0


if __name__ == '__main__':
    try:
        sys.exit(main(sys.argv[1:]))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
