"""
The GPU suite: what routed execution saves in time on this machine, in one command.

    python bench.py --suite=gpu                  # GPT-2 124M shape; ~12 min on one H200 (estimate)
    python bench.py --suite=gpu --smoke=True     # the same code paths on tiny shapes, any device

Writes results/<gpu>_<date>/suite.json (with --smoke: results/<gpu>_<date>_smoke/; --out_dir=
names another folder; NANODEPTH_SMOKE=1 runs the tiny shapes too, as in every script's smoke run)
and suite.md beside it, a Markdown table of the same rows, both rewritten after every row (a run
cut short keeps what it measured). Header: commit, torch / triton / CUDA versions, GPU name, the
exact command, the date and the path routed_rows.default_path picks here.

1. Correctness first: ffn and MoD at budget 0.5 on the suite's model, sparse eval on every
   available path against the masked-dense reference (model(idx, sparse=False)). Decisions must
   be equal exactly: they are random here (ffn_gate='random', mod_router='random', seeded alike),
   so a path cannot move them; G1's threshold on bf16 activations could flip a token sitting on
   it, which is no kernel error. Logits must agree within CHECK_TOL x max|reference logit|. A
   mismatch stops the suite: one line naming path, family and difference, exit 1.
2. Rows of kind prefill, then decode, then train (a short --suite_seconds skips training first),
   each with every path routed_rows.available_paths allows here forced, in the main dtype (bf16 on
   CUDA sm_80+, fp32 on the CPU), plus the compact path in the stand-in dtype (fp16 on CUDA:
   the V100/T4 stand-in; bf16 on the CPU, so smoke runs it too):
   - prefill: ffn and MoD at budgets 1.0/0.5/0.25/0.125, shapes 16x1024 and 64x256, last-position
     logits, against the dense model timed in the same window (bench.routed_model's models: ffn's
     G1 gate calibrated to the budget, MoD's random router at the capacity);
   - decode: dense and routed (budget 0.5) at batch 1/8/64, decode alone (bench.time_model's
     subtraction); on CUDA every path but compact runs generate(compile=True), a CUDA graph per
     step, the compact path (a host sync per layer) eagerly against an eager dense baseline;
   - train: our dense step against a nanoGPT step of the same shape (NanoGPT below, a minimal copy
     of nanoGPT's model: any gap is this harness's overhead); controller-only G1 against the dense
     step; MoD at capacity 0.125 (learned router) against the dense step.
   --compile=True also compiles the prefill and training steps (beyond the 8 minutes): prefill's
   paths that torch.compile can trace in that dtype, the others eagerly (`compiled` says which).
Row: kind, route ('none' for dense), budget, shape ('BxT') or batch, path (null: training, and
dense decode), dtype, compiled, ms (prefill: one forward; decode: one step of the whole batch;
train: one step), dense_ms (the baseline's, `baseline` says which), speedup = dense_ms / ms, ideal
= dense FLOPs / routed FLOPs (prefill: as executed, bench.prefill_flops_ratio at the executed
fractions, MoD's rows padded to the longest; decode: the FLOPs-ideal, the same ratio at one
position at the mean realised fractions, which a batched step may not reach: compact MoD runs a
block for the whole batch when any row takes it, and the static paths' cached MoD step projects
every row's attention; train: flops.train_step_flops), realised = speedup / ideal; decode rows add
tokens_per_s.
Rows not started within --suite_seconds (420 on the real suite) are listed under `skipped`, rows
that raised under `failed` (exit 1 after writing both files).
Repeats: each figure is the median of --bench_steps timed repeats, after --bench_warmup untimed
ones (decode: after one untimed round). Left unset: prefill and train 10 after 3, decode 3 (each
repeat is two whole generations); with --smoke 1 of each kind, prefill and train unwarmed.
"""
import json
import os
import sys
import time
from dataclasses import replace
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

import flops
import routed_rows
import train
from bench import (controller_g1_config, eval_model, prefill_flops_ratio, routed_model,
                   time_train_step, timed, timed_difference)
from configurator import SMOKE_ENV, ConfigError, given_keys, writable_folder
from device import autocast_context, cli_device
from files import write_whole
from model import DECODE_GRAPHS, FAMILIES, allow_graphs

