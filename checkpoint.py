"""
Checkpoint files: atomic writes that never lose the previous checkpoint, and reads that turn a
missing, truncated or foreign file into one clear error instead of a torch traceback.

    from checkpoint import save_checkpoint, load_checkpoint, load_model
"""
import errno
import os

import torch

from configurator import UserError
from files import write_whole
from lora import apply_lora, has_lora_keys, merge_lora
from model import GPT, GPTConfig


class CheckpointError(UserError):
    """A checkpoint that cannot be read or written; the message names the file and what to do."""


def save_checkpoint(path, state):
    """Written whole (files.write_whole), so a crash or a full disk at any moment leaves either the
    old or the new checkpoint, never a partial one."""
    try:
        write_whole(path, lambda f: torch.save(state, f), binary=True)
    except (OSError, RuntimeError) as e:
        raise write_failed(path, e, 'checkpoint', os.path.dirname(os.path.abspath(path))) from None


def write_failed(path, e, what, folder):
    """The CheckpointError of a failed checkpoint write (`what` at path, in folder): a folder this
    user cannot write, or else a full disk (ENOSPC, or torch's zip writer's RuntimeError)."""
    what = f"could not write {what} {path} ({type(e).__name__}: {first_line(e, 200)})"
    kept = "the previous checkpoint, if any, is kept unchanged"
    if isinstance(e, OSError) and e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return CheckpointError(f"{what}: {folder} is not writable by this user; make it "
                               f"writable (chmod u+w {folder}) and resume with "
                               f"--init_from=resume ({kept})")
    free = _free_bytes(folder)
    return CheckpointError(f"{what}; {free / 2**20:.0f} MiB free on its disk: free some space "
                           f"and resume with --init_from=resume ({kept})")


def _free_bytes(folder):
    try:
        st = os.statvfs(folder)
        return st.f_bavail * st.f_frsize
    except OSError:
        return float('nan')


def load_checkpoint(path, map_location='cpu', mmap=False):
    """torch.load of a nanodepth checkpoint; CheckpointError for a missing, truncated, corrupt or
    foreign file (one line naming it), never a raw traceback. mmap: tensors read only when used
    (to check a checkpoint's fields without reading its weights)."""
    if not os.path.isfile(path):
        raise CheckpointError(f"no checkpoint file at {path}")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=False, mmap=mmap)
    except PermissionError as e:     # the file is fine; this user may not read it
        raise CheckpointError(f"checkpoint {path} cannot be read by this user ({e.strerror}); "
                              "make it "
                              f"readable (chmod u+r {path}) or run as its owner") from None
    except Exception as e:           # truncated zip, random bytes, pickle errors, ...
        if _is_text(path):             # e.g. the run's config.json given for its ckpt.pt
            raise CheckpointError(f"{path} is a text file, not a checkpoint (a file torch.save "
                                  "wrote); give the ckpt.pt a run saved") from None
        raise CheckpointError(f"checkpoint {path} is unreadable ({type(e).__name__}: "
                              f"{first_line(e) or 'corrupt'}); it is "
                              "truncated or "
                              f"corrupt: use another checkpoint or retrain") from None
    missing = [
        k for k in ('model', 'model_args', 'config') if not isinstance(ckpt, dict) or k not in ckpt
    ]
    if missing:
        raise CheckpointError(f"{path} is not a nanodepth checkpoint (no {', '.join(missing)})")
    wrong = [k for k in ('model', 'model_args', 'config') if not isinstance(ckpt[k], dict)]
    if wrong:
        raise CheckpointError(f"{path} is not a nanodepth checkpoint (its {', '.join(wrong)} "
                              "not a mapping)")
    try:                              # what its model_args describe must build here
        GPTConfig.from_dict(ckpt['model_args'])
    except (TypeError, ValueError, KeyError) as e:
        if isinstance(e, UserError):  # (old option names: its own line)
            raise
        raise CheckpointError(f"{path}: its model_args describe no model this code builds "
                              f"({first_line(e) or type(e).__name__}); use another checkpoint") \
            from None
    return ckpt


def _is_text(path):
    """Does the file begin with printable text (no control bytes but tab and line ends)?"""
    try:
        with open(path, 'rb') as f:
            head = f.read(512)
    except OSError:
        return False
    return bool(head) and not any(b < 9 or 13 < b < 32 or b == 127 for b in head)


def first_line(e, limit=160):
    """The first line of an exception's message, cut to `limit` characters ('' for none)."""
    return (str(e).splitlines() or [''])[0][:limit]


def check_init_from(init_from):
    """init_from is scratch, resume, gpt2[-medium|-large|-xl], a checkpoint file or a local Hugging
    Face GPT-2 directory; a run folder (ckpt.pt inside) is not a GPT-2 directory: say what to give
    instead."""
    hub_name = init_from.startswith('gpt2') and not os.path.exists(init_from)
    if init_from in ('scratch', 'resume') or hub_name:
        return
    if os.path.isfile(init_from):
        return
    if os.path.isdir(init_from):
        if os.path.exists(os.path.join(init_from, 'ckpt.pt')):
            raise CheckpointError(
                f"init_from={init_from} is a run folder, not a GPT-2 directory: start from its "
                "weights with "
                f"--init_from={os.path.join(init_from, 'ckpt.pt')}, or continue that run with "
                f"--out_dir={init_from} --init_from=resume")
        hf = ('pytorch_model.bin', 'model.safetensors')
        if not (os.path.isfile(os.path.join(init_from, 'config.json'))
                and any(os.path.isfile(os.path.join(init_from, f)) for f in hf)):
            raise CheckpointError(f"init_from={init_from} is a folder without a checkpoint "
                                  "(ckpt.pt) or "
                                  "Hugging Face GPT-2 weights (config.json and "
                                  f"{' or '.join(hf)}); give "
                                  f"a checkpoint file or such a folder")
        return
    raise CheckpointError("init_from must be scratch, resume, a checkpoint file, "
                          "gpt2[-medium|-large|-xl] "
                          f"or a local HF GPT-2 directory; {init_from!r} is none of these")


def load_model(ckpt, device, path=None):
    """The model a loaded checkpoint holds (built from its model_args, its weights loaded) on
    device. A LoRA run's adapters (lora.py) are rebuilt from its config, loaded and merged into
    the projections: the model returned is plain, its merged weights W + (alpha / r) · B A.
    `path`, the file it was loaded from, names it in the error when its weights do not fit."""
    model = GPT(GPTConfig.from_dict(ckpt['model_args']))
    try:
        if has_lora_keys(ckpt['model']):
            c = ckpt['config']
            apply_lora(model, c['lora_rank'], c['lora_alpha'], 0.0, c['lora_targets'])
            model.load_state_dict(ckpt['model'])
            merge_lora(model)
            model.requires_grad_(True)         # as a plain checkpoint's model: nothing frozen
        else:
            model.load_state_dict(ckpt['model'])
    except (RuntimeError, KeyError, ValueError) as e:    # weights of another shape or model
        where = f"checkpoint {path}" if path else "the checkpoint"
        raise CheckpointError(f"{where}: its weights do not fit the model its model_args "
                              f"describe ({first_line(e) or type(e).__name__}); use the checkpoint "
                              "its run saved") \
            from None
    return model.to(device)
