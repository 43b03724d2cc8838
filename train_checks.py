"""
The checks train.py makes before any work is done, each failing with a TrainError (one line
`error: ...` on stderr, exit 2, nothing written): the training loop's own config fields, the model
config, the run folder, and a checkpoint against the config that resumes or extends it.

    from train_checks import TrainError, check_train_config, model_config
"""
import math
import os
from dataclasses import fields

import torch

import loggers
from checkpoint import CheckpointError, check_init_from
from configurator import UserError, given_keys, writable_folder
from data.loader import check_checkpoint_data, check_data_folder
from files import RUN_FILES
from lora import check_targets, matching
from model import FAMILIES, GPT, GPTConfig, read_stored_config
from routing import BLOCK_PROJECTIONS, adapters_of, projection_name

TRAINABLE = ('all', 'controller', 'last_layers', 'lora', 'controller+lora', 'draft')


class TrainError(UserError):
    """A problem with the user's input: printed as 'error: ...' and exit code 2, before any work."""


PARALLEL = ('ddp', 'fsdp')       # under torchrun: whole replicas, or FSDP2 shards (sharding.py)


def check_train_config(cfg):
    """The training loop's own fields."""
    try:
        check_init_from(cfg.init_from)
    except CheckpointError as e:    # a bad value of this run's own key: the run's own error
        raise TrainError(str(e)) from None
    try:
        thresholds = [float(t) for t in str(cfg.lm_thresholds).split(',') if t.strip()]
    except ValueError:
        thresholds = [math.nan]
    if not all(math.isfinite(t) and t > 0 for t in thresholds):   # a loss no run ever goes below
        raise TrainError(
            "lm_thresholds must be comma-separated losses > 0 such as '2.5,2.0', got "
            f"{cfg.lm_thresholds!r}"
        ) from None
    loggers.check_options(cfg)      # --log: known loggers, their packages installed
    if cfg.trainable not in TRAINABLE:
        raise TrainError(f"trainable must be one of {', '.join(TRAINABLE)}; got {cfg.trainable!r}")
    check_lora_options(cfg)
    check_drafts(cfg)
    check_trainable_family(cfg)
    if cfg.parallel not in PARALLEL:
        raise TrainError(f"parallel must be one of {', '.join(PARALLEL)}; got {cfg.parallel!r}")
    if cfg.dtype not in ('auto', 'float32', 'bfloat16', 'float16'):
        raise TrainError(f"dtype must be auto, float32, bfloat16 or float16, got {cfg.dtype!r}")
    at_least = dict(
        seed=0,
        eval_seed=0,
        ffn_oracle_layers_per_step=1,
        eval_interval=1,
        log_interval=1,
        eval_iters=1,
        batch_size=1,
        block_size=1,
        gradient_accumulation_steps=1,
        max_iters=0,
        calib_iters=1,
        warmup_iters=0,
        lr_decay_iters=0,
        max_fp16_skips=1,
        ddp_timeout=1,
    )
    for key, lo in at_least.items():
        if getattr(cfg, key) < lo:
            raise TrainError(f"{key} must be >= {lo}, got {getattr(cfg, key)}")
    for key in ('seed', 'eval_seed'):      # numpy's generators take 32-bit seeds
        if getattr(cfg, key) >= 2**32:
            raise TrainError(f"{key} must be < 2**32, got {getattr(cfg, key)}")
    for key in ('learning_rate', 'min_lr', 'weight_decay', 'grad_clip'):
        if not getattr(cfg, key) >= 0:         # also refuses NaN
            raise TrainError(f"{key} must be >= 0, got {getattr(cfg, key)}")
    if cfg.decay_lr and cfg.min_lr > cfg.learning_rate:
        raise TrainError(f"min_lr ({cfg.min_lr}) is above learning_rate ({cfg.learning_rate}): "
                         f"the decay would raise the rate; give --min_lr <= --learning_rate")
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
            kind = torch.device(cfg.device).type
        except RuntimeError:           # torch.device('bogus')
            kind = None
        if kind not in ('cpu', 'cuda'):   # e.g. 'mps': a device type torch knows but this harness
                                          # does not run on
            raise TrainError(
                f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {cfg.device!r}"
            )


def check_trainable_family(cfg):
    """What trainable needs of the family, where the config alone says it (train.py's
    trainable_parameters checks the model built, e.g. the layer count a checkpoint gives)."""
    family = FAMILIES[cfg.route]
    if cfg.trainable == 'last_layers':
        key = family.last_layers_option
        # (the layer count is the config's unless GPT-2's weights set it)
        known = cfg.init_from in ('scratch', 'resume') or os.path.isfile(cfg.init_from)
        if family.routes or not 1 <= getattr(cfg, key) <= (cfg.n_layer if known else math.inf):
            raise TrainError(f"trainable=last_layers fine-tunes the last {key} (1..n_layer) blocks "
                             f"of a dense model (route='none'); got route={cfg.route!r}, "
                             f"{key}={getattr(cfg, key)}")
    if cfg.trainable in ('controller', 'controller+lora') and not family.routes:
        raise TrainError(f"trainable={cfg.trainable} trains a routing controller, which "
                         f"route={cfg.route!r} has none of; use trainable=all, lora or last_layers")