SUITES = ('gpu',)
BUDGETS = (1.0, 0.5, 0.25, 0.125)
ROUTES = ('ffn', 'mod')
DECODE_BUDGET = CHECK_BUDGET = 0.5
MOD_TRAIN_CAPACITY = 0.125
# The options the suite reads (it fixes shapes, budgets, paths and dtypes itself).
SUITE_OPTIONS = ('suite', 'smoke', 'out_dir', 'overwrite', 'device', 'seed', 'compile',
                 'bench_steps', 'bench_warmup', 'suite_seconds')
PLANS = dict(
    real=dict(
        model=dict(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50304,
                   ffn_cheap_rank=64),
        prefill_shapes=((16, 1024), (64, 256)), decode_batches=(1, 8, 64), decode_prompt=128,
        decode_tokens=64, decode_steps=3, train_batch=12, bench_steps=10, bench_warmup=3,
        check_shape=(4, 256)),
    smoke=dict(
        model=dict(n_layer=2, n_head=2, n_embd=64, block_size=64, vocab_size=128,
                   ffn_cheap_rank=16),
        prefill_shapes=((2, 64), (4, 32)), decode_batches=(1, 8, 64), decode_prompt=8,
        decode_tokens=4, decode_steps=1, train_batch=2, bench_steps=1, bench_warmup=0,
        check_shape=(2, 32)),
)
# max |sparse - reference| logit over max |reference| logit. Both sides round every matmul output
# to the dtype, by different kernels (a GEMM over the selected rows vs all rows): fp32 differs in
# the last bits; bf16 (8 significant bits, 2^-8 = 0.004 a rounding) accumulates up to a few
# roundings' worth over 12 residual layers; fp16 has 3 more bits. A row left unwritten or computed
# on the wrong path moves its logits by the FFN's whole update, which at GPT-2's init is as large as
# the residual stream itself: far above these.
CHECK_TOL = {torch.float32: 1e-4, torch.bfloat16: 0.05, torch.float16: 0.01}
DTYPES = {'float32': torch.float32, 'bfloat16': torch.bfloat16, 'float16': torch.float16}


class PathMismatch(Exception):
    """A path's sparse eval disagrees with the masked-dense reference."""


# --------------------------------------------------------------------------------------------------
# options

def check_options(cfg, argv):
    """Refuse, before any work, what the suite would not read: a suite name other than SUITES, a
    config file or another option beside --suite, or a suite option without --suite."""
    given = given_keys(argv)
    if 'suite' in given and not cfg['suite']:
        raise ConfigError("--suite is empty; name a suite (--suite=gpu) or drop --suite")
    if not cfg['suite']:
        for key in ('smoke', 'suite_seconds'):
            if key in given:
                raise ConfigError(f"--{key} is an option of --suite=gpu; add --suite=gpu or drop "
                                  f"--{key}")
        return
    if cfg['suite'] not in SUITES:
        raise ConfigError(f"--suite must be one of {', '.join(SUITES)}, got {cfg['suite']!r}; "
                          "e.g. --suite=gpu")
    files = [a for a in argv if not a.startswith('--')]
    if files:
        raise ConfigError(f"--suite=gpu takes no config file ({files[0]}): it fixes its own "
                          "shapes; drop the file")
    other = [k for k in given if k not in SUITE_OPTIONS]
    if other:
        reads = ', --'.join(SUITE_OPTIONS[1:])
        raise ConfigError(f"--{other[0]} is not read by --suite=gpu, which fixes its shapes, "
                          f"budgets, paths and dtypes; drop it (it reads --{reads})")
    if cfg['suite_seconds'] < 0:
        raise ConfigError(f"suite_seconds must be >= 0 (0: no limit), got {cfg['suite_seconds']}")
    cli_device(cfg['device'])
    folder = out_folder(cfg, argv)
    writable_folder(folder, 'out_dir')
    if os.path.exists(os.path.join(folder, 'suite.json')) and not cfg['overwrite']:
        raise ConfigError(f"{folder} already holds suite.json; pass --out_dir=<another folder>, "
                          "or --overwrite=True to replace it")


def smoke_plan(cfg):
    """Tiny shapes: --smoke=True, or NANODEPTH_SMOKE=1 (configurator's smoke runs, which cap every
    script's sizes so that a documented command runs in seconds)."""
    return cfg['smoke'] or os.environ.get(SMOKE_ENV, '') not in ('', '0')


