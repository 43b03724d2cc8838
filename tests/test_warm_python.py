"""tests/warm_python.py, which runs the documented commands for tests/test_docs.py, against the
independent reference it stands in for: the same script run by a fresh `python SCRIPT ARGS...`.
What a script can see of how it was started (argv, sys.path[0], __name__, __file__, the working
folder, its session, stdin, its open files, the project's modules not yet imported) and how it
ends (exit status, traceback, atexit handlers, non-daemon threads) must be the same, and an
overrunning script must be ended with everything it started."""
import os
import subprocess
import sys
import time

import pytest
from conftest import run_group
from test_docs import WarmPython

PROBE = r'''
import atexit, os, sys, threading, time
print('argv', sys.argv)
print('path0', sys.path[0])
print('name', __name__, 'file', __file__)
print('cwd', os.getcwd())
print('own session', os.getsid(0) == os.getpid())
print('stdin', repr(sys.stdin.read()))
print('open files', sorted(int(fd) for fd in os.listdir('/proc/self/fd')))
print('project modules', sorted(m for m in ('model', 'train', 'configurator') if m in sys.modules))
helper = __import__('helper')     # from the script's folder, which python puts first on the path
print('helper', helper.WHERE)
atexit.register(lambda: print('atexit ran', flush=True))
threading.Thread(target=lambda: (time.sleep(0.3), print('thread ended', flush=True))).start()
how = sys.argv[1]
if how == 'raise':
    raise ValueError('probe failed')
if how == 'message':
    sys.exit('a message to stderr')
if how == 'leave':                  # a process the script starts and leaves running
    import subprocess
    child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])
    print('child', child.pid, flush=True)
    sys.exit(0)
if how == 'child':                  # a process the script starts, left running: ended with it
    import subprocess
    child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])
    print('child', child.pid, flush=True)
    time.sleep(600)
sys.exit(int(how))
'''


ENV = {**os.environ, 'OMP_NUM_THREADS': '1'}


@pytest.fixture(scope='module')
def probe(tmp_path_factory):
    """(the probe script, a working folder beside its folder, a WarmPython) for the module."""
    root = tmp_path_factory.mktemp('warm')
    (root / 'scripts').mkdir()
    (root / 'scripts' / 'probe.py').write_text(PROBE)
    (root / 'scripts' / 'helper.py').write_text("WHERE = 'the script folder'\n")
    (root / 'work').mkdir()
    warm = WarmPython(root, ENV)
    try:
        yield root / 'scripts' / 'probe.py', root / 'work', warm
    finally:
        warm.close()


@pytest.mark.parametrize('how', ['0', '3', 'raise', 'message'])
def test_a_script_run_warm_sees_and_ends_as_in_a_fresh_python(probe, how):
    script, work, warm = probe
    argv = [os.path.relpath(script, work), how]
    fresh = run_group([sys.executable, *argv], 120, cwd=work, env=ENV, stdin=subprocess.DEVNULL)
    status, out = warm.run(argv, work, 'probe')
    want = {'0': 0, '3': 3, 'raise': 1, 'message': 1}[how]
    assert (fresh.returncode, status) == (want, want)
    # stdout then stderr in the fresh run; one file, in the order written, in the warm one
    assert sorted(out.splitlines()) == sorted((fresh.stdout + fresh.stderr).splitlines())
    assert f"argv {argv}" in out and 'own session True' in out and "stdin ''" in out
    assert 'project modules []' in out and 'atexit ran' in out and 'thread ended' in out
    assert ('ValueError: probe failed' in out) == (how == 'raise')
    assert ('a message to stderr' in out) == (how == 'message')


def test_an_overrunning_script_is_ended_with_what_it_started(probe, monkeypatch):
    """A script past the time limit: the test fails naming it, neither the script nor the
    process it started is left running, and the warm process serves the next command."""
    import test_docs
    script, work, warm = probe
    monkeypatch.setattr(test_docs, 'TIMEOUT_S', 3)
    began = time.time()
    with pytest.raises(pytest.fail.Exception, match='probe child ran past 3 s') as failed:
        warm.run([str(script), 'child'], work, 'probe child')
    assert time.time() - began < 30
    child = int(str(failed.value).split('child ')[-1].split()[0])
    assert not os.path.exists(f'/proc/{child}') or open(f'/proc/{child}/stat').read().split(
        ')')[-1].split()[0] == 'Z'
    status, out = warm.run([str(script), '0'], work, 'probe again')
    assert status == 0 and 'atexit ran' in out


def test_a_script_that_leaves_a_process_running_fails(probe):
    """A script that exits 0 but leaves a process it started running fails (a fresh process's
    output pipe would stay open until that one ended), and the process is ended."""
    script, work, warm = probe
    with pytest.raises(pytest.fail.Exception, match=r'probe leave exited \(0\) but left') as e:
        warm.run([str(script), 'leave'], work, 'probe leave')
    child = int(str(e.value).split('[')[1].split(']')[0].split(',')[0])
    deadline = time.time() + 10
    while os.path.exists(f'/proc/{child}') and open(f'/proc/{child}/stat').read().split(
            ')')[-1].split()[0] != 'Z' and time.time() < deadline:
        time.sleep(0.1)
    assert time.time() < deadline
    assert warm.run([str(script), '0'], work, 'probe again')[0] == 0
