"""
One writer per run folder: train.py holds an exclusive lock on its out_dir, sweep.py on its
out_root, for as long as it runs. A second writer (a resume, a fresh run with --overwrite=True, a
sweep into the same folder) is refused with one line naming the folder and the holder's PID, before
it touches anything. The lock is an flock on <folder>/.lock, so the kernel drops it when its holder
dies, even by SIGKILL; the file left behind is then simply locked again.

    from runlock import lock_folder
    lock = lock_folder(cfg.out_dir, 'out_dir')     # FolderBusy (a UserError) if another holds it
    ...
    lock.release()                                 # or let the process end
"""
import os
import time

from configurator import UserError

try:
    import fcntl
except ImportError:   # Windows: no advisory file locks, so two writers are not kept apart there
    fcntl = None

LOCK_NAME = '.lock'


class FolderBusy(UserError):
    """Another live process holds the folder's lock."""

    def __init__(self, folder, pid, option):
        self.pid = pid
        holder = f"PID {pid}" if pid else "a process whose PID it did not record"
        super().__init__(f"{option} {folder} is in use by another run ({holder}, a train.py or "
                         f"sweep.py still writing there); wait for it to end or stop it, or choose "
                         f"another {option}")


class FolderLock:
    """A held lock; release() (or the end of the process, or this object being freed) drops it."""

    def __init__(self, fd, path, created_folder):
        self.fd, self.path, self.created_folder = fd, path, created_folder

    def release(self):
        if self.fd is None:
            return
        # unlink while still holding it: a contender that opened the old file checks, once it has
        # the lock, that the file is still the one at the path (see lock_folder)
        try:
            os.unlink(self.path)
        except OSError:
            pass
        os.close(self.fd)
        self.fd = None
        if self.created_folder:        # a run refused before it wrote anything leaves no folder
            try:
                os.rmdir(self.created_folder)
            except OSError:
                pass                   # not empty: the run wrote its files

    def __del__(self):
        self.release()


def lock_folder(folder, option='out_dir'):
    """Take the exclusive lock on folder (created if missing): a FolderLock, or FolderBusy naming
    the holder's PID, or a UserError if the folder or its lock file cannot be created."""
    if fcntl is None:
        return FolderLock(None, None, None)
    created = None if os.path.isdir(folder) else folder
    path = os.path.join(folder, LOCK_NAME)
    try:
        os.makedirs(folder, exist_ok=True)
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                pid = holder_pid(fd)
                os.close(fd)
                raise FolderBusy(folder, pid, option) from None
            except OSError:            # a file system without flock: run unlocked, as on Windows
                os.close(fd)
                return FolderLock(None, None, None)
            try:                       # the holder we waited on may have unlinked it meanwhile
                if os.path.samestat(os.fstat(fd), os.stat(path)):
                    break
            except FileNotFoundError:
                pass
            os.close(fd)
    except FolderBusy:
        raise
    except OSError as e:
        raise UserError(f"cannot create the lock file {path} ({e.strerror}); choose an {option} "
                        f"you can write to") from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return FolderLock(fd, path, created)


def holder_pid(fd, wait_s=0.5):
    """The PID the holder wrote into the lock file (written just after locking: wait a moment)."""
    deadline = time.time() + wait_s
    while True:
        text = os.pread(fd, 32, 0).decode(errors='replace').strip()
        if text.isdigit():
            return int(text)
        if time.time() > deadline:
            return None
        time.sleep(0.02)
