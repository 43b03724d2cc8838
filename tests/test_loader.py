"""data/loader.py's sampler: every window once per epoch, stateless batches, DDP ranks that read
what accumulation reads, fixed eval batches."""
import os
import tempfile

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from data import loader

@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(block_size=st.integers(1, 24), batch_size=st.integers(1, 6), seed=st.integers(0, 2**20),
       extra=st.integers(0, 400), wide=st.booleans())
def test_batches_epochs_ranks_and_shift(block_size, batch_size, seed, extra, wide):
    n = 2 * block_size + 1 + extra                   # at least one window
    dtype = np.uint32 if wide else np.uint16
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "tok.bin")
        data = (np.arange(n) % 60000).astype(dtype)  # token value == position: x[0] gives the start
        data.tofile(path)
        cpu = torch.device("cpu")
        b = loader.Batches(path, dtype, block_size, batch_size, seed, cpu)
        n_win = b.n_windows
        assert n_win == (n - block_size) // block_size >= 1

        # rows of 3 epochs: within an epoch, the starts are exactly {k*T + shift}, each once
        rows_needed = 3 * n_win
        n_batches = -(-rows_needed // batch_size)
        starts = np.concatenate([b.starts(j) for j in range(n_batches)])
        for e in range(3):
            ep = starts[e * n_win:(e + 1) * n_win]
            assert len(set(ep.tolist())) == n_win, "a window repeats within an epoch"
            shift = int(ep[0]) % block_size
            assert sorted(ep.tolist()) == [k * block_size + shift for k in range(n_win)]
        assert (starts >= 0).all() and (starts + block_size + 1 <= n).all()

        # stateless: a fresh sampler, queried out of order, agrees
        b2 = loader.Batches(path, dtype, block_size, batch_size, seed, cpu)
        for j in reversed(range(n_batches)):
            assert np.array_equal(b2.starts(j), starts[j * batch_size:(j + 1) * batch_size])

        # x/y are the file's windows, y shifted by one
        for j in range(min(n_batches, 4)):
            x, y = b.get(j)
            assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (
                batch_size,
                block_size,
            )
            s = b.starts(j)
            assert torch.equal(
                x, torch.tensor(np.stack([data[i : i + block_size] for i in s]).astype(np.int64))
            )
            assert torch.equal(y[:, :-1], x[:, 1:])
            assert torch.equal(y[:, -1], torch.tensor(data[s + block_size].astype(np.int64)))

        # 2 ranks x accumulation 1 read exactly what 1 rank x accumulation 2 reads, iteration by
        # iteration (train.py's index: j = (iter*accum + micro)*world + rank), and ranks never share
        # a row
        def read(world, accum, iters=3):
            out = []
            for it in range(iters):
                per_iter = {}
                for rank in range(world):
                    for micro in range(accum):
                        j = (it * accum + micro) * world + rank
                        per_iter[(rank, micro)] = tuple(b.starts(j).tolist())
                out.append(per_iter)
            return out
        ddp, single = read(2, 1), read(1, 2)
        for it in range(3):
            assert sorted(ddp[it].values()) == sorted(single[it].values())
            assert ddp[it][(0, 0)] == single[it][(0, 0)] and ddp[it][(1, 0)] == single[it][(0, 1)]
        # world 2, accum 2
        js = [(it * 2 + m) * 2 + r for it in range(5) for m in range(2) for r in range(2)]
        assert sorted(js) == list(range(20))          # every micro-batch index exactly once

        # eval batches: fixed, in range, and different per split seed
        ev = b.eval_batches(3, 1)
        assert all(np.array_equal(u, v) for u, v in zip(ev, b2.eval_batches(3, 1)))
        for s in ev:
            assert s.shape == (batch_size,) and (s >= 0).all() and (s + block_size + 1 <= n).all()


def test_batches_rejects_too_short_file(tmp_path):
    path = tmp_path / "tok.bin"
    np.arange(63, dtype=np.uint16).tofile(path)
    with pytest.raises(loader.DataError, match=r"holds 63 tokens, too few for block_size=32 "
                       r"\(a window at every shift needs 64\): lower --block_size"):
        loader.Batches(str(path), np.uint16, 32, 4, 0, torch.device("cpu"))
    # a window of T + 1 tokens at a shift of up to T - 1: 2T tokens hold one window
    np.arange(64, dtype=np.uint16).tofile(path)
    assert loader.Batches(str(path), np.uint16, 32, 4, 0, torch.device("cpu")).n_windows == 1


@pytest.mark.parametrize("n", [8, 11, 12, 13, 40])
def test_eval_windows_start_wherever_a_window_fits(tmp_path, n):
    """T = 4: eval starts cover 0 .. n - T - 1, every start whose T + 1 tokens fit, so every token
    can be a target; a split of one training window's worth (n < 3T) is not evaluated on one
    window again and again."""
    path = tmp_path / "tok.bin"
    np.arange(n, dtype=np.uint16).tofile(path)
    b = loader.Batches(str(path), np.uint16, 4, 64, 0, torch.device("cpu"))
    starts = np.concatenate(b.eval_batches(20, 2))
    assert sorted(set(starts.tolist())) == list(range(n - 4))
    x, y = b.fetch(starts)
    assert int(y.max()) == n - 1 and torch.equal(x[:, 1:], y[:, :-1])


@pytest.mark.parametrize("n, windows", [(12, 2), (13, 2), (15, 2), (16, 3)])
def test_every_window_that_fits_every_shift_is_read(tmp_path, n, windows):
    """n tokens, T = 4: k windows at starts k*T + shift (shift < T) read up to token k*T + 2T - 1,
    so the file holds (n - T) // T of them: a file of 12 is read to its last token."""
    path = tmp_path / "tok.bin"
    np.arange(n, dtype=np.uint16).tofile(path)
    b = loader.Batches(str(path), np.uint16, 4, 1, 0, torch.device("cpu"))
    assert b.n_windows == windows
    starts = np.concatenate([b.starts(j) for j in range(200 * windows)])
    assert starts.max() + 4 + 1 <= n
    read = set()
    for s in starts.tolist():
        read.update(range(s, s + 5))
    assert max(read) == windows * 4 + 3                # the last window at the largest shift
    assert (max(read) == n - 1) == (n % 4 == 0)


def test_batches_seed_changes_order(tmp_path):
    path = tmp_path / "tok.bin"
    np.arange(5000, dtype=np.uint16).tofile(path)
    a = loader.Batches(str(path), np.uint16, 16, 8, 1, torch.device("cpu"))
    b = loader.Batches(str(path), np.uint16, 16, 8, 2, torch.device("cpu"))
    assert not all(np.array_equal(a.starts(j), b.starts(j)) for j in range(4))


def test_a_loss_mask_counts_answers_whose_prompt_is_in_the_window(tmp_path):
    """'12+3=15\n' problems: targets are the answer tokens (mask 1) after a prompt that starts
    inside the window; every other target is -1, which the loss ignores."""
    line_mask = [0] * 5 + [1] * 3                              # "12+3=" then "15\n"
    mask = np.array(line_mask * 20, dtype=np.uint8)
    tokens = np.arange(len(mask), dtype=np.uint16)
    tokens.tofile(tmp_path / "tok.bin")
    mask.tofile(tmp_path / "mask.bin")
    b = loader.Batches(str(tmp_path / "tok.bin"), np.uint16, 12, 1, 0, torch.device("cpu"),
                       mask_path=str(tmp_path / "mask.bin"))
    for s in (0, 3, 5, 8, 13):
        x, y = b.fetch([s])
        got = [t for t in range(12) if y[0, t] != -1]
        first = next(p for p in range(12) if mask[s + p] == 0 and (s + p == 0 or mask[s + p - 1]))
        want = [t for t in range(12) if mask[s + 1 + t] == 1 and t >= first]
        assert got == want and got, (s, got, want)
        assert y[0, got].tolist() == [s + 1 + t for t in got]      # the true targets, unmoved
    # a window cut through a prompt (s = 3: '3=' of the first problem) counts none of its answer
    assert b.fetch([3])[1][0, :4].tolist() == [-1] * 4
