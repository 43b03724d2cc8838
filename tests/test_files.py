"""Tests for files.py: a file written whole is the old one or the new one whatever stops its
writer (an error, SIGKILL mid-write); the temporary files of dead writers are removed and a live
writer's kept; writers of one folder take turns; and no module writes a kept file any other way."""
import ast
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path

import pytest

import files
from conftest import finish, start, stop
from files import pid_alive, remove_stale_temps, taking_turns, write_whole

REPO = Path(__file__).resolve().parents[1]


def test_write_whole_replaces_the_file_and_leaves_nothing_beside_it(tmp_path):
    path = tmp_path / 'a.json'
    write_whole(path, lambda f: f.write('old'))
    write_whole(path, lambda f: f.write(b'new'), binary=True)
    assert path.read_text() == 'new' and os.listdir(tmp_path) == ['a.json']


def test_an_error_mid_write_keeps_the_old_file(tmp_path):
    path = tmp_path / 'a.json'
    write_whole(path, lambda f: f.write('old'))

    def half_then_full_disk(f):
        f.write('ne')
        raise OSError(28, 'No space left on device')
    with pytest.raises(OSError, match='No space left'):
        write_whole(path, half_then_full_disk)
    assert path.read_text() == 'old' and os.listdir(tmp_path) == ['a.json']


KILLED_MID_WRITE = """
import os, signal, sys
from files import write_whole
def half_then_killed(f):
    f.write('ne')
    f.flush()
    print(os.getpid(), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
write_whole(sys.argv[1], half_then_killed)
"""


@pytest.mark.skipif(sys.platform == 'win32', reason='no SIGKILL on Windows')
def test_a_writer_killed_mid_write_leaves_the_old_file_and_a_temp_the_next_write_removes(
        tmp_path):
    path = tmp_path / 'a.json'
    write_whole(path, lambda f: f.write('old'))
    r = finish(start([sys.executable, '-c', KILLED_MID_WRITE, path], cwd=REPO), timeout=60)
    assert r.returncode == -signal.SIGKILL, r.stderr
    pid = int(r.stdout)
    tmp = tmp_path / f'a.json.tmp-{socket.gethostname()}-{pid}'
    assert path.read_text() == 'old' and tmp.read_text() == 'ne' and not pid_alive(pid)
    write_whole(path, lambda f: f.write('newer'))      # the next write removes what it left
    assert path.read_text() == 'newer' and os.listdir(tmp_path) == ['a.json']


WRITE_OVER_AND_OVER = """
import json, sys
from files import write_whole
path, tag = sys.argv[1], sys.argv[2]
for i in range(200):
    write_whole(path, lambda f: json.dump({'tag': tag, 'i': i, 'pad': tag * 200_000}, f))
"""


@pytest.mark.skipif(sys.platform == 'win32', reason='os.replace over an open file')
def test_readers_never_see_part_of_a_file_while_two_processes_rewrite_it(tmp_path):
    """Two processes rewrite one 200 kB JSON file 200 times each while this one reads it: every
    read parses, and is one writer's whole file (a write in place would be read half done)."""
    path = tmp_path / 'a.json'
    write_whole(path, lambda f: json.dump({'tag': 'x', 'i': -1, 'pad': ''}, f))
    writers = []
    try:
        for tag in 'ab':
            writers.append(start([sys.executable, '-c', WRITE_OVER_AND_OVER, path, tag], cwd=REPO))
        reads, deadline = 0, time.monotonic() + 60
        while ((any(w.poll() is None for w in writers) or reads == 0)
               and time.monotonic() < deadline):
            got = json.loads(path.read_text())
            assert got['pad'] == got['tag'] * (200_000 if got['i'] >= 0 else 0)
            reads += 1
        assert [finish(w, timeout=60).returncode for w in writers] == [0, 0]
    finally:                            # a failed read or a timeout leaves no writer running
        for w in writers:
            stop(w)
    assert reads > 10 and os.listdir(tmp_path) == ['a.json']


