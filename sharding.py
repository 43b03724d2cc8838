"""
FSDP2 (torch's `fully_shard`) for `train.py --parallel=fsdp` under torchrun: the model's parameters,
gradients and optimizer state are sharded across the processes, and checkpoints are saved and
resumed with torch.distributed.checkpoint (DCP), sharded, beside a consolidated ckpt.pt that
eval.py, sample.py and the other tools read as they read any run's.

    from sharding import check_parallel, shard_model, gathered, save_sharded, load_sharded

Units: each transformer block the family runs through the Block's own methods (forward,
attn_update, ffn_update) is one unit, gathered for its forward and backward and freed after;
blocks whose routed code reaches into their modules directly (FFN-routed and MoD-routed layers),
and every module outside the blocks (embeddings, heads, routers, gates), belong to the root unit,
gathered for the whole step. Evaluations (the loss estimates, threshold calibration, the end-of-run
routing report) run on every rank with all weights gathered, because their sparse paths reach into
modules directly: the weights alone (no gradients, no optimizer state) must fit on one device.
"""
import os
import shutil
from contextlib import contextmanager

import torch

from checkpoint import write_failed
from train_checks import PARALLEL, TrainError

SHARDED_DIR = 'ckpt_dcp'         # out_dir/ckpt_dcp/iter_NNNNNNN: one DCP checkpoint per save
BLOCK_METHODS = ('attn_update', 'ffn_update')   # Block's entry points besides forward (and
                                                # write_kv, which only eager sparse eval calls: it
                                                # runs with every weight gathered)


def check_parallel(cfg, distributed):
    """parallel's value and what it needs, before any work: a known mode, torchrun for fsdp, and
    (fsdp) no float16 (its GradScaler is not written for sharded gradients) and no compile."""
    if cfg.parallel not in PARALLEL:
        raise TrainError(f"parallel must be one of {', '.join(PARALLEL)}; got {cfg.parallel!r}")
    if cfg.parallel != 'fsdp':
        return
    if not distributed:
        raise TrainError("parallel=fsdp shards the model across torchrun's processes: start it "
                         "with torchrun --standalone --nproc_per_node=N train.py ... (one "
                         "process trains without it: drop --parallel=fsdp)")
    if cfg.dtype == 'float16':
        raise TrainError("parallel=fsdp trains in float32 or bfloat16 (float16's GradScaler is not "
                         "supported on sharded gradients here): use --dtype=bfloat16")
    if cfg.compile:
        raise TrainError("parallel=fsdp with compile=True is not supported yet: use "
                         "--compile=False (or parallel=ddp)")


def check_resume(cfg, ckpt):
    """A checkpoint resumes under the mode that wrote it: its optimizer state is sharded (fsdp) or
    whole (ddp, one process)."""
    sharded = bool(ckpt.get('sharded'))
    if sharded != (cfg.parallel == 'fsdp' and int(os.environ.get('RANK', -1)) != -1):
        wrote = 'parallel=fsdp under torchrun' if sharded else 'one process or parallel=ddp'
        raise TrainError(f"the checkpoint in {cfg.out_dir} was written by {wrote}: resume it the "
                         f"same way (its optimizer state is {'sharded' if sharded else 'whole'})")


def block_units(model):
    """The blocks that are FSDP units of their own: those the family runs only through the
    Block's methods (FFN-routed layers hold `cheap`, MoD-routed ones `router`: their code calls
    the block's modules and weights directly, so they stay in the root unit)."""
    return [b for b in model.transformer.h if not (hasattr(b, 'cheap') or hasattr(b, 'router'))]


def shard_model(model, dev):
    """fully_shard each block unit, then the root (whatever is left: embeddings, heads, routers,
    gates, the routed blocks), in place over all processes; the shards land on dev."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method
    mesh = init_device_mesh(dev.type, (torch.distributed.get_world_size(),))
    for block in block_units(model):
        fully_shard(block, mesh=mesh)
        for name in BLOCK_METHODS:      # (a no-op before fully_shard)
            register_fsdp_forward_method(block, name)
    fully_shard(model, mesh=mesh)
    return model


@contextmanager
def gathered(model):
    """Every unit's weights gathered (on every rank: a collective) and kept until the end, so code
    that calls a module or reads a weight outside its unit's forward sees whole tensors."""
    from torch.distributed.fsdp import FSDPModule
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for m in units:
        m.set_reshard_after_forward(False, recurse=False)
        m.unshard()
    try:
        yield model
    finally:
        for m in units:
            m.reshard()
            m.set_reshard_after_forward(m is not model, recurse=False)   # FSDP's own defaults


def local(t):
    """A DTensor's shard on this rank (a plain tensor is its own)."""
    return t.to_local() if hasattr(t, 'to_local') else t


