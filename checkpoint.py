"""
Checkpoint files: atomic writes that never lose the previous checkpoint, and reads that turn a
missing, truncated or foreign file into one clear error instead of a torch traceback.

    from checkpoint import save_checkpoint, load_checkpoint, load_model
"""
import glob
import os

import torch

from configurator import UserError
from model import GPT, GPTConfig


class CheckpointError(UserError):
    """A checkpoint that cannot be read or written; the message names the file and what to do."""


def save_checkpoint(path, state):
    """Atomic: write path.tmp-<pid> in the same folder, fsync, then rename over the old checkpoint, so
    a crash or a full disk at any moment leaves either the old or the new file, never a partial one."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, 'wb') as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:
        # torch.save reports a full disk as a RuntimeError from its zip writer; say what it means
        free = _free_bytes(os.path.dirname(os.path.abspath(path)))
        raise CheckpointError(
            f"could not write checkpoint {path} ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
            f"{free / 2**20:.0f} MiB free on its disk: free some space (the previous checkpoint, if any, is "
            f"kept unchanged)") from None
    finally:
        if os.path.exists(tmp):           # the write failed: drop the partial file
            os.remove(tmp)


def _free_bytes(folder):
    try:
        st = os.statvfs(folder)
        return st.f_bavail * st.f_frsize
    except OSError:
        return float('nan')


def remove_stale_temps(path):
    """Delete path.tmp-<pid> files left by a process that was killed mid-write (SIGKILL, power loss)
    and is no longer running. Returns the paths removed."""
    removed = []
    for tmp in glob.glob(glob.escape(path) + '.tmp-*'):
        pid = tmp.rsplit('-', 1)[-1]
        if pid.isdigit() and int(pid) != os.getpid() and _alive(int(pid)):
            continue                     # another live process is writing it right now
        try:
            os.remove(tmp)
            removed.append(tmp)
        except OSError:
            pass
    return removed


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def load_checkpoint(path, map_location='cpu'):
    """torch.load of a nanodepth checkpoint; CheckpointError for a missing, truncated, corrupt or
    foreign file (one line naming it), never a raw traceback."""
    if not os.path.isfile(path):
        raise CheckpointError(f"no checkpoint file at {path}")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=False)
    except Exception as e:           # truncated zip, random bytes, pickle errors, ...
        raise CheckpointError(f"checkpoint {path} is unreadable ({type(e).__name__}: "
                              f"{str(e).splitlines()[0][:160] if str(e) else 'corrupt'}); it is truncated or "
                              f"corrupt: use another checkpoint or retrain") from None
    missing = [k for k in ('model', 'model_args', 'config') if not isinstance(ckpt, dict) or k not in ckpt]
    if missing:
        raise CheckpointError(f"{path} is not a nanodepth checkpoint (no {', '.join(missing)})")
    return ckpt


def load_model(ckpt, device):
    """The model a loaded checkpoint holds (built from its model_args, its weights loaded) on device."""
    model = GPT(GPTConfig.from_dict(ckpt['model_args']))
    model.load_state_dict(ckpt['model'])
    return model.to(device)
