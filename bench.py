"""
Speed of a config: training step, prefill and KV-cached decode, as tokens/s and MFU.

    python bench.py                                   # the quickstart model on this machine
    python bench.py config/gpt2_124m_fineweb.py --compile=True --json

Takes every key of train.py (model shape, batch_size, block_size, device, dtype, compile) plus
bench_steps / bench_warmup / decode_tokens / decode_batches. Random tokens, so no data is needed.
Reports medians over bench_steps timed repeats after bench_warmup untimed ones (decode: after one
untimed decode of each length); prefill is the no-grad eval forward of batch_size x block_size
tokens without targets (no loss; the last position's logits only, as generation's prefill and
--budgets' prefill); decode is decode
alone (generate of 1 + decode_tokens tokens minus generate of 1: the prefill is not counted), from a
prompt of decode_prompt tokens (block_size - decode_tokens when 0); with --json prints
exactly one JSON object, which records the device, torch version and git commit (git_sha,
git_dirty).

--out=results/<name>.json also writes the JSON (with the command and the date) to that file.

Repeats and noise: every timing keeps its bench_steps repeats (Timing: the median, and the spread
(max - min) / median); decode alone is the difference long minus short taken within each repeat, so
load that comes and goes cancels. Each routed/dense (and ours/theirs) ratio records both sides'
spreads (and, as repeats_ms, each side's repeats in order) and is marked noisy (NOISY in the
tables, with a count under them) when a side has fewer than MIN_REPEATS (3) repeats or spreads by
more than SPREAD_LIMIT (25%) of its median: the ratio could then be off by about that much.
--quick=True: the QUICK preset (128-token context, batch 1, prefill 4x128, decode batches 1 and 8
of 16 tokens, 3 repeats after 1 warm-up) for every one of those keys the command line does not
set, so the README's CPU commands take minutes on 2 cores; a progress bar over budgets (and decode
repeats) on a terminal, off with --quiet=True.

Routed vs dense: with --budgets=1.0,0.75,0.5,0.25,0.125 the config's routed model (route=ffn or mod
at that budget; route=halt or exit with its eval threshold bisected on the benchmark batch until the
realised active fraction meets the budget) is timed at each budget beside the dense model of the
same shape, in eval mode: prefill of each --prefill_shapes BxT (last-position logits, as
generation's prefill) and KV-cached decode at each --decode_batches (decode alone: the prefill's
time is subtracted). Per row: measured time ratio routed/dense, analytic forward-FLOPs ratio
routed/dense at the realised routing (ideal; and as executed, where MoD pads each row to the
longest), and their quotient flops_ratio / time_ratio = the share of the FLOPs-ideal speedup
realised (1.0 = all of it). Routing: ffn uses its gate with the threshold calibrated on the
benchmark batch; mod uses mod_router='random' at the capacity (an untrained router's σ(r) > 0.5 rule
would not hold the budget; the router is one dot product per token). Also the joint training step of
the routed model at each budget (once where training ignores the budget: TSA, exits) against the
dense one's, with the analytic step-FLOPs ratio; the training step of controller-only G1 (util/rank
off) against the dense joint step; and with --profile where the routed prefill at budget 0.5 spends
its time (torch.profiler, by op kind).

    python bench.py config/bench_cpu.py --budgets=1.0,0.75,0.5,0.25,0.125 --json

--suite=gpu runs the GPU suite (bench_suite.py): correctness of every routed path, then prefill,
decode and training rows at the GPT-2 124M shape, written to results/<gpu>_<date>/suite.json and
suite.md; --smoke=True runs it on tiny shapes on any device.

    python bench.py --suite=gpu

Dense decode beside Hugging Face transformers: with --decode_vs_hf=True our dense model (GPT-2's
architecture at the config's shape) and transformers' GPT2LMHeadModel of the same shape, random
weights, decode greedily from a decode_prompt-token prompt (64 when 0), each with its own KV cache;
the decode_tokens steps after the prefill are timed step by step, the two interleaved token by token
in one process (transformers through a manual loop over its cache, its fastest eager decode). Per
decode batch: both tokens/s and ratio = ours / theirs, eager (and compiled with --compile=True);
beside them the weights alone (every Linear applied once per token, interleaved too): no decoder
reading every weight per token in that layout goes faster, so floor / theirs bounds our ratio. Ours
decodes in GPT.decode_layout (column-major weights on the CPU, as transformers' Conv1D keeps them).

    python bench.py config/bench_decode_vs_hf_cpu.py --out=results/<device>_<date>/decode_vs_hf.json

Self-speculative decode beside plain decode (bench_speculative.py): with --speculate=1,2,4,8 the
model of --init_from=<run folder> (or a random one of the config's shape), per decode batch and K:
plain and speculative tokens/s, speedup, acceptance per draft position, tokens per verifier pass,
the draft/verify split and the speedup predicted from them; --draft/--draft_layers pick the draft.

    python bench.py --init_from=out/<run> --speculate=1,2,4,8 --json

--compile_cache=FILE.bin (with --compile=True) keeps torch.compile's compiled code across
processes and machines: read first where the file exists, then rewritten whole with what this run
compiled or reused (after each --speculate batch's warm-up and rows, and when the run ends, SIGTERM
included), keeping every earlier run's code this one did not use. A GPU machine that starts bare
compiles again only what no run kept.
"""
import contextlib
import inspect
import json
import math
import os
import statistics
import sys
import time
from dataclasses import replace
from types import SimpleNamespace

import torch

import bench_speculative
import flops
import train
from configurator import (ConfigError, asks_help, given_keys, load_config, print_help, run_cli,
                          replaceable_result, smoke_caps, source_group, writable_file)
from device import autocast_context, cli_device, resolve_device_dtype
from files import taking_turns, write_whole
from model import FAMILIES, GPT
from progress import progress
from routing import exec_path

