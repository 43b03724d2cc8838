"""
Files written whole. Every file nanodepth keeps (a checkpoint, a run's config and metrics, a sweep's
summary and plots, a benchmark's JSON, a prepared dataset, the compile cache) is written beside its
path as <name>.tmp-<host>-<pid>, flushed to disk and renamed over the path: a crash, a kill or a
full disk at any moment leaves the old file or the new one, never part of one, and two processes
writing one path never write into one temporary file. The next write of the path on the same host
removes what a killed writer left (a PID says whether a process lives only on its own host).

    from files import write_whole
    write_whole('out/summary.json', lambda f: json.dump(summary, f))
"""
import contextlib
import os
import re
import socket

try:
    import fcntl
except ImportError:   # Windows: no advisory file locks
    fcntl = None


RUN_FILES = ('ckpt.pt', 'metrics.jsonl', 'config.json', 'run_info.json')    # what a run writes


def run_file_in(folder):
    """The first of a training run's own files that folder holds (it is a run's folder, before its
    first checkpoint too), or None. config.json alone is not one: a Hugging Face export has one."""
    return next((n for n in RUN_FILES if n != 'config.json'
                 and os.path.isfile(os.path.join(folder, n))), None)


def write_whole(path, write, binary=False):
    """Call write(f) on path's temporary file, fsync it and rename it over path, making path's
    folder first if it is missing (configurator.writable_file accepts a folder it can make). On
    any error the temporary file is removed, path is left as it was, and the error propagates.
    Temporary files of path that dead writers left are removed first."""
    folder, name = os.path.split(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    remove_stale_temps(folder, name)
    tmp = os.path.join(folder, f"{name}.tmp-{host_name()}-{os.getpid()}")
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
    included, are kept: it may be writing them right now (another thread of this one, say). So are
    another host's, whose PIDs say nothing here (a name without a host is judged by its PID)."""
    removed = []
    if not os.path.isdir(folder):
        return removed
    for entry in os.scandir(folder):
        m = re.fullmatch(r"(.+)\.tmp-(?:([A-Za-z0-9._-]+)-)?(\d+)", entry.name)
        if not m or (name is not None and m[1] != name) or not entry.is_file():
            continue
        if (m[2] is not None and m[2] != host_name()) or pid_alive(int(m[3])):
            continue
        try:
            os.remove(entry.path)
            removed.append(entry.path)
        except OSError:
            pass          # removed meanwhile by another cleaner
    return sorted(removed)


def host_name():
    """This host's name as temporary files carry it (letters, digits, '.', '_' and '-')."""
    return re.sub(r'[^A-Za-z0-9._-]', '_', socket.gethostname()) or 'host'


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


class NoFlock(Exception):
    """There is no flock here (Windows, or a file system without it): the caller runs unlocked.
    str() says why."""


def locked_fd(path, wait=True):
    """An fd of the file at path (created where missing) holding its exclusive flock, waiting for
    another holder where wait, else BlockingIOError; NoFlock where there is no flock. A holder
    removes the file while it still holds it (unlock_and_remove), so a waiter that then holds the
    removed file sees so and locks the file now at the path; the kernel drops the lock of a holder
    that is killed."""
    if fcntl is None:
        raise NoFlock("this system has no flock")
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            os.close(fd)
            raise
        except OSError as e:
            os.close(fd)
            raise NoFlock(f"flock: {e.strerror}") from None
        try:
            if os.path.samestat(os.fstat(fd), os.stat(path)):
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)          # the holder before removed it: lock the file now at the path


def unlock_and_remove(fd, path):
    """Remove the lock file while still holding it, then let it go (see locked_fd)."""
    try:
        os.unlink(path)
    except OSError:
        pass                  # removed by hand meanwhile
    os.close(fd)


@contextlib.contextmanager
def taking_turns(lock_path):
    """The lock file lock_path held for the block (locked_fd), waiting for another holder, and
    removed at its end: writers of one folder take turns. A lock file rather than the folder
    itself, since on NFS only a file's lock holds across machines."""
    try:
        fd = locked_fd(lock_path)
    except NoFlock:
        fd = None             # no flock here: writers do not take turns
    try:
        yield
    finally:
        if fd is not None:
            unlock_and_remove(fd, lock_path)
