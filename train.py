"""
Train a nanodepth model.

    python train.py                                 # quickstart: synthetic corpus, small model, CPU
    python train.py config/shakespeare_char.py --max_iters=500 --compile=False
    torchrun --standalone --nproc_per_node=2 train.py config/gpt2_124m_fineweb.py   # DDP

Writes into out_dir: metrics.jsonl (one JSON object per log line and per eval), config.json (the
resolved config), run_info.json (code version, torch, device), ckpt.pt (written atomically: model,
optimizer, scaler, RNG states, iteration, best val loss, config, sampler state).
`--init_from=resume` continues exactly where ckpt.pt left off (a finished run says so and writes
nothing). Ctrl-C / SIGTERM finishes the current step (or stops an evaluation), saves,
exits 0. One run at a time per out_dir (runlock.py).

The file reads as a run: the config defaults, main, setup, the loop, one optimisation step. The
checks live in train_checks.py, what carries a run across processes, signals and resumes in
run_state.py, and its metrics, FLOPs and end-of-run report in train_report.py.
"""
import errno
import math
import os
import shlex
import time
from contextlib import nullcontext
from dataclasses import fields
from types import SimpleNamespace

import torch

import eval as evaluation
from checkpoint import load_model, save_checkpoint
from configurator import (ConfigError, asks_help, declared_defaults, load_config, model_groups,
                          print_help, run_cli, source_group)
from data.loader import VOCAB_IDENTITY, DataError, open_splits
from device import autocast_context, check_batch_fits, resolve_device_dtype
from loggers import Loggers
import sharding
from model import FAMILIES, GPT, GPTConfig, allow_graphs, is_controller_key, is_draft_key
from run_state import (StopFlag, any_rank, check_inputs, checkpoint_state, end_ddp_process,
                       eval_rng, evaluated_at, finished_already, hold_out_dir, kept, open_inputs,
                       rng_state, seed_rngs, set_rng_state, share_interval, share_rank0_outcome,
                       start_progress, stop_requested)
from lora import apply_lora, has_lora_keys, lora_parameters
from train_checks import (TRAINABLE, TrainError, check_against_checkpoint, check_family_options,
                          check_state_fits, check_train_config, model_config)
from train_report import (accumulate, count_flops, count_params, finish_run, log_eval, log_progress,
                          open_run_files, start_counters)
# names bench.py and the tests reach as train.<name>
from configurator import UserError  # noqa: F401
from run_state import drop_records_after, parse_record  # noqa: F401
from train_checks import check_out_dir  # noqa: F401
from train_report import code_version, run_info  # noqa: F401

# --------------------------------------------------------------------------------------------------
# defaults (override with a config file and/or --key=value); the quickstart trains on these
# I/O
out_dir = 'out/quickstart'    # the run's folder: metrics.jsonl, config.json, ckpt.pt
eval_interval = 100          # iterations between evals (and checkpoints)
log_interval = 10            # iterations between train log lines
eval_iters = 20              # batches per split in each eval
eval_only = False            # evaluate once and exit (no training)
init_from = 'scratch'        # 'scratch', 'resume', a checkpoint file (e.g. out/stage1/ckpt.pt:
                             # weights only, fresh optimizer; for stage 2 of controller-only
                             # training), or GPT-2: 'gpt2', ...
# logging besides metrics.jsonl, which is always written (loggers.py)
log = ''                     # '' (none), 'tensorboard', 'wandb' or 'tensorboard,wandb'
wandb_project = 'nanodepth'  # the W&B project of --log=wandb
wandb_run_name = ''          # its run's name ('': W&B picks one)
# data
dataset = 'synthetic'        # a folder data/<dataset> written by data/prepare.py
data_dir = ''                # where dataset folders live; '' means data/ beside this file
batch_size = 16              # sequences per micro-batch per process
gradient_accumulation_steps = 1   # micro-batches per optimizer step, summed over all DDP processes
# model and routing: every field of model.GPTConfig is a config key with GPTConfig's default (there:
# the shape, block_size 128, and every family's options); the two below are the only ones train.py
# changes
route = 'ffn'                # the routing family ('none': dense, GPTConfig's default); the
                             # quickstart trains G1-routed FFNs
vocab_size = 0               # 0: from the data's meta.json (rounded up to a multiple of 64 above
                             # 1024)
trainable = 'all'            # 'all' (joint), 'controller' (backbone frozen: gates, routers,
                             # predictors, exit heads, ensemble norms), 'last_layers' (the last
                             # ens_layers blocks + ln_f), 'lora' (low-rank adapters, lora.py),
                             # 'controller+lora' (both, the rest frozen) or 'draft' (a draft's own
                             # modules, e.g. ffn_draft_rank's, by self-distillation: from
                             # init_from=<checkpoint>, whose model stays as it is)
