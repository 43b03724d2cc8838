"""
One writer per run folder: train.py holds an exclusive lock on its out_dir, sweep.py on its
out_root, for as long as it runs. A second writer (a resume, a fresh run with --overwrite=True, a
sweep into the same folder) is refused with one line naming the folder and the holder's host and
PID, before it touches anything. The lock is an flock on <folder>/.lock, so the kernel drops it when
its holder dies, even by SIGKILL; the file left behind is then simply locked again. Where the file
system has no flock, the run goes on unlocked after a note saying so; its .lock file, which names
it, is still removed at release unless another run has rewritten or replaced it since.

    from runlock import lock_folder
    lock = lock_folder(cfg.out_dir, 'out_dir')     # FolderBusy (a UserError) if another holds it
    ...
    lock.release()                                 # or let the process end
"""
import os
import socket
import sys
import time

from configurator import UserError, writable_folder
from files import NoFlock, locked_fd, unlock_and_remove

LOCK_NAME = '.lock'


class FolderBusy(UserError):
    """Another live process holds the folder's lock."""

    def __init__(self, folder, pid, option, host=None):
        self.pid, self.host = pid, host
        holder = (f"PID {pid} on {host}" if pid and host else f"PID {pid}" if pid else
                  "a process whose PID it did not record")
        super().__init__(f"{option} {folder} is in use by another run ({holder}, a train.py or "
                         f"sweep.py still writing there); wait for it to end or stop it, or choose "
                         f"another {option}")


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
