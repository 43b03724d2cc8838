"""
Train a nanodepth model.

    python train.py                                   # quickstart: synthetic corpus, small model, CPU
    python train.py config/shakespeare_char.py --max_iters=500 --compile=False
    torchrun --standalone --nproc_per_node=2 train.py config/gpt2_124m_fineweb.py   # DDP

Writes into out_dir: metrics.jsonl (one JSON object per log line and per eval), config.json (the
resolved config), run_info.json (code version, torch, device), ckpt.pt (written atomically: model,
optimizer, scaler, RNG states, iteration, best val loss, config, sampler state). `--init_from=resume`
continues exactly where ckpt.pt left off (a finished run says so and writes nothing). Ctrl-C /
SIGTERM finishes the current step, saves, exits 0. One run at a time per out_dir (runlock.py).
"""
import errno
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
import traceback
from contextlib import contextmanager
from dataclasses import asdict, fields
from types import SimpleNamespace

import numpy as np
import torch

import eval as evaluation
import flops
from checkpoint import load_checkpoint, remove_stale_temps, save_checkpoint
from configurator import ConfigError, UserError, declared_defaults, load_config, run_cli
from data.loader import DataError, check_data, data_identity, load_dataset_meta, open_splits
from device import autocast_context, resolve_device_dtype
from model import ALIASES, FAMILIES, GPT, GPTConfig, is_controller_key
from runlock import FolderBusy, lock_folder
from train_checks import (RUN_FILES, TrainError, check_against_checkpoint, check_family_options,
                          check_out_dir, check_state_fits, check_train_config, model_config)

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
gradient_accumulation_steps = 1   # micro-batches per optimizer step, summed over all DDP processes
# model and routing: every field of model.GPTConfig is a config key with GPTConfig's default (there: the
# shape, block_size 128, and every family's options); the two below are the only ones train.py changes
route = 'ffn'                # GPTConfig's default is the dense model; the quickstart trains G1-routed FFNs
vocab_size = 0               # 0: from the data's meta.json (rounded up to a multiple of 64 above 1024)
trainable = 'all'            # 'all' (joint), 'controller' (backbone frozen: gates, routers, predictors,
                             # exit heads, ensemble norms) or 'last_layers' (the last ens_layers blocks + ln_f)
ffn_oracle_layers_per_step = 1   # controlled layers given oracle utility labels per step (util/rank losses)
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
verify_data = True           # before training: the data files' sha256 against meta.json, token ids against the vocabulary
DEFAULTS = declared_defaults(__file__)     # the literals above: flops.py and eval.py read the same keys
for _f in fields(GPTConfig):
    DEFAULTS.setdefault(_f.name, _f.default)
# fields a run shares with its checkpoint: the backbone's shape (stage 2 too), the routed layers (a resume),
# and how the controllers are built and what their losses train (a resume); each family names its own
BACKBONE_KEYS = ('n_layer', 'n_head', 'n_embd', 'block_size', 'bias', 'pos', 'vocab_size', 'gelu', 'rope_base',
                 *(k for f in FAMILIES.values() for k in f.backbone_options))
MODEL_KEYS = BACKBONE_KEYS + ('route', *(f.layers_option for f in FAMILIES.values() if f.layers_option))
RESUME_KEYS = MODEL_KEYS + tuple(k for f in FAMILIES.values() for k in f.resume_options)
HERE = os.path.dirname(os.path.abspath(__file__))
# ----------------------------------------------------------------------------------------------------


def main(argv):
    if int(os.environ.get('RANK', -1)) == -1:
        return run_checked(argv)
    end_ddp_process(argv)


def end_ddp_process(argv):
    """A DDP process ends with os._exit, on every path (done, stopped by a signal, an error).
    Left to the interpreter, freeing the DDP wrapper drops the last reference to the gloo process
    group, whose destructor joins gloo's worker thread while holding the GIL, which that thread
    waits for: about one run in ten then hangs after its work is done, deaf to SIGTERM. By now
    everything the run writes is on disk (the checkpoint fsynced, metrics flushed per record and
    closed, the lock released): only stdout and stderr remain to flush."""
    code = 1
    try:
        code = run_checked(argv)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        code = 2
    except SystemExit as e:    # as the interpreter does: sys.exit(message) prints it, exits 1
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
        if code == 1 and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
    except KeyboardInterrupt:          # a second Ctrl-C
        code = 130
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run_checked(argv):
    try:
        return train(argv)
    except (ConfigError, DataError) as e:   # the config, device and data checks shared with the other scripts
        raise TrainError(str(e)) from None
    except OSError as e:               # a full disk under the run's logs (a checkpoint write says so itself)
        if e.errno != errno.ENOSPC:
            raise
        raise TrainError(f"no space left on the disk while writing {e.filename or 'the run files'}; free some "
                         f"space, then continue with --init_from=resume (the last checkpoint, if any, is kept)") from None
    except RuntimeError as e:          # DDP: a peer died, or hung past ddp_timeout, inside a collective
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            raise
        raise TrainError(f"a DDP process stopped responding ({str(e).splitlines()[0][:160]}); this process "
                         f"stops too. The last checkpoint is kept: resume with --init_from=resume") from None