def gpu_name(dev):
    """'NVIDIA H100 80GB HBM3' -> 'h100', 'Tesla V100-SXM2-16GB' -> 'v100', 'NVIDIA GeForce RTX
    4090' -> 'rtx4090'; 'cpu' off CUDA."""
    if dev.type != 'cuda':
        return 'cpu'
    words = [w for w in torch.cuda.get_device_name(dev).split()
             if w.lower() not in ('nvidia', 'tesla', 'geforce', 'quadro')]
    name = ''
    for w in words:
        name += w.split('-')[0]
        if any(c.isdigit() for c in w):
            break
    return ''.join(c for c in name.lower() if c.isalnum()) or 'gpu'


def out_folder(cfg, argv):
    if any(a.startswith('--out_dir=') for a in argv):
        return cfg['out_dir']
    dev, _ = cli_device(cfg['device'])
    suffix = '_smoke' if cfg['smoke'] else ''
    return os.path.join(train.HERE, 'results', f"{gpu_name(dev)}_{time.strftime('%Y-%m-%d')}"
                        + suffix)


def dtype_passes(dev, compiling=False):
    """[(dtype name, paths)]: the main dtype with every available path, then the stand-in dtype
    with the compact path (fp16 on CUDA sm_80+: the V100/T4 stand-in; bf16 on the CPU)."""
    if dev.type == 'cuda':
        main = 'bfloat16' if torch.cuda.get_device_capability(dev)[0] >= 8 else 'float16'
        standin = 'float16' if main == 'bfloat16' else None
    else:
        main, standin = 'float32', 'bfloat16'
    passes = [(main, routed_rows.available_paths(dev, DTYPES[main], compiling))]
    if standin and not compiling:
        passes.append((standin, ['compact']))
    return passes


def default_paths(dev):
    """The path routed_rows.default_path picks here for each dtype of the suite, eagerly and under
    torch.compile."""
    kind = 'cuda' if dev.type == 'cuda' and torch.version.hip is None else dev.type
    capability = torch.cuda.get_device_capability(dev) if kind == 'cuda' else None
    out = {}
    for name, _ in dtype_passes(dev):
        with autocast_context(dev, name):
            eager = routed_rows.default_path(torch.zeros(1, device=dev))
        compiled = os.environ.get('NANODEPTH_PATH') or routed_rows.choose_path(
            torch.__version__, kind, capability, DTYPES[name], routed_rows.installed_apis(), True)
        out[name] = dict(eager=eager, compiled=compiled)
    return out


# --------------------------------------------------------------------------------------------------
# the record

class Record:
    """The suite's JSON and Markdown, rewritten after every row; rows past the deadline skipped,
    rows that raise recorded as failed."""

    def __init__(self, header, folder, seconds):
        self.res = dict(header, rows=[], skipped=[], failed=[])
        self.folder, self.seconds, self.t0 = folder, seconds, time.monotonic()

    def run(self, label, make_rows):
        """make_rows() -> rows (dicts), unless the deadline has passed."""
        elapsed = time.monotonic() - self.t0
        if self.seconds and elapsed > self.seconds:
            self.res['skipped'].append(label)
            say(f"{elapsed:5.0f}s {label}: skipped (past --suite_seconds={self.seconds})")
            return []
        try:
            rows = make_rows()
        except Exception as e:        # one row's failure (a kernel, memory) must not lose the rest
            error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            self.res['failed'].append(dict(row=label, error=error))
            say(f"{elapsed:5.0f}s {label}: FAILED {error}")
            self.write()
            return []
        for r in rows:
            self.res['rows'].append(r)
            say(f"{time.monotonic() - self.t0:5.0f}s {describe(r)}")
        self.write()
        return rows

    def write(self):
        os.makedirs(self.folder, exist_ok=True)
        self.res['seconds'] = time.monotonic() - self.t0
        for name, text in (('suite.json', json.dumps(self.res, indent=1)),
                           ('suite.md', markdown(self.res))):
            write_whole(os.path.join(self.folder, name), lambda f: f.write(text + '\n'))


def say(text):
    print(f"suite {text}", file=sys.stderr, flush=True)


