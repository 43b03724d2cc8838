"""
Files written whole. Every file nanodepth keeps (a checkpoint, a run's config and metrics, a sweep's
summary and plots, a benchmark's JSON, a prepared dataset, the compile cache) is written beside its
path as <name>.tmp-<pid>, flushed to disk and renamed over the path: a crash, a kill or a full disk
at any moment leaves the old file or the new one, never part of one, and two processes writing one
path never write into one temporary file. The next write of the path removes what a killed writer
left.

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
    temporary file is removed, path is left as it was, and the error propagates. Temporary files
    of path that dead writers left are removed first."""
    folder, name = os.path.split(os.path.abspath(path))
    remove_stale_temps(folder, name)
    tmp = os.path.join(folder, f"{name}.tmp-{os.getpid()}")
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
    writer is no longer running; returns the paths removed, sorted. A live process's, this one's
    included, are kept: it may be writing them right now (another thread of this one, say)."""
    removed = []
    if not os.path.isdir(folder):
        return removed
    for entry in os.scandir(folder):
        m = re.fullmatch(r"(.+)\.tmp-(\d+)", entry.name)
        if not m or (name is not None and m[1] != name) or not entry.is_file():
            continue
        if pid_alive(int(m[2])):
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
def taking_turns(lock_path):
    """An exclusive flock on the file lock_path for the block, waiting for another holder: writers
    of one folder take turns. A lock file rather than the folder itself, since on NFS only a
    file's lock holds across machines. The file is made for the block and removed, while still
    held, at its end; a waiter that then holds the removed file sees so and locks the path anew.
    The kernel drops the lock of a holder that is killed (its file is then locked and removed by
    the next holder)."""
    if fcntl is None:
        yield
        return
    while True:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            if os.path.samestat(os.fstat(fd), os.stat(lock_path)):
                break
        except FileNotFoundError:
            pass
        os.close(fd)          # the holder before removed it: lock the file now at the path
    try:
        yield
    finally:
        try:
            os.unlink(lock_path)
        except FileNotFoundError:
            pass              # removed by hand meanwhile
        os.close(fd)
