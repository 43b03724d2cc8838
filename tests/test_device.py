"""Tests for device.py: the device and dtype a script runs on from --device / --dtype ('auto' by
what the machine has), the refusals (a missing GPU or GPU index, float16 on CPU, an unknown dtype or
device), the autocast context each dtype gives, and the refusal of a batch no memory holds."""
import os
import re
from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch

from configurator import ConfigError
import device
from device import autocast_context, check_batch_fits, cli_device, resolve_device_dtype


def test_cuda_index_beyond_the_machine_is_refused(monkeypatch):
    """--device=cuda:3 on a machine with one GPU: a ConfigError before any work, not a CUDA
    traceback."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError, match=r"device=cuda:3 but this machine has 1 CUDA device "
                                                r"\(cuda:0\.\.cuda:0\)"):
        resolve_device_dtype(SimpleNamespace(device="cuda:3", dtype="float32"))
    assert resolve_device_dtype(SimpleNamespace(device="cuda:0", dtype="float32"))[
        0
    ] == torch.device("cuda:0")


def cfg(device, dtype):
    return SimpleNamespace(device=device, dtype=dtype)


def test_auto_without_a_gpu_is_cpu_in_float32(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device_dtype(cfg("auto", "auto")) == (torch.device("cpu"), "float32")
    assert resolve_device_dtype(cfg("cpu", "bfloat16")) == (torch.device("cpu"), "bfloat16")


@pytest.mark.parametrize("capability,dtype", [((8, 0), "bfloat16"), ((9, 0), "bfloat16"),
                                              ((7, 0), "float16")])
def test_auto_dtype_on_a_gpu_follows_its_generation(monkeypatch, capability, dtype):
    """bfloat16 from Ampere (8.x) on; a V100 (7.x) has no bf16 matmuls: float16 with a scaler."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev: capability)
    assert resolve_device_dtype(cfg("auto", "auto")) == (torch.device("cuda"), dtype)
    assert resolve_device_dtype(cfg("cuda", "float32")) == (torch.device("cuda"), "float32")


@pytest.mark.parametrize("device,dtype,needle", [
    ("cpu", "float16", "dtype=float16 is for CUDA"),
    ("cpu", "fp8", "dtype must be auto, float32, bfloat16 or float16, got 'fp8'"),
    ("cuda", "float32", "device=cuda but no CUDA device is available; use --device=cpu"),
    ("bogus", "float32", "device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got 'bogus'"),
    ("mps", "float32", "device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got 'mps'")])
def test_cli_device_refuses_what_cannot_run(monkeypatch, device, dtype, needle):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=f"^{re.escape(needle)}"):
        cli_device(device, dtype)


def test_autocast_context_casts_only_below_float32():
    a, b = torch.randn(4, 8), torch.randn(8, 3)
    cpu = torch.device("cpu")
    assert isinstance(autocast_context(cpu, "float32"), nullcontext)
    with autocast_context(cpu, "float32"):
        assert (a @ b).dtype == torch.float32
    with autocast_context(cpu, "bfloat16"):
        assert (a @ b).dtype == torch.bfloat16


@pytest.mark.skipif(not os.path.exists('/proc/meminfo'), reason='reads Linux /proc/meminfo')
def test_host_memory_is_what_the_kernel_reports():
    """The CPU's memory_bytes against /proc/meminfo's MemTotal (kB), read independently: the
    kernel keeps a little for itself, so within 2%."""
    with open('/proc/meminfo') as f:
        total = next(int(line.split()[1]) * 1024 for line in f if line.startswith('MemTotal:'))
    have = device.memory_bytes(torch.device('cpu'))
    assert 0.98 * have <= total <= have


def test_a_batch_whose_logits_fill_more_than_the_memory_is_refused(monkeypatch):
    """The bound is the logits at 2 bytes each: a batch of exactly the memory passes, one token
    row more is refused, naming the key, the sizes and the fix."""
    monkeypatch.setattr(device, 'memory_bytes', lambda dev: 2**30)
    check_batch_fits(2**13, 2**8, 2**8, torch.device('cpu'))
    with pytest.raises(ConfigError) as e:
        check_batch_fits(2**14, 2**8, 2**8, torch.device('cpu'), key='eval_batch')
    assert str(e.value) == ("eval_batch=16384: one batch's logits alone (16384 x 256 tokens x 256 "
                            "in the vocabulary, 2 bytes each) are 2.00 GiB, more than the 1.00 "
                            "GiB of cpu; lower --eval_batch")
    with pytest.raises(ConfigError):
        check_batch_fits(2**13 + 1, 2**8, 2**8, torch.device('cpu'))
    monkeypatch.setattr(device, 'memory_bytes', lambda dev: None)   # a system that does not say
    check_batch_fits(2**40, 2**8, 2**8, torch.device('cpu'))