def train(argv):
    cfg, cfg_dict = read_config(argv)
    proc = setup_process(cfg)
    start_process_group(cfg, proc)
    lock = hold_out_dir(cfg, proc)    # one writer per run folder, before anything is read or done
    run = None
    try:
        run = setup(cfg, cfg_dict, proc, argv)
        if run is None:               # a resumed run that is already finished: nothing to do
            return 0
        train_loop(run, argv)
    finally:
        if run is not None and run.metrics_f is not None:
            run.metrics_f.close()
        if lock is not None:
            lock.release()
    if proc.ddp:        # rank 0 may still be writing its summary: leave together (no destroy:
        torch.distributed.barrier()    # the process ends with os._exit, see end_ddp_process)
    return 0


def train_loop(run, argv):
    stop = StopFlag()                 # from here, a first Ctrl-C / SIGTERM ends the run with a checkpoint
    stopped = False                   # by a signal to this process or, under DDP, to any process
    while True:
        if eval_due(run):
            if run.master:
                evaluate_and_checkpoint(run)
            run.t_last, run.it_last = time.time(), run.iter_num
        if run.iter_num >= run.cfg.max_iters or run.cfg.eval_only:
            break
        lr, loss_sum, norm, step = optimisation_step(run)
        logged = run.iter_num % run.cfg.log_interval == 0 or run.iter_num == run.cfg.max_iters
        if logged:
            log_progress(run, lr, loss_sum, norm, step)
        if run.iter_num < run.cfg.max_iters and stop_requested(run, stop, logged):   # else: finish
            stopped = True
            if run.master:
                save_run(run)
                print(f"stopped by signal at iteration {run.iter_num}; checkpoint saved to {run.ckpt_path}.\n"
                      f"resume with: python train.py {shlex.join(argv)} --init_from=resume")
            break
    if run.master:
        finish_run(run, stopped)


def hold_out_dir(cfg, proc):
    """Rank 0 locks out_dir for the run's lifetime (runlock); under DDP every rank learns whether it
    could, so that all of them stop with the same error if another process holds the folder."""
    lock, refusal = None, None
    if proc.master:
        try:
            lock = lock_folder(cfg.out_dir, 'out_dir')
        except UserError as e:
            refusal = e
    if proc.ddp:              # 0: locked; the holder's PID; -1: another error (rank 0 prints it)
        code = 0 if refusal is None else (getattr(refusal, 'pid', None) or -1)
        status = torch.tensor([code], dtype=torch.int64, device=proc.dev)
        torch.distributed.broadcast(status, 0)
        code = int(status.item())
        if refusal is None and code > 0:
            refusal = FolderBusy(cfg.out_dir, code, 'out_dir')
        elif refusal is None and code < 0:
            refusal = TrainError(f"rank 0 could not lock out_dir {cfg.out_dir} (its error is "
                                 f"above)")
    if refusal is not None:
        raise refusal
    return lock


def setup(cfg, cfg_dict, proc, argv):
    """Everything the loop shares, in one namespace: the config, this process (DDP rank and world,
    device, dtype), the model (raw, and wrapped for the steps), optimizer, data, fixed eval batches,
    the iteration and totals to start from; rank 0 also opens the run files. None for a resumed run
    that is already finished (it says so, and writes nothing)."""
    meta, ckpt = open_inputs(cfg, proc.master)     # the data's meta.json, the checkpoint to start from
    if finished_already(cfg, ckpt):
        if proc.master:
            print(f"the run in {cfg.out_dir} is already finished (iteration {ckpt['iter_num']}, "
                  f"max_iters={cfg.max_iters}, its summary recorded): nothing to do. Train it "
                  f"further with a larger --max_iters, or evaluate it with --eval_only=True")
        return None
    seed_rngs(cfg.seed + proc.rank)
    model = build_model(cfg, meta, ckpt).to(proc.dev)
    cfg_dict.update({k: getattr(cfg, k) for k in MODEL_KEYS})    # what was built (GPT-2 init sets the shape)
    train_data, val_data = open_splits(meta, cfg.block_size, cfg.batch_size, cfg.seed, proc.dev)
    scaler = torch.amp.GradScaler(proc.dev.type, enabled=(proc.dt == 'float16'))
    params = trainable_parameters(model, cfg)
    optimizer = model.configure_optimizers(cfg.weight_decay, cfg.learning_rate, (cfg.beta1, cfg.beta2),
                                           proc.dev.type, params=params)
    progress = start_progress(cfg, ckpt, optimizer, scaler, proc.master)
    del ckpt                                       # loaded: free its memory before the loop
    run = SimpleNamespace(
        **vars(proc), **progress, cfg=cfg, cfg_dict=cfg_dict, argv=argv, meta=meta, raw_model=model,
        model=wrap_model(model, cfg, proc), params=params, ctrl_params=model.controller_parameters(),
        optimizer=optimizer, scaler=scaler, train_data=train_data, val_data=val_data,
        # fixed batches (by eval_seed) for the loss estimates, and train-split ones (never val) that
        # calibrate the causal thresholds
        eval_sets={'train': (train_data, train_data.eval_batches(cfg.eval_iters, 1, cfg.eval_seed)),
                   'val': (val_data, val_data.eval_batches(cfg.eval_iters, 2, cfg.eval_seed))},
        calib=[train_data.fetch(s)[0] for s in train_data.eval_batches(cfg.calib_iters, 3, cfg.eval_seed)],
        ckpt_path=os.path.join(cfg.out_dir, 'ckpt.pt'), metrics_f=None)
    if run.master:
        run.metrics_f = open_run_files(cfg, cfg_dict, proc, run.iter_num)
        print(f"model: {model.get_num_params() / 1e6:.2f}M parameters ({count_params(params):,} trainable) | data: "
              f"{cfg.dataset} ({meta['vocab_size']} tokens vocab, {meta['train_tokens']:,} train tokens) | "
              f"device {run.dev}, {run.dt}, world {run.world}")
    start_counters(run)
    return run