def row(kind, route, budget, where, path, dtype, compiled, ms, dense_ms, ideal, baseline='dense',
        **extra):
    """One row of the schema (module docstring); where: 'BxT' (prefill, train) or a batch size."""
    speedup = dense_ms / ms
    return dict(kind=kind, route=route, budget=budget,
                **({'batch': where} if kind == 'decode' else {'shape': where}),
                path=path, dtype=dtype, compiled=compiled, ms=ms, dense_ms=dense_ms,
                speedup=speedup, ideal=ideal, realised=speedup / ideal, baseline=baseline,
                **extra)


def describe(r):
    where = r['shape'] if 'shape' in r else f"batch {r['batch']}"
    tps = f", {r['tokens_per_s']:.0f} tok/s" if 'tokens_per_s' in r else ''
    return (f"{r['kind']} {r['route']} b={r['budget']} {where} {r['path']} {r['dtype']}"
            f"{' compiled' if r['compiled'] else ''}: {r['ms']:.3f} ms vs {r['baseline']} "
            f"{r['dense_ms']:.3f}: speedup {r['speedup']:.3f}, ideal {r['ideal']:.3f}, "
            f"realised {r['realised']:.2f}{tps}")


COLUMNS = ('kind', 'route', 'budget', 'shape / batch', 'path', 'dtype', 'compiled', 'ms',
           'baseline ms', 'baseline', 'speedup', 'ideal', 'realised', 'tokens/s')


def markdown(res):
    lines = [f"# GPU suite: {res['gpu']} ({res['date']})", '',
             f"`{res['command']}`", '',
             f"commit {res['git_sha']}{' (dirty)' if res['git_dirty'] else ''}; torch "
             f"{res['torch']}, triton {res['triton']}, CUDA {res['cuda']}; device {res['gpu']}"
             f"{' (smoke: tiny shapes, the numbers mean nothing)' if res['smoke'] else ''}; "
             f"routed_rows.default_path: {json.dumps(res['default_path'])}. The float16 compact "
             "rows stand in for a V100/T4 (compute capability 7.x).", '',
             '| ' + ' | '.join(COLUMNS) + ' |', '|' + '---|' * len(COLUMNS)]
    for r in res['rows']:
        cells = (r['kind'], r['route'], r['budget'], r.get('shape', r.get('batch')),
                 r['path'] or '', r['dtype'], 'yes' if r['compiled'] else 'no', f"{r['ms']:.3f}",
                 f"{r['dense_ms']:.3f}", r['baseline'], f"{r['speedup']:.3f}", f"{r['ideal']:.3f}",
                 f"{r['realised']:.2f}",
                 f"{r['tokens_per_s']:.0f}" if 'tokens_per_s' in r else '')
        lines.append('| ' + ' | '.join(str(c) for c in cells) + ' |')
    for what in ('skipped', 'failed'):
        if res[what]:
            lines += ['', f"{what}: " + '; '.join(map(str, res[what]))]
    return '\n'.join(lines)


# --------------------------------------------------------------------------------------------------
# 1. correctness

def check_config(base, route):
    """The family at CHECK_BUDGET with random decisions (see the module docstring)."""
    if route == 'ffn':
        return replace(base, route='ffn', ffn_gate='random', ffn_budget=CHECK_BUDGET)
    return replace(base, route='mod', mod_router='random', mod_capacity=CHECK_BUDGET)


def routed_logits(m, x, seed, dtype, sparse, path=None):
    """(every position's logits as fp32, {layer: mask}) of m's eval forward, seeded."""
    torch.manual_seed(seed)
    with torch.no_grad(), autocast_context(x.device, dtype):
        logits, _, aux = m(x, sparse=sparse, exec_mode=path, last_only=False)
    return logits.float(), aux['masks']


