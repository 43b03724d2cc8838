"""A Python that has imported torch once and runs each script it is asked to in a fork of itself:
what a command line `python SCRIPT ARGS...` does, without the 3-4 s that importing torch (and the
compiler stack its optimizers load) costs every such process on a small CPU machine.
tests/test_docs.py runs the documented commands through it.

It reads requests from stdin, one JSON object a line, {"argv": [SCRIPT, ARGS...], "cwd": DIR,
"out": FILE}, and for each forks a child that starts a session of its own, sends its stdout and
stderr to FILE and reads /dev/null, runs SCRIPT as __main__ in DIR with sys.argv = argv (as
`python SCRIPT ARGS...` would: sys.path[0] is the script's folder), and ends as the interpreter
ends a script (exit status from SystemExit, or 1 after a traceback; non-daemon threads joined,
atexit handlers run, output flushed; see end_child for what it leaves out). The parent writes the
child's pid on a line, then its exit status (negative: the signal that ended it) once it ends,
and waits for the next request. Run it with the environment the scripts need: torch reads some
of it when imported.

Only torch and torch._dynamo (with what they import) are in sys.modules before a script starts;
the project's modules are imported by each script from its own folder, as in a fresh process.
Importing them starts no thread and no GPU context (checked at start), so the fork copies a
single-threaded process.
"""
import atexit
import builtins
import ctypes
import importlib.machinery
import io
import json
import os
import sys
import threading
import types

import torch  # noqa: F401  (imported once, here: the point of this process)
import torch._dynamo  # noqa: F401  (torch's optimizers import it when first used: 1-2 s more)


def run_script(argv, cwd, out):
    """In the child: run argv[0] as __main__; the exit status the interpreter would give."""
    os.setsid()
    null = os.open(os.devnull, os.O_RDONLY)
    log = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(null)
    os.close(log)
    os.chdir(cwd)
    # as the interpreter runs a script: __file__ the working folder joined to argv[0] (not
    # normalised), argv[0] as given, sys.path[0] the script's real folder, a fresh __main__
    # module (runpy.run_path would set argv[0] to the path it is given)
    script = os.path.join(os.getcwd(), argv[0])
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.realpath(script))
    main = types.ModuleType('__main__')
    main.__dict__.update(__file__=script, __cached__=None, __builtins__=builtins,
                         __loader__=importlib.machinery.SourceFileLoader('__main__', script))
    sys.modules['__main__'] = main
    try:
        with io.open_code(script) as f:
            code = compile(f.read(), script, 'exec')
        exec(code, main.__dict__)
        return 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)          # sys.exit('message'): printed, status 1
        return 1
    except BaseException:
        kind, error, trace = sys.exc_info()      # shown from the script's frame on, as python
        sys.excepthook(kind, error.with_traceback(trace.tb_next), trace.tb_next)
        return 1


def end_child(status):
    """What the interpreter's exit does that a script can observe: non-daemon threads joined,
    atexit handlers run, Python's and C's output buffers flushed; the status to leave with. Not
    the teardown of modules (1-2 s of a process holding torch, longer than most smoke-sized
    commands): an object still referenced at exit is not finalised, which Python does not promise
    either."""
    try:
        getattr(threading, '_shutdown', lambda: None)()
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        ctypes.CDLL(None).fflush(None)          # printf / std::cout of C and C++ code
    except BaseException:
        return 120 if status == 0 else status   # as python when a flush at exit fails
    return status


def main():
    # single-threaded, no GPU context: what a fork may copy safely
    assert len(os.listdir('/proc/self/task')) == 1, 'importing torch started a thread'
    assert not torch.cuda.is_initialized(), 'importing torch initialised CUDA'
    # (readline reads ahead, but a request comes only after the last one's status is read)
    while line := sys.stdin.readline():
        request = json.loads(line)
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            status = 1
            try:
                status = run_script(request['argv'], request['cwd'], request['out'])
            finally:
                os._exit(end_child(status))
        print(pid, flush=True)
        _, wait_status = os.waitpid(pid, 0)
        print(os.waitstatus_to_exitcode(wait_status), flush=True)


if __name__ == '__main__':
    main()
