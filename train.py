"""
Train a nanodepth model.

    python train.py                                   # quickstart: synthetic corpus, small model, CPU
    python train.py config/shakespeare_char.py --max_iters=500 --compile=False
    torchrun --standalone --nproc_per_node=2 train.py config/gpt2_124m_fineweb.py   # DDP

Writes into out_dir: metrics.jsonl (one JSON object per log line and per eval), config.json (the
resolved config), run_info.json (code version, torch, device), ckpt.pt (written atomically: model,
optimizer, scaler, RNG states, iteration, best val loss, config, sampler state). `--init_from=resume`
continues exactly where ckpt.pt left off. Ctrl-C / SIGTERM finishes the current step, saves, exits 0.
"""
import json
import math
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, fields
from types import SimpleNamespace

import numpy as np
import torch

import eval as evaluation
import flops
from checkpoint import load_checkpoint, remove_stale_temps, save_checkpoint
from configurator import ConfigError, UserError, declared_defaults, load_config, run_cli
from data.loader import Batches, DataError, check_checkpoint_data, check_data, data_identity, load_dataset_meta
from device import autocast_context, resolve_device_dtype
from model import FAMILIES, GPT, GPTConfig, controlled_layer_ids, is_controller_key
from route_exit import exit_depths

# ----------------------------------------------------------------------------------------------------
# defaults (override with a config file and/or --key=value); the quickstart trains on these
# I/O
out_dir = 'out/quickstart'
eval_interval = 100
log_interval = 10
eval_iters = 20
eval_only = False
init_from = 'scratch'        # 'scratch', 'resume', a checkpoint file (e.g. out/stage1/ckpt.pt: weights only,
                             # fresh optimizer; for stage 2 of controller-only training), or GPT-2: 'gpt2', ...
# data
dataset = 'synthetic'        # a folder data/<dataset> written by data/prepare.py
data_dir = ''                # where dataset folders live; '' means data/ beside this file
batch_size = 16              # sequences per micro-batch per process
block_size = 128
gradient_accumulation_steps = 1   # micro-batches per optimizer step, summed over all DDP processes
# model
n_layer = 4
n_head = 4
n_embd = 128
dropout = 0.0
bias = False
pos = 'learned'              # 'learned' or 'rope'
vocab_size = 0               # 0: from the data's meta.json (rounded up to a multiple of 64 above 1024)
# routing (every field of model.GPTConfig is a config key; see model.py for the full list)
route = 'ffn'                # the quickstart trains G1-routed FFNs; 'none' is the dense baseline
gate = 'mlp'
budget = 0.5
cheap_rank = 16
trainable = 'all'            # 'all' (joint), 'controller' (backbone frozen: gates, routers, predictors,
                             # exit heads, ensemble norms) or 'last_layers' (the last ens_layers blocks + ln_f)
oracle_layers_per_step = 1   # controlled layers given oracle utility labels per step (util/rank losses)
calib_iters = 4              # train-split batches that calibrate the causal thresholds before each eval
lm_thresholds = ''           # e.g. '2.5,2.0': report the first iteration the train LM falls below each
avg_lm_until = 0.5           # avg LM = mean logged train LM over the first avg_lm_until of the run
# AdamW and schedule
learning_rate = 2e-3
max_iters = 600
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0              # 0 disables clipping (the grad norm is still logged)
decay_lr = True
warmup_iters = 50
lr_decay_iters = 0           # 0: max_iters
min_lr = 2e-4
# system
device = 'auto'              # 'auto', 'cpu', 'cuda', 'cuda:1', ...
dtype = 'auto'               # 'auto', 'float32', 'bfloat16', 'float16' (float16 uses a GradScaler)
compile = False              # torch.compile(dynamic=False)
seed = 1337
eval_seed = 1337             # eval/calibration batches: fixed, so every run of a study sees the same ones
max_fp16_skips = 50          # stop if this many consecutive fp16 steps overflow
ddp_timeout = 900            # seconds a DDP process waits for a silent peer before stopping with an error
overwrite = False            # a fresh run may replace the run already in out_dir (else it refuses)
verify_data = True           # on resume / from a checkpoint: recompute the data files' sha256 against meta.json
DEFAULTS = declared_defaults(__file__)     # the literals above: flops.py and eval.py read the same keys
for _f in fields(GPTConfig):
    DEFAULTS.setdefault(_f.name, _f.default)
# fields that define the backbone's weights: a resumed or stage-2 run must agree with its checkpoint
MODEL_KEYS = ('n_layer', 'n_head', 'n_embd', 'block_size', 'bias', 'pos', 'vocab_size', 'gelu', 'rope_base',
              'route', 'controlled_layers', 'cheap_rank')
RESUME_KEYS = MODEL_KEYS + ('gate', 'gate_hidden', 'infer_rule', 'jepa_latent', 'jepa_readout', 'exit_layers',
                            'exit_head', 'ens_layers')
