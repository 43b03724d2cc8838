"""
Progress bars for work that runs more than a few seconds without a log line (data preparation,
sweeps, long evaluations, benchmark suites), drawn by tqdm on stderr.

A bar is shown only where a person watches: tqdm installed, stdout and stderr both terminals, and
the script's --quiet=True not given. Otherwise progress() returns its iterable unchanged and bar()
a stand-in that draws nothing, so redirected output, logs, metrics and result files never hold a
bar (stdout stays clean for --json either way: the bar goes to stderr).
"""
import sys


def shown(quiet=False):
    """Whether a bar would be drawn now."""
    if quiet or not (_is_tty(sys.stdout) and _is_tty(sys.stderr)):
        return False
    try:
        import tqdm  # noqa: F401
    except ImportError:         # optional: without it the work runs the same, without a bar
        return False
    return True


def _is_tty(stream):
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):      # a replaced or closed stream
        return False


def progress(iterable, total=None, desc=None, quiet=False):
    """iterable itself, or the same items under a tqdm bar on stderr (see shown())."""
    if not shown(quiet):
        return iterable
    from tqdm import tqdm
    return tqdm(iterable, total=total, desc=desc, file=sys.stderr, dynamic_ncols=True,
                leave=False)


class NoBar:
    """What bar() gives where no bar is drawn: the same calls, drawing nothing; write() prints."""

    def update(self, n=1):
        pass

    def set_postfix_str(self, text):
        pass

    def write(self, line):
        print(line, flush=True)

    def close(self):
        pass


def bar(total, desc=None, quiet=False):
    """A bar advanced by hand (update(n), set_postfix_str(text)), for work that finishes out of
    order; its write(line) prints a line above the bar without tearing it."""
    if not shown(quiet):
        return NoBar()
    from tqdm import tqdm
    b = tqdm(total=total, desc=desc, file=sys.stderr, dynamic_ncols=True, leave=False)
    b.write = lambda line: tqdm.write(line, file=sys.stdout)
    return b
