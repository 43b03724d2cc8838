"""
The device and precision a script runs on, from its --device / --dtype options.

    from device import autocast_context, check_batch_fits, resolve_device_dtype
"""
import os
from contextlib import nullcontext
from types import SimpleNamespace

import torch

from configurator import ConfigError


def resolve_device_dtype(cfg):
    """(torch.device, dtype name) for cfg.device ('auto', 'cpu', 'cuda', 'cuda:N') and cfg.dtype
    ('auto', 'float32', 'bfloat16', 'float16'); a ConfigError for a missing GPU or a dtype the
    device cannot use."""
    dev = cfg.device
    if dev == 'auto':
        dev = 'cuda' if torch.cuda.is_available() else 'cpu'
    dev = torch.device(dev)
    if dev.type == 'cuda' and not torch.cuda.is_available():
        raise ConfigError("device=cuda but no CUDA device is available; use --device=cpu")
    if dev.type == 'cuda' and dev.index is not None and dev.index >= torch.cuda.device_count():
        n = torch.cuda.device_count()
        raise ConfigError(
            f"device={cfg.device} but this machine has {n} CUDA device{'s' if n != 1 else ''} "
            f"(cuda:0..cuda:{n - 1}); choose one of them"
        )
    dt = cfg.dtype
    if dt == 'auto':
        if dev.type != 'cuda':
            dt = 'float32'
        else:
            major, _ = torch.cuda.get_device_capability(dev)
            dt = 'bfloat16' if major >= 8 else 'float16'    # V100 (7.x): fp16 + GradScaler
    if dt not in ('float32', 'bfloat16', 'float16'):
        raise ConfigError(f"dtype must be auto, float32, bfloat16 or float16, got {dt!r}")
    if dt == 'float16' and dev.type != 'cuda':
        raise ConfigError(
            "dtype=float16 is for CUDA (with a GradScaler); on CPU use float32 or bfloat16"
        )
    return dev, dt


def cli_device(device, dtype='float32'):
    """resolve_device_dtype for a script's --device / --dtype, with a one-line error for a device
    string torch cannot parse (or that is neither cpu nor cuda) as well as for a missing GPU."""
    try:
        kind = 'cpu' if device == 'auto' else torch.device(device).type
    except RuntimeError:                 # torch.device('bogus')
        kind = None
    if kind not in ('cpu', 'cuda'):
        raise ConfigError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    return resolve_device_dtype(SimpleNamespace(device=device, dtype=dtype))


def autocast_context(dev, dt):
    """The forward's precision context: none for float32, else autocast to bf16 / fp16 on dev."""
    if dt == 'float32':
        return nullcontext()
    return torch.autocast(
        device_type=dev.type, dtype={'bfloat16': torch.bfloat16, 'float16': torch.float16}[dt]
    )


def memory_bytes(dev):
    """What one process could fill on dev: a GPU's whole memory, else the host's physical memory
    (None where the system does not say: no os.sysconf on Windows)."""
    if dev.type == 'cuda':
        return torch.cuda.get_device_properties(dev).total_memory
    try:
        return os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES')
    except (AttributeError, ValueError, OSError):
        return None


def check_batch_fits(batch_size, block_size, vocab_size, dev, key='batch_size'):
    """Refuse (ConfigError naming --key) a batch whose logits alone, at 2 bytes each, would fill
    more than dev's memory: no run of it can finish, and building its batches first takes minutes
    (a lower bound: a batch that passes may still run out of memory, which the scripts report)."""
    need = batch_size * block_size * vocab_size * 2
    have = memory_bytes(dev)
    if have is not None and need > have:
        raise ConfigError(
            f"{key}={batch_size}: one batch's logits alone ({batch_size} x {block_size} tokens x "
            f"{vocab_size} in the vocabulary, 2 bytes each) are {need / 2**30:,.2f} GiB, more "
            f"than the {have / 2**30:,.2f} GiB of {dev}; lower --{key}")