HERE = os.path.dirname(os.path.abspath(__file__))
# ----------------------------------------------------------------------------------------------------


class TrainError(UserError):
    """A problem with the user's input: printed as 'error: ...' and exit code 2, before any work."""


def lr_at(cfg, it):
    if not cfg.decay_lr:
        return cfg.learning_rate
    if it < cfg.warmup_iters:
        return cfg.learning_rate * (it + 1) / (cfg.warmup_iters + 1)
    decay_iters = cfg.lr_decay_iters or cfg.max_iters
    if it >= decay_iters:
        return cfg.min_lr
    ratio = (it - cfg.warmup_iters) / max(1, decay_iters - cfg.warmup_iters)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (cfg.learning_rate - cfg.min_lr)


def run_info(cfg, dev, dt, world_size):
    def git(*args):
        try:
            r = subprocess.run(['git', *args], cwd=HERE, capture_output=True, text=True, timeout=10)
            return r.stdout.strip() if r.returncode == 0 else ''   # e.g. no commits yet: not a sha
        except Exception:
            return ''
    return dict(git_sha=git('rev-parse', 'HEAD') or None, git_dirty=bool(git('status', '--porcelain')),
                torch=torch.__version__, cuda=torch.version.cuda, python=sys.version.split()[0],
                device=str(dev), device_name=torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'cpu',
                dtype=dt, world_size=world_size, host=socket.gethostname(), argv=sys.argv,
                threads=torch.get_num_threads(), started=time.strftime('%Y-%m-%dT%H:%M:%S%z'))


def rng_state():
    return dict(torch=torch.get_rng_state(), numpy=np.random.get_state(), python=random.getstate(),
                cuda=torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)


def set_rng_state(s):
    torch.set_rng_state(s['torch'])
    np.random.set_state(s['numpy'])
    random.setstate(s['python'])
    if s.get('cuda') is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s['cuda'])


def model_config(cfg, **override):
    d = {f.name: getattr(cfg, f.name) for f in fields(GPTConfig) if hasattr(cfg, f.name)}
    d.update(override)
    try:
        return GPTConfig(**d)
    except ValueError as e:
        raise TrainError(str(e)) from None


RUN_FILES = ('ckpt.pt', 'metrics.jsonl', 'config.json', 'run_info.json')


def check_out_dir(cfg):
    """A fresh run never silently replaces or appends to the run already in out_dir."""
    if cfg.init_from == 'resume' or cfg.overwrite:
        return
    held = [f for f in RUN_FILES if os.path.exists(os.path.join(cfg.out_dir, f))]
    if held:
        raise TrainError(f"out_dir {cfg.out_dir} already holds a run ({', '.join(held)}); continue it with "
                         f"--init_from=resume, pick another --out_dir, or replace it with --overwrite=True")


def check_against_checkpoint(cfg, meta, ckpt, keys):
    """The config's fields `keys` agree with the checkpoint's model_args, and the data is its own."""
    margs = ckpt['model_args']
    for k in keys:
        want, have = getattr(cfg, k), margs.get(k)
        if k == 'vocab_size' and want == 0:
            continue
        if k == 'controlled_layers':    # compare the layers meant ('auto' is the family's default)
            want, have = (controlled_layer_ids(GPTConfig.from_dict({**margs, 'controlled_layers': v})) for v in (want, have))
        if k == 'exit_layers' and margs.get('route') == 'exit':
            want, have = (exit_depths(GPTConfig.from_dict({**margs, 'exit_layers': v})) for v in (want, have))
        if have != want:
            raise TrainError(f"config field '{k}' differs from the checkpoint: checkpoint has "
                             f"{margs.get(k)!r}, config has {getattr(cfg, k)!r}")
    check_checkpoint_data(cfg, meta, ckpt)


