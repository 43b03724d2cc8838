"""
Files written whole. Every file nanodepth keeps (a checkpoint, a run's config and metrics, a sweep's
summary, a benchmark's JSON, a prepared dataset, the compile cache) is written beside its path as
<name>.tmp-<pid>, flushed to disk and renamed over the path: a crash, a kill or a full disk at any
moment leaves the old file or the new one, never part of one, and two processes writing one path
never write into one temporary file.

    from files import write_whole
    write_whole('out/summary.json', lambda f: json.dump(summary, f))
"""
import contextlib
import os
import re

try:
    import fcntl
except ImportError:   # Windows: no advisory file locks
    fcntl = None


def write_whole(path, write, binary=False):
    """Call write(f) on path's temporary file, fsync it and rename it over path. On any error the
    temporary file is removed, path is left as it was, and the error propagates."""
    tmp = f"{os.fspath(path)}.tmp-{os.getpid()}"
    try:
        with open(tmp, 'wb' if binary else 'w') as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def remove_stale_temps(folder, name=None):
    """Delete write_whole's temporary files in folder (of the file `name` only, unless None) whose
    writer is no longer running, or is this process (which is not writing them now); returns the
    paths removed, sorted. A live process's are kept: it may be writing them right now."""
    removed = []
    if not os.path.isdir(folder):
        return removed
    for entry in os.scandir(folder):
        m = re.fullmatch(r"(.+)\.tmp-(\d+)", entry.name)
        if not m or (name is not None and m[1] != name) or not entry.is_file():
            continue
        if int(m[2]) != os.getpid() and pid_alive(int(m[2])):
            continue
        try:
            os.remove(entry.path)
            removed.append(entry.path)
        except OSError:
            pass          # removed meanwhile by another cleaner
    return sorted(removed)


def pid_alive(pid):
    if os.name != 'posix':
        return True       # os.kill(pid, 0) would signal the process on Windows; keep its files
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True       # another user's process
    return True


@contextlib.contextmanager
def taking_turns(folder):
    """An exclusive flock on the folder itself for the block, waiting for another holder: writers
    of one folder take turns, no lock file is left in it, and the kernel drops the lock of a
    holder that is killed."""
    if fcntl is None:
        yield
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