BENCH_DEFAULTS = dict(
    bench_steps=10,         # timed repeats (medians reported)
    bench_warmup=3,         # untimed repeats before them
    decode_tokens=32,       # tokens decoded per timed decode
    decode_batches='1,8',   # batch sizes of the decode timings
    budgets='',             # routed vs dense at these full-path fractions, e.g. 1.0,0.5 ('': off)
    prefill_shapes='8x512', # BxT of the routed-vs-dense prefill timings (with --budgets)
    sparse=True,            # routed eval runs sparse (else masked-dense: every path on every token)
    profile=False,          # with --budgets: where the routed prefill at 0.5 spends its time;
                            # with --speculate: how busy the GPU is in each side's decode
    decode_prompt=0,        # prompt tokens before a timed decode (0: block_size - decode_tokens,
                            # one fewer with --budgets; 64 with --decode_vs_hf or --speculate)
    decode_vs_hf=False,     # dense decode beside transformers' GPT-2 (needs transformers)
    out='',                 # also write the JSON result to this .json file (new, or a bench result)
    suite='',               # 'gpu': the GPU suite of bench_suite.py (its options below)
    smoke=False,            # --suite on tiny shapes, on any device
    suite_seconds=420,      # --suite: rows not started within this many seconds are skipped
    quick=False,            # the QUICK preset: smaller shapes, 3 repeats (minutes on 2 cores)
    quiet=False,            # no progress bar (there is none off a terminal either)
    compile_cache='',       # with --compile=True: a file of torch.compile's compiled code, read
                            # first where it exists and rewritten as the run goes ('': off)
    **bench_speculative.SPECULATE_DEFAULTS,     # --speculate=1,2,4,8 [--draft=NAME]
)
# --quick=True: each of these that the command line does not set itself (a config file's value is
# replaced); the README's CPU commands finish in about 3 minutes on 2 cores with it
QUICK = dict(bench_steps=3, bench_warmup=1, decode_tokens=16, decode_batches='1,8',
             prefill_shapes='4x128', batch_size=1, block_size=128)
SPREAD_LIMIT = 0.25     # a ratio is 'noisy' when either side's repeats spread by more than this
MIN_REPEATS = 3         # ... or when a side has fewer repeats than this (no spread to judge by)
BENCH_EXAMPLES = dict(budgets="'1.0,0.5'", decode_batches="'1,8'", prefill_shapes="'8x512' (BxT)")


def numbers(cfg, key, kind):
    """The comma-separated values of a list option such as --budgets=1.0,0.5, each parsed by
    kind."""
    try:
        values = [kind(s) for s in str(cfg[key]).split(',') if s.strip()]
    except ValueError:
        raise ConfigError(f"{key} must be a comma-separated list of {kind.__name__} values such as "
                          f"{BENCH_EXAMPLES[key]}, got {cfg[key]!r}") from None
    # as configurator refuses for an int key: torch takes 64-bit sizes, a larger one fails later
    if any(isinstance(n, int) and not -2**63 <= n < 2**63
           for v in values for n in (v if isinstance(v, tuple) else (v,))):
        raise ConfigError(f"{key} is too large: {cfg[key]!r} holds a number that does not fit in "
                          "64 bits")
    return values


def shape(text):
    b, t = text.lower().split('x')          # exactly two parts, else a ValueError
    return int(b), int(t)


def check_bench_config(cfg):
    """The benchmark's own fields, refused before any model is built."""
    at_least = dict(
        bench_steps=1, bench_warmup=0, block_size=1, batch_size=1, decode_tokens=1, decode_prompt=0
    )
    for key, lo in at_least.items():
        if cfg[key] < lo:
            raise ConfigError(f"{key} must be >= {lo}, got {cfg[key]}")
    # a list that holds no value (',') would time nothing of its kind: refused as a bad value
    batches = numbers(cfg, 'decode_batches', int)
    if not batches or any(b < 1 for b in batches):
        raise ConfigError(f"decode_batches must be batch sizes >= 1 such as "
                          f"{BENCH_EXAMPLES['decode_batches']}, got {cfg['decode_batches']!r}")
    if cfg['decode_vs_hf'] and cfg['budgets']:     # main would time decode_vs_hf alone
        raise ConfigError("--decode_vs_hf times dense decode alone, --budgets routed vs dense; "
                          "drop one of them")
    budgets = numbers(cfg, 'budgets', float)       # (main: any text turns the routed timings on)
    if (cfg['budgets'] and not budgets) or any(not 0 < b <= 1 for b in budgets):
        raise ConfigError(f"budgets must be full-path fractions in (0, 1] such as "
                          f"{BENCH_EXAMPLES['budgets']} ('': no routed timings), got "
                          f"{cfg['budgets']!r}")
    if cfg['profile'] and not cfg['speculate'] and not any(abs(b - 0.5) < 1e-9 for b in budgets):
        raise ConfigError("--profile profiles the routed prefill at budget 0.5 (with --budgets "
                          "holding 0.5) or a --speculate decode; add one of them or drop "
                          "--profile")
    shapes = numbers(cfg, 'prefill_shapes', shape)
    # without --budgets no shape is timed, but a list of only commas is still refused as a typo
    listed = budgets or str(cfg['prefill_shapes']).strip()
    if (listed and not shapes) or any(min(s) < 1 for s in shapes):
        raise ConfigError(f"prefill_shapes must be BxT with B, T >= 1 such as "
                          f"{BENCH_EXAMPLES['prefill_shapes']}, got {cfg['prefill_shapes']!r}")
    # decode is timed with the KV cache: past block_size, generate would recompute the cropped
    # window
    # (--speculate checks its own prompt against its model's block_size)
    prompt = (cfg['decode_prompt'] if not cfg['speculate'] else 0) or 1
    if cfg['decode_vs_hf']:
        prompt = hf_prompt_len(cfg)
    if prompt + cfg['decode_tokens'] > cfg['block_size']:
        raise ConfigError(
            f"decode_tokens={cfg['decode_tokens']} plus a {prompt}-token prompt exceeds "
            f"block_size={cfg['block_size']}, so decode would not be KV-cached; lower decode_tokens"
            + (" or decode_prompt" if prompt > 1 else '')
        )


class Timing(float):
    """The median of repeated timings in seconds (a float, so arithmetic on it works as before),
    with the repeats behind it (times) and their spread."""

    def __new__(cls, times):
        t = super().__new__(cls, statistics.median(times))
        t.times = list(times)
        return t

    @property
    def spread(self):
        """(max - min) / |median| of the repeats: 0.2 = the repeats lie within 20% of the median's
        size of each other (0 for one repeat, which says nothing: see noise; infinite for a median
        of 0 s, null in the JSON)."""
        return (max(self.times) - min(self.times)) / abs(self) if self else float('inf')


def noise(*timings):
    """The spreads of the timings a ratio is made of, and whether that ratio is noisy (means
    little): a side has fewer than MIN_REPEATS repeats, or its repeats spread by more than
    SPREAD_LIMIT of its median, so the ratio could be off by about as much. repeats_ms keeps each
    side's repeats in order (ms), so that a spread can be read afterwards: one slow repeat (a
    recompile, a collection) or a drift."""
    spreads = [t.spread for t in timings]
    repeats = min(len(t.times) for t in timings)
    return dict(spreads=[round(x, 4) for x in spreads], repeats=repeats,
                noisy=repeats < MIN_REPEATS or max(spreads) > SPREAD_LIMIT,
                repeats_ms=[[round(x * 1e3, 4) for x in t.times] for t in timings])