# ----------------------------------------------------------------------------------------------------
# the config, checked before anything is read or written (train_checks.py holds the checks)

def read_config(argv):
    """Defaults, then config files and --key=value in argv: (namespace, the dict written to config.json)."""
    cfg_dict = load_config(DEFAULTS, argv, ALIASES)
    cfg = SimpleNamespace(**cfg_dict)
    check_train_config(cfg)
    model_config(cfg)                           # validates routing fields before any work
    check_family_options(cfg, argv, DEFAULTS)
    return cfg, cfg_dict


# ----------------------------------------------------------------------------------------------------
# the process, the inputs, the model and what it trains

def setup_process(cfg):
    """This process's place in the run: DDP (torchrun sets RANK / WORLD_SIZE) or a lone process, the
    micro-batches it accumulates per step, its device and dtype."""
    ddp = int(os.environ.get('RANK', -1)) != -1
    rank, local_rank, world = (int(os.environ['RANK']), int(os.environ['LOCAL_RANK']),
                               int(os.environ['WORLD_SIZE'])) if ddp else (0, 0, 1)
    if cfg.gradient_accumulation_steps % world:
        raise TrainError(f"gradient_accumulation_steps={cfg.gradient_accumulation_steps} must be a "
                         f"multiple of the number of processes ({world})")
    dev, dt = resolve_device_dtype(cfg)
    if ddp and dev.type == 'cuda':
        dev = torch.device(f'cuda:{local_rank}')
        torch.cuda.set_device(dev)
    return SimpleNamespace(ddp=ddp, rank=rank, local_rank=local_rank, world=world, master=rank == 0,
                           accum=cfg.gradient_accumulation_steps // world, dev=dev, dt=dt,
                           autocast=autocast_context(dev, dt))


def open_inputs(cfg, master):
    """The dataset's meta.json and the checkpoint the run starts from (None from scratch or GPT-2),
    checked against each other."""
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
        if finished_already(cfg, ckpt):            # nothing more to check: setup says so and stops
            return meta, ckpt
    elif os.path.isfile(cfg.init_from):
        ckpt = load_checkpoint(cfg.init_from)
    check_data(cfg, meta, ckpt)
    return meta, ckpt


def finished_already(cfg, ckpt):
    """A resume (not eval-only) of a run whose checkpoint reached max_iters and whose metrics hold
    the summary written at that iteration (a run killed between its last checkpoint and its
    summary is not finished: resuming writes the summary)."""
    if cfg.init_from != 'resume' or cfg.eval_only or ckpt is None:
        return False
    if ckpt['iter_num'] < cfg.max_iters:
        return False
    path = os.path.join(cfg.out_dir, 'metrics.jsonl')
    if not os.path.exists(path):
        return False
    with open(path) as f:
        records = [r for line in f if (r := parse_record(line)) is not None]
    return any(r.get('type') == 'summary' and r.get('iter') == ckpt['iter_num'] for r in records)