def test_remove_stale_temps_keeps_a_live_writer_s_and_other_names(tmp_path):
    """A pid above Linux's PID_MAX_LIMIT (2**22) never runs; this process and its parent are
    alive (one of this process's threads may be writing). With a name, only that file's temporary
    files are looked at."""
    dead, own, live = (f'x.bin.tmp-{pid}' for pid in (2**22 + 1, os.getpid(), os.getppid()))
    others = ['y.bin.tmp-4194305', 'x.bin.tmp-abc', 'x.bin']
    for name in (dead, own, live, *others):
        (tmp_path / name).write_text('x')
    assert remove_stale_temps(tmp_path, 'x.bin') == [str(tmp_path / dead)]
    assert sorted(os.listdir(tmp_path)) == sorted([own, live, *others])
    assert remove_stale_temps(tmp_path) == [str(tmp_path / 'y.bin.tmp-4194305')]


def test_remove_stale_temps_leaves_another_host_s_temps_alone(tmp_path):
    """On a shared file system a PID says whether a writer lives only on its own host: temporary
    files named by another host are kept, this host's and unnamed ones judged by their PID."""
    dead = 2**22 + 1
    here, there = f'x.bin.tmp-{socket.gethostname()}-{dead}', f'x.bin.tmp-node-7.cluster-{dead}'
    live_here, unnamed = f'x.bin.tmp-{socket.gethostname()}-{os.getpid()}', f'x.bin.tmp-{dead}'
    for name in (here, there, live_here, unnamed):
        (tmp_path / name).write_text('x')
    removed = sorted(str(tmp_path / n) for n in (here, unnamed))
    assert remove_stale_temps(tmp_path, 'x.bin') == removed
    assert sorted(os.listdir(tmp_path)) == sorted([there, live_here])


TRY_LOCK = """
import fcntl, os, sys
try:
    fd = os.open(sys.argv[1], os.O_RDONLY)
except FileNotFoundError:
    print('free')
    sys.exit()
try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    print('free')
except BlockingIOError:
    print('busy')
"""


@pytest.mark.skipif(sys.platform == 'win32', reason='no advisory locks on Windows')
def test_writers_of_one_folder_take_turns(tmp_path):
    """While one process holds taking_turns (a compile cache's save, a prepare), another cannot
    take the lock; released, it can, and the lock file is gone."""
    lock = tmp_path / 'x.lock'

    def other_process():
        r = finish(start([sys.executable, '-c', TRY_LOCK, lock]), timeout=60)
        return r.stdout.strip()
    with taking_turns(lock):
        assert other_process() == 'busy'
    assert other_process() == 'free' and os.listdir(tmp_path) == []


@pytest.mark.skipif(sys.platform == 'win32', reason='no advisory locks on Windows')
def test_a_waiter_whose_lock_file_was_removed_locks_the_path_anew(tmp_path, monkeypatch):
    """A waiter that opened the lock file just before its holder removed it gets the lock on a
    file no longer at the path, which a newcomer could lock too: it must see so and lock the file
    at the path instead."""
    lock, real_open, opened = str(tmp_path / 'x.lock'), os.open, []

    def opened_then_removed_by_the_holder(path, flags, mode=0o777):
        fd = real_open(path, flags, mode)
        if not opened:
            os.unlink(path)
        opened.append(path)
        return fd
    monkeypatch.setattr(files.os, 'open', opened_then_removed_by_the_holder)
    with taking_turns(lock):
        assert len(opened) == 2 and os.path.exists(lock)
    assert os.listdir(tmp_path) == []


def writes_outside_files_py():
    """(file, line) of each call in the repository's modules that writes a file in place: open()
    with a 'w' mode, Path.write_text / write_bytes, or a figure saved to a path (savefig given a
    name, not a file). A file they keep is written through files.write_whole instead. The null
    device is no kept file."""
    found = []
    for path in sorted([*REPO.glob('*.py'), *REPO.glob('data/*.py')]):
        if path.name == 'files.py':
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            called = getattr(node.func, 'id', None) or getattr(node.func, 'attr', None)
            first = ast.unparse(node.args[0]) if node.args else ''
            if called == 'open':
                mode = node.args[1] if len(node.args) > 1 else next(
                    (k.value for k in node.keywords if k.arg == 'mode'), None)
                writes = (isinstance(mode, ast.Constant) and str(mode.value).startswith('w')
                          and 'devnull' not in first)
            else:
                writes = called in ('write_text', 'write_bytes') or (
                    called == 'savefig' and first != 'f')
            if writes:
                found.append((path.name, node.lineno))
    return found


def test_no_module_writes_a_kept_file_in_place():
    assert writes_outside_files_py() == []