def timed(fn, steps, warmup, dev):
    """Timing of steps calls of fn after warmup untimed ones."""
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
    return Timing(times)


def timed_difference(long, short, steps, warmup, dev):
    """Timing of long() minus short(), the two run back to back in every repeat so that load that
    comes and goes hits both alike: e.g. decode alone = generate of 1 + N tokens minus generate of
    1 (the prefill and first token cancel)."""
    for _ in range(warmup):
        long()
        short()
    return Timing([timed(long, 1, 0, dev) - timed(short, 1, 0, dev) for _ in range(steps)])


def bench(cfg):
    dev, dt = resolve_device_dtype(SimpleNamespace(**cfg))
    autocast = autocast_context(dev, dt)
    if dev.type == 'cuda':
        torch.backends.cuda.matmul.allow_tf32 = True
    torch.manual_seed(cfg['seed'])
    vocab = cfg['vocab_size']
    if not vocab:          # the dataset's vocabulary if it is prepared, else GPT-2's (padded)
        data_dir = cfg['data_dir'] or os.path.join(train.HERE, 'data')
        meta_path = os.path.join(data_dir, cfg['dataset'], 'meta.json')
        vocab = json.load(open(meta_path))['vocab_size'] if os.path.exists(meta_path) else 50304
    mcfg = train.model_config(SimpleNamespace(**cfg), vocab_size=vocab)
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
        # inference prefill, as --budgets times it: no targets, so no loss and the last
        # position's logits only
        with torch.no_grad(), autocast:
            fwd(x)
    t_prefill = timed(prefill, cfg['bench_steps'], cfg['bench_warmup'], dev)
    decode = {}
    for db in numbers(cfg, 'decode_batches', int):
        n = cfg['decode_prompt'] or max(1, T - cfg['decode_tokens'])
        prompt = torch.randint(0, mcfg.vocab_size, (db, n), device=dev)

        gen = lambda k: (lambda: model.generate(prompt, k, temperature=0, use_cache=True))
        with autocast:          # decode alone: (prefill + 1 + N steps) minus (prefill + 1)
            t = timed_difference(gen(1 + cfg['decode_tokens']), gen(1), cfg['bench_steps'], 1,
                                 dev)
        decode[db] = t
    train_tps, prefill_tps = B * T / t_train, B * T / t_prefill
    peak = flops.peak_flops(dev, dt)          # MFU from the FLOPs the step really runs (routed or
                                              # not)
    step_flops = B * flops.train_step_flops(mcfg, T)['total']
    mfu = step_flops / t_train / peak if peak else None
    return dict(
        route=mcfg.route,
        budget=FAMILIES[mcfg.route].budget(mcfg),
        vocab_size=mcfg.vocab_size,
        device=str(dev),
        device_name=torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'cpu',
        dtype=dt,
        compile=cfg['compile'],
        torch=torch.__version__,
        **train.code_version(),
        threads=torch.get_num_threads(),
        params=model.get_num_params(),
        batch_size=B,
        block_size=T,
        train_ms_per_step=t_train * 1e3,
        train_tokens_per_s=train_tps,
        train_mfu=mfu,
        prefill_tokens_per_s=prefill_tps,
        decode_tokens_per_s={str(k): k * cfg['decode_tokens'] / max(t, 1e-9)
                             for k, t in decode.items()},
        train_flops_per_step=step_flops,
        repeats=cfg['bench_steps'],
        spread=dict(train=t_train.spread, prefill=t_prefill.spread,
                    decode={str(k): t.spread for k, t in decode.items()}),
    )


def eval_model(mcfg, dev):
    return GPT(mcfg).to(dev).eval()


def op_kind(name):
    """Coarse class of an aten op for the profile breakdown."""
    if any(k in name for k in ('mm', 'addmm', 'matmul', 'linear')):
        return 'matmul'
    if any(k in name for k in ('attention', 'softmax', 'bmm', 'baddbmm')):
        return 'attention'
    if any(k in name for k in ('index', 'nonzero', 'gather', 'scatter', 'sort', 'masked', 'where')):
        return 'gather/scatter'
    if any(
        k in name
        for k in (
            'gelu',
            'layer_norm',
            'add',
            'mul',
            'sigmoid',
            'copy',
            'cat',
            'zeros',
            'fill',
            'empty',
        )
    ):
        return 'elementwise/norm'
    return 'other'