lora_rank = 8                # LoRA: rank r of each adapter
lora_alpha = 16.0            # LoRA: the update is scaled by lora_alpha / lora_rank
lora_dropout = 0.0           # LoRA: dropout on the adapters' input
lora_targets = 'attn.c_attn,attn.c_proj,mlp.c_fc,mlp.c_proj'   # LoRA: projections, by name's end
ffn_oracle_layers_per_step = 1   # controlled layers given oracle utility labels per step (util/rank
                                 # losses)
calib_iters = 4              # train-split batches that calibrate the causal thresholds before each
                             # eval
lm_thresholds = ''           # e.g. '2.5,2.0': report the first iteration the train LM falls below
                             # each
avg_lm_until = 0.5           # avg LM = mean logged train LM over the first avg_lm_until of the run
# AdamW and schedule
learning_rate = 2e-3         # peak learning rate
max_iters = 600              # optimizer steps in the run
weight_decay = 0.1           # AdamW weight decay (matrices only)
beta1 = 0.9                  # AdamW beta1
beta2 = 0.95                 # AdamW beta2
grad_clip = 1.0              # 0 disables clipping (the grad norm is still logged)
decay_lr = True              # cosine decay to min_lr after warmup (else constant)
warmup_iters = 50            # linear warmup steps
lr_decay_iters = 0           # 0: max_iters
min_lr = 2e-4                # learning rate at the end of the decay
# system
device = 'auto'              # 'auto', 'cpu', 'cuda', 'cuda:1', ...
dtype = 'auto'               # 'auto', 'float32', 'bfloat16', 'float16' (float16 uses a GradScaler)
compile = False              # torch.compile(dynamic=False)
seed = 1337                  # model init and training batches
eval_seed = 1337             # eval/calibration batches: fixed, so every run of a study sees the
                             # same ones
max_fp16_skips = 50          # stop if this many consecutive fp16 steps overflow
ddp_timeout = 900            # seconds a DDP process waits for a silent peer before stopping with an
                             # error
parallel = 'ddp'             # under torchrun: 'ddp' (each process holds the whole model and
                             # optimizer) or 'fsdp' (FSDP2: sharded across the processes, sharded
                             # checkpoints in out_dir/ckpt_dcp; sharding.py, docs/design.md)
overwrite = False            # a fresh run may replace the run already in out_dir (else it refuses)
verify_data = True           # before training: the data files' sha256 against meta.json, token ids
                             # against the vocabulary
DEFAULTS = declared_defaults(__file__)     # the literals above: flops.py and eval.py read the same
                                           # keys
for _f in fields(GPTConfig):
    DEFAULTS.setdefault(_f.name, _f.default)
# fields a run shares with its checkpoint: the backbone's shape (stage 2 too), the routed layers (a
# resume), and how the controllers are built and what their losses train (a resume); each family
# names its own
BACKBONE_KEYS = (
    'n_layer',
    'n_head',
    'n_embd',
    'block_size',
    'bias',
    'pos',
    'vocab_size',
    'gelu',
    'rope_base',
    *(k for f in FAMILIES.values() for k in f.backbone_options),
)
MODEL_KEYS = BACKBONE_KEYS + (
    'route',
    *(f.layers_option for f in FAMILIES.values() if f.layers_option),
)
RESUME_KEYS = MODEL_KEYS + tuple(k for f in FAMILIES.values() for k in f.resume_options)
HERE = os.path.dirname(os.path.abspath(__file__))
# --------------------------------------------------------------------------------------------------


def main(argv):
    if asks_help(argv):
        return print_help(__doc__, 'python train.py [CONFIG.py ...] [--key=value ...]',
                          help_groups())
    if int(os.environ.get('RANK', -1)) == -1:
        return run_checked(argv)
    end_ddp_process(run_checked, argv)


def help_groups():
    """--help's groups: the globals above, then the model's and each family's fields."""
    own = declared_defaults(__file__)
    return [source_group('train.py options', own, __file__),
            *model_groups(GPTConfig, FAMILIES, shown=own)]


def run_checked(argv):
    try:
        return train(argv)
    except (ConfigError, DataError) as e:   # the config, device and data checks shared with the
                                            # other scripts
        raise TrainError(str(e)) from None
    except OSError as e:               # a full disk under the run's logs (a checkpoint write says
                                       # so itself)
        if e.errno != errno.ENOSPC:
            raise
        raise TrainError("no space left on the disk while writing "
                         f"{e.filename or 'the run files'}; free some "
                         "space, then continue with --init_from=resume (the last checkpoint, if "
                         "any, is kept)") from None
    except RuntimeError as e:          # DDP: a peer died, or hung past ddp_timeout, inside a
                                       # collective
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            raise
        raise TrainError(f"a DDP process stopped responding ({str(e).splitlines()[0][:160]}); this "
                         "process "
                         "stops too. The last checkpoint is kept: resume with "
                         "--init_from=resume") from None


