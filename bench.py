"""
Speed of a config: training step, prefill and KV-cached decode, as tokens/s and MFU.

    python bench.py                                   # the quickstart model on this machine
    python bench.py config/gpt2_124m_fineweb.py --compile=True --json

Takes every key of train.py (model shape, batch_size, block_size, device, dtype, compile) plus
bench_steps / bench_warmup / decode_tokens / decode_batches. Random tokens, so no data is needed.
Reports medians over bench_steps timed repeats after bench_warmup untimed ones; with --json prints
exactly one JSON object.
"""
import json
import os
import statistics
import sys
import time
from contextlib import nullcontext

import torch

import flops
import train
from configurator import ConfigError, load_config
from model import GPT

BENCH_DEFAULTS = dict(bench_steps=10, bench_warmup=3, decode_tokens=32, decode_batches='1,8')


def timed(fn, steps, warmup, dev):
    def sync():
        if dev.type == 'cuda':
            torch.cuda.synchronize(dev)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench(cfg):
    dev, dt = train.resolve_device_dtype(type('C', (), cfg)())
    ptdtype = {'float32': torch.float32, 'bfloat16': torch.bfloat16, 'float16': torch.float16}[dt]
    autocast = nullcontext() if dt == 'float32' else torch.autocast(device_type=dev.type, dtype=ptdtype)
    if dev.type == 'cuda':
        torch.backends.cuda.matmul.allow_tf32 = True
    torch.manual_seed(cfg['seed'])
    vocab = cfg['vocab_size']
    if not vocab:          # the dataset's vocabulary if it is prepared, else GPT-2's (padded)
        meta_path = os.path.join(cfg['data_dir'] or os.path.join(train.HERE, 'data'), cfg['dataset'], 'meta.json')
        vocab = json.load(open(meta_path))['vocab_size'] if os.path.exists(meta_path) else 50304
    mcfg = train.model_config(type('C', (), cfg)(), vocab_size=vocab)
    model = GPT(mcfg).to(dev)
    B, T = cfg['batch_size'], cfg['block_size']
    x = torch.randint(0, mcfg.vocab_size, (B, T), device=dev)
    y = torch.randint(0, mcfg.vocab_size, (B, T), device=dev)
    opt = model.configure_optimizers(0.1, 1e-4, (0.9, 0.95), dev.type)
    scaler = torch.amp.GradScaler(dev.type, enabled=(dt == 'float16'))
    fwd = torch.compile(model, dynamic=False) if cfg['compile'] else model

    def train_step():
        with autocast:
            loss = fwd(x, y)[1]
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)

    model.train()
    t_train = timed(train_step, cfg['bench_steps'], cfg['bench_warmup'], dev)
    model.eval()

    def prefill():
        with torch.no_grad(), autocast:
            fwd(x, y)
    t_prefill = timed(prefill, cfg['bench_steps'], cfg['bench_warmup'], dev)
    decode = {}
    for db in [int(s) for s in str(cfg['decode_batches']).split(',')]:
        prompt = torch.randint(0, mcfg.vocab_size, (db, max(1, T - cfg['decode_tokens'])), device=dev)

        def gen():
            with autocast:
                model.generate(prompt, cfg['decode_tokens'], temperature=0, use_cache=True)
        decode[db] = db * cfg['decode_tokens'] / timed(gen, max(1, cfg['bench_steps'] // 3), 1, dev)
    train_tps, prefill_tps = B * T / t_train, B * T / t_prefill
    peak = flops.peak_flops(dev, dt)          # MFU from the FLOPs the step really runs (routed or not)
    step_flops = B * flops.train_step_flops(mcfg, T)['total']
    mfu = step_flops / t_train / peak if peak else None
    return dict(route=mcfg.route, gate=mcfg.gate, budget=mcfg.budget, vocab_size=mcfg.vocab_size, device=str(dev), device_name=torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'cpu',
                dtype=dt, compile=cfg['compile'], torch=torch.__version__, threads=torch.get_num_threads(),
                params=model.get_num_params(), batch_size=B, block_size=T,
                train_ms_per_step=t_train * 1e3, train_tokens_per_s=train_tps, train_mfu=mfu,
                prefill_tokens_per_s=prefill_tps, decode_tokens_per_s={str(k): v for k, v in decode.items()},
                train_flops_per_step=step_flops)


def main(argv):
    as_json = '--json' in argv
    argv = [a for a in argv if a != '--json']
    cfg = load_config({**train.DEFAULTS, **BENCH_DEFAULTS}, argv)
    res = bench(cfg)
    if as_json:
        print(json.dumps(res))
    else:
        for k, v in res.items():
            print(f"{k:>24}: {v}")
    return 0


if __name__ == '__main__':
    try:
        sys.exit(main(sys.argv[1:]))
    except (ConfigError, train.TrainError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