def drop_records_after(path, iter_num):
    """Keep the metrics records up to the resumed iteration: the steps after it run again."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        lines = [l for l in f if l.strip()]
    keep = [l for l in lines if json.loads(l).get('iter', 0) <= iter_num]
    if len(keep) < len(lines):
        with open(path + '.tmp', 'w') as f:
            f.writelines(keep)
        os.replace(path + '.tmp', path)


def check_state_fits(model, state, source):
    """The same tensor names and shapes as the model, or one line naming the first differences
    (a config field this check's key list does not name still changes the model's shape)."""
    mine = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    theirs = {k: tuple(v.shape) for k, v in state.items()}
    diff = sorted(set(mine) ^ set(theirs)) + sorted(k for k in set(mine) & set(theirs) if mine[k] != theirs[k])
    if diff:
        raise TrainError(f"checkpoint ({source}) does not fit the model this config builds: {diff[:4]} differ; "
                         f"use the run's original model and routing options")


def build_model(cfg, meta, ckpt):
    """Model from scratch, from a checkpoint (resume: everything; a checkpoint file: the backbone, with
    fresh gates), or from GPT-2 weights, with the checks that the data and the checkpoint agree."""
    data_vocab = meta['vocab_size']
    if ckpt is not None and cfg.init_from == 'resume':
        check_against_checkpoint(cfg, meta, ckpt, RESUME_KEYS)
        for k in ('batch_size', 'gradient_accumulation_steps', 'seed', 'trainable'):   # data order, optimizer
            if ckpt['config'].get(k) != getattr(cfg, k):
                raise TrainError(f"config field '{k}' differs from the checkpoint: checkpoint has "
                                 f"{ckpt['config'].get(k)!r}, config has {getattr(cfg, k)!r}; resume with the "
                                 f"run's original value")
        model = GPT(model_config(cfg, vocab_size=ckpt['model_args']['vocab_size']))
        check_state_fits(model, ckpt['model'], cfg.init_from)
        model.load_state_dict(ckpt['model'])
    elif ckpt is not None:
        # the routing family may change (e.g. a dense backbone under a halting, MoD or ensemble
        # controller) as long as every backbone weight comes from the checkpoint: checked below
        check_against_checkpoint(cfg, meta, ckpt, [k for k in MODEL_KEYS if k not in ('route', 'controlled_layers')])
        model = GPT(model_config(cfg, vocab_size=ckpt['model_args']['vocab_size']))
        backbone = {k: v for k, v in ckpt['model'].items() if not is_controller_key(k)}
        missing, unexpected = model.load_state_dict(backbone, strict=False)
        bad = [k for k in missing if not is_controller_key(k)] + list(unexpected)
        if bad:
            raise TrainError(f"checkpoint {cfg.init_from} does not fit this model's backbone (route "
                             f"{ckpt['model_args'].get('route')!r} -> {cfg.route!r}): {bad[:5]}")
        model.family.after_load(model)     # e.g. ensemble norms start as copies of ln_f
    elif cfg.init_from == 'scratch':
        vs = cfg.vocab_size or (data_vocab if data_vocab <= 1024 else ((data_vocab + 63) // 64) * 64)
        model = GPT(model_config(cfg, vocab_size=vs))
    else:
        if meta.get('tokenizer') != 'gpt2':
            raise TrainError(f"init_from={cfg.init_from} needs GPT-2 BPE data; data/{cfg.dataset} uses "
                             f"the {meta.get('tokenizer')!r} tokenizer")
        routing = {f.name: getattr(cfg, f.name) for f in fields(GPTConfig)
                   if f.name not in ('n_layer', 'n_head', 'n_embd', 'vocab_size', 'block_size', 'bias', 'pos', 'gelu')}
        model = GPT.from_pretrained(cfg.init_from, routing)
        if cfg.block_size < model.config.block_size:
            model.crop_block_size(cfg.block_size)
        for k in MODEL_KEYS:            # the checkpoint's shape wins: record it, so config.json and resume agree
            setattr(cfg, k, getattr(model.config, k))
    if data_vocab > model.config.vocab_size:
        raise TrainError(f"field 'vocab_size' differs: data/{cfg.dataset} has {data_vocab} tokens but the "
                         f"model's vocabulary is {model.config.vocab_size}")
    if cfg.block_size != model.config.block_size:
        raise TrainError(f"field 'block_size' differs: config {cfg.block_size}, model {model.config.block_size}")
    return model


def trainable_parameters(model, cfg):
    """Joint training: everything. Controller-only: freeze the backbone (requires_grad=False) and
    return only the controller's parameters (model.is_controller_key). 'last_layers': only the last
    ens_layers blocks and the final norm (the fine-tuning baseline of the ensemble family)."""
    if cfg.trainable == 'all':
        return list(model.parameters())
    if cfg.trainable not in ('controller', 'last_layers'):
        raise TrainError(f"trainable must be 'all', 'controller' or 'last_layers', got {cfg.trainable!r}")
    if cfg.trainable == 'last_layers':    # plain fine-tuning of the last ens_layers blocks and ln_f
        k = model.config.ens_layers
        if model.config.route != 'none' or not 1 <= k <= model.config.n_layer:
            raise TrainError(f"trainable=last_layers fine-tunes the last ens_layers (1..n_layer) blocks of a dense "
                             f"model (route='none'); got route={model.config.route!r}, ens_layers={k}")
        ctrl = [p for b in model.transformer.h[-k:] for p in b.parameters()] + list(model.transformer.ln_f.parameters())
    else:
        ctrl = model.controller_parameters()
    if not ctrl:
        raise TrainError(f"trainable=controller needs a controller with parameters (route='ffn' or 'mod' with "
                         f"gate='mlp', 'ffn' with 'jepa', route='halt', route='exit' with exit_head='own', or "
                         f"route='ensemble'); this config (route={cfg.route!r}, gate={cfg.gate!r}) has none")
    ids = {id(p) for p in ctrl}
    for p in model.parameters():
        p.requires_grad_(id(p) in ids)
    return ctrl


def run_summary(log_lines, evals, cfg, wall_s):
    """avg LM, best LM, threshold hits: the seed paper's optimisation metrics, from this run's logs."""
    lm = [(r['iter'], r['lm_loss']) for r in log_lines]
    early = [v for it, v in lm if it <= cfg.avg_lm_until * cfg.max_iters]
    out = dict(avg_lm=float(np.mean(early)) if early else None,
               best_train_lm=min((v for _, v in lm), default=None),
               best_val_lm=min((e['val_loss'] for e in evals), default=None), wall_s=wall_s)
    for th in [float(t) for t in str(cfg.lm_thresholds).split(',') if t.strip()]:
        out[f'hit_{th:g}'] = next((it for it, v in lm if v < th), None)
    return out


def print_routing(family, r):
    for line in family.report_lines(r):
        print(line)
    for name, per_layer in r.get('full_frac_by_class', {}).items():
        print(f"  full-path fraction for {name:>9} targets: " + ' '.join(f"L{l}:{v:.2f}" for l, v in per_layer.items()))


def check_train_config(cfg):
    """The training loop's own fields, checked before anything is read or written."""
    if cfg.init_from not in ('scratch', 'resume') and not cfg.init_from.startswith('gpt2') \
            and not os.path.exists(cfg.init_from):
        raise TrainError(f"init_from must be scratch, resume, a checkpoint file, gpt2[-medium|-large|-xl] "
                         f"or a local HF GPT-2 directory; {cfg.init_from!r} is none of these")
    try:
        [float(t) for t in str(cfg.lm_thresholds).split(',') if t.strip()]
    except ValueError:
        raise TrainError(f"lm_thresholds must be comma-separated numbers such as '2.5,2.0', got {cfg.lm_thresholds!r}") from None
    at_least = dict(oracle_layers_per_step=1, eval_interval=1, log_interval=1, eval_iters=1, batch_size=1,
                    block_size=1, gradient_accumulation_steps=1, max_iters=0, calib_iters=1, warmup_iters=0,
                    lr_decay_iters=0, max_fp16_skips=1, ddp_timeout=1)
    for key, lo in at_least.items():
        if getattr(cfg, key) < lo:
            raise TrainError(f"{key} must be >= {lo}, got {getattr(cfg, key)}")
    for key in ('learning_rate', 'min_lr', 'weight_decay', 'grad_clip'):
        if not getattr(cfg, key) >= 0:         # also refuses NaN
            raise TrainError(f"{key} must be >= 0, got {getattr(cfg, key)}")
    for key in ('beta1', 'beta2'):
        if not 0 <= getattr(cfg, key) < 1:
            raise TrainError(f"{key} must be in [0, 1), got {getattr(cfg, key)}")
    if not 0 < cfg.avg_lm_until <= 1:
        raise TrainError(f"avg_lm_until must be in (0, 1], got {cfg.avg_lm_until}")
    for key in ('out_dir', 'data_dir'):
        path = getattr(cfg, key)
        if path and os.path.exists(path) and not os.path.isdir(path):
            raise TrainError(f"{key}={path!r} is a file, not a folder; choose a folder")
    if cfg.device != 'auto':
        try:
            torch.device(cfg.device)
        except RuntimeError:
            raise TrainError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {cfg.device!r}") from None