def train(argv):
    cfg, cfg_dict = read_config(argv)
    proc = setup_process(cfg)
    start_process_group(cfg, proc)
    lock = hold_out_dir(cfg, proc)    # one writer per run folder, before anything is read or done
    run, failed = None, True
    try:
        run = setup(cfg, cfg_dict, proc, argv)
        if run is not None:           # (None: a resumed run that is already finished)
            train_loop(run, argv)
        failed = False
    finally:
        if run is not None and run.metrics_f is not None:
            run.metrics_f.close()
        if run is not None and run.loggers is not None:
            run.loggers.close(failed)
        if lock is not None:
            lock.release()
    if run is None:                   # nothing to do
        return 0
    if proc.ddp:        # rank 0 may still be writing its summary: leave together (no destroy:
        torch.distributed.barrier()    # the process ends with os._exit, see end_ddp_process)
    return 0


def train_loop(run, argv):
    stop = StopFlag()                 # from here, a first Ctrl-C / SIGTERM ends the run with a
                                      # checkpoint
    stopped = False                   # by a signal to this process or, under DDP, to any process
    # an evaluation a signal lands in is abandoned at its next batch: a long eval would outlast a
    # scheduler's grace period. (An eval-only run has no checkpoint to save instead.)
    abandon = None if run.cfg.eval_only else eval_abandoner(run, stop)
    while True:
        if eval_due(run):
            if run.ddp:                           # the checkpoint keeps every rank's interval
                share_interval(run)
            outcome = 'done'
            if run.master or run.sharded:         # FSDP: every rank (forward and save gather)
                if not evaluate_and_checkpoint(run, abandon):
                    outcome = 'abandoned'
                # a signal in the eval's last batch or its save: stop on the checkpoint just saved
                elif abandon is not None and abandon() and 0 < run.iter_num < run.cfg.max_iters:
                    outcome = 'stop'
            if run.ddp and not run.sharded:       # rank 0 alone evaluated: it tells the others
                outcome = share_eval_outcome(run, outcome)
            if outcome != 'done':
                stopped = True
                stop_with_checkpoint(run, argv, 'during the evaluation at' if outcome == 'abandoned'
                                     else 'after the evaluation at', save=outcome == 'abandoned')
                break
            run.t_last, run.it_last = time.time(), run.iter_num
        if run.iter_num >= run.cfg.max_iters or run.cfg.eval_only:
            break
        lr, loss_sum, norm, step = optimisation_step(run)
        logged = run.iter_num % run.cfg.log_interval == 0 or run.iter_num == run.cfg.max_iters
        if logged:
            log_progress(run, lr, loss_sum, norm, step)
        # at max_iters: the final eval (which a signal abandons) and the summary
        if run.iter_num < run.cfg.max_iters and stop_requested(run, stop, logged):
            stopped = True
            stop_with_checkpoint(run, argv, 'at')
            break
    if run.master or run.sharded:                 # FSDP: every rank joins the report's forward
        with evaluated(run):
            if not finish_run(run, stopped, abandon):   # (stopped in it: at its last checkpoint)
                stop_with_checkpoint(run, argv, 'during the end-of-run report at', save=False)


def eval_abandoner(run, stop):
    """The question an evaluation asks before each batch: abandon it for a signal? One process
    (DDP: rank 0, which alone evaluates) asks its own flag; FSDP's ranks, which evaluate together,
    agree on it (a collective each batch: all stop at the same batch, if any got the signal)."""
    if not run.sharded:
        return lambda: stop.signum is not None
    return lambda: any_rank(run.dev, stop.signum is not None)


EVAL_OUTCOMES = ('done', 'abandoned', 'stop')


def share_eval_outcome(run, outcome):
    """DDP, after rank 0's evaluation (every rank: a collective): rank 0's outcome, 'done', or a
    stop ('abandoned' during the eval, or 'stop' after it), so that every rank stops with it."""
    code = torch.tensor([EVAL_OUTCOMES.index(outcome)], dtype=torch.int64, device=run.dev)
    torch.distributed.broadcast(code, 0)
    return EVAL_OUTCOMES[code.item()]


def stop_with_checkpoint(run, argv, when, save=True):
    """A signal's stop: the checkpoint (at an eval's iteration without its record: the resumed run
    evaluates first; save False: one is saved already) and, on rank 0, the command that
    resumes."""
    if save and (run.master or run.sharded):
        save_run(run)
    if run.master:
        print(
            f"stopped by signal {when} iteration {run.iter_num}; checkpoint saved to "
            f"{run.ckpt_path}.\n"
            f"resume with: {resume_command(run, argv)}"
        )


def resume_command(run, argv):
    """The command that continues a stopped run: under torchrun the same launch (FSDP's sharded
    optimizer state resumes only there), else one process; its options, with one
    --init_from=resume in place of any --init_from it had (a resumed run's included)."""
    argv = [a for a in argv if not a.startswith('--init_from=')]
    launch = 'python'
    if run.ddp:
        per_node = int(os.environ.get('LOCAL_WORLD_SIZE', run.world))
        launch = (f'torchrun --standalone --nproc_per_node={run.world}' if per_node == run.world
                  else f'torchrun --nnodes={run.world // per_node} --nproc_per_node={per_node} '
                       '(on each node, with its --node_rank and rendezvous as launched)')
    return f"{launch} train.py {shlex.join(argv)} --init_from=resume"


