"""runlock: one writer per run folder. A held folder refuses a second lock naming the holder's host
and PID; the kernel drops the lock of a holder killed by SIGKILL; a released lock leaves no lock
file and no folder it created; a folder without flock is used unlocked, with a note; sweep.py
refuses an out_root another process holds before it runs anything. The helpers that start processes
(conftest) end everything they started, and the session check finds a process left running.
train.py's own lock is tested in test_train.py."""
import errno
import os
import re
import select
import signal
import socket
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
import files  # noqa: E402
import runlock  # noqa: E402
import sweep  # noqa: E402
from conftest import (_signal_all, leftover_processes, run_group, start,  # noqa: E402
                      started, stop, tagged_processes)
HOLD = "import sys, time; sys.path.insert(0, {repo!r}); import runlock; " \
       "lock = runlock.lock_folder({folder!r}); print('held', flush=True); time.sleep(600)"


def hold_in_another_process(folder):
    """A process holding folder's lock (started by conftest.start: end it with stop)."""
    proc = start([sys.executable, "-c", HOLD.format(repo=str(REPO), folder=str(folder))])
    expect_line(proc, "held")
    return proc


def expect_line(proc, want, timeout=60):
    """Wait up to timeout s for proc's first stdout line, which must be want; else proc and all it
    started are ended and the test fails, showing its stderr (a process that hangs without
    printing must not hang the test). The first read only: select sees the pipe, not the lines
    a readline left in the buffer."""
    line = None
    try:
        if select.select([proc.stdout], [], [], timeout)[0]:
            line = proc.stdout.readline().strip()
            if line == want:
                return
        _signal_all(proc, signal.SIGKILL)
        err = proc.communicate(timeout=10)[1]
    except BaseException:
        stop(proc)
        raise
    stop(proc)
    pytest.fail(f"{proc.args}: expected {want!r} within {timeout} s, got {line!r}; stderr: {err}")


def test_second_lock_is_refused_naming_the_holder(tmp_path):
    hold = HOLD.format(repo=str(REPO), folder=str(tmp_path / "run"))
    with started([sys.executable, "-c", hold]) as holder:
        expect_line(holder, "held")
        with pytest.raises(runlock.FolderBusy) as e:
            runlock.lock_folder(tmp_path / "run", "out_dir")
        assert (e.value.pid, e.value.host) == (holder.pid, socket.gethostname())
        assert str(e.value) == (f"out_dir {tmp_path / 'run'} is in use by another run (PID "
                                f"{holder.pid} on {socket.gethostname()}, a train.py or sweep.py "
                                f"still writing there); wait for it to end or stop it, or choose "
                                f"another out_dir")


def test_a_folder_that_cannot_be_one_is_named_for_what_it_is(tmp_path):
    """A path through a file, a link to nowhere and an empty name are refused as such, before the
    lock file is tried (whose error, 'cannot create the lock file ... (File exists)', named none of
    them), and nothing is created."""
    (tmp_path / "afile").write_text("x")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    for folder, message in [
        (tmp_path / "afile" / "run", f"--out_dir={tmp_path / 'afile' / 'run'} cannot be created: "
                                     f"{tmp_path / 'afile'} is a file"),
        (tmp_path / "dangling", f"--out_dir={tmp_path / 'dangling'} is a link to "
                                f"{tmp_path / 'nowhere'}, which does not exist"),
        ("", "--out_dir=: empty; name a folder")]:
        with pytest.raises(runlock.UserError) as e:
            runlock.lock_folder(str(folder), 'out_dir')
        assert str(e.value).startswith(message), str(e.value)
    assert sorted(os.listdir(tmp_path)) == ["afile", "dangling"]


