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
from files import locked_fd, unlock_and_remove

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
        unlock_and_remove(self.fd, self.path)      # (see files.locked_fd)
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
    the holder's PID, or a UserError if the folder or its lock file cannot be created. Where there
    is no flock (Windows), two writers are not kept apart."""
    created = None if os.path.isdir(folder) else folder
    path = os.path.join(folder, LOCK_NAME)
    try:
        os.makedirs(folder, exist_ok=True)
        fd = locked_fd(path, wait=False)
    except BlockingIOError:
        raise FolderBusy(folder, holder_pid(path), option) from None
    except OSError as e:
        raise UserError(f"cannot create the lock file {path} ({e.strerror}); choose an {option} "
                        f"you can write to") from None
    if fd is None:                     # no flock here: run unlocked, as on Windows
        return FolderLock(None, None, None)
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return FolderLock(fd, path, created)


def holder_pid(path, wait_s=0.5):
    """The PID the holder wrote into the lock file (written just after locking: wait a moment)."""
    deadline = time.time() + wait_s
    while True:
        try:
            with open(path, 'rb') as f:
                text = f.read(32).decode(errors='replace').strip()
        except OSError:                # released and removed meanwhile
            text = ''
        if text.isdigit():
            return int(text)
        if time.time() > deadline:
            return None
        time.sleep(0.02)
