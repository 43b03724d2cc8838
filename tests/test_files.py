"""Tests for files.py: a file written whole is the old one or the new one whatever stops its
writer (an error, SIGKILL mid-write); the temporary files of dead writers are removed and a live
writer's kept; writers of one folder take turns; and no module writes a kept file any other way."""
import ast
import os
import signal
import sys
from pathlib import Path

import pytest

from conftest import finish, start
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
def test_a_writer_killed_mid_write_leaves_the_old_file_and_a_temp_that_is_cleaned(tmp_path):
    path = tmp_path / 'a.json'
    write_whole(path, lambda f: f.write('old'))
    r = finish(start([sys.executable, '-c', KILLED_MID_WRITE, path], cwd=REPO), timeout=60)
    assert r.returncode == -signal.SIGKILL, r.stderr
    pid = int(r.stdout)
    tmp = tmp_path / f'a.json.tmp-{pid}'
    assert path.read_text() == 'old' and tmp.read_text() == 'ne' and not pid_alive(pid)
    assert remove_stale_temps(tmp_path) == [str(tmp)]
    assert os.listdir(tmp_path) == ['a.json']


def test_remove_stale_temps_keeps_a_live_writer_s_and_other_names(tmp_path):
    """A pid above Linux's PID_MAX_LIMIT (2**22) never runs; this process is not writing now; the
    parent is alive. With a name, only that file's temporary files are looked at."""
    dead, own, live = (f'x.bin.tmp-{pid}' for pid in (2**22 + 1, os.getpid(), os.getppid()))
    others = ['y.bin.tmp-4194305', 'x.bin.tmp-abc', 'x.bin']
    for name in (dead, own, live, *others):
        (tmp_path / name).write_text('x')
    assert remove_stale_temps(tmp_path, 'x.bin') == sorted(str(tmp_path / n) for n in (dead, own))
    assert sorted(os.listdir(tmp_path)) == sorted([live, *others])
    assert remove_stale_temps(tmp_path) == [str(tmp_path / 'y.bin.tmp-4194305')]


TRY_LOCK = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDONLY)
try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    print('free')
except BlockingIOError:
    print('busy')
"""


@pytest.mark.skipif(sys.platform == 'win32', reason='no advisory locks on Windows')
def test_writers_of_one_folder_take_turns(tmp_path):
    """While one process holds taking_turns on a folder (a compile cache's save, a prepare),
    another cannot take the folder's lock; released, it can. No lock file is left."""
    def other_process():
        r = finish(start([sys.executable, '-c', TRY_LOCK, tmp_path]), timeout=60)
        return r.stdout.strip()
    with taking_turns(str(tmp_path)):
        assert other_process() == 'busy'
    assert other_process() == 'free' and os.listdir(tmp_path) == []


def writes_opened_outside_files_py():
    """(file, line) of each open(..., 'w…') call in the repository's modules: a file they keep is
    written through files.write_whole instead. The null device is no kept file."""
    found = []
    for path in sorted([*REPO.glob('*.py'), *REPO.glob('data/*.py')]):
        if path.name == 'files.py':
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and getattr(node.func, 'id', None) == 'open'):
                continue
            mode = node.args[1] if len(node.args) > 1 else next(
                (k.value for k in node.keywords if k.arg == 'mode'), None)
            if (isinstance(mode, ast.Constant) and str(mode.value).startswith('w')
                    and 'devnull' not in ast.unparse(node.args[0])):
                found.append((path.name, node.lineno))
    return found


def test_no_module_writes_a_kept_file_in_place():
    assert writes_opened_outside_files_py() == []