def check_lora_options(cfg):
    """LoRA's rank, alpha and dropout ranges, and targets that name projections this model has
    (checked on a shape-only copy of the model: nothing is allocated), whatever `trainable`; under
    LoRA, targets that name block projections only, some of which run in training."""
    if not 1 <= cfg.lora_rank <= 8192:
        raise TrainError(f"lora_rank must be in 1..8192, got {cfg.lora_rank}")
    if not 0 < cfg.lora_alpha < float('inf'):
        raise TrainError(f"lora_alpha must be > 0 and finite, got {cfg.lora_alpha}")
    if not 0 <= cfg.lora_dropout < 1:
        raise TrainError(f"lora_dropout must be in [0, 1), got {cfg.lora_dropout}")
    config = model_config(cfg, vocab_size=64)
    model = shape_only_model(config)
    try:
        check_targets(model, cfg.lora_targets)
    except ValueError as e:
        raise TrainError(str(e)) from None
    if 'lora' not in cfg.trainable.split('+'):
        return
    # LoRA adapts the backbone: the blocks' four projections, which the FLOPs count; a family's own
    # modules (gates, routers, cheap FFNs, exit heads) are its controller's to train
    block = {projection_name(layer, p) for layer in range(config.n_layer)
             for p in BLOCK_PROJECTIONS}
    others = sorted({n for hits in matching(model, cfg.lora_targets).values() for n in hits}
                    - block)
    if others:
        raise TrainError(f"lora_targets={cfg.lora_targets!r} names {others[0]}"
                         f"{f' and {len(others) - 1} more' if len(others) > 1 else ''}, not a "
                         f"block projection: LoRA adapts {', '.join(BLOCK_PROJECTIONS)} (e.g. "
                         "'mlp.c_fc', not 'c_fc'); a family's own modules train with "
                         "trainable=controller or controller+lora")
    # where the adapters run, as the FLOPs count it: nowhere means a loss that reaches no adapter
    adapters = adapters_of(config, cfg.lora_rank, cfg.lora_targets)
    if not FAMILIES[config.route].adapter_forward_flops(config, config.block_size, adapters):
        raise TrainError(f"lora_targets={cfg.lora_targets!r} adapts only projections this model "
                         "never runs in training (e.g. the full FFN under ffn_gate="
                         "'static_cheap'): name projections that run, e.g. 'attn.c_attn'")


def check_drafts(cfg):
    """A draft's own modules (Family.is_draft_key) train by self-distillation, alone
    (trainable='draft': from a trained model, a checkpoint file or its own run resumed, without
    dropout) or jointly ('all'); the other trainables would train nothing with it or reach modules
    it is not counted on. FSDP shards each block on its own, and a draft that runs a block without
    draft modules reaches into it: every block has some, or parallel=ddp."""
    config = model_config(cfg, vocab_size=64)
    family = FAMILIES[config.route]
    names = [n for n, _ in shape_only_model(config).named_parameters() if family.is_draft_key(n)]
    if cfg.trainable == 'draft':
        if cfg.init_from != 'resume' and not os.path.isfile(cfg.init_from):
            raise TrainError(f"trainable=draft distils a draft from a trained model: give its "
                             f"checkpoint with --init_from=<out_dir>/ckpt.pt (got init_from="
                             f"{cfg.init_from!r})")
        if not names:
            raise TrainError(f"trainable=draft trains a draft's own modules; this config (route="
                             f"{cfg.route!r} with its options) has none: e.g. route='ffn' with "
                             "ffn_draft_rank > 0")
        if cfg.dropout > 0:
            raise TrainError(f"trainable=draft distils without dropout (the model's distribution "
                             f"is the target): set --dropout=0 (got {cfg.dropout})")
    if not names:
        return
    if cfg.trainable not in ('all', 'draft'):
        raise TrainError(f"a model with a draft of its own ({', '.join(family.draft_options)}) "
                         f"trains with trainable=all or draft, not {cfg.trainable!r}")
    blocks_with = {n.split('.')[2] for n in names if n.startswith('transformer.h.')}
    if cfg.parallel == 'fsdp' and len(blocks_with) < config.n_layer:
        raise TrainError("parallel=fsdp shards each block on its own, and this draft runs blocks "
                         "without draft modules: draft every layer (e.g. ffn_layers='all') or "
                         "use parallel=ddp")


SHAPE_ONLY_MODELS = {}
SHAPE_ONLY_ON_CPU = 4_000_000   # parameters up to which a shape-only model is built on the CPU


