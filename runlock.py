"""
One writer per run folder: train.py holds an exclusive lock on its out_dir, sweep.py on its
out_root, for as long as it runs. A second writer (a resume, a fresh run with --overwrite=True, a
sweep into the same folder) is refused with one line naming the folder and the holder's host and
PID, before it touches anything. The lock is an flock on <folder>/.lock, so the kernel drops it when
its holder dies, even by SIGKILL; the file left behind is then simply locked again. Where the file
system has no flock, the run goes on unlocked after a note saying so; its .lock file, which names
it, is still removed at release unless another run has rewritten or replaced it since. A folder
inside one another live process holds (a run folder of a running sweep) is refused too, except to
the runs of the sweep that holds it (SWEEP_ROOT_ENV).

    from runlock import lock_folder
    lock = lock_folder(cfg.out_dir, 'out_dir')     # FolderBusy (a UserError) if another holds it
    ...
    lock.release()                                 # or let the process end
"""
import os
import socket
import sys
import time

try:
    import fcntl
except ImportError:   # Windows: no advisory file locks
    fcntl = None

from configurator import UserError, writable_folder
from files import NoFlock, locked_fd, pid_alive, unlock_and_remove

LOCK_NAME = '.lock'


class FolderBusy(UserError):
    """Another live process holds the folder's lock, or (inside) a folder above it."""

    def __init__(self, folder, pid, option, host=None, inside=None):
        self.pid, self.host = pid, host
        holder = (f"PID {pid} on {host}" if pid and host else f"PID {pid}" if pid else
                  "a process whose PID it did not record")
        if inside is None:
            super().__init__(f"{option} {folder} is in use by another run ({holder}, a train.py "
                             f"or sweep.py still writing there); wait for it to end or stop it, "
                             f"or choose another {option}")
            return
        super().__init__(f"{option} {folder} is inside {inside}, which another run holds "
                         f"({holder}: a sweep.py's out_root, whose runs it writes itself, or a "
                         f"train.py's out_dir); choose an {option} outside it, or wait for that "
                         f"run to end (if it has, remove {os.path.join(inside, LOCK_NAME)})")


SWEEP_ROOT_ENV = 'NANODEPTH_SWEEP_ROOT'     # a sweep's out_root, set for the runs it starts there


def enclosing_holder(folder):
    """(folder above, PID, host) of the nearest folder above `folder` whose lock is held, or None.
    A .lock that names no host is another tool's (pytest's names its PID alone). Held: its flock
    is taken (a shared flock on it is refused); where there is no flock, its holder is still
    running (on this host; another host's, which a PID says nothing of here, counts as running:
    a released lock leaves no file). The folder in SWEEP_ROOT_ENV is passed over: it is the
    out_root of the sweep that started this run."""
    own_sweep = os.environ.get(SWEEP_ROOT_ENV)
    here = os.path.realpath(folder)
    while True:
        above = os.path.dirname(here)
        if above == here:
            return None
        here = above
        path = os.path.join(here, LOCK_NAME)
        if here == own_sweep or not os.path.isfile(path):
            continue
        pid, host = holder(path, wait_s=0)
        if pid is None or host is None:
            continue
        held = flock_held(path)
        if held is None:                        # no flock here: judged by its PID
            held = host != socket.gethostname() or pid_alive(pid)
        if held:
            return here, pid, host


def flock_held(path):
    """Whether another process holds path's flock (a shared flock, taken and dropped at once, is
    refused), or None where there is no flock. (The dead holder's PID may be another process's
    by now: the lock itself says whether it is held.)"""
    if fcntl is None:
        return None
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False                    # released and removed meanwhile
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    except OSError:
        return None
    finally:
        os.close(fd)                    # (drops the shared flock, where taken)