def check_family_options(cfg, argv):
    """Refuse another family's option given on the command line with a non-default value (e.g.
    --route=halt --gate=jepa); only note the ones a config file set, since a study's arms switch route
    on a shared base file (they are recorded in config.json but change nothing)."""
    given = {a[2:].partition('=')[0] for a in argv if a.startswith('--')}
    mine = set(FAMILIES[cfg.route].options)
    if cfg.trainable == 'last_layers':
        mine.add('ens_layers')          # the dense fine-tuning baseline trains the last ens_layers blocks
    inert = []
    for name, family in FAMILIES.items():
        for key in family.options:
            if key in mine or key in inert or getattr(cfg, key) == DEFAULTS[key]:
                continue
            if key in given:
                raise TrainError(f"--{key} is an option of route={name}, which route={cfg.route!r} does not "
                                 f"read; drop it or set --route")
            inert.append(key)
    if inert and int(os.environ.get('RANK', 0)) == 0:
        print(f"note: route={cfg.route} does not read {', '.join(sorted(inert))} (set in a config file)")


class StopFlag:
    """First Ctrl-C / SIGTERM: finish the step, checkpoint, exit 0. A second Ctrl-C aborts at once."""

    def __init__(self):
        self.signum = None
        signal.signal(signal.SIGINT, self._handle)
        signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame):
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = signum