def check_paths(base, dev, passes, shape, seed, routes=ROUTES):
    """Every (dtype, path) of passes against the masked-dense reference, for each family of routes;
    raises PathMismatch on the first disagreement. Returns one result per (family, dtype, path)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, base.vocab_size, shape, generator=g).to(dev)
    results = []
    for route in routes:
        torch.manual_seed(seed)
        m = eval_model(check_config(base, route), dev)
        for dtype, paths in passes:
            ref, ref_masks = routed_logits(m, x, seed, dtype, sparse=False)
            scale = ref.abs().max().item()
            tol = CHECK_TOL[DTYPES[dtype]] * scale
            for path in paths:
                got, masks = routed_logits(m, x, seed, dtype, sparse=True, path=path)
                where = f"path {path!r}, route={route}, {dtype}"
                differ = [layer for layer in ref_masks
                          if not torch.equal(ref_masks[layer], masks.get(layer))]
                if differ or set(masks) != set(ref_masks):
                    raise PathMismatch(f"{where}: routing decisions differ from the masked-dense "
                                       f"reference at layers {differ or sorted(masks)}")
                diff = (got - ref).abs().max().item()
                if not diff <= tol:           # NaN fails too
                    raise PathMismatch(
                        f"{where}: logits differ from the masked-dense reference by up to "
                        f"{diff:.3g} > {tol:.3g} (= {CHECK_TOL[DTYPES[dtype]]} x max|logit| "
                        f"{scale:.3g})")
                results.append(dict(route=route, dtype=dtype, path=path, max_diff=diff,
                                    tolerance=tol, masks_equal=True))
                say(f"check {where}: decisions equal, max |logit diff| {diff:.3g} <= {tol:.3g}")
    return results


# --------------------------------------------------------------------------------------------------
# 2. prefill

def prefill_masks(m, x, seed, dtype):
    """m's routing decisions on x, per routed layer."""
    torch.manual_seed(seed)
    with torch.no_grad(), autocast_context(x.device, dtype):
        return m(x)[2]['masks']


def prefill_ideal(m, base, T, masks, path):
    """Dense forward FLOPs over m's as executed on `path` (last-position logits): the reference
    computes every path on every row (the masked forward's FLOPs: nothing saved), the other paths
    the fractions the family says they run (Family.executed_fracs: compact MoD pads each row to
    the longest)."""
    executed = m.family.executed_fracs(masks, path)
    fracs = (executed.tolist() if executed is not None
             else [v.float().mean().item() for _, v in sorted(masks.items())])
    return 1 / prefill_flops_ratio(m.config, base, T, fracs, path)


def forward_seconds(m, x, seed, dtype, path, plan, compiled):
    """Median seconds of one no-grad eval forward of m on x (last-position logits) on path."""
    fwd = compiled_module(m) if compiled else m

    def call():
        with torch.no_grad():
            fwd(x, exec_mode=path)
    torch.manual_seed(seed)
    with autocast_context(x.device, dtype):
        return timed(call, plan['bench_steps'], plan['bench_warmup'], x.device)


def compiled_module(m):
    if '_suite_compiled' not in m.__dict__:
        m.__dict__['_suite_compiled'] = torch.compile(m, dynamic=False)
    return m.__dict__['_suite_compiled']


def prefill_section(rec, base, dev, plan, seed, compile_prefill):
    """Prefill rows; returns the dense model and the routed models at DECODE_BUDGET (for
    decode)."""
    g = torch.Generator().manual_seed(seed)
    xs = {s: torch.randint(0, base.vocab_size, s, generator=g).to(dev)
          for s in plan['prefill_shapes']}
    torch.manual_seed(seed)
    dense = eval_model(replace(base, route='none'), dev)
    state, keep = dense.state_dict(), {}
    passes = dtype_passes(dev)
    # --compile=True compiles the paths torch.compile can trace in that dtype (not compact, nor
    # grouped_mm outside bf16: its meta kernel refuses them); the others run eagerly
    compilable = {dtype: routed_rows.available_paths(dev, DTYPES[dtype], compiling=True)
                  for dtype, _ in passes}
    for route in ROUTES:
        for budget in BUDGETS:
            mcfg = FAMILIES[route].bench_config(replace(base, route=route), budget)
            main_autocast = autocast_context(dev, passes[0][0])
            m = routed_model(mcfg, state, xs, seed, dev, main_autocast, budget)
            if budget == DECODE_BUDGET:
                keep[route] = m
            dense_s = {}        # the dense forward, timed once per (shape, dtype, compiled) here
            for dtype, paths in passes:
                for s, x in xs.items():
                    masks = prefill_masks(m, x, seed, dtype)
                    for path in paths:
                        ideal = prefill_ideal(m, base, s[1], masks, path)
                        compiled = compile_prefill and path in compilable[dtype]
                        label = f"prefill {route} b={budget} {s[0]}x{s[1]} {path} {dtype}"

                        def make(x=x, s=s, path=path, dtype=dtype, compiled=compiled,
                                 ideal=ideal):
                            key = (s, dtype, compiled)
                            if key not in dense_s:
                                dense_s[key] = forward_seconds(dense, x, seed, dtype, None, plan,
                                                               compiled)
                            t = forward_seconds(m, x, seed, dtype, path, plan, compiled)
                            return [row('prefill', route, budget, f"{s[0]}x{s[1]}", path, dtype,
                                        compiled, t * 1e3, dense_s[key] * 1e3, ideal)]
                        rec.run(label, make)
    return dense, keep