def setup(cfg, cfg_dict, proc, argv):
    """Everything the loop shares, in one namespace: the config, this process (DDP rank and world,
    device, dtype), the model (raw, and wrapped for the steps), optimizer, data, fixed eval batches,
    the iteration and totals to start from; rank 0 also starts the loggers and opens the run files
    (under DDP every rank stops at once if that fails). None for a resumed run that is already
    finished (it says so, and writes nothing)."""
    # the data's meta.json and the checkpoint to start from, its fields checked before the data
    meta, ckpt = open_inputs(cfg, proc.master, check_start_fields)
    if finished_already(cfg, ckpt):
        if proc.master:
            print(f"the run in {cfg.out_dir} is already finished (iteration {ckpt['iter_num']}, "
                  f"max_iters={cfg.max_iters}, its summary recorded): nothing to do. Train it "
                  f"further with a larger --max_iters, or evaluate it with --eval_only=True")
        return None
    check_batch_fits(cfg.batch_size, cfg.block_size, meta['vocab_size'], proc.dev)
    # W&B may refuse the run (no login, a bad project, no network): ask before any work
    loggers, failed = None, None
    if proc.master:
        try:
            loggers = Loggers(cfg, cfg_dict)
        except Exception as e:        # raised once every rank knows
            failed = e
    try:
        share_rank0_outcome(proc, failed, 'start its loggers')
        return build_run(cfg, cfg_dict, proc, argv, meta, ckpt, loggers)
    except BaseException:
        if loggers is not None:
            loggers.close(failed=True)
        raise


def check_run_inputs(cfg):
    """What setup refuses before any work, checked without doing it (sweep.py, for every run of a
    study before its first starts): the device and dtype, the checkpoint the run starts from
    against the config, the prepared data, and the batch against the device's memory. W&B's
    login is not checked: only starting a W&B run tells."""
    dev, _ = resolve_device_dtype(cfg)
    meta = check_inputs(cfg, check_start_fields)
    if meta is not None:
        check_batch_fits(cfg.batch_size, cfg.block_size, meta['vocab_size'], dev)


def build_run(cfg, cfg_dict, proc, argv, meta, ckpt, loggers):
    """setup's namespace, from its checked inputs and rank 0's loggers."""
    seed_rngs(cfg.seed + proc.rank)
    model = build_model(cfg, meta, ckpt)
    if proc.sharded and proc.rank > 0:   # FSDP, unlike DDP, copies no weights from rank 0: build
        stream = rng_state()             # rank 0's (its seed), then go on with this rank's stream
        seed_rngs(cfg.seed)
        model = build_model(cfg, meta, ckpt)
        set_rng_state(stream)
    # FSDP builds on the CPU and moves only this rank's shards to the device
    model = sharding.shard_model(model, proc.dev) if proc.sharded else model.to(proc.dev)
    # what was built (GPT-2 init sets the shape)
    cfg_dict.update({k: getattr(cfg, k) for k in MODEL_KEYS})
    train_data, val_data = open_splits(meta, cfg.block_size, cfg.batch_size, cfg.seed, proc.dev)
    scaler = torch.amp.GradScaler(proc.dev.type, enabled=(proc.dt == 'float16'))
    params = trainable_parameters(model, cfg)
    optimizer = model.configure_optimizers(
        cfg.weight_decay, cfg.learning_rate, (cfg.beta1, cfg.beta2), proc.dev.type, params=params
    )
    progress = start_progress(cfg, ckpt, optimizer, scaler, proc.master)
    if progress['resumed'] and proc.sharded:       # the model's and optimizer's shards (DCP)
        sharding.load_sharded(model, optimizer, cfg.out_dir, ckpt['sharded'])
    run = SimpleNamespace(
        **vars(proc), **progress, cfg=cfg, cfg_dict=cfg_dict, argv=argv, meta=meta, raw_model=model,
        model=wrap_model(model, cfg, proc), params=params,
        # the controller's gradient norm, where it trains (frozen, under 'draft' or 'lora', it
        # would read 0: not logged)
        ctrl_params=[p for p in model.controller_parameters() if p.requires_grad],
        optimizer=optimizer, scaler=scaler, train_data=train_data, val_data=val_data,
        # fixed batches (by eval_seed) for the loss estimates, and train-split ones (never val) that
        # calibrate the causal thresholds
        eval_sets={'train': (train_data, train_data.eval_batches(cfg.eval_iters, 1, cfg.eval_seed)),
                   'val': (val_data, val_data.eval_batches(cfg.eval_iters, 2, cfg.eval_seed))},
        calib=[train_data.fetch(s)[0]
               for s in train_data.eval_batches(cfg.calib_iters, 3, cfg.eval_seed)],
        ckpt_path=os.path.join(cfg.out_dir, 'ckpt.pt'), metrics_f=None, loggers=loggers)
    failed = None
    try:
        if run.master:
            try:
                # W&B gains what was built; TensorBoard starts, and removes the old run's events
                # only once the run files have replaced its checkpoint and metrics
                loggers.open_local({k: cfg_dict[k] for k in MODEL_KEYS}, run.iter_num)
                run.metrics_f = open_run_files(cfg, cfg_dict, proc, run.iter_num,
                                               evaluated_at(run.history, run.iter_num))
                loggers.replace()
            except Exception as e:    # raised once every rank knows
                failed = e
        share_rank0_outcome(proc, failed, 'open its run files or loggers')
    except BaseException:
        if run.metrics_f is not None:
            run.metrics_f.close()
        raise
    if run.master:
        print(
            f"model: {model.get_num_params() / 1e6:.2f}M parameters ({count_params(params):,} "
            "trainable) | data: "
            f"{cfg.dataset} ({meta['vocab_size']} tokens vocab, {meta['train_tokens']:,} train "
            "tokens) | "
            f"device {run.dev}, {run.dt}, world {run.world}"
        )
    start_counters(run)
    return run