def shape_only_model(config):
    """GPT(config) for its module names and shapes, on the meta device (nothing allocated), one per
    config: a study checks hundreds of runs that share a few. A small model is built on the CPU
    first (under its own RNG state), since on the meta device the first random init imports
    torch._dynamo, ~2 s in every process that checks its options."""
    key = repr(config)
    if key not in SHAPE_ONLY_MODELS:
        size = (12 * config.n_layer * config.n_embd + config.vocab_size + config.block_size) \
            * config.n_embd
        with torch.random.fork_rng(devices=[]), \
                torch.device('cpu' if size <= SHAPE_ONLY_ON_CPU else 'meta'):
            SHAPE_ONLY_MODELS[key] = GPT(config).to('meta')
    return SHAPE_ONLY_MODELS[key]


def model_config(cfg, **override):
    d = {f.name: getattr(cfg, f.name) for f in fields(GPTConfig) if hasattr(cfg, f.name)}
    d.update(override)
    try:
        return GPTConfig(**d)
    except ValueError as e:
        raise TrainError(str(e)) from None


def check_family_options(cfg, argv, defaults):
    """Refuse another family's option given on the command line with a non-default value (e.g.
    --route=halt --ffn_gate=jepa); only note the ones a config file set, since a study's arms switch
    route on a shared base file (they are recorded in config.json but change nothing)."""
    given = given_keys(argv)
    mine = set(FAMILIES[cfg.route].options)
    if cfg.trainable == 'last_layers':      # the dense fine-tuning baseline's number of last blocks
        mine.add(FAMILIES[cfg.route].last_layers_option)
    inert = []
    for name, family in FAMILIES.items():
        for key in family.options:
            if key in mine or key in inert or getattr(cfg, key) == defaults[key]:
                continue
            if key in given:
                raise TrainError(
                    f"--{key} is an option of route={name}, which route={cfg.route!r} does not "
                    f"read; drop it or set --route"
                )
            inert.append(key)
    if inert and int(os.environ.get('RANK', 0)) == 0:
        print(
            f"note: route={cfg.route} does not read {', '.join(sorted(inert))} (set in a config "
            "file)"
        )


def check_out_dir(cfg, held=True):
    """Every folder the run will write can be written, before any work (a resume onto a read-only
    folder would otherwise train until its first save fails), and (held) a fresh run never silently
    replaces or appends to the run already in out_dir. train.py checks the latter on rank 0 alone,
    under its lock and before any rank writes (run_state.hold_out_dir): a rank that looked later
    would see the files rank 0 had begun and refuse its own run."""
    writable_folder(cfg.out_dir, 'out_dir')
    check_data_folder(cfg)          # a named dataset; its folder writable where it will be prepared
    if held:
        check_run_files(cfg)


def check_run_files(cfg):
    """A fresh run (not a resume, not --overwrite) refuses an out_dir that holds a run's files."""
    if cfg.init_from == 'resume' or cfg.overwrite:
        return
    # and an FSDP run's shards (sharding.SHARDED_DIR), which a fresh run removes with the rest
    held = [f for f in (*RUN_FILES, 'ckpt_dcp') if os.path.exists(os.path.join(cfg.out_dir, f))]
    if held:
        raise TrainError(
            f"out_dir {cfg.out_dir} already holds a run ({', '.join(held)}); continue it with "
            f"--init_from=resume, pick another --out_dir, or replace it with --overwrite=True"
        )


def check_against_checkpoint(cfg, meta, ckpt, keys, data_keys=None):
    """The config's fields `keys` agree with the checkpoint's model_args, and the data is its
    own (data_keys: only these fields of its identity, see check_checkpoint_data; meta None: the
    fields alone, before the data is read)."""
    margs = read_stored_config(ckpt['model_args'])      # as it ran (stored_before)
    family = FAMILIES[margs.get('route', GPTConfig.route)]
    defaults = {f.name: f.default for f in fields(GPTConfig)}
    for k in keys:
        want, have = getattr(cfg, k), margs.get(k, defaults.get(k))
        if k == 'vocab_size' and want == 0:
            continue
        if k in family.spelled_options:    # compare what is meant ('auto' is the family's default)
            want, have = (family.option_meaning(GPTConfig.from_dict({**margs, k: v}), k)
                          for v in (want, have))
        if have != want:
            raise TrainError(f"config field '{k}' differs from the checkpoint: checkpoint has "
                             f"{margs.get(k)!r}, config has {getattr(cfg, k)!r}; give "
                             f"--{k}={margs.get(k, defaults.get(k))!r}, as the checkpoint's run "
                             "had it")
    if meta is not None:
        check_checkpoint_data(cfg, meta, ckpt, data_keys)


def check_state_fits(model, state, source):
    """The same tensor names and shapes as the model, or one line naming the first differences
    (a config field this check's key list does not name still changes the model's shape)."""
    mine = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    theirs = {k: tuple(v.shape) for k, v in state.items()}
    diff = sorted(set(mine) ^ set(theirs)) + sorted(
        k for k in set(mine) & set(theirs) if mine[k] != theirs[k]
    )
    if diff:
        raise TrainError(
            f"checkpoint ({source}) does not fit the model this config builds: {diff[:4]} differ; "
            f"use the run's original model and routing options"
        )