# --------------------------------------------------------------------------------------------------
# 3. training

class NanoGPT(nn.Module):
    """nanoGPT's model (github.com/karpathy/nanoGPT, model.py), cut to what a training step runs:
    pre-LN blocks of causal flash attention and a 4x GELU MLP, learned positions, tied embeddings,
    GPT-2's init; the same shape and FLOPs as this repository's dense GPT."""

    def __init__(self, cfg):
        super().__init__()
        d, bias = cfg.n_embd, cfg.bias
        self.n_head = cfg.n_head
        self.wte, self.wpe = nn.Embedding(cfg.vocab_size, d), nn.Embedding(cfg.block_size, d)
        self.blocks = nn.ModuleList(nn.ModuleDict(dict(
            ln_1=nn.LayerNorm(d, bias=bias), c_attn=nn.Linear(d, 3 * d, bias=bias),
            attn_proj=nn.Linear(d, d, bias=bias), ln_2=nn.LayerNorm(d, bias=bias),
            c_fc=nn.Linear(d, 4 * d, bias=bias), c_proj=nn.Linear(4 * d, d, bias=bias),
        )) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(d, bias=bias)
        self.lm_head = nn.Linear(d, cfg.vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight
        for name, p in self.named_parameters():
            if p.dim() == 2:           # residual projections scaled down, as GPT-2
                residual = name.endswith(('c_proj.weight', 'attn_proj.weight'))
                nn.init.normal_(p, 0.0, 0.02 / (2 * cfg.n_layer) ** 0.5 if residual else 0.02)
            elif name.endswith('.bias'):
                nn.init.zeros_(p)

    def forward(self, idx, targets):
        B, T = idx.shape
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        for b in self.blocks:
            q, k, v = b.c_attn(b.ln_1(x)).split(x.size(-1), dim=2)
            q, k, v = (t.view(B, T, self.n_head, -1).transpose(1, 2) for t in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + b.attn_proj(y.transpose(1, 2).reshape(B, T, -1))
            x = x + b.c_proj(F.gelu(b.c_fc(b.ln_2(x))))
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def nanogpt_step_seconds(tcfg, base, dev, dtype):
    """Median seconds of nanoGPT's training step (forward, backward, AdamW with its weight-decay
    groups) at batch_size x block_size."""
    g = torch.Generator().manual_seed(tcfg['seed'])
    x, y = (torch.randint(0, base.vocab_size, (tcfg['batch_size'], base.block_size),
                          generator=g).to(dev) for _ in range(2))
    torch.manual_seed(tcfg['seed'])
    m = NanoGPT(base).to(dev).train()
    params = [p for p in m.parameters()]
    groups = [dict(params=[p for p in params if p.dim() >= 2], weight_decay=0.1),
              dict(params=[p for p in params if p.dim() < 2], weight_decay=0.0)]
    opt = torch.optim.AdamW(groups, lr=1e-4, betas=(0.9, 0.95), fused=dev.type == 'cuda')
    fwd = torch.compile(m, dynamic=False) if tcfg['compile'] else m

    def step():
        with autocast_context(dev, dtype):
            loss = fwd(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return timed(step, tcfg['bench_steps'], tcfg['bench_warmup'], dev)


def train_flops(mcfg, trainable='all'):
    return flops.train_step_flops(mcfg, mcfg.block_size, trainable)['total']


def train_section(rec, base, dev, plan, seed, compile_train):
    dtype = dtype_passes(dev)[0][0]
    autocast = autocast_context(dev, dtype)
    tcfg = dict(batch_size=plan['train_batch'], seed=seed, bench_steps=plan['bench_steps'],
                bench_warmup=plan['bench_warmup'], compile=compile_train)
    dense_cfg = replace(base, route='none')
    shape = f"{plan['train_batch']}x{base.block_size}"
    dense = {}

    def dense_s():
        if 'dense' not in dense:
            dense['dense'] = time_train_step(tcfg, dense_cfg, dev, autocast)
        return dense['dense']

    def vs_nanogpt():
        nano = nanogpt_step_seconds(tcfg, base, dev, dtype)
        return [row('train', 'none', 1.0, shape, None, dtype, compile_train, dense_s() * 1e3,
                    nano * 1e3, 1.0, baseline='nanogpt')]

    def controller():
        g1 = controller_g1_config(base)
        t = time_train_step(tcfg, g1, dev, autocast, controller=True)
        ideal = train_flops(dense_cfg) / train_flops(g1, 'controller')
        return [row('train', 'ffn', g1.ffn_budget, shape, None, dtype, compile_train, t * 1e3,
                    dense_s() * 1e3, ideal, baseline='dense', trainable='controller')]

    def mod():
        mcfg = replace(base, route='mod', mod_capacity=MOD_TRAIN_CAPACITY)
        t = time_train_step(tcfg, mcfg, dev, autocast)
        ideal = train_flops(dense_cfg) / train_flops(mcfg)
        return [row('train', 'mod', MOD_TRAIN_CAPACITY, shape, None, dtype, compile_train,
                    t * 1e3, dense_s() * 1e3, ideal, baseline='dense', trainable='all')]
    rec.run(f"train dense vs nanoGPT {shape}", vs_nanogpt)
    rec.run(f"train controller-only G1 vs dense {shape}", controller)
    rec.run(f"train mod c={MOD_TRAIN_CAPACITY} vs dense {shape}", mod)


# --------------------------------------------------------------------------------------------------
# 4. decode

def decode_paths(dev):
    """[(dtype, path, compiled)] in the order they run: on CUDA the paths a CUDA graph can hold
    (routed_rows.default_path's first) compiled, then compact eagerly; on the CPU every path
    eagerly."""
    out = []
    for dtype, paths in dtype_passes(dev):
        graphed = dev.type == 'cuda'
        capturable = (routed_rows.available_paths(dev, DTYPES[dtype], compiling=True)
                      if graphed else [])
        first = default_paths(dev)[dtype]['compiled' if graphed else 'eager']
        for path in sorted(paths, key=lambda p: (p != first, paths.index(p))):
            out.append((dtype, path, graphed and path in capturable))
    return out


def decode_seconds(m, prompt, new, dtype, compiled, plan):
    """Seconds of one decode step of the whole batch: (prefill + 1 + new steps) minus (prefill +
    1), paired per repeat, over new (bench.time_model's subtraction); the median of
    plan['decode_steps'] repeats (--bench_steps when given) after one untimed round."""
    gen = lambda k: (lambda: m.generate(prompt, k, temperature=0, compile=compiled))
    steps = plan['decode_steps']
    with autocast_context(prompt.device, dtype):
        t = timed_difference(gen(1 + new), gen(1), steps, 1, prompt.device)
    return max(t, 1e-9) / new


def decode_ideal(m, base, prompt, new, dtype, compiled, path):
    """Dense forward FLOPs of one position over m's at the mean fractions its decode realises (the
    reference computes every row: all-full fractions, as prefill_ideal). The FLOPs-ideal, not the
    executed count: a batched step pads (compact MoD runs a block for every row when any row takes
    it; the static paths' cached MoD step projects attention on every row), so `realised` says how
    much of the routing's saving a path turns into time. Attention over the cache is costed at
    length 1 on both sides: its real 4·L·d per layer over L cached keys is 3.5% of a 124M block's
    24·d² at the suite's mean L of 160."""
    stats = {}
    with autocast_context(prompt.device, dtype):
        m.generate(prompt, new, temperature=0, compile=compiled, stats=stats)
    fracs = stats['full_frac']
    if path == 'reference':
        fracs = [1.0] * len(fracs)
    return 1 / prefill_flops_ratio(m.config, base, 1, fracs)


def decode_section(rec, base, dev, plan, seed, dense, routed):
    g = torch.Generator().manual_seed(seed)
    new = plan['decode_tokens']
    prompts = {b: torch.randint(0, base.vocab_size, (b, plan['decode_prompt']), generator=g).to(dev)
               for b in plan['decode_batches']}
    dense_s = {}
    for dtype, path, compiled in decode_paths(dev):
        for b, prompt in prompts.items():
            key = (b, dtype, compiled)
            if key not in dense_s:
                def dense_row(b=b, prompt=prompt, dtype=dtype, compiled=compiled, key=key):
                    torch.manual_seed(seed)
                    dense_s[key] = t = decode_seconds(dense, prompt, new, dtype, compiled, plan)
                    return [row('decode', 'none', 1.0, b, None, dtype, compiled, t * 1e3,
                                t * 1e3, 1.0, tokens_per_s=b / t)]
                rec.run(f"decode dense batch {b} {dtype}{' compiled' * compiled}", dense_row)
            for route, m in routed.items():
                def routed_row(b=b, prompt=prompt, dtype=dtype, path=path, compiled=compiled,
                               key=key, route=route, m=m):
                    if key not in dense_s:
                        raise RuntimeError("its dense baseline did not run")
                    m.exec_mode = path
                    torch.manual_seed(seed)
                    t = decode_seconds(m, prompt, new, dtype, compiled, plan)
                    ideal = decode_ideal(m, base, prompt, new, dtype, compiled, path)
                    return [row('decode', route, DECODE_BUDGET, b, path, dtype, compiled, t * 1e3,
                                dense_s[key] * 1e3, ideal, tokens_per_s=b / t)]
                rec.run(f"decode {route} b={DECODE_BUDGET} batch {b} {path} {dtype}", routed_row)
    for m in routed.values():
        m.exec_mode = None


# --------------------------------------------------------------------------------------------------
# the suite

def run(cfg, argv):
    """bench.py --suite=gpu: returns the exit code (0; 1 on a correctness mismatch or a failed
    row)."""
    plan = dict(PLANS['smoke' if smoke_plan(cfg) else 'real'])
    given = given_keys(argv)
    for key in ('bench_steps', 'bench_warmup'):
        if key in given:
            plan[key] = cfg[key]
    if 'bench_steps' in given:          # every timing's repeats, decode's too
        plan['decode_steps'] = cfg['bench_steps']
    dev, _ = cli_device(cfg['device'])
    if dev.type == 'cuda':
        torch.backends.cuda.matmul.allow_tf32 = True
    allow_graphs(DECODE_GRAPHS)                     # every path and batch is its own graph
    if hasattr(torch._dynamo.config, 'fail_on_recompile_limit_hit'):
        torch._dynamo.config.fail_on_recompile_limit_hit = True
    base = train.model_config(SimpleNamespace(**{**train.DEFAULTS, **plan['model']}))
    base = replace(base, route='none', dropout=0.0)
    folder = out_folder(cfg, argv)
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    header = dict(
        suite=cfg['suite'], smoke=smoke_plan(cfg), command='python bench.py ' + ' '.join(argv),
        date=time.strftime('%Y-%m-%d'), **train.code_version(), torch=torch.__version__,
        triton=triton_version, cuda=torch.version.cuda,
        gpu=torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'cpu',
        capability=list(torch.cuda.get_device_capability(dev)) if dev.type == 'cuda' else None,
        device=str(dev), threads=torch.get_num_threads(), default_path=default_paths(dev),
        compile=cfg['compile'], seed=cfg['seed'],
        model={k: getattr(base, k) for k in plan['model']},
        plan={k: v for k, v in plan.items() if k != 'model'},
        check_tolerance={k: CHECK_TOL[v] for k, v in DTYPES.items()},
    )
    rec = Record(header, folder, cfg['suite_seconds'])
    say(f"writing {folder}/suite.json and suite.md; correctness first")
    try:
        rec.res['check'] = check_paths(base, dev, dtype_passes(dev), plan['check_shape'],
                                       cfg['seed'])
    except PathMismatch as e:
        rec.res['check_error'] = str(e)
        rec.write()
        print(f"error: {e}", file=sys.stderr)
        return 1
    rec.write()
    dense, routed = prefill_section(rec, base, dev, plan, cfg['seed'], cfg['compile'])
    decode_section(rec, base, dev, plan, cfg['seed'], dense, routed)
    train_section(rec, base, dev, plan, cfg['seed'], cfg['compile'])
    rec.write()
    res = rec.res
    say(f"done in {res['seconds']:.0f} s: {len(res['rows'])} rows, {len(res['skipped'])} skipped, "
        f"{len(res['failed'])} failed; {folder}/suite.json")
    return 1 if res['failed'] else 0