def grad_norm(params):
    """The global L2 norm of the sharded gradients (a collective: every rank calls it)."""
    sq = torch.zeros((), dtype=torch.float32, device=local(params[0]).device)
    for p in params:
        if p.grad is not None:
            sq = sq + local(p.grad).float().pow(2).sum()
    torch.distributed.all_reduce(sq)
    return sq.sqrt()


def clip_grad_norm(params, max_norm):
    """torch.nn.utils.clip_grad_norm_ on sharded gradients: the global norm (returned), and every
    shard scaled by the same min(1, max_norm / (norm + 1e-6))."""
    norm = grad_norm(params)
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for p in params:
        if p.grad is not None:
            local(p.grad).mul_(coef.to(local(p.grad).dtype))
    return norm


def all_finite(params):
    """Whether every rank's shards are finite (a collective)."""
    bad = torch.zeros((), dtype=torch.float32, device=local(params[0]).device)
    for p in params:
        bad = bad + (~torch.isfinite(local(p.detach()))).sum()
    torch.distributed.all_reduce(bad)
    return bad.item() == 0


def save_sharded(model, optimizer, out_dir, iter_num, master):
    """Every rank writes its shards of the model and optimizer to out_dir/ckpt_dcp/iter_N (DCP);
    returns (the folder relative to out_dir, the whole model's state dict on rank 0's CPU, {}
    elsewhere). ckpt.pt, written by rank 0 after this, names the folder: a save killed midway
    leaves the previous pair intact (prune_sharded removes the leftovers)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_state_dict)
    rel = os.path.join(SHARDED_DIR, f'iter_{iter_num:07d}')
    path = os.path.join(out_dir, rel)
    if master and os.path.exists(path):      # a save of this iteration that was killed midway
        shutil.rmtree(path)
    torch.distributed.barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    try:
        dcp.save({'model': model_sd, 'optimizer': optim_sd}, checkpoint_id=path)
    except (Exception, dcp.api.CheckpointException) as e:    # (not an Exception: a BaseException)
        raise write_failed(path, first_failure(e), 'the sharded checkpoint', out_dir) from None
    whole = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                 cpu_offload=True))
    return rel, whole


def prune_sharded(out_dir, keep):
    """Rank 0, once ckpt.pt names `keep`: remove every other DCP folder (older saves, and one a
    kill left half-written)."""
    root = os.path.join(out_dir, SHARDED_DIR)
    for name in os.listdir(root) if os.path.isdir(root) else []:
        if os.path.join(SHARDED_DIR, name) != keep:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def load_sharded(model, optimizer, out_dir, rel):
    """Load the model's and optimizer's shards from out_dir/rel into the sharded model and its
    optimizer (any number of processes: DCP reshards). Parameters that had no optimizer state
    when it was saved (none of their gradients seen yet) get none now either, as in a run that
    was never interrupted."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict,
                                                         set_model_state_dict,
                                                         set_optimizer_state_dict)
    path = os.path.join(out_dir, rel)
    if not os.path.isdir(path):
        raise TrainError(f"ckpt.pt names the sharded checkpoint {path}, which is missing: restore "
                         "it, or start the run afresh with --overwrite=True")
    try:
        saved = set(dcp.FileSystemReader(path).read_metadata().state_dict_metadata)
    except Exception as e:      # no .metadata (a copy cut short), or not DCP's
        raise damaged(path, e) from None
    model_sd, optim_sd = get_state_dict(model, optimizer)    # (creates state for every parameter)
    stateless = [k for k in optim_sd['state']
                 if not any(s.startswith(f'optimizer.state.{k}.') for s in saved)]
    for k in stateless:
        del optim_sd['state'][k]
    state = {'model': model_sd, 'optimizer': optim_sd}
    try:
        dcp.load(state, checkpoint_id=path)
    except (Exception, dcp.api.CheckpointException) as e:    # (not an Exception: a BaseException)
        raise damaged(path, e) from None
    set_model_state_dict(model, state['model'])
    # (strict refuses a trainable parameter without state: the stateless ones, on purpose)
    set_optimizer_state_dict(model, optimizer, state['optimizer'],
                             options=StateDictOptions(strict=not stateless))
    by_name = dict(model.named_parameters())
    for k in stateless:
        optimizer.state.pop(by_name[k], None)


def damaged(path, e):
    """One line for a DCP folder that cannot be read: the first rank's error (DCP's
    CheckpointException wraps each rank's), its type and first line."""
    e = first_failure(e)
    first = str(e).splitlines()[0][:120] if str(e) else 'corrupt'
    return TrainError(f"the sharded checkpoint {path} that ckpt.pt names is unreadable "
                      f"({type(e).__name__}: {first}): it is truncated or corrupt; restore it, or "
                      "start the run afresh with --overwrite=True")


def first_failure(e):
    """The first rank's error that DCP's CheckpointException wraps (each rank's), else e."""
    failures = getattr(e, 'failures', None)
    return next(iter(failures.values()))[0] if failures else e