def profile_breakdown(fn):
    """Self CPU time (ms) by op kind over one call of fn, from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    out = {}
    for e in prof.key_averages():
        if e.key.startswith('aten::'):
            k = op_kind(e.key)
            out[k] = out.get(k, 0.0) + e.self_cpu_time_total / 1e3
    total = sum(out.values())
    return {k: dict(ms=v, share=v / total) for k, v in sorted(out.items(), key=lambda kv: -kv[1])}


def bench_routed(cfg):
    """The routed-vs-dense table (see the module docstring): at each budget the routed model, on the
    dense model's backbone, timed beside the dense model in the same window; and the training
    step."""
    dev, dt = resolve_device_dtype(SimpleNamespace(**cfg))
    autocast = autocast_context(dev, dt)
    base, shapes = routed_base(cfg)
    g = torch.Generator().manual_seed(cfg['seed'])
    xs = {s: torch.randint(0, base.vocab_size, s, generator=g).to(dev) for s in shapes}
    torch.manual_seed(cfg['seed'])
    dense = eval_model(replace(base, route='none'), dev)
    state = dense.state_dict()
    d_pre, d_dec = time_model(dense, cfg, xs, base, dev, autocast)
    rows, profile, trained = [], None, {}
    dense_train_ms = time_train_step(cfg, replace(base, route='none'), dev, autocast)
    for budget in progress(numbers(cfg, 'budgets', float), desc='budgets', quiet=cfg['quiet']):
        mcfg = FAMILIES[base.route].bench_config(base, budget)
        m = routed_model(mcfg, state, xs, cfg['seed'], dev, autocast, budget)
        if mcfg not in trained.values():     # TSA's and the exits' training does not depend on the
                                             # budget
            trained[budget] = mcfg
            rows.append(train_row(cfg, mcfg, base, budget, dev, autocast, dense_train_ms))
        r_pre, r_dec = time_model(m, cfg, xs, base, dev, autocast)
        # dense again, in the same window
        d_pre = time_model(dense, cfg, xs, base, dev, autocast, decode=False)[0]
        rows += prefill_rows(cfg, m, base, budget, xs, r_pre, d_pre, autocast)
        rows += [
            dict(
                kind='decode',
                budget=budget,
                batch=b,
                dense_tokens_per_s=b * cfg['decode_tokens'] / max(d_dec[b], 1e-9),
                routed_tokens_per_s=b * cfg['decode_tokens'] / max(r_dec[b], 1e-9),
                time_ratio=r_dec[b] / d_dec[b],
                **noise(r_dec[b], d_dec[b]),
            )
            for b in r_dec
        ]
        if cfg['profile'] and abs(budget - 0.5) < 1e-9:
            s, x = shapes[-1], xs[shapes[-1]]
            with autocast:
                profile = dict(
                    shape=f"{s[0]}x{s[1]}",
                    routed=profile_breakdown(no_grad_forward(m, x, cfg['sparse'])),
                    dense=profile_breakdown(no_grad_forward(dense, x, cfg['sparse'])),
                )
    return dict(
        route=base.route,
        device=str(dev),
        device_name=torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'cpu',
        dtype=dt,
        compile=cfg['compile'],
        sparse=cfg['sparse'],
        torch=torch.__version__,
        **train.code_version(),
        threads=torch.get_num_threads(),
        n_layer=base.n_layer,
        n_embd=base.n_embd,
        routed_layers=FAMILIES[base.route].routed_layers(base),
        rows=rows,
        train=bench_controller_step(cfg, base, dev, autocast),
        profile=profile,
    )


def routed_base(cfg):
    """The config --budgets times (its family must have a budget) and the prefill shapes (within its
    block_size)."""
    base = train.model_config(SimpleNamespace(**cfg), vocab_size=cfg['vocab_size'] or 50304)
    if FAMILIES[base.route].bench_config(base, 1.0) is None:
        routes = tuple(r for r, f in FAMILIES.items() if f.bench_config(base, 1.0) is not None)
        raise train.TrainError(
            f"--budgets times route={' or '.join(map(repr, routes))} against dense; "
            f"this config has route={base.route!r}"
        )
    shapes = numbers(cfg, 'prefill_shapes', shape)
    if any(T > base.block_size for _, T in shapes):
        raise train.TrainError(
            f"prefill_shapes {cfg['prefill_shapes']} exceed block_size {base.block_size}"
        )
    return base, shapes


def routed_model(mcfg, state, xs, seed, dev, autocast, budget):
    """The routed model of config mcfg on the dense model's backbone (state), its causal thresholds
    calibrated on the benchmark batches xs (ffn) or its bench_knob bisected on the first of them
    (halt, exit), so that it holds its budget."""
    torch.manual_seed(seed)
    m = eval_model(mcfg, dev)
    m.load_state_dict(state, strict=False)
    for x in xs.values():
        with torch.no_grad(), autocast:
            m.calibrate(x)
    knob = m.family.bench_knob(m.config)
    if knob:
        hold_budget(m, next(iter(xs.values())), budget, knob, autocast)
    return m


def hold_budget(m, x, budget, knob, autocast, steps=30):
    """Bisect the eval threshold knob = (field, lo, hi) of m's config to the smallest value whose
    realised active fraction on x is at least budget (raising it keeps more tokens active)."""
    field, lo, hi = knob
    if budget >= 1:                 # every token on every batch, not only on this one
        setattr(m.config, field, hi)
        return

    def active(v):
        setattr(m.config, field, v)
        with torch.no_grad(), autocast:
            f = m(x)[2].get('full_frac')
        return 1.0 if f is None else float(f.float().mean())
    for _ in range(steps):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if active(mid) < budget else (lo, mid)
    setattr(m.config, field, hi)


def no_grad_forward(m, x, sparse):
    """A call of m's eval forward on x without autograd, for timed() and the profiler."""
    def call():
        with torch.no_grad():
            return m(x, sparse=sparse)
    return call


def time_model(m, cfg, xs, base, dev, autocast, decode=True):
    """{shape: Timing} of m's prefill of each batch in xs (compiled with --compile) and {batch:
    Timing} of its eager KV-cached decode of decode_tokens tokens, on prompts drawn from the seed
    (the same prompts for every model timed). Decode alone: (prefill + 1 + N steps) minus
    (prefill + 1), paired per repeat."""
    steps, warm = cfg['bench_steps'], cfg['bench_warmup']
    g = torch.Generator().manual_seed(cfg['seed'])
    fwd = torch.compile(m, dynamic=False) if cfg['compile'] else m
    pre = {}
    for s, x in xs.items():
        torch.manual_seed(cfg['seed'])
        with autocast:
            pre[s] = timed(no_grad_forward(fwd, x, cfg['sparse']), steps, warm, dev)
    dec = {}
    for b in numbers(cfg, 'decode_batches', int) if decode else ():
        # prompt tokens
        n = cfg['decode_prompt'] or max(1, base.block_size - cfg['decode_tokens'] - 1)
        prompt = torch.randint(0, base.vocab_size, (b, n), generator=g).to(dev)
        gen = lambda k: (lambda: m.generate(prompt, k, temperature=0))
        with autocast:
            dec[b] = timed_difference(gen(1 + cfg['decode_tokens']), gen(1), steps, 1, dev)
    return pre, dec


def prefill_rows(cfg, m, base, budget, xs, r_pre, d_pre, autocast):
    """One row per prefill shape: the realised routing, routed and dense times and their ratio, the
    analytic FLOPs ratio at the realised routing (ideal, and as sparse execution runs it: MoD pads
    each row to the longest), and the share of the FLOPs-ideal speedup realised."""
    rows = []
    for s, x in xs.items():
        torch.manual_seed(cfg['seed'])
        with torch.no_grad(), autocast:
            masks = m(x, sparse=cfg['sparse'])[2].get('masks', {})
        frac = [int(v.sum()) / v.numel() for _, v in sorted(masks.items())]
        # masked-dense (--sparse=False) runs every path on every token, as the reference path
        path = exec_path(x, m.exec_mode) if cfg['sparse'] else 'reference'
        executed = m.family.executed_fracs(masks, path) if masks else None
        run_frac = executed.tolist() if executed is not None else frac
        f_ratio, exec_ratio = (prefill_flops_ratio(m.config, base, s[1], frac),
                               prefill_flops_ratio(m.config, base, s[1], run_frac, path))
        t_ratio = r_pre[s] / d_pre[s]
        rows.append(
            dict(
                kind='prefill',
                budget=budget,
                batch=s[0],
                seq=s[1],
                realised_frac=sum(frac) / len(frac),
                layer_fracs=frac,
                executed_fracs=run_frac,
                dense_ms=d_pre[s] * 1e3,
                routed_ms=r_pre[s] * 1e3,
                time_ratio=t_ratio,
                flops_ratio=f_ratio,
                executed_flops_ratio=exec_ratio,
                ideal_realised=f_ratio / t_ratio,
                **noise(r_pre[s], d_pre[s]),
            )
        )
    return rows