def seed_rngs(seed):
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def build_model(cfg, meta, ckpt):
    """Model from scratch, from a checkpoint (resume: everything; a checkpoint file: the backbone, with
    fresh gates), or from GPT-2 weights, with the checks that the data and the checkpoint agree."""
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
        model = backbone_from_checkpoint(cfg, meta, ckpt)
    elif cfg.init_from == 'scratch':
        data_vocab = meta['vocab_size']
        vs = cfg.vocab_size or (data_vocab if data_vocab <= 1024 else ((data_vocab + 63) // 64) * 64)
        model = GPT(model_config(cfg, vocab_size=vs))
    else:
        model = gpt2_model(cfg, meta)
    if meta['vocab_size'] > model.config.vocab_size:
        raise TrainError(f"field 'vocab_size' differs: data/{cfg.dataset} has {meta['vocab_size']} tokens but "
                         f"the model's vocabulary is {model.config.vocab_size}")
    if cfg.block_size != model.config.block_size:
        raise TrainError(f"field 'block_size' differs: config {cfg.block_size}, model {model.config.block_size}")
    return model


def backbone_from_checkpoint(cfg, meta, ckpt):
    """Stage 2: the checkpoint's backbone under fresh controller modules. The routing family may change
    (e.g. a dense backbone under another family's controller) as long as every backbone weight comes
    from the checkpoint."""
    check_against_checkpoint(cfg, meta, ckpt, BACKBONE_KEYS)
    model = GPT(model_config(cfg, vocab_size=ckpt['model_args']['vocab_size']))
    backbone = {k: v for k, v in ckpt['model'].items() if not is_controller_key(k)}
    missing, unexpected = model.load_state_dict(backbone, strict=False)
    bad = [k for k in missing if not is_controller_key(k)] + list(unexpected)
    if bad:
        raise TrainError(f"checkpoint {cfg.init_from} does not fit this model's backbone (route "
                         f"{ckpt['model_args'].get('route')!r} -> {cfg.route!r}): {bad[:5]}")
    model.family.after_load(model)     # e.g. a family's own norms start as copies of ln_f
    return model


def gpt2_model(cfg, meta):
    """GPT-2 weights (a hub name or a local HF directory) under this config's routing fields."""
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
    return model


def start_process_group(cfg, proc):
    if proc.ddp:
        from torch.distributed import init_process_group
        from datetime import timedelta     # a silent (hung, stopped) peer ends the run instead of blocking it
        init_process_group(backend='nccl' if proc.dev.type == 'cuda' else 'gloo',
                           timeout=timedelta(seconds=cfg.ddp_timeout))
    if proc.dev.type == 'cuda':
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


def trainable_parameters(model, cfg):
    """Joint training: everything. Controller-only: freeze the backbone (requires_grad=False) and
    return only the controller's parameters (model.is_controller_key). 'last_layers': only the last
    ens_layers blocks and the final norm (plain fine-tuning of a dense model, a baseline for controllers
    trained on a frozen backbone)."""
    if cfg.trainable == 'all':
        return list(model.parameters())
    if cfg.trainable not in ('controller', 'last_layers'):
        raise TrainError(f"trainable must be 'all', 'controller' or 'last_layers', got {cfg.trainable!r}")
    if cfg.trainable == 'last_layers':
        k = model.config.ens_layers
        if model.family.routes or not 1 <= k <= model.config.n_layer:
            raise TrainError(f"trainable=last_layers fine-tunes the last ens_layers (1..n_layer) blocks of a dense "
                             f"model (route='none'); got route={model.config.route!r}, ens_layers={k}")
        ctrl = [p for b in model.transformer.h[-k:] for p in b.parameters()] + list(model.transformer.ln_f.parameters())
    else:
        ctrl = model.controller_parameters()
    if not ctrl:
        raise TrainError(f"trainable=controller trains only a routing controller's parameters (gates, routers, "
                         f"predictors, own exit heads, ensemble norms); this config (route={cfg.route!r} with its "
                         f"options) has none: use trainable=all")
    ids = {id(p) for p in ctrl}
    for p in model.parameters():
        p.requires_grad_(id(p) in ids)
    return ctrl


def count_params(params):
    return sum(p.numel() for p in {id(p): p for p in params}.values())    # tied weights once


# ----------------------------------------------------------------------------------------------------
# where the loop starts: fresh or resumed, the wrapped model, the run files, the counters

def start_progress(cfg, ckpt, optimizer, scaler, master):
    """What a checkpoint carries across a resume: iteration, best val loss, cumulative training FLOPs
    (exact: autograd's count, and the paper's proxy; per sequence), the log history for the summary,
    the optimizer and scaler, and (rank 0, whose RNG draws matter) the RNG streams."""
    if ckpt is None or cfg.init_from != 'resume':
        return dict(resumed=False, iter_num=0, best_val=float('inf'), history=dict(train=[], eval=[]),
                    flops_state=dict(exact=0.0, proxy_num=0.0, dense=0.0, wall_s=0.0))
    optimizer.load_state_dict(ckpt['optimizer'])
    scaler.load_state_dict(ckpt['scaler'])
    if master and ckpt.get('rng') is not None:
        set_rng_state(ckpt['rng'])
    return dict(resumed=True, iter_num=ckpt['iter_num'], best_val=ckpt['best_val_loss'], history=ckpt['history'],
                flops_state=ckpt['flops_state'])


def rng_state():
    return dict(torch=torch.get_rng_state(), numpy=np.random.get_state(), python=random.getstate(),
                cuda=torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)


def set_rng_state(s):
    torch.set_rng_state(s['torch'])
    np.random.set_state(s['numpy'])
    random.setstate(s['python'])
    if s.get('cuda') is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s['cuda'])


def wrap_model(raw_model, cfg, proc):
    """What the training steps call: the model compiled and/or DDP-wrapped (evals, checkpoints and the
    family's hooks use the raw model)."""
    model = raw_model
    if cfg.compile:
        model = torch.compile(model, dynamic=False)
        import torch._dynamo as dynamo         # (a bare `import torch._dynamo` would make torch local here)
        limit = 'recompile_limit' if hasattr(dynamo.config, 'recompile_limit') else 'cache_size_limit'
        # one graph per set of per-step options (e.g. oracle layers): compile each
        setattr(dynamo.config, limit, max(getattr(dynamo.config, limit), raw_model.config.n_layer + 8))
    if proc.ddp:
        from torch.nn.parallel import DistributedDataParallel as DDP
        partial = raw_model.family.ddp_find_unused(raw_model.config)   # some parameters get no gradient
        model = DDP(model, device_ids=[proc.local_rank] if proc.dev.type == 'cuda' else None,
                    find_unused_parameters=partial)
    return model


def open_run_files(cfg, cfg_dict, proc, iter_num):
    """config.json and run_info.json, and metrics.jsonl open for appending (rank 0 only)."""
    os.makedirs(cfg.out_dir, exist_ok=True)
    if not (cfg.eval_only and cfg.init_from == 'resume'):     # an evaluation keeps the training's
        with open(os.path.join(cfg.out_dir, 'config.json'), 'w') as f:
            json.dump(cfg_dict, f, indent=2)
        with open(os.path.join(cfg.out_dir, 'run_info.json'), 'w') as f:
            json.dump(run_info(cfg, proc.dev, proc.dt, proc.world), f, indent=2)
    if cfg.init_from != 'resume':      # --overwrite: the old run goes only now that every check has passed
        for name in ('ckpt.pt', 'metrics.jsonl'):
            if os.path.exists(os.path.join(cfg.out_dir, name)):
                os.remove(os.path.join(cfg.out_dir, name))
    else:                              # records a killed run logged after its last checkpoint are redone
        drop_records_after(os.path.join(cfg.out_dir, 'metrics.jsonl'), iter_num)
    return open(os.path.join(cfg.out_dir, 'metrics.jsonl'), 'a')


def code_version():
    """The git commit of this code (None outside git or before the first commit) and whether the
    working tree differs from it: run_info.json and bench.py's results record it."""
    def git(*args):
        try:
            r = subprocess.run(['git', *args], cwd=HERE, capture_output=True, text=True, timeout=10)
            return r.stdout.strip() if r.returncode == 0 else ''   # e.g. no commits yet: not a sha
        except Exception:
            return ''
    return dict(git_sha=git('rev-parse', 'HEAD') or None, git_dirty=bool(git('status', '--porcelain')))


def run_info(cfg, dev, dt, world_size):
    return dict(**code_version(), torch=torch.__version__, cuda=torch.version.cuda, python=sys.version.split()[0],
                device=str(dev), device_name=torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'cpu',
                dtype=dt, world_size=world_size, host=socket.gethostname(), argv=sys.argv,
                threads=torch.get_num_threads(), started=time.strftime('%Y-%m-%dT%H:%M:%S%z'))


def drop_records_after(path, iter_num):
    """Keep the metrics records up to the resumed iteration: the steps after it run again."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        lines = [l for l in f if l.strip()]
    keep = [l if l.endswith('\n') else l + '\n' for l in lines
            if (r := parse_record(l)) is not None and r.get('iter', 0) <= iter_num]
    if keep != lines:
        with open(path + '.tmp', 'w') as f:
            f.writelines(keep)
        os.replace(path + '.tmp', path)


def parse_record(line):
    """A metrics line as a dict, or None for a line cut short (a full disk or a kill mid-write)."""
    try:
        r = json.loads(line)
    except ValueError:
        return None
    return r if isinstance(r, dict) else None


def start_counters(run):
    """The loop's running totals and clocks; fp16 overflow steps are counted on the device (no sync)."""
    cfg = run.cfg
    run.seqs_per_iter = cfg.gradient_accumulation_steps * cfg.batch_size
    run.dense_step = 3 * flops.dense_forward_flops(run.raw_model.config, cfg.block_size)   # a full-only step, per sequence
    run.step_costs, run.interval = {}, new_interval(run.dev)
    run.skipped, run.last_skipped, run.consecutive_skips = torch.zeros((), device=run.dev), 0, 0
    run.t_last, run.it_last, run.start_iter = time.time(), run.iter_num, run.iter_num
    run.t_run = time.time() - run.flops_state['wall_s']


def new_interval(dev):
    """Sums over one log interval, kept on the device until the log step reads them."""
    return dict(lm=torch.zeros((), device=dev), frac=None, ctrl_norm=torch.zeros((), device=dev), n=0, aux={})


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


# ----------------------------------------------------------------------------------------------------
# the loop: eval and checkpoint, one optimisation step, its FLOPs, the log, stopping

def eval_due(run):
    cfg = run.cfg
    # by the run this one resumes (an eval-only run evaluates the checkpoint once, whatever it has)
    logged_already = run.resumed and run.iter_num == run.start_iter and not cfg.eval_only
    return (run.iter_num % cfg.eval_interval == 0 or run.iter_num >= cfg.max_iters or cfg.eval_only) \
        and not logged_already


def evaluate_and_checkpoint(run):
    """Rank 0: train and val loss on the fixed eval batches, one 'eval' record, and a checkpoint."""
    res = estimate_loss(run)
    if not all(math.isfinite(res[s]['loss']) for s in res):
        raise TrainError(f"eval loss is not finite at iteration {run.iter_num} (train {res['train']['loss']}, "
                         f"val {res['val']['loss']}); stopping; {kept(run)}. Try a lower learning_rate or grad_clip.")
    run.best_val = min(run.best_val, res['val']['loss'])
    frac = res['val']['full_frac']
    print(f"iter {run.iter_num}: train loss {res['train']['loss']:.4f}, val loss {res['val']['loss']:.4f}"
          + (f", val full-path fraction {np.mean(frac):.3f}" if frac else ''))
    rec = dict(type='eval', iter=run.iter_num, train_loss=res['train']['loss'], val_loss=res['val']['loss'],
               val_full_frac=frac)
    if run.cfg.eval_only:             # an evaluation of the checkpoint, not a step of its training
        rec['eval_only'] = True
    run.history['eval'].append(rec)
    log(run, rec)
    if not run.cfg.eval_only and run.iter_num > 0:
        run.flops_state['wall_s'] = time.time() - run.t_run
        save_run(run)


def estimate_loss(run):
    """LM loss on fixed train/val batches in eval mode: causal routing, thresholds calibrated first on
    separate train-split batches (never on val)."""
    with eval_rng(run.dev, run.cfg.eval_seed):
        with run.autocast:
            run.raw_model.calibrate(torch.cat(run.calib))
        return {split: evaluation.evaluate(run.raw_model, [batches.fetch(s) for s in starts], run.autocast)
                for split, (batches, starts) in run.eval_sets.items()}


@contextmanager
def eval_rng(dev, seed):
    """Evals draw random numbers (ffn_gate='random' decides per token at eval): fork the RNG and seed it,
    so evaluating never changes training and every eval is repeatable."""
    with torch.random.fork_rng(devices=[dev] if dev.type == 'cuda' else []):
        torch.manual_seed(seed)
        yield


def save_run(run):
    """Everything an exact resume needs, written atomically; never a broken model over a good checkpoint."""
    for p in run.raw_model.parameters():
        if not torch.isfinite(p).all():
            raise TrainError(f"non-finite weights at iteration {run.iter_num}; {kept(run)}")
    cfg = run.cfg
    save_checkpoint(run.ckpt_path, dict(
        model=run.raw_model.state_dict(), optimizer=run.optimizer.state_dict(), scaler=run.scaler.state_dict(),
        model_args=asdict(run.raw_model.config), iter_num=run.iter_num, best_val_loss=run.best_val,
        config=run.cfg_dict, history=run.history, flops_state=run.flops_state,
        rng=rng_state(), sampler=dict(kind='epoch-permutation', seed=cfg.seed, next_iter=run.iter_num,
                                      micro_batches_per_iter=cfg.gradient_accumulation_steps),
        data_meta=data_identity(run.meta)))


def kept(run):
    return (f"the last good checkpoint {run.ckpt_path} is left untouched" if os.path.exists(run.ckpt_path)
            else "no checkpoint was saved yet")


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


def optimisation_step(run):
    """One optimizer step over accum micro-batches (DDP syncs gradients on the last), unscaled and
    clipped. Returns its learning rate, summed loss (on the device: no sync), grad norm and FLOPs."""
    cfg = run.cfg
    lr = lr_at(cfg, run.iter_num)
    for group in run.optimizer.param_groups:
        group['lr'] = lr
    # the family's per-step options (oracle layers, the exit curriculum): a pure function of the step
    opts = run.raw_model.family.step_options(run.raw_model, run.iter_num, cfg)
    loss_sum = torch.zeros((), device=run.dev)
    for micro in range(run.accum):
        x, y = run.train_data.get((run.iter_num * run.accum + micro) * run.world + run.rank)
        if run.ddp:
            run.model.require_backward_grad_sync = micro == run.accum - 1
        with run.autocast:
            _, loss, aux = run.model(x, y, **opts)
            loss = loss / run.accum
        run.scaler.scale(loss).backward()
        loss_sum += loss.detach().float()
        accumulate(run.interval, aux, run.accum, run.raw_model.family.logged_stats)
    run.scaler.unscale_(run.optimizer)
    if run.ctrl_params:                           # controller gradient norm, before clipping
        grads = [p.grad.float().norm() for p in run.ctrl_params if p.grad is not None]
        run.interval['ctrl_norm'] += torch.stack(grads).norm() if grads else 0.0
    norm = torch.nn.utils.clip_grad_norm_(run.params, cfg.grad_clip if cfg.grad_clip > 0 else float('inf'))
    if run.scaler.is_enabled():
        run.skipped += ~torch.isfinite(norm)      # exactly the steps the GradScaler skips
    run.scaler.step(run.optimizer)
    run.scaler.update()
    run.optimizer.zero_grad(set_to_none=True)
    run.iter_num += 1
    run.interval['n'] += 1
    return lr, loss_sum, norm, count_flops(run, opts)


def accumulate(interval, aux, accum, stats):
    """Add one micro-batch's LM loss, auxiliary *_loss terms, the family's statistics `stats` and its
    full-path fractions to the interval's sums."""
    interval['lm'] += aux['lm_loss'].float() / accum
    for k, v in aux.items():
        if (k.endswith('_loss') and k != 'lm_loss') or k in stats:
            interval['aux'][k] = interval['aux'].get(k, 0.0) + v.detach().float() / accum
    if 'full_frac' in aux:
        f = aux['full_frac'].float() / accum
        interval['frac'] = f if interval['frac'] is None else interval['frac'] + f


def count_flops(run, opts):
    """Add the step's training FLOPs, exact and the paper's proxy, to the run's totals; returns the
    step's analytic cost per sequence (computed once per set of oracle layers and exits)."""
    key = (opts.get('oracle_layers', ()), opts.get('exits'))
    if key not in run.step_costs:
        mcfg, T = run.raw_model.config, run.cfg.block_size
        run.step_costs[key] = (flops.train_step_flops(mcfg, T, run.cfg.trainable, *key), flops.flops_proxy(mcfg, T, *key))
    step, proxy_step = run.step_costs[key]
    run.flops_state['exact'] += run.seqs_per_iter * step['total']
    run.flops_state['proxy_num'] += run.seqs_per_iter * proxy_step * run.dense_step
    run.flops_state['dense'] += run.seqs_per_iter * run.dense_step
    return step


def log_progress(run, lr, loss_sum, norm, step):
    """Every log_interval steps: the interval's means (global under DDP), a stop if training diverged,
    and (rank 0) one printed line and one 'train' record."""
    iv = run.interval
    if run.ddp:                                # log the global mean, not rank 0's share
        both = torch.stack([loss_sum, iv['lm']])
        torch.distributed.all_reduce(both)
        loss_sum, iv['lm'] = both[0] / run.world, both[1] / run.world
    lossf = loss_sum.item()
    dtime = (time.time() - run.t_last) / max(1, run.iter_num - run.it_last)
    run.t_last, run.it_last = time.time(), run.iter_num
    n_skipped = check_divergence(run, lossf)
    n = max(1, iv['n'])
    lm = iv['lm'].item() / n
    frac = (iv['frac'] / n).tolist() if iv['frac'] is not None else None
    ctrl_norm = iv['ctrl_norm'].item() / n if run.ctrl_params else None
    aux_means = {k: float(v) / n for k, v in iv['aux'].items()}
    run.interval = new_interval(run.dev)
    if not run.master:
        return
    tps = run.seqs_per_iter * run.cfg.block_size / dtime
    peak = flops.peak_flops(run.dev, run.dt)         # MFU from the FLOPs this step really ran
    mfu = step['total'] * run.seqs_per_iter / run.world / dtime / peak if peak else None
    fs = run.flops_state
    proxy = fs['proxy_num'] / fs['dense']
    print(f"iter {run.iter_num}: loss {lossf:.4f}, lm {lm:.4f}, lr {lr:.2e}, {dtime * 1000:.1f} ms/iter, "
          f"{tps:,.0f} tok/s" + (f", mfu {mfu * 100:.1f}%" if mfu is not None else '')
          + (f", full {np.mean(frac):.3f}, flops proxy {proxy:.3f}x" if frac else ''))
    rec = dict(type='train', iter=run.iter_num, loss=lossf, lm_loss=lm, lr=lr, ms_per_iter=dtime * 1000,
               tokens_per_s=tps, mfu=mfu, grad_norm=float(norm), ctrl_grad_norm=ctrl_norm, full_frac=frac,
               flops_proxy=proxy, train_flops=fs['exact'], train_flops_vs_dense=fs['exact'] / fs['dense'],
               skipped_steps=n_skipped)
    rec.update(aux_means)            # auxiliary terms, averaged over the log interval
    run.history['train'].append(dict(iter=run.iter_num, lm_loss=lm))
    log(run, rec)


def check_divergence(run, lossf):
    """Stop on a loss that is no longer finite, or (fp16) on max_fp16_skips overflow steps in a row;
    returns the number of steps the GradScaler skipped so far."""
    n_skipped = int(run.skipped.item())
    run.consecutive_skips = run.consecutive_skips + (n_skipped - run.last_skipped) if n_skipped > run.last_skipped else 0
    run.last_skipped = n_skipped
    if not math.isfinite(lossf) and not run.scaler.is_enabled():
        raise TrainError(f"loss is {lossf} at iteration {run.iter_num}; stopping; {kept(run)}. "
                         f"Try a lower learning_rate or grad_clip.")
    if run.scaler.is_enabled() and run.consecutive_skips >= run.cfg.max_fp16_skips:
        raise TrainError(f"{run.consecutive_skips} consecutive fp16 overflow steps by iteration {run.iter_num}; "
                         f"stopping. Try dtype=bfloat16/float32 or a lower learning_rate.")
    return n_skipped


def log(run, obj):
    if run.metrics_f is not None:
        try:
            run.metrics_f.write(json.dumps(obj) + '\n')
            run.metrics_f.flush()
        except OSError as e:           # name the file (a full disk: see main)
            raise OSError(e.errno, e.strerror, run.metrics_f.name) from None


def stop_requested(run, stop, logged):
    """A signal stops a lone process after this step; DDP processes agree at a log step (a collective),
    so that all of them stop at the same iteration."""
    if not run.ddp:
        return stop.signum is not None
    if not logged:
        return False
    flag = torch.tensor(float(stop.signum is not None), device=run.dev)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    return flag.item() > 0


# ----------------------------------------------------------------------------------------------------
# the end of the run

def finish_run(run, stopped):
    """Rank 0: the 'summary' record (and, for a routing family after a complete run, its routing
    report). An eval-only run's summary is marked eval_only and keeps the training's wall time."""
    cfg = run.cfg
    if not cfg.eval_only:
        run.flops_state['wall_s'] = time.time() - run.t_run
    summary = run_summary(run.history['train'], run.history['eval'], cfg, run.flops_state['wall_s'])
    summary.update(type='summary', iter=run.iter_num, best_val_loss=run.best_val, skipped_steps=int(run.skipped.item()),
                   trainable_params=count_params(run.params),
                   flops_proxy=run.flops_state['proxy_num'] / max(1.0, run.flops_state['dense']),
                   train_flops=run.flops_state['exact'])
    if cfg.eval_only:
        summary['eval_only'] = True
    if not stopped and run.raw_model.family.routes:
        summary.update(routing_summary(run))
    per_token = flops.dense_forward_flops(run.raw_model.config, cfg.block_size) / cfg.block_size
    if not run.raw_model.family.routes:
        summary['eval_flops'] = per_token             # absolute: puts models of different sizes on one axis
    elif 'eval_flops_vs_dense' in summary:
        summary['eval_flops'] = summary['eval_flops_vs_dense'] * per_token
    log(run, summary)
    run.metrics_f.close()
    if cfg.eval_only:
        print(f"evaluated {cfg.out_dir} at iteration {run.iter_num} (eval only: nothing trained); "
              f"its eval and summary are appended to {os.path.join(cfg.out_dir, 'metrics.jsonl')}")
    elif not stopped:
        written = [f for f in RUN_FILES if os.path.exists(os.path.join(cfg.out_dir, f))]
        print(f"done: {run.iter_num} iterations, best val loss {run.best_val:.4f}. Outputs in {cfg.out_dir}/ "
              f"({', '.join(written)})."
              + (f"\nsample with: python sample.py --out_dir={cfg.out_dir}" if 'ckpt.pt' in written else ''))


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


def routing_summary(run):
    """The family's end-of-run report (eval.report), printed, and the eval forward's FLOPs at the
    realised routing: ideal (mean fractions) and as executed (sparse execution may run more, e.g. MoD
    pads every row to the longest)."""
    cfg, mcfg = run.cfg, run.raw_model.config
    with eval_rng(run.dev, cfg.eval_seed):
        out = dict(routing=evaluation.report(run.raw_model, run.train_data, run.val_data, run.meta, cfg.eval_iters,
                                             cfg.calib_iters, run.autocast, cfg.eval_seed))
    print_routing(run.raw_model.family, out['routing'])
    dense_fwd = flops.dense_forward_flops(mcfg, cfg.block_size)
    for key, frac_key in (('eval_flops_vs_dense', 'full_frac'), ('eval_flops_executed_vs_dense', 'exec_frac')):
        frac = out['routing']['val_loss'][frac_key]
        out[key] = flops.forward_flops(mcfg, cfg.block_size, 'sparse', full_frac=frac) / dense_fwd
    return out


def print_routing(family, r):
    for line in family.report_lines(r):
        print(line)
    for name, per_layer in r.get('full_frac_by_class', {}).items():
        print(f"  full-path fraction for {name:>9} targets: " + ' '.join(f"L{l}:{v:.2f}" for l, v in per_layer.items()))


if __name__ == '__main__':
    run_cli(main)