def test_a_holder_on_another_host_is_named_by_host_and_pid(tmp_path):
    """On a shared file system the holder's PID alone names no process: the message names its
    host too."""
    fd = os.open(tmp_path / runlock.LOCK_NAME, os.O_RDWR | os.O_CREAT)
    try:
        files.fcntl.flock(fd, files.fcntl.LOCK_EX)
        os.write(fd, b"4242 node-7.cluster\n")
        with pytest.raises(runlock.FolderBusy) as e:
            runlock.lock_folder(tmp_path)
        assert (e.value.pid, e.value.host) == (4242, "node-7.cluster")
        assert f"{tmp_path} is in use by another run (PID 4242 on node-7.cluster, " in str(e.value)
    finally:
        os.close(fd)


def test_a_folder_that_cannot_be_locked_is_used_unlocked_with_a_note(tmp_path, monkeypatch,
                                                                     capsys):
    """A file system without flock (some NFS mounts): the run goes on, saying once that the folder
    is not locked and why."""
    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")
    monkeypatch.setattr(files.fcntl, "flock", no_locks)
    lock = runlock.lock_folder(tmp_path / "run", "out_dir")
    assert lock.fd is None
    out, err = capsys.readouterr()
    assert out == "" and err == (f"note: out_dir {tmp_path / 'run'} could not be locked (flock: No "
                                 f"locks available); a second run writing there at the same time "
                                 f"would not be refused\n")
    lock.release()


def test_release_without_flock_removes_the_lock_file_while_it_is_ours(tmp_path, monkeypatch):
    """Without flock the lock file is still made, naming this process: release removes it, and a
    folder the lock made and left empty, as with flock; a lock file that another writer (unlocked
    too) has since rewritten or replaced is left to it."""
    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")
    monkeypatch.setattr(files.fcntl, "flock", no_locks)
    mine = f"{os.getpid()} {socket.gethostname()}\n"
    lock = runlock.lock_folder(tmp_path / "new", "out_dir")
    assert (tmp_path / "new" / runlock.LOCK_NAME).read_text() == mine
    lock.release()
    assert not (tmp_path / "new").exists()
    kept = tmp_path / "kept"
    lock = runlock.lock_folder(kept)
    (kept / "metrics.jsonl").write_text("{}\n")
    lock.release()
    lock.release()                                      # (a second release does nothing)
    assert os.listdir(kept) == ["metrics.jsonl"]
    lock = runlock.lock_folder(kept)
    (kept / runlock.LOCK_NAME).write_text("4242 node-7.cluster\n")     # rewritten by another
    lock.release()
    assert (kept / runlock.LOCK_NAME).read_text() == "4242 node-7.cluster\n"
    lock = runlock.lock_folder(kept)                    # and a file put in its place (made
    (kept / "new.lock").write_text(mine)                # first: its inode is not the old one's)
    os.replace(kept / "new.lock", kept / runlock.LOCK_NAME)
    lock.release()
    assert (kept / runlock.LOCK_NAME).read_text() == mine


def test_a_folder_inside_a_held_one_is_refused_but_for_the_holding_sweeps_own_runs(
        tmp_path, monkeypatch):
    """A train.py into a run folder of a running sweep (or inside another run's out_dir) would
    write where the holder writes, and the sweep would summarise that run as its own: refused,
    naming the folder above and its holder. The sweep's own runs (its out_root in the
    environment) pass, and so does everyone once the holder has died."""
    root = tmp_path / "study"
    holder = hold_in_another_process(root)
    try:
        inside = root / "arm" / "seed1"
        with pytest.raises(runlock.FolderBusy) as e:
            runlock.lock_folder(inside, "out_dir")
        assert str(e.value).startswith(
            f"out_dir {inside} is inside {root}, which another run holds (PID {holder.pid} on "
            f"{socket.gethostname()}: a sweep.py's out_root")
        assert not inside.exists()
        monkeypatch.setenv(runlock.SWEEP_ROOT_ENV, os.path.realpath(root))
        runlock.lock_folder(inside, "out_dir").release()
        monkeypatch.delenv(runlock.SWEEP_ROOT_ENV)
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(timeout=30)
    finally:
        stop(holder)
    assert (root / runlock.LOCK_NAME).exists()          # a dead holder's file: no longer held
    runlock.lock_folder(inside, "out_dir").release()