def prefill_flops_ratio(mcfg, base, T, full_frac, path=None):
    """Analytic forward FLOPs of mcfg's sparse prefill at the fractions full_frac (as executed on
    `path`, where the family's count depends on it) over the dense model's, both computing the
    logits of the last position only."""
    last_only = (T - 1) * 2 * base.n_embd * base.vocab_size
    dense = flops.forward_flops(replace(base, route='none'), T, 'eval') - last_only
    routed = flops.forward_flops(mcfg, T, 'sparse', full_frac=full_frac, path=path)
    return (routed - last_only) / dense


def bench_controller_step(cfg, base, dev, autocast):
    """Training step of controller-only G1 without util/rank (frozen backbone, gates only) against a
    dense joint training step of the same backbone, at batch_size x block_size."""
    g1 = controller_g1_config(base)
    dense = time_train_step(cfg, replace(base, route='none'), dev, autocast)
    ctrl = time_train_step(cfg, g1, dev, autocast, controller=True)
    return dict(dense_joint_ms=dense * 1e3, g1_controller_ms=ctrl * 1e3, ratio=ctrl / dense,
                **noise(ctrl, dense))


def controller_g1_config(base):
    """G1 (the MLP gate on every routed FFN) trained controller-only, without util/rank losses: the
    FFN-routing paper's controller step."""
    return replace(base, route='ffn', ffn_gate='mlp', ffn_util_weight=0.0, ffn_rank_weight=0.0)


def time_train_step(cfg, mcfg, dev, autocast, controller=False):
    """Seconds of one training step (forward, backward, AdamW) of a model of mcfg at batch_size x
    block_size: every parameter trained, or (controller) the routing controller alone."""
    B, T = cfg['batch_size'], mcfg.block_size
    g = torch.Generator().manual_seed(cfg['seed'])
    x = torch.randint(0, mcfg.vocab_size, (B, T), generator=g).to(dev)
    y = torch.randint(0, mcfg.vocab_size, (B, T), generator=g).to(dev)
    torch.manual_seed(cfg['seed'])
    m = GPT(mcfg).to(dev).train()
    params = list(m.parameters())
    if controller:
        ctrl = {id(p) for p in m.controller_parameters()}
        for p in m.parameters():
            p.requires_grad_(id(p) in ctrl)
        params = m.controller_parameters()
    opt = m.configure_optimizers(0.1, 1e-4, (0.9, 0.95), dev.type, params=params)
    fwd = torch.compile(m, dynamic=False) if cfg['compile'] else m

    def step():
        with autocast:
            loss = fwd(x, y)[1]
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return timed(step, cfg['bench_steps'], cfg['bench_warmup'], dev)


def train_row(cfg, mcfg, base, budget, dev, autocast, dense_s):
    """The routed model's joint training step against the dense one's (timed before the budgets),
    with the analytic step-FLOPs ratio (training top-k at the budget; soft TSA and the exits run
    every token)."""
    routed_s, T = time_train_step(cfg, mcfg, dev, autocast), base.block_size
    f_ratio = (
        flops.train_step_flops(mcfg, T)['total']
        / flops.train_step_flops(replace(base, route='none'), T)['total']
    )
    t_ratio = routed_s / dense_s
    return dict(
        kind='train',
        budget=budget,
        dense_ms=dense_s * 1e3,
        routed_ms=routed_s * 1e3,
        time_ratio=t_ratio,
        flops_ratio=f_ratio,
        ideal_realised=f_ratio / t_ratio,
        **noise(routed_s, dense_s),
    )


def spread_cell(r):
    """The spreads of a ratio's two sides as percentages, and NOISY where noise() says so."""
    text = ' / '.join(f'{x * 100:.0f}%' for x in r['spreads'])
    return f"**NOISY** {text}" if r['noisy'] else text


def noise_note(rows):
    """One line under a table: the repeats behind it, and how many of its ratios are noisy."""
    bad = sum(r['noisy'] for r in rows)
    what = (f"{bad} of {len(rows)} ratios NOISY: a side's repeats spread by more than "
            f"{SPREAD_LIMIT:.0%} of its median, or it has fewer than {MIN_REPEATS} repeats; those "
            "ratios mean little: rerun on a quieter machine or with more --bench_steps"
            if bad else f"no ratio noisy (every side's repeats within {SPREAD_LIMIT:.0%})")
    return (f"medians of {min(r['repeats'] for r in rows)}+ repeats; spread = (max - min) / "
            f"median of a side's repeats; {what}")


def print_routed(res):
    print(
        f"{res['route']} routing vs dense | {res['device']} {res['dtype']} "
        f"compile={res['compile']} "
        f"sparse={res['sparse']} torch {res['torch']} threads {res['threads']} | "
        f"L={res['n_layer']} d={res['n_embd']}"
    )
    print(
        '| budget | BxT | realised | dense ms | routed ms | time ratio | FLOPs ratio (ideal / '
        'executed) | ideal realised | spread routed / dense |'
    )
    print('|---|---|---|---|---|---|---|---|---|')
    for r in res['rows']:
        if r['kind'] == 'prefill':
            print(
                f"| {r['budget']} | {r['batch']}x{r['seq']} | {r['realised_frac']:.3f} | "
                f"{r['dense_ms']:.1f} | "
                f"{r['routed_ms']:.1f} | {r['time_ratio']:.3f} | {r['flops_ratio']:.3f} / "
                f"{r['executed_flops_ratio']:.3f} | {r['ideal_realised']:.2f} | {spread_cell(r)} |"
            )
    print('| budget | decode batch | dense tok/s | routed tok/s | time ratio | spread routed / '
          'dense |')
    print('|---|---|---|---|---|---|')
    for r in res['rows']:
        if r['kind'] == 'decode':
            print(
                f"| {r['budget']} | {r['batch']} | {r['dense_tokens_per_s']:.0f} | "
                f"{r['routed_tokens_per_s']:.0f} | "
                f"{r['time_ratio']:.3f} | {spread_cell(r)} |"
            )
    print(
        '| budget | joint training step: dense ms | routed ms | time ratio | FLOPs ratio | ideal '
        'realised | spread routed / dense |'
    )
    print('|---|---|---|---|---|---|---|')
    for r in res['rows']:
        if r['kind'] == 'train':
            print(
                f"| {r['budget']} | {r['dense_ms']:.1f} | {r['routed_ms']:.1f} | "
                f"{r['time_ratio']:.3f} | "
                f"{r['flops_ratio']:.3f} | {r['ideal_realised']:.2f} | {spread_cell(r)} |"
            )
    t = res['train']
    print(
        f"training step: dense joint {t['dense_joint_ms']:.1f} ms, controller-only G1 (no "
        "util/rank) "
        f"{t['g1_controller_ms']:.1f} ms, ratio {t['ratio']:.3f} ({spread_cell(t)})"
    )
    print(noise_note([*res['rows'], t]))
    if res['profile']:
        for name in ('routed', 'dense'):
            print(
                f"profile of the {name} prefill {res['profile']['shape']} at budget 0.5: "
                + ', '.join(
                    f"{k} {v['ms']:.0f} ms ({v['share'] * 100:.0f}%)"
                    for k, v in res['profile'][name].items()
                )
            )