class FolderLock:
    """A held lock; release() (or the end of the process, or this object being freed) drops it.
    Without flock (fd None) it holds nothing, but release() still removes the lock file while it is
    the one this process wrote (`mine`: its device, inode and contents)."""

    def __init__(self, fd, path, created_folder, mine=None):
        self.fd, self.path, self.created_folder, self.mine = fd, path, created_folder, mine

    def release(self):
        if self.path is None:
            return
        if self.fd is not None:
            unlock_and_remove(self.fd, self.path)      # (see files.locked_fd)
        else:
            remove_if_mine(self.path, self.mine)
        self.fd = self.path = None
        # a run refused before it wrote anything leaves no folder (parents made for it stay: another
        # process may be about to write under them)
        if self.created_folder:
            try:
                os.rmdir(self.created_folder)
            except OSError:
                pass                   # not empty: the run wrote its files

    def __del__(self):
        self.release()


def lock_folder(folder, option='out_dir'):
    """Take the exclusive lock on folder (created if missing): a FolderLock, or FolderBusy naming
    the holder's host and PID, or a UserError if the folder or its lock file cannot be created.
    Where there is no flock (Windows, some network file systems), two writers are not kept apart:
    a note on stderr says so."""
    writable_folder(folder, option)        # (a file on the way, a dangling link: named as such)
    above = enclosing_holder(folder)      # e.g. a train.py into a run folder of a running sweep
    if above is not None:
        raise FolderBusy(folder, above[1], option, above[2], inside=above[0])
    created = None if os.path.isdir(folder) else folder
    path = os.path.join(folder, LOCK_NAME)
    try:
        os.makedirs(folder, exist_ok=True)
        fd = locked_fd(path, wait=False)
    except BlockingIOError:
        pid, host = holder(path)
        raise FolderBusy(folder, pid, option, host) from None
    except NoFlock as e:               # run unlocked, saying so
        print(f"note: {option} {folder} could not be locked ({e}); a second run writing there at "
              f"the same time would not be refused", file=sys.stderr)
        try:                           # sign the file anyway, so that release() knows it
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                stamp, st = sign(fd), os.fstat(fd)
            finally:
                os.close(fd)
        except OSError as e:
            raise UserError(f"cannot create the lock file {path} ({e.strerror}); choose an "
                            f"{option} you can write to") from None
        return FolderLock(None, path, created, mine=(st.st_dev, st.st_ino, stamp))
    except OSError as e:
        raise UserError(f"cannot create the lock file {path} ({e.strerror}); choose an {option} "
                        f"you can write to") from None
    sign(fd)
    return FolderLock(fd, path, created)


def sign(fd):
    """Write this process's PID and host into the lock file (what holder() reads); the bytes."""
    stamp = f"{os.getpid()} {socket.gethostname()}\n".encode()
    os.ftruncate(fd, 0)
    os.write(fd, stamp)
    return stamp


def remove_if_mine(path, mine):
    """Remove the unlocked lock file at path if it is still the one this process signed (mine:
    device, inode, contents): with no flock another run may have rewritten or replaced it since,
    and its file is its own to remove."""
    dev, ino, stamp = mine
    try:
        with open(path, 'rb') as f:
            st = os.fstat(f.fileno())
            if (st.st_dev, st.st_ino) == (dev, ino) and f.read(len(stamp) + 1) == stamp:
                os.unlink(path)
    except OSError:
        pass                           # removed meanwhile, or unreadable: not ours to decide


def holder(path, wait_s=0.5):
    """(PID, host) the holder wrote into the lock file (just after locking: wait a moment for
    it); (None, None) if none is there, host None in a file that names none."""
    deadline = time.time() + wait_s
    while True:
        try:
            with open(path, 'rb') as f:
                words = f.read(300).decode(errors='replace').split()
        except OSError:                # released and removed meanwhile
            words = []
        if words and words[0].isdigit():
            return int(words[0]), (words[1] if len(words) > 1 else None)
        if time.time() > deadline:
            return None, None
        time.sleep(0.02)