# --------------------------------------------------------------------------------------------------
# the config, checked before anything is read or written (train_checks.py holds the checks)

def read_config(argv):
    """Defaults, then config files and --key=value in argv: (namespace, the dict written to
    config.json)."""
    cfg_dict = load_config(DEFAULTS, argv)
    cfg = SimpleNamespace(**cfg_dict)
    check_train_config(cfg)
    model_config(cfg)                           # validates routing fields before any work
    check_family_options(cfg, argv, DEFAULTS)
    sharding.check_parallel(cfg, distributed=int(os.environ.get('RANK', -1)) != -1)
    return cfg, cfg_dict


# --------------------------------------------------------------------------------------------------
# the process, the inputs, the model and what it trains

def setup_process(cfg):
    """This process's place in the run: DDP or FSDP (torchrun sets RANK / WORLD_SIZE; `ddp` says
    the run is distributed, `sharded` that it is FSDP) or a lone process, the micro-batches it
    accumulates per step, its device and dtype."""
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
    return SimpleNamespace(ddp=ddp, sharded=ddp and cfg.parallel == 'fsdp', rank=rank,
                           local_rank=local_rank, world=world, master=rank == 0,
                           accum=cfg.gradient_accumulation_steps // world, dev=dev, dt=dt,
                           autocast=autocast_context(dev, dt))


def start_process_group(cfg, proc):
    if proc.ddp and not torch.distributed.is_initialized():
        from torch.distributed import init_process_group
        from datetime import timedelta     # a silent (hung, stopped) peer ends the run instead of
                                           # blocking it
        init_process_group(backend='nccl' if proc.dev.type == 'cuda' else 'gloo',
                           timeout=timedelta(seconds=cfg.ddp_timeout))
    if proc.dev.type == 'cuda':
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


def check_start_fields(cfg, ckpt):
    """The config's fields against the checkpoint the run starts from, before any data is read or
    prepared (run_state.open_inputs; build_model checks them again beside the data): a resume's
    model, what trains, the data order and the optimizer's own settings (its saved state brings
    back the checkpoint's betas and weight decay over the config's); a draft's model; a new run's
    backbone."""
    family = FAMILIES[cfg.route]
    if cfg.init_from != 'resume':
        keys = draft_run_keys(family) if cfg.trainable == 'draft' else BACKBONE_KEYS
        return check_against_checkpoint(cfg, None, ckpt, keys)
    check_against_checkpoint(cfg, None, ckpt, RESUME_KEYS)
    if cfg.max_iters < ckpt['iter_num'] and not cfg.eval_only:
        # it would train nothing and record the run as ending at max_iters, over its own
        raise TrainError(
            f"--max_iters={cfg.max_iters} is below the iteration the checkpoint reached "
            f"({ckpt['iter_num']}); give --max_iters={ckpt['iter_num']} to end the run there, a "
            "larger one to train it further, or --eval_only=True to evaluate it"
        )
    if cfg.trainable == 'draft':            # thresholds are never recalibrated: nothing moves
        check_against_checkpoint(cfg, None, ckpt, draft_run_keys(family))
    sharding.check_resume(cfg, ckpt)           # fsdp's optimizer state is sharded
    lora_keys = ('lora_rank', 'lora_alpha', 'lora_targets') if 'lora' in cfg.trainable else ()
    for k in ('batch_size', 'gradient_accumulation_steps', 'seed', 'trainable', 'weight_decay',
              'beta1', 'beta2', *lora_keys):
        if ckpt['config'].get(k) != getattr(cfg, k):
            raise TrainError(
                f"config field '{k}' differs from the checkpoint: checkpoint has "
                f"{ckpt['config'].get(k)!r}, config has {getattr(cfg, k)!r}; resume with the "
                f"run's original value"
            )