# --------------------------------------------------------------------------------------------------
# dense decode beside Hugging Face transformers' GPT-2

def hf_prompt_len(cfg):
    return cfg['decode_prompt'] or 64


def gpt2_twins(cfg, dev):
    """Our dense model and transformers' GPT2LMHeadModel of the same shape (GPT-2's architecture:
    biases, tanh GELU, learned positions; the config's layers, heads, width, context and
    vocabulary), random weights, eval mode, the config's dtype; ours in the layout it decodes with
    (GPT.decode_layout: column-major weights on the CPU, as transformers' Conv1D keeps them)."""
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError:
        raise ConfigError("decode_vs_hf=True needs the transformers package: "
                          "pip install transformers") from None
    vocab = cfg['vocab_size'] or 50257
    ours_cfg = replace(
        train.model_config(SimpleNamespace(**cfg), vocab_size=vocab),
        route='none', bias=True, gelu='tanh', pos='learned', dropout=0.0,
    )
    hf_cfg = GPT2Config(
        n_layer=cfg['n_layer'], n_head=cfg['n_head'], n_embd=cfg['n_embd'],
        n_positions=cfg['block_size'], vocab_size=vocab, activation_function='gelu_new',
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        bos_token_id=vocab - 1, eos_token_id=vocab - 1,     # GPT-2's, inside any vocabulary
    )
    dtype = getattr(torch, resolve_device_dtype(SimpleNamespace(**cfg))[1])
    ours = GPT(ours_cfg).to(dev, dtype).eval().decode_layout()
    theirs = GPT2LMHeadModel(hf_cfg).to(dev, dtype).eval()
    return ours, theirs


def our_greedy_steps(model, prompt, new_tokens, compile):
    """generate's greedy KV-cached loop (equal prompts), one token per next(): the first next() runs
    the prefill and picks the first token, each later one a decoding step (decode_step, compiled
    with compile) and its argmax."""
    B, T = prompt.shape
    dev = prompt.device
    step = model.decode_step_fn(dev, compile)
    cache = model.new_cache(B, dev, compile)
    cache.attend_to(T)
    logits = model(prompt, pos=torch.arange(T, device=dev).expand(B, T), cache=cache)[0]
    nxt = model.sample_next(logits[:, -1], 0, None)
    yield
    for i in range(new_tokens):
        cache.attend_to(T + i + 1)
        logits, _ = step(nxt, torch.full((B, 1), T + i, device=dev), cache, False)
        nxt = model.sample_next(logits, 0, None)
        yield


def hf_greedy_steps(model, prompt, new_tokens):
    """transformers' fastest eager greedy decode, one token per next() as our_greedy_steps: the
    model's own KV cache, one forward per token, argmax; no generate() machinery (logits processors,
    stopping criteria, input preparation), so the comparison gives transformers its best case."""
    # transformers 5 names the cache `cache`, older releases `past_key_values`
    key = 'cache' if 'cache' in inspect.signature(model.forward).parameters else 'past_key_values'
    out = model(input_ids=prompt, use_cache=True)
    nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    yield
    for _ in range(new_tokens):
        out = model(input_ids=nxt, use_cache=True, **{key: getattr(out, key)})
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        yield


def weights_floor_steps(model, batch, new_tokens):
    """The weights' part of a decode step alone, one step per next() as our_greedy_steps: every
    Linear of the model (the blocks' projections and the LM head) applied once to a (batch, 1, in)
    input, nothing else (no attention, norms, embedding or argmax), with the weights in the model's
    layout. Any decoder of this shape, dtype and layout reads all these weights per token, so its
    tokens/s bound the model's own at small batch, where a step is bound by reading weights."""
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    p = next(model.parameters())
    xs = {n: torch.randn(batch, 1, n, device=p.device, dtype=p.dtype)
          for n in {m.in_features for m in linears}}
    yield
    for _ in range(new_tokens):
        for m in linears:
            m(xs[m.in_features])
        yield


def interleaved_decode_seconds(decoders, new_tokens, dev):
    """{name: seconds} of new_tokens decoding steps of each decoder (a generator as
    our_greedy_steps), timed step by step with the decoders interleaved per token, so load that
    comes and goes hits every decoder alike; the prefill and first token (the first next()) are
    not timed. The decoders run under this function's torch.no_grad(): a no_grad inside each
    generator, entered and left in interleaved order, could leave gradients off afterwards."""
    secs = dict.fromkeys(decoders, 0.0)
    with torch.no_grad():
        for d in decoders.values():
            next(d)
        for _ in range(new_tokens):
            for name, d in decoders.items():
                if dev.type == 'cuda':
                    torch.cuda.synchronize(dev)
                t0 = time.perf_counter()
                next(d)
                if dev.type == 'cuda':
                    torch.cuda.synchronize(dev)
                secs[name] += time.perf_counter() - t0
    return secs