def test_a_lock_above_is_judged_by_its_flock_and_without_flock_by_its_pid(tmp_path, monkeypatch):
    """A .lock above whose flock nobody holds is not held, whatever PID it names (a dead holder's
    PID may be another process's by now: here this test's own). Without flock, a live PID on this
    host, or any PID of another host (which says nothing here), counts as held. A .lock with a PID
    alone is another tool's (pytest keeps one in its temporary folders)."""
    lock, mine = tmp_path / runlock.LOCK_NAME, f"{os.getpid()} {socket.gethostname()}\n"
    for text in (mine, "4242 another-host\n", f"{os.getpid()}\n"):
        lock.write_text(text)
        runlock.lock_folder(tmp_path / "a", "out_dir").release()
    monkeypatch.setattr(runlock, "flock_held", lambda path: None)
    for text, named in ((mine, f"PID {os.getpid()} on {socket.gethostname()}"),
                        ("4242 another-host\n", "PID 4242 on another-host")):
        lock.write_text(text)
        with pytest.raises(runlock.FolderBusy, match=re.escape(f"({named}: ") + r".*\(if it "
                           r"has, remove .*\.lock\)$"):
            runlock.lock_folder(tmp_path / "a", "out_dir")
    lock.write_text(f"{os.getpid()}\n")
    runlock.lock_folder(tmp_path / "a", "out_dir").release()


def test_lock_is_released_when_the_holder_is_killed(tmp_path):
    holder = hold_in_another_process(tmp_path)
    try:
        with pytest.raises(runlock.FolderBusy):
            runlock.lock_folder(tmp_path)
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(timeout=30)
    finally:
        stop(holder)
    assert (tmp_path / runlock.LOCK_NAME).exists()      # left by the killed holder: reused
    lock = runlock.lock_folder(tmp_path)
    assert (tmp_path / runlock.LOCK_NAME).read_text() == f"{os.getpid()} {socket.gethostname()}\n"
    lock.release()


def test_release_removes_the_lock_file_and_a_folder_left_empty(tmp_path):
    lock = runlock.lock_folder(tmp_path / "new", "out_dir")
    assert (tmp_path / "new" / runlock.LOCK_NAME).exists()
    lock.release()
    assert not (tmp_path / "new").exists()      # created by the lock and left empty: removed
    lock = runlock.lock_folder(tmp_path / "a" / "b")    # a parent made for it stays: another
    lock.release()                              # process may be about to write under it
    assert os.listdir(tmp_path / "a") == []
    lock = runlock.lock_folder(tmp_path / "kept")
    (tmp_path / "kept" / "metrics.jsonl").write_text("{}\n")
    lock.release()
    assert os.listdir(tmp_path / "kept") == ["metrics.jsonl"]
    again = runlock.lock_folder(tmp_path / "kept")          # released: free for the next writer
    again.release()


def test_a_lock_file_unlinked_under_a_contender_is_not_shared(tmp_path, monkeypatch):
    """A contender that opened the lock file just before the holder released (and unlinked) it locks
    an unlinked file: it must notice and lock the file at the path instead, or a third writer that
    creates a new lock file would hold the folder at the same time."""
    first = runlock.lock_folder(tmp_path)
    real_flock, calls = files.fcntl.flock, []

    def flock_after_release(fd, op):          # the holder releases between our open() and flock()
        calls.append(fd)
        if len(calls) == 1:
            first.release()
        return real_flock(fd, op)
    monkeypatch.setattr(files.fcntl, "flock", flock_after_release)
    second = runlock.lock_folder(tmp_path)
    assert len(calls) == 2                    # the first file was stale: it opened the path again
    assert os.path.samestat(os.fstat(second.fd), os.stat(tmp_path / runlock.LOCK_NAME))
    monkeypatch.undo()
    with pytest.raises(runlock.FolderBusy):   # and it is the lock a third writer meets
        runlock.lock_folder(tmp_path)
    second.release()