def build_model(cfg, meta, ckpt):
    """Model from scratch, from a checkpoint (resume: everything; a checkpoint file: the backbone,
    with fresh gates), or from GPT-2 weights, with the checks that the data and the checkpoint
    agree."""
    if ckpt is not None and cfg.init_from == 'resume':
        # (its fields: check_start_fields, which open_inputs ran before the data was read)
        check_against_checkpoint(cfg, meta, ckpt, ())          # the data is its own
        model = GPT(model_config(cfg, vocab_size=ckpt['model_args']['vocab_size']))
        add_adapters(model, cfg)                   # a LoRA run's state holds its adapters
        check_state_fits(model, ckpt['model'], cfg.init_from)
        model.load_state_dict(ckpt['model'])
    elif ckpt is not None and cfg.trainable == 'draft':
        model = model_under_draft(cfg, meta, ckpt)
    elif ckpt is not None:
        model = backbone_from_checkpoint(cfg, meta, ckpt)
    elif cfg.init_from == 'scratch':
        data_vocab = meta['vocab_size']
        vs = cfg.vocab_size or (
            data_vocab if data_vocab <= 1024 else ((data_vocab + 63) // 64) * 64
        )
        model = GPT(model_config(cfg, vocab_size=vs))
    else:
        model = gpt2_model(cfg, meta)
    if meta['vocab_size'] > model.config.vocab_size:
        raise TrainError(
            f"field 'vocab_size' differs: data/{cfg.dataset} has {meta['vocab_size']} tokens but "
            f"the model's vocabulary is {model.config.vocab_size}"
        )
    if cfg.block_size != model.config.block_size:
        raise TrainError(
            f"field 'block_size' differs: config {cfg.block_size}, model {model.config.block_size}"
        )
    if not (ckpt is not None and cfg.init_from == 'resume'):   # (a resumed one has them already)
        add_adapters(model, cfg)
    return model


def add_adapters(model, cfg):
    """LoRA adapters on the projections lora_targets names, for trainable='lora' or
    'controller+lora' (lora.py); the base weights stay as loaded, frozen."""
    if 'lora' in cfg.trainable.split('+'):
        try:
            apply_lora(model, cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_targets)
        except ValueError as e:
            raise TrainError(str(e)) from None


def backbone_from_checkpoint(cfg, meta, ckpt):
    """Stage 2: the checkpoint's backbone under fresh controller modules. The routing family may
    change (e.g. a dense backbone under another family's controller) as long as every backbone
    weight comes from the checkpoint."""
    # a task written in the backbone's vocabulary (prepare.py arith --vocab_from) is new data
    task = VOCAB_IDENTITY if meta.get('vocab_from') else None
    check_against_checkpoint(cfg, meta, ckpt, BACKBONE_KEYS, task)
    model = GPT(model_config(cfg, vocab_size=ckpt['model_args']['vocab_size']))
    backbone = {k: v for k, v in plain_state(ckpt).items()
                if not (is_controller_key(k) or is_draft_key(k))}
    missing, unexpected = model.load_state_dict(backbone, strict=False)
    bad = [k for k in missing if not (is_controller_key(k) or is_draft_key(k))] + list(unexpected)
    if bad:
        raise TrainError(f"checkpoint {cfg.init_from} does not fit this model's backbone (route "
                         f"{ckpt['model_args'].get('route')!r} -> {cfg.route!r}): {bad[:5]}; "
                         "give the options of its run's config.json that shape these weights, or "
                         "another checkpoint")
    model.family.after_load(model)     # e.g. a family's own norms start as copies of ln_f
    return model


def model_under_draft(cfg, meta, ckpt):
    """trainable='draft': the checkpoint's whole model (backbone, controller, thresholds), the draft
    modules it lacks fresh. The draft imitates this model, so the config must build the same one:
    every model field but the draft's own and dropout as the checkpoint has it."""
    family = FAMILIES[cfg.route]
    check_against_checkpoint(cfg, meta, ckpt, draft_run_keys(family))
    model = GPT(model_config(cfg, vocab_size=ckpt['model_args']['vocab_size']))
    state = plain_state(ckpt)
    fresh = {k: v for k, v in model.state_dict().items()
             if family.is_draft_key(k) and k not in state}
    check_state_fits(model, {**state, **fresh}, cfg.init_from)   # (a draft's other rank)
    model.load_state_dict(state, strict=False)
    return model


def plain_state(ckpt):
    """A checkpoint's model state; a LoRA run's with its adapters merged into the projections, as
    eval.py and sample.py load it (checkpoint.load_model)."""
    state = ckpt['model']
    return load_model(ckpt, 'cpu').state_dict() if has_lora_keys(state) else state


def draft_run_keys(family):
    """The model fields a trainable='draft' run (fresh or resumed) shares with its checkpoint: all
    but the draft's own, dropout, and other families' options, which this family does not read (a
    run may have set them in a config file shared across families)."""
    inert = {k for f in FAMILIES.values() for k in f.options} - set(family.options)
    return tuple(f.name for f in fields(GPTConfig)
                 if f.name not in (*family.draft_options, 'dropout', *inert))


def gpt2_model(cfg, meta):
    """GPT-2 weights (a hub name or a local HF directory) under this config's routing fields."""
    if meta.get('tokenizer') != 'gpt2':
        raise TrainError(f"init_from={cfg.init_from} needs GPT-2 BPE data; data/{cfg.dataset} uses "
                         f"the {meta.get('tokenizer')!r} tokenizer")
    routing = {
        f.name: getattr(cfg, f.name)
        for f in fields(GPTConfig)
        if f.name
        not in ('n_layer', 'n_head', 'n_embd', 'vocab_size', 'block_size', 'bias', 'pos', 'gelu')
    }
    model = GPT.from_pretrained(cfg.init_from, routing)
    if cfg.block_size < model.config.block_size:
        model.crop_block_size(cfg.block_size)
    for k in MODEL_KEYS:            # the checkpoint's shape wins: record it, so config.json and
                                    # resume agree
        setattr(cfg, k, getattr(model.config, k))
    return model


def trainable_parameters(model, cfg):
    """Joint training: everything. Controller-only: freeze the backbone (requires_grad=False) and
    return only the controller's parameters (model.is_controller_key). 'last_layers': only the last
    ens_layers blocks and the final norm (plain fine-tuning of a dense model, a baseline for
    controllers trained on a frozen backbone). 'lora': the adapters only; 'controller+lora': the
    controller and the adapters."""
    if cfg.trainable == 'all':
        return list(model.parameters())
    if cfg.trainable not in TRAINABLE[1:]:
        raise TrainError(f"trainable must be one of {', '.join(TRAINABLE)}; got {cfg.trainable!r}")
    if cfg.trainable == 'lora':
        return lora_parameters(model)
    if cfg.trainable == 'draft':        # (train_checks.check_drafts: there are some)
        ctrl = [p for n, p in model.named_parameters() if model.family.is_draft_key(n)]
    elif cfg.trainable == 'last_layers':
        key = model.family.last_layers_option
        k = getattr(model.config, key)
        if model.family.routes or not 1 <= k <= model.config.n_layer:
            raise TrainError(f"trainable=last_layers fine-tunes the last {key} (1..n_layer) blocks "
                             f"of a dense model (route='none'); got route={model.config.route!r}, "
                             f"{key}={k}")
        ctrl = [p for b in model.transformer.h[-k:] for p in b.parameters()] + list(
            model.transformer.ln_f.parameters()
        )
    else:
        ctrl = model.controller_parameters()
    if not ctrl:
        raise TrainError(
            f"trainable=controller trains only a routing controller's parameters (gates, routers, "
            f"predictors, own exit heads, ensemble norms); this config (route={cfg.route!r} with "
            "its "
            f"options) has none: use trainable=all"
        )
    ctrl = ctrl + (lora_parameters(model) if cfg.trainable == 'controller+lora' else [])
    ids = {id(p) for p in ctrl}
    for p in model.parameters():
        p.requires_grad_(id(p) in ids)
    return ctrl


def wrap_model(raw_model, cfg, proc):
    """What the training steps call: the model compiled and/or DDP-wrapped (evals, checkpoints and
    the family's hooks use the raw model); FSDP shards it in place (setup)."""
    model = raw_model
    if proc.sharded:
        return model
    if cfg.compile:
        model = torch.compile(model, dynamic=False)
        # one graph per set of per-step options (e.g. oracle layers): compile each
        allow_graphs(raw_model.config.n_layer + 8)
    if proc.ddp:
        from torch.nn.parallel import DistributedDataParallel as DDP
        # some parameters get no gradient
        partial = raw_model.family.ddp_find_unused(raw_model.config)
        model = DDP(model, device_ids=[proc.local_rank] if proc.dev.type == 'cuda' else None,
                    find_unused_parameters=partial)
    return model


# --------------------------------------------------------------------------------------------------
# the loop: eval and checkpoint, one optimisation step (train_report.py logs it, counts its FLOPs)

def eval_due(run):
    cfg = run.cfg
    # by the run this one resumes, if its checkpoint has the record: one saved by a signal at an
    # eval's iteration has not (an eval-only run evaluates the checkpoint once, whatever it has)
    logged_already = (run.resumed and run.iter_num == run.start_iter and not cfg.eval_only
                      and evaluated_at(run.history, run.iter_num))
    return (
        run.iter_num % cfg.eval_interval == 0 or run.iter_num >= cfg.max_iters or cfg.eval_only
    ) and not logged_already


def evaluate_and_checkpoint(run, abandon=None):
    """Rank 0 (FSDP: every rank): train and val loss on the fixed eval batches, one 'eval' record
    (rank 0), and a checkpoint. False, with none of them, where `abandon` says True before one of
    the batches (evaluation.evaluate)."""
    with evaluated(run):
        res = estimate_loss(run, abandon)
    if res is None:
        return False
    if not all(math.isfinite(res[s]['loss']) for s in res):
        raise TrainError(
            f"eval loss is not finite at iteration {run.iter_num} (train {res['train']['loss']}, "
            f"val {res['val']['loss']}); stopping; {kept(run)}. Try a lower learning_rate or "
            "grad_clip."
        )
    run.best_val = min(run.best_val, res['val']['loss'])
    if run.master:
        log_eval(run, res)
    if not run.cfg.eval_only and run.iter_num > 0:
        save_run(run)
    return True


def evaluated(run):
    """FSDP: every weight gathered on every rank for an evaluation (its sparse paths reach into
    the blocks' modules); otherwise nothing to do."""
    return sharding.gathered(run.raw_model) if run.sharded else nullcontext()


def estimate_loss(run, abandon=None):
    """LM loss on fixed train/val batches in eval mode: causal routing, thresholds calibrated first
    on separate train-split batches (never on val), except under trainable='draft', which leaves
    the checkpoint's model, thresholds included, as it was. None where `abandon` says True before
    a batch."""
    res = {}
    with eval_rng(run.dev, run.cfg.eval_seed):
        if run.cfg.trainable != 'draft':
            with run.autocast:
                run.raw_model.calibrate(torch.cat(run.calib))
        for split, (batches, starts) in run.eval_sets.items():
            res[split] = evaluation.evaluate(run.raw_model, [batches.fetch(s) for s in starts],
                                             run.autocast, abandon=abandon)
            if res[split] is None:
                return None
    return res


def save_run(run):
    """Everything an exact resume needs, written atomically; never a broken model over a good
    checkpoint. FSDP: every rank saves its shards (DCP), then rank 0 writes ckpt.pt with the whole
    model (what eval.py, sample.py and init_from read) naming the shards' folder."""
    # every checkpoint, the one a signal makes too, keeps the time run so far: a resume goes on
    # from it
    run.flops_state['wall_s'] = time.time() - run.t_run
    if run.sharded:
        if not sharding.all_finite(list(run.raw_model.parameters())):
            raise TrainError(f"non-finite weights at iteration {run.iter_num}; {kept(run)}")
        rel, whole = sharding.save_sharded(run.raw_model, run.optimizer, run.cfg.out_dir,
                                           run.iter_num, run.master)
        if run.master:
            save_checkpoint(run.ckpt_path, checkpoint_state(run, model=whole, sharded=rel))
            sharding.prune_sharded(run.cfg.out_dir, rel)
        return
    for p in run.raw_model.parameters():
        if not torch.isfinite(p).all():
            raise TrainError(f"non-finite weights at iteration {run.iter_num}; {kept(run)}")
    save_checkpoint(run.ckpt_path, checkpoint_state(run))


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
    clipped. Returns its learning rate, summed loss (on the device: no sync), grad norm and
    FLOPs."""
    cfg = run.cfg
    lr = lr_at(cfg, run.iter_num)
    for group in run.optimizer.param_groups:
        group['lr'] = lr
    # the family's per-step options (oracle layers, the exit curriculum): a pure function of the
    # step
    opts = run.raw_model.family.step_options(run.raw_model, run.iter_num, cfg)
    loss_sum = torch.zeros((), device=run.dev)
    for micro in range(run.accum):
        x, y = run.train_data.get((run.iter_num * run.accum + micro) * run.world + run.rank)
        if run.sharded:
            run.model.set_requires_gradient_sync(micro == run.accum - 1)
        elif run.ddp:
            run.model.require_backward_grad_sync = micro == run.accum - 1
        with run.autocast:
            _, loss, aux = run.model(x, y, **opts)
            loss = loss / run.accum
        run.scaler.scale(loss).backward()
        loss_sum += loss.detach().float()
        accumulate(run.interval, aux, run.accum, run.raw_model.family.logged_stats)
    run.scaler.unscale_(run.optimizer)
    max_norm = cfg.grad_clip if cfg.grad_clip > 0 else float('inf')
    if run.sharded:                               # norms over every rank's shards
        if run.ctrl_params:
            run.interval['ctrl_norm'] += sharding.grad_norm(run.ctrl_params)
        norm = sharding.clip_grad_norm(run.params, max_norm)
    else:
        if run.ctrl_params:                       # controller gradient norm, before clipping
            grads = [p.grad.float().norm() for p in run.ctrl_params if p.grad is not None]
            run.interval['ctrl_norm'] += torch.stack(grads).norm() if grads else 0.0
        norm = torch.nn.utils.clip_grad_norm_(run.params, max_norm)
    if run.scaler.is_enabled():
        run.skipped += ~torch.isfinite(norm)      # exactly the steps the GradScaler skips
    run.scaler.step(run.optimizer)
    run.scaler.update()
    run.optimizer.zero_grad(set_to_none=True)
    run.iter_num += 1
    run.interval['n'] += 1
    return lr, loss_sum, norm, count_flops(run, opts)


if __name__ == '__main__':
    run_cli(main)
