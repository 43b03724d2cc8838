"""progress.py: items pass through unchanged; nothing is drawn off a terminal, with quiet, or
without tqdm; on a (fake) terminal a bar goes to stderr and stdout gets only what is printed."""
import io
import sys

import pytest

import progress


class FakeTTY(io.StringIO):
    def isatty(self):
        return True


def test_off_a_terminal_the_iterable_itself_comes_back_and_nothing_is_written(monkeypatch):
    out, err = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, 'stdout', out)
    monkeypatch.setattr(sys, 'stderr', err)
    items = [3, 1, 2]
    assert progress.progress(items, desc='x') is items
    b = progress.bar(3, desc='runs')
    b.update(1)
    b.set_postfix_str('ETA 1s')
    b.write('done: a')
    b.close()
    assert out.getvalue() == 'done: a\n' and err.getvalue() == ''


@pytest.mark.parametrize('where', ['stdout', 'quiet', 'no_tqdm'])
def test_each_reason_to_stay_quiet_draws_nothing(monkeypatch, where):
    monkeypatch.setattr(sys, 'stdout', io.StringIO() if where == 'stdout' else FakeTTY())
    monkeypatch.setattr(sys, 'stderr', FakeTTY())
    if where == 'no_tqdm':
        monkeypatch.setitem(sys.modules, 'tqdm', None)     # import tqdm raises ImportError
    items = iter(range(4))
    assert progress.progress(items, total=4, quiet=where == 'quiet') is items
    assert list(items) == [0, 1, 2, 3] and sys.stderr.getvalue() == ''


def test_on_a_terminal_a_bar_goes_to_stderr_and_the_items_are_the_same(monkeypatch):
    pytest.importorskip('tqdm')
    out, err = FakeTTY(), FakeTTY()
    monkeypatch.setattr(sys, 'stdout', out)
    monkeypatch.setattr(sys, 'stderr', err)
    assert list(progress.progress(['a', 'b', 'c'], desc='tokenise')) == ['a', 'b', 'c']
    # tqdm draws at the start, then at most every 0.1 s; leave=False clears the line at the end
    assert 'tokenise:   0%' in err.getvalue() and '0/3' in err.getvalue()
    assert out.getvalue() == ''
    b = progress.bar(2, desc='runs')
    b.update(1)
    b.write('done: one')
    b.close()
    assert '0/2' in err.getvalue() and 'done: one\n' in out.getvalue()
    assert 'runs' not in out.getvalue()