def bench_decode_vs_hf(cfg):
    """Greedy KV-cached decode of our dense model (eager; and compiled with --compile=True) beside
    transformers' GPT-2 of the same shape, in one process. Decode alone: the N = decode_tokens steps
    after the prefill and first token of a decode_prompt-token prompt (64 when 0), each step timed,
    the contenders interleaved token by token (load that comes and goes hits both); tokens/s from
    the median over bench_steps repeats (after one untimed warm-up); ratio = ours / theirs."""
    import transformers
    dev, dt = resolve_device_dtype(SimpleNamespace(**cfg))
    torch.manual_seed(cfg['seed'])
    ours, theirs = gpt2_twins(cfg, dev)
    n, N = hf_prompt_len(cfg), cfg['decode_tokens']
    contenders = {'ours_eager': lambda p: our_greedy_steps(ours, p, N, False)}
    if cfg['compile']:
        contenders['ours_compiled'] = lambda p: our_greedy_steps(ours, p, N, True)
    contenders['hf'] = lambda p: hf_greedy_steps(theirs, p, N)
    contenders['floor'] = lambda p: weights_floor_steps(ours, p.size(0), N)
    rows = []
    for b in numbers(cfg, 'decode_batches', int):
        prompt = torch.randint(0, ours.config.vocab_size, (b, n), device=dev)
        secs = {name: [] for name in contenders}
        repeats = progress(range(1 + cfg['bench_steps']), desc=f'batch {b}', quiet=cfg['quiet'])
        for r in repeats:          # repeat 0: warm-up (compilation, caches)
            got = interleaved_decode_seconds({k: c(prompt) for k, c in contenders.items()}, N, dev)
            for name, t in got.items():
                secs[name] += [t] if r else []
        secs = {k: Timing(v) for k, v in secs.items()}
        tps = {k: b * N / max(v, 1e-9) for k, v in secs.items()}
        for name in (k for k in contenders if k.startswith('ours_')):
            rows.append(dict(
                batch=b, ours=name.removeprefix('ours_'), ours_tokens_per_s=tps[name],
                hf_tokens_per_s=tps['hf'], ratio=tps[name] / tps['hf'],
                weights_floor_tokens_per_s=tps['floor'],
                best_ratio_possible=tps['floor'] / tps['hf'],
                **noise(secs[name], secs['hf']),
            ))
    return dict(
        kind='decode_vs_hf', device=str(dev), dtype=dt, threads=torch.get_num_threads(),
        torch=torch.__version__, transformers=transformers.__version__, **train.code_version(),
        n_layer=cfg['n_layer'], n_head=cfg['n_head'], n_embd=cfg['n_embd'],
        block_size=cfg['block_size'], vocab_size=ours.config.vocab_size,
        prompt_tokens=n, decode_tokens=N, repeats=cfg['bench_steps'],
        ours_weights='column-major' if ours.lm_head.weight.stride(0) == 1 else 'row-major',
        hf_attn_implementation=theirs.config._attn_implementation,
        hf_loop='manual greedy loop over its KV cache (no generate())',
        timing='decode steps only, interleaved per token with transformers', rows=rows,
    )


def print_decode_vs_hf(res):
    print(f"greedy decode, {res['n_layer']}L d{res['n_embd']} {res['dtype']} on {res['device']} "
          f"({res['threads']} threads), {res['prompt_tokens']}-token prompt, "
          f"{res['decode_tokens']} new tokens, decode alone")
    print('| batch | nanodepth | nanodepth tok/s | transformers tok/s | ratio | spread ours / '
          'theirs | weights alone tok/s | floor / transformers |')
    print('|---|---|---|---|---|---|---|---|')
    for r in res['rows']:
        print(f"| {r['batch']} | {r['ours']} | {r['ours_tokens_per_s']:.1f} | "
              f"{r['hf_tokens_per_s']:.1f} | {r['ratio']:.2f} | {spread_cell(r)} | "
              f"{r['weights_floor_tokens_per_s']:.1f} | {r['best_ratio_possible']:.2f} |")
    print(noise_note(res['rows']))