def main(argv):
    try:
        return train(argv)
    except (ConfigError, DataError) as e:   # the device and data checks shared with the other scripts
        raise TrainError(str(e)) from None
    except RuntimeError as e:          # DDP: a peer died, or hung past ddp_timeout, inside a collective
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            raise
        raise TrainError(f"a DDP process stopped responding ({str(e).splitlines()[0][:160]}); this process "
                         f"stops too. The last checkpoint is kept: resume with --init_from=resume") from None


def train(argv):
    try:
        cfg_dict = load_config(DEFAULTS, argv)
    except ConfigError as e:
        raise TrainError(str(e)) from None
    cfg = SimpleNamespace(**cfg_dict)
    check_train_config(cfg)
    model_config(cfg)                           # validates routing fields before any work
    check_family_options(cfg, argv)

    # DDP: torchrun sets RANK / WORLD_SIZE; NCCL on GPU, gloo on CPU
    ddp = int(os.environ.get('RANK', -1)) != -1
    rank, local_rank, world = (int(os.environ['RANK']), int(os.environ['LOCAL_RANK']),
                               int(os.environ['WORLD_SIZE'])) if ddp else (0, 0, 1)
    master = rank == 0
    if cfg.gradient_accumulation_steps % world:
        raise TrainError(f"gradient_accumulation_steps={cfg.gradient_accumulation_steps} must be a "
                         f"multiple of the number of processes ({world})")
    accum = cfg.gradient_accumulation_steps // world
    dev, dt = resolve_device_dtype(cfg)
    if ddp and dev.type == 'cuda':
        dev = torch.device(f'cuda:{local_rank}')
        torch.cuda.set_device(dev)
    ckpt_path = os.path.join(cfg.out_dir, 'ckpt.pt')
    check_out_dir(cfg)
    meta = load_dataset_meta(cfg, master)
    if master:                  # temp files of a writer that was killed mid-save (the checkpoint is intact)
        for tmp in remove_stale_temps(ckpt_path):
            print(f"removed {tmp}, left by a checkpoint write that was killed")
    ckpt = None
    if cfg.init_from == 'resume':
        if not os.path.exists(ckpt_path):
            raise TrainError(f"init_from=resume but there is no checkpoint at {ckpt_path}; start the run afresh "
                             f"(with --overwrite=True if {cfg.out_dir} holds its other files)")
        ckpt = load_checkpoint(ckpt_path)
    elif os.path.isfile(cfg.init_from):
        ckpt = load_checkpoint(cfg.init_from)
    check_data(cfg, meta, ckpt)
    torch.manual_seed(cfg.seed + rank)
    random.seed(cfg.seed + rank)
    np.random.seed(cfg.seed + rank)
    model = build_model(cfg, meta, ckpt).to(dev)
    cfg_dict.update({k: getattr(cfg, k) for k in MODEL_KEYS})    # what was built (GPT-2 init sets the shape)

    if ddp:
        from torch.distributed import init_process_group
        from datetime import timedelta     # a silent (hung, stopped) peer ends the run instead of blocking it
        init_process_group(backend='nccl' if dev.type == 'cuda' else 'gloo', timeout=timedelta(seconds=cfg.ddp_timeout))
    if dev.type == 'cuda':
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    np_dtype = np.uint32 if meta.get('dtype') == 'uint32' else np.uint16
    train_data = Batches(os.path.join(meta['folder'], 'train.bin'), np_dtype, cfg.block_size, cfg.batch_size, cfg.seed, dev)
    val_data = Batches(os.path.join(meta['folder'], 'val.bin'), np_dtype, cfg.block_size, cfg.batch_size, cfg.seed, dev)
    eval_sets = {'train': (train_data, train_data.eval_batches(cfg.eval_iters, 1, cfg.eval_seed)),
                 'val': (val_data, val_data.eval_batches(cfg.eval_iters, 2, cfg.eval_seed))}

    autocast = autocast_context(dev, dt)
    scaler = torch.amp.GradScaler(dev.type, enabled=(dt == 'float16'))
    params = trainable_parameters(model, cfg)
    ctrl_params = model.controller_parameters()
    optimizer = model.configure_optimizers(cfg.weight_decay, cfg.learning_rate, (cfg.beta1, cfg.beta2), dev.type,
                                           params=params)
    iter_num, best_val = 0, float('inf')
    init_state = None
    if ckpt is not None and cfg.init_from == 'resume':
        init_state = dict(flops_state=ckpt['flops_state'], history=ckpt['history'])
        optimizer.load_state_dict(ckpt['optimizer'])
        scaler.load_state_dict(ckpt['scaler'])
        iter_num, best_val = ckpt['iter_num'], ckpt['best_val_loss']
        if master and ckpt.get('rng') is not None:
            set_rng_state(ckpt['rng'])
    ckpt = None
    raw_model = model
    if cfg.compile:
        model = torch.compile(model, dynamic=False)
    if ddp:
        from torch.nn.parallel import DistributedDataParallel as DDP
        partial = raw_model.family.ddp_find_unused(raw_model.config)   # some parameters get no gradient
        model = DDP(model, device_ids=[local_rank] if dev.type == 'cuda' else None, find_unused_parameters=partial)
    mcfg = raw_model.config
    calib = [train_data.fetch(s)[0] for s in train_data.eval_batches(cfg.calib_iters, 3, cfg.eval_seed)]
    if cfg.compile:                     # one graph per set of per-step options (e.g. oracle layers): compile each
        import torch._dynamo as dynamo         # (a bare `import torch._dynamo` would make torch local here)
        limit = 'recompile_limit' if hasattr(dynamo.config, 'recompile_limit') else 'cache_size_limit'
        setattr(dynamo.config, limit, max(getattr(dynamo.config, limit), mcfg.n_layer + 8))

    metrics_f = None
    if master:
        os.makedirs(cfg.out_dir, exist_ok=True)
        with open(os.path.join(cfg.out_dir, 'config.json'), 'w') as f:
            json.dump(cfg_dict, f, indent=2)
        with open(os.path.join(cfg.out_dir, 'run_info.json'), 'w') as f:
            json.dump(run_info(cfg, dev, dt, world), f, indent=2)
        if cfg.init_from != 'resume':      # --overwrite: the old run goes only now that every check has passed
            for name in ('ckpt.pt', 'metrics.jsonl'):
                if os.path.exists(os.path.join(cfg.out_dir, name)):
                    os.remove(os.path.join(cfg.out_dir, name))
        else:                              # records a killed run logged after its last checkpoint are redone
            drop_records_after(os.path.join(cfg.out_dir, 'metrics.jsonl'), iter_num)
        metrics_f = open(os.path.join(cfg.out_dir, 'metrics.jsonl'), 'a')
        n_params = raw_model.get_num_params()
        n_trainable = sum(p.numel() for p in {id(p): p for p in params}.values())    # tied weights once
        print(f"model: {n_params / 1e6:.2f}M parameters ({n_trainable:,} trainable) | data: {cfg.dataset} "
              f"({meta['vocab_size']} tokens vocab, {meta['train_tokens']:,} train tokens) | device {dev}, {dt}, world {world}")

    def log(obj):
        if metrics_f is not None:
            metrics_f.write(json.dumps(obj) + '\n')
            metrics_f.flush()

    @contextmanager
    def eval_rng():
        """Evals draw random numbers (gate='random' decides per token at eval): fork the RNG and seed
        it, so evaluating never changes training and every eval is repeatable."""
        with torch.random.fork_rng(devices=[dev] if dev.type == 'cuda' else []):
            torch.manual_seed(cfg.eval_seed)
            yield

    def estimate_loss():
        """LM loss on fixed train/val batches in eval mode: causal routing, thresholds calibrated
        first on separate train-split batches (never on val)."""
        with eval_rng():
            with autocast:
                raw_model.calibrate(torch.cat(calib))
            return {split: evaluation.evaluate(raw_model, [batches.fetch(s) for s in starts_list], autocast)
                    for split, (batches, starts_list) in eval_sets.items()}

    def kept():
        return (f"the last good checkpoint {ckpt_path} is left untouched" if os.path.exists(ckpt_path)
                else "no checkpoint was saved yet")

    def checkpoint():
        for p in raw_model.parameters():       # never overwrite a good checkpoint with a broken model
            if not torch.isfinite(p).all():
                raise TrainError(f"non-finite weights at iteration {iter_num}; {kept()}")
        save_checkpoint(ckpt_path, dict(
            model=raw_model.state_dict(), optimizer=optimizer.state_dict(), scaler=scaler.state_dict(),
            model_args=asdict(raw_model.config), iter_num=iter_num, best_val_loss=best_val, config=cfg_dict,
            history=history, flops_state=flops_state,
            rng=rng_state(), sampler=dict(kind='epoch-permutation', seed=cfg.seed, next_iter=iter_num,
                                          micro_batches_per_iter=cfg.gradient_accumulation_steps),
            data_meta=data_identity(meta)))

    stop = StopFlag()
    seqs_per_iter = cfg.gradient_accumulation_steps * cfg.batch_size
    tokens_per_iter = seqs_per_iter * cfg.block_size
    dense_step = 3 * flops.dense_forward_flops(mcfg, cfg.block_size)      # a full-only step, per sequence
    skipped = torch.zeros((), device=dev)        # fp16 overflow steps, counted on device (no sync)
    last_skipped, consecutive_skips = 0, 0
    # cumulative training FLOPs: exact (autograd's count) and the paper's proxy, both per sequence
    flops_state = dict(exact=0.0, proxy_num=0.0, dense=0.0, wall_s=0.0)
    history = dict(train=[], eval=[])            # (iter, lm) and eval records, for the run summary
    step_costs = {}
    if init_state is not None:
        flops_state, history = init_state['flops_state'], init_state['history']
    interval = dict(lm=torch.zeros((), device=dev), frac=None, ctrl_norm=torch.zeros((), device=dev), n=0, aux={})
    t_last, it_last = time.time(), iter_num
    t_run = time.time() - flops_state['wall_s']
    start_iter = iter_num
    stopped = False                   # by a signal to this process or, under DDP, to any process
    while True:
        evaluated_already = init_state is not None and iter_num == start_iter   # the resumed run logged it
        if (iter_num % cfg.eval_interval == 0 or iter_num >= cfg.max_iters or cfg.eval_only) and not evaluated_already:
            if master:
                res = estimate_loss()
                if not all(math.isfinite(res[s]['loss']) for s in res):
                    raise TrainError(f"eval loss is not finite at iteration {iter_num} (train {res['train']['loss']}, "
                                     f"val {res['val']['loss']}); stopping; {kept()}. Try a lower learning_rate or grad_clip.")
                best_val = min(best_val, res['val']['loss'])
                frac = res['val']['full_frac']
                print(f"iter {iter_num}: train loss {res['train']['loss']:.4f}, val loss {res['val']['loss']:.4f}"
                      + (f", val full-path fraction {np.mean(frac):.3f}" if frac else ''))
                rec = dict(type='eval', iter=iter_num, train_loss=res['train']['loss'], val_loss=res['val']['loss'],
                           val_full_frac=frac)
                history['eval'].append(rec)
                log(rec)
                flops_state['wall_s'] = time.time() - t_run
                if not cfg.eval_only and iter_num > 0:
                    checkpoint()
            t_last, it_last = time.time(), iter_num
        if iter_num >= cfg.max_iters or cfg.eval_only:
            break

        lr = lr_at(cfg, iter_num)
        for group in optimizer.param_groups:
            group['lr'] = lr
        # the family's per-step options (oracle layers, the exit curriculum): a pure function of the step
        opts = raw_model.family.step_options(raw_model, iter_num, cfg)
        oracle_layers, exits = opts.get('oracle_layers', ()), opts.get('exits')
        loss_sum = torch.zeros((), device=dev)
        for micro in range(accum):
            j = (iter_num * accum + micro) * world + rank
            x, y = train_data.get(j)
            if ddp:
                model.require_backward_grad_sync = micro == accum - 1
            with autocast:
                _, loss, aux = model(x, y, **opts)
                loss = loss / accum
            scaler.scale(loss).backward()
            loss_sum += loss.detach().float()
            interval['lm'] += aux['lm_loss'].float() / accum
            for k, v in aux.items():
                if (k.endswith('_loss') and k != 'lm_loss') or k in ('jepa_pred_std', 'utility_mean', 'tlops_saved', 'alpha'):
                    interval['aux'][k] = interval['aux'].get(k, 0.0) + v.detach().float() / accum
            if 'full_frac' in aux:
                f = aux['full_frac'].float() / accum
                interval['frac'] = f if interval['frac'] is None else interval['frac'] + f
        scaler.unscale_(optimizer)
        if ctrl_params:                           # controller gradient norm, before clipping
            grads = [p.grad.float().norm() for p in ctrl_params if p.grad is not None]
            interval['ctrl_norm'] += torch.stack(grads).norm() if grads else 0.0
        norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip if cfg.grad_clip > 0 else float('inf'))
        if scaler.is_enabled():
            skipped += ~torch.isfinite(norm)      # exactly the steps the GradScaler skips
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        iter_num += 1
        interval['n'] += 1
        key = (oracle_layers, exits)
        if key not in step_costs:              # analytic, so computed once per set of oracle layers / exits
            step_costs[key] = (flops.train_step_flops(mcfg, cfg.block_size, cfg.trainable, oracle_layers, exits),
                               flops.flops_proxy(mcfg, cfg.block_size, oracle_layers, exits))
        step, proxy_step = step_costs[key]
        flops_state['exact'] += seqs_per_iter * step['total']
        flops_state['proxy_num'] += seqs_per_iter * proxy_step * dense_step
        flops_state['dense'] += seqs_per_iter * dense_step

        if iter_num % cfg.log_interval == 0 or iter_num == cfg.max_iters:
            if ddp:                                # log the global mean, not rank 0's share
                both = torch.stack([loss_sum, interval['lm']])
                torch.distributed.all_reduce(both)
                loss_sum, interval['lm'] = both[0] / world, both[1] / world
            lossf = loss_sum.item()
            dtime = (time.time() - t_last) / max(1, iter_num - it_last)
            t_last, it_last = time.time(), iter_num
            n_skipped = int(skipped.item())
            consecutive_skips = consecutive_skips + (n_skipped - last_skipped) if n_skipped > last_skipped else 0
            last_skipped = n_skipped
            if not math.isfinite(lossf) and not scaler.is_enabled():
                raise TrainError(f"loss is {lossf} at iteration {iter_num}; stopping; {kept()}. "
                                 f"Try a lower learning_rate or grad_clip.")
            if scaler.is_enabled() and consecutive_skips >= cfg.max_fp16_skips:
                raise TrainError(f"{consecutive_skips} consecutive fp16 overflow steps by iteration {iter_num}; "
                                 f"stopping. Try dtype=bfloat16/float32 or a lower learning_rate.")
            n = max(1, interval['n'])
            lm = interval['lm'].item() / n
            frac = (interval['frac'] / n).tolist() if interval['frac'] is not None else None
            ctrl_norm = interval['ctrl_norm'].item() / n if ctrl_params else None
            aux_means = {k: float(v) / n for k, v in interval['aux'].items()}
            interval = dict(lm=torch.zeros((), device=dev), frac=None, ctrl_norm=torch.zeros((), device=dev), n=0, aux={})
            if master:
                tps = tokens_per_iter / dtime
                peak = flops.peak_flops(dev, dt)         # MFU from the FLOPs this step really ran
                mfu = step['total'] * seqs_per_iter / world / dtime / peak if peak else None
                proxy = flops_state['proxy_num'] / flops_state['dense']
                print(f"iter {iter_num}: loss {lossf:.4f}, lm {lm:.4f}, lr {lr:.2e}, {dtime * 1000:.1f} ms/iter, "
                      f"{tps:,.0f} tok/s" + (f", mfu {mfu * 100:.1f}%" if mfu is not None else '')
                      + (f", full {np.mean(frac):.3f}, flops proxy {proxy:.3f}x" if frac else ''))
                rec = dict(type='train', iter=iter_num, loss=lossf, lm_loss=lm, lr=lr, ms_per_iter=dtime * 1000,
                           tokens_per_s=tps, mfu=mfu, grad_norm=float(norm), ctrl_grad_norm=ctrl_norm,
                           full_frac=frac, flops_proxy=proxy, train_flops=flops_state['exact'],
                           train_flops_vs_dense=flops_state['exact'] / flops_state['dense'],
                           skipped_steps=n_skipped)
                rec.update(aux_means)            # auxiliary terms, averaged over the log interval
                history['train'].append(dict(iter=iter_num, lm_loss=lm))
                log(rec)
            if ddp:                                # agree on stopping at a common iteration
                flag = torch.tensor(float(stop.signum is not None), device=dev)
                torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
                stop_now = flag.item() > 0
            else:
                stop_now = stop.signum is not None
        else:
            stop_now = stop.signum is not None and not ddp
        if stop_now:
            stopped = True
            if master:
                checkpoint()
                print(f"stopped by signal at iteration {iter_num}; checkpoint saved to {ckpt_path}.\n"
                      f"resume with: python train.py {shlex.join(argv)} --init_from=resume")
            break

    if master:
        flops_state['wall_s'] = time.time() - t_run
        summary = run_summary(history['train'], history['eval'], cfg, flops_state['wall_s'])
        summary.update(type='summary', iter=iter_num, best_val_loss=best_val, skipped_steps=int(skipped.item()),
                       trainable_params=sum(p.numel() for p in {id(p): p for p in params}.values()),
                       flops_proxy=flops_state['proxy_num'] / max(1.0, flops_state['dense']),
                       train_flops=flops_state['exact'])
        if not cfg.eval_only and not stopped and mcfg.route != 'none':
            with eval_rng():
                summary['routing'] = evaluation.report(raw_model, train_data, val_data, meta, cfg.eval_iters,
                                                       cfg.calib_iters, autocast, cfg.eval_seed)
            print_routing(raw_model.family, summary['routing'])
            # the eval forward at the realised routing: ideal (mean fractions) and as executed (MoD pads
            # every row to the longest, so it runs more than the mean)
            dense_fwd = flops.dense_forward_flops(mcfg, cfg.block_size)
            for key, frac_key in (('eval_flops_vs_dense', 'full_frac'), ('eval_flops_executed_vs_dense', 'exec_frac')):
                frac = summary['routing']['val_loss'][frac_key]
                summary[key] = flops.forward_flops(mcfg, cfg.block_size, 'sparse', full_frac=frac) / dense_fwd
        log(summary)
        metrics_f.close()
        if not stopped:
            written = [f for f in RUN_FILES if os.path.exists(os.path.join(cfg.out_dir, f))]
            print(f"done: {iter_num} iterations, best val loss {best_val:.4f}. Outputs in {cfg.out_dir}/ "
                  f"({', '.join(written)})."
                  + (f"\nsample with: python sample.py --out_dir={cfg.out_dir}" if 'ckpt.pt' in written else ''))
    if ddp:                     # rank 0 may still be writing its summary: leave together, or a rank
        torch.distributed.barrier()            # tearing gloo down early can abort the others
        torch.distributed.destroy_process_group()
    return 0


if __name__ == '__main__':
    run_cli(main)