STUDY = """
base = {base!r}
arms = {{'a': []}}
seeds = [1]
out_root = {root!r}
reference = 'a'
"""


def test_sweep_refuses_an_out_root_another_process_holds(tmp_path, monkeypatch):
    """A second sweep into one out_root: exit 2 naming the folder and the holder, no run started, no
    file written."""
    root = tmp_path / "study"
    study = tmp_path / "study_x.py"
    base = REPO / "config" / "exit_synthetic.py"
    study.write_text(textwrap.dedent(STUDY.format(base=str(base), root=str(root))))
    runs = []
    monkeypatch.setattr(sweep, "run_one", lambda *a, **kw: runs.append(a) or (a[1], 0))
    holder = hold_in_another_process(root)
    try:
        before = sorted(p.name for p in root.iterdir())
        busy = rf"out_root {root} is in use by another run \(PID {holder.pid} on "
        with pytest.raises(runlock.FolderBusy, match=busy):
            sweep.main([str(study), "--no_plots"])
        r = run_group([sys.executable, "sweep.py", study, "--no_plots"], 120, cwd=REPO)
        assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
        assert r.stderr.startswith(f"error: out_root {root} is in use by another run "
                                   f"(PID {holder.pid} on {socket.gethostname()},")
        assert runs == [] and sorted(p.name for p in root.iterdir()) == before
    finally:
        stop(holder)


# --------------------------------------------------------------------------------------------------
# conftest's process helpers

ESCAPES = ("import signal, subprocess, sys, time\n"
           "subprocess.Popen([sys.executable, '-c', 'import signal, time; "
           "signal.signal(signal.SIGTERM, signal.SIG_IGN); print(1, flush=True); "
           "time.sleep(600)'], "
           "start_new_session=True)\n"
           "time.sleep(600)\n")


def test_stop_ends_a_descendant_that_left_the_group_and_ignores_sigterm():
    """Like a hung torchrun worker: its own session, deaf to SIGTERM; stop() still ends it."""
    proc = start([sys.executable, "-c", ESCAPES])
    try:
        expect_line(proc, "1")                            # the descendant now ignores SIGTERM
        assert len(tagged_processes("NANODEPTH_TEST_GROUP", proc.group_tag)) == 2
    finally:
        stop(proc, grace=1)
    assert tagged_processes("NANODEPTH_TEST_GROUP", proc.group_tag) == []


def test_run_group_timeout_ends_everything():
    escapes = ESCAPES.replace("signal.signal(signal.SIGTERM, signal.SIG_IGN); ", "")   # not deaf
    with pytest.raises(Exception) as e:
        run_group([sys.executable, "-c", escapes], 2)
    assert type(e.value).__name__ == "TimeoutExpired"
    assert leftover_processes() == []


def test_a_command_that_exits_leaving_a_process_fails():
    leaves = ("import subprocess, sys\n"
              "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], "
              "start_new_session=True)\n")
    with pytest.raises(AssertionError, match="but left"):
        run_group([sys.executable, "-c", leaves], 60)
    assert leftover_processes() == []


LEAKS = """
import subprocess, sys
def test_leaks():
    subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], start_new_session=True)
"""


def test_session_check_fails_a_run_that_leaves_a_process(tmp_path):
    """A pytest run whose test starts a process and leaves it: the run fails at its end, saying so,
    and the process is killed."""
    (tmp_path / "test_leak.py").write_text(LEAKS)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parent))
    r = run_group([sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider",
                   tmp_path / "test_leak.py"], 120, cwd=tmp_path, env=env)
    assert r.returncode == 1, r.stdout[-3000:]
    assert "1 passed" in r.stdout
    assert "1 process(es) started by the tests were still running at the end of the session" \
        in r.stdout
    assert "time.sleep(600)" in r.stdout
    assert leftover_processes() == []       # (torch.compile's worker pool is not a leak)