def quick_preset(cfg, argv):
    """cfg with the QUICK values for every key the command line does not set (a prompt and
    decode within the smaller context; smoke caps applied again on top)."""
    given = given_keys(argv)
    quick = {k: v for k, v in QUICK.items() if k not in given}
    if 'block_size' in quick and 'block_size' not in given:
        quick['block_size'] = min(cfg['block_size'], QUICK['block_size'])
    out = {**cfg, **quick}
    if 'prefill_shapes' in quick:
        out['prefill_shapes'] = f"4x{out['block_size']}"
    if 'decode_prompt' not in given and out['decode_prompt']:
        out['decode_prompt'] = min(out['decode_prompt'], out['block_size'] // 4)
    return smoke_caps(out)


def parse_args(argv):
    """(config, as_json, argv without --json): every option checked before any work, train.py's keys
    as train.py checks them, and --out a writable .json file path."""
    as_json = '--json' in argv
    argv = [a for a in argv if a != '--json']
    cfg = load_config({**train.DEFAULTS, **BENCH_DEFAULTS}, argv)
    if cfg['quick']:
        cfg = quick_preset(cfg, argv)
    given = given_keys(argv)
    if 'init_from' in given and cfg['init_from'] != 'scratch' and not cfg['speculate']:
        # the other timings build a random model of the config's shape: the run would go unread
        raise ConfigError(f"--init_from={cfg['init_from']}: bench.py times a run's checkpoint "
                          "with --speculate alone, its other timings a random model of the "
                          "config's shape; add --speculate=K or drop --init_from (and give the "
                          "run's config for its shape)")
    # bench.py trains from no checkpoint: a config's starting point (init_from, and
    # trainable='draft' that needs one) is not train.py's to check here; --speculate reads
    # init_from as the run to time
    start = dict(init_from='scratch', trainable='all' if cfg['trainable'] == 'draft' else
                 cfg['trainable'])
    ns = SimpleNamespace(**dict(cfg, **start))
    train.check_train_config(ns)
    train.model_config(ns)
    if not (cfg['speculate'] and bench_speculative.checkpoint_file(cfg['init_from'])):
        # the config's own model: another family's option would change nothing, as in train.py
        # (its note on a config file's such options to stderr: --json's stdout is the JSON alone)
        with contextlib.redirect_stdout(sys.stderr):
            train.check_family_options(ns, argv, train.DEFAULTS)
    check_bench_config(cfg)
    cli_device(cfg['device'], cfg['dtype'])
    import bench_suite                  # here: it imports this file's helpers
    bench_suite.check_options(cfg, argv)
    bench_speculative.check_options(cfg, argv)
    if cfg['out']:
        writable_file(cfg['out'], 'out', suffix='.json')
        replaceable_result(cfg['out'], 'out', 'bench.py',
                           lambda res: str(res.get('command', '')).startswith('python bench.py'))
    if cfg['compile_cache']:
        if not cfg['compile']:
            raise ConfigError("--compile_cache keeps what --compile=True compiles; add "
                              "--compile=True or drop --compile_cache")
        writable_file(cfg['compile_cache'], 'compile_cache', suffix='.bin')
    return cfg, as_json, argv


def json_ready(obj, spread=False):
    """obj with every non-finite spread (the spread of repeats over a median of 0 s, infinite in
    memory so that the ratio reads as noisy) as None: JSON has no Infinity."""
    if isinstance(obj, dict):
        return {k: json_ready(v, spread or k in ('spread', 'spreads')) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_ready(v, spread) for v in obj]
    if spread and isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def json_text(obj, **kw):
    """A result as JSON text; any other non-finite figure raises ValueError rather than writing
    the Infinity or NaN that JSON parsers refuse."""
    return json.dumps(json_ready(obj), allow_nan=False, **kw)


def write_json_whole(path, obj):
    """obj as JSON at path (json_text), written whole: a reader (or a run stopped mid-write) sees
    the old file or the new one, never part of one."""
    text = json_text(obj, indent=1)     # first: a figure JSON cannot hold leaves the old file
    write_whole(path, lambda f: f.write(text))


def partial_json(path):
    """Where --out's rows go while a run is under way: x.partial.json beside x.json, so that a run
    stopped early leaves an earlier finished x.json as it was."""
    return path[:-len('.json')] + '.partial.json'


def load_compile_cache(path):
    """Fill torch.compile's caches from --compile_cache's file where it exists (a GPU machine that
    starts bare then compiles only what no earlier run kept); ConfigError if it is no such file.
    Code saved by another torch is left in the file, unread: it could never be reused here."""
    if not path or not os.path.exists(path):
        return
    try:
        for version, _, blob in compile_cache_entries(path):
            if version == torch.__version__ and torch.compiler.load_cache_artifacts(blob) is None:
                raise ValueError('a blob torch could not read')
    except Exception as e:      # what a foreign or truncated file raises is zipfile's or torch's
        raise ConfigError(f"compile_cache={path} is not a compile cache that this torch reads "
                          f"({type(e).__name__}: {e}); delete it or name another file") from None


def compile_cache_entries(path):
    """[(torch version, artifact keys, torch.compiler.save_cache_artifacts bytes)] of a
    --compile_cache file: a zip of such blobs and an index of their versions and keys."""
    import zipfile
    with zipfile.ZipFile(path) as z:
        return [(version, set(keys), z.read(f'{i}.bin'))
                for i, (version, keys) in enumerate(json.loads(z.read('index.json')))]


def save_compile_cache(path):
    """Add what torch.compile compiled or reused in this process to --compile_cache's file, written
    whole. torch saves only the artifacts a process used, so the file keeps each earlier blob
    holding one this process did not (a run of fewer variants loses nothing saved before; another
    torch's blobs hold none this one makes)."""
    import zipfile
    saved = torch.compiler.save_cache_artifacts() if path else None
    if not saved:
        return
    blob, info = saved
    keys = {k for ks in info.artifacts.values() for k in ks}
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    with taking_turns(path + '.lock'):
        kept = [(v, ks, b) for v, ks, b in
                (compile_cache_entries(path) if os.path.exists(path) else [])
                if not ks <= keys]
        entries = kept + [(torch.__version__, keys, blob)]

        def write(f):
            with zipfile.ZipFile(f, 'w', compression=zipfile.ZIP_DEFLATED) as z:
                z.writestr('index.json', json.dumps([[v, sorted(ks)] for v, ks, _ in entries]))
                for i, (_, _, b) in enumerate(entries):
                    z.writestr(f'{i}.bin', b)
        write_whole(path, write, binary=True)


def stop_on_sigterm():
    """SIGTERM (what `timeout` sends) as SystemExit, so that a run stopped so still runs its
    finally blocks: the compile cache keeps what was compiled before the stop. Returns a list that
    holds the signal once one came: raised inside torch.compile, the SystemExit can come out as a
    compiler error (inductor wraps what its passes raise), which the run must not report."""
    import signal
    came = []

    def stop(signum, frame):
        came.append(signum)
        raise SystemExit(128 + signum)
    signal.signal(signal.SIGTERM, stop)
    return came


def note_sigterm(came):
    """From here SIGTERM is only noted in came, not raised: a save under way (the compile cache's)
    finishes, and the error being reported is not replaced by a silent exit."""
    import signal
    signal.signal(signal.SIGTERM, lambda signum, frame: came.append(signum))


def main(argv):
    if asks_help(argv):
        own = source_group('bench.py options', BENCH_DEFAULTS, (__file__, 'BENCH_DEFAULTS'),
                           (bench_speculative.__file__, 'SPECULATE_DEFAULTS'))
        return print_help(__doc__, 'python bench.py [CONFIG.py ...] [--key=value ...] [--json]',
                          [own, *train.help_groups()], flags={'--json': 'print one JSON object'})
    cfg, as_json, argv = parse_args(argv)
    if cfg['suite']:
        import bench_suite
        return bench_suite.run(cfg, argv + ['--json'] * as_json)
    load_compile_cache(cfg['compile_cache'])
    command = 'python bench.py ' + ' '.join(argv + ['--json'] * as_json)

    def save(res):      # the raw file behind a reported figure, with the command that made it
        if cfg['out']:
            done = res.get('complete', True)
            write_json_whole(cfg['out'] if done else partial_json(cfg['out']),
                             dict(res, command=command, date=time.strftime('%Y-%m-%d')))
            if done and os.path.exists(partial_json(cfg['out'])):
                os.remove(partial_json(cfg['out']))

    def batch_done(res, rows):      # --speculate: a batch's rows shown and kept as they are done
        if not as_json:
            if len(res['rows']) == len(rows):
                bench_speculative.print_header(res)
            bench_speculative.print_rows(rows)
        save(res)
        save_compile_cache(cfg['compile_cache'])

    stopped = stop_on_sigterm() if cfg['compile_cache'] else []
    try:
        res = (bench_decode_vs_hf(cfg) if cfg['decode_vs_hf']
               else bench_speculative.bench_speculative(
                   cfg, batch_done, warmed_up=lambda: save_compile_cache(cfg['compile_cache']))
               if cfg['speculate'] else bench_routed(cfg) if cfg['budgets'] else bench(cfg))
    except BaseException as e:  # kept whatever stopped the run (a timeout's SIGTERM too)
        stopped_first = bool(stopped)       # (not a SIGTERM that comes during the save below)
        if cfg['compile_cache']:
            note_sigterm(stopped)
        save_compile_cache(cfg['compile_cache'])
        if stopped_first and not isinstance(e, SystemExit):
            print(f"bench.py: stopped by SIGTERM (a time limit's?), which surfaced as "
                  f"{type(e).__name__}; compiled code kept in {cfg['compile_cache']}",
                  file=sys.stderr)
            raise SystemExit(128 + stopped[0]) from None
        raise
    save(res)           # first: a stop during the cache's save (seconds) leaves the figures whole
    if cfg['compile_cache']:
        note_sigterm(stopped)
    save_compile_cache(cfg['compile_cache'])
    if as_json:
        print(json_text(res))
    elif cfg['decode_vs_hf']:
        print_decode_vs_hf(res)
    elif cfg['speculate']:
        bench_speculative.print_footer(res)
    elif cfg['budgets']:
        print_routed(res)
    else:
        for k, v in res.items():
            print(f"{k:>24}: {v}")
    return 0


if __name__ == '__main__':
    run_cli(main)
