"""packed_attention.py: causal attention among the packed selected tokens of several sequences
equals, on every selected token, attention computed on its whole sequence with only the selected
tokens as keys (ragged counts: none, one, all), on every backend the CPU runs (sdpa, flex, varlen
through a stand-in); the rows past the count come out as zeros whatever they held; the varlen
adapter builds the right call for each of the three varlen_attn signatures; the backend choice is a
pure function tested over a table."""
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import packed_attention
from conftest import SETTINGS
from routed_rows import sort_by_mask
from packed_attention import choose_backend, packed_causal_attention, varlen_call

pytestmark = pytest.mark.usefixtures('one_thread')      # tiny ops: see conftest.py

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def masked_full_attention(q, k, v, mask, scale=None):
    """The independent reference: per sequence, attention over the whole sequence (B, T, H, D)
    with the keys restricted to the selected tokens at positions <= the query's, in fp32; the rows
    of unselected queries are zeros."""
    B, T = mask.shape
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    out = torch.zeros(q.shape, dtype=torch.float32)
    for b in range(B):
        keys = causal & mask[b][None, :]
        keys = keys | torch.eye(T, dtype=torch.bool)         # unselected queries: dropped below
        y = F.scaled_dot_product_attention(
            *(t[b].float().transpose(0, 1) for t in (q, k, v)), attn_mask=keys, scale=scale)
        out[b] = torch.where(mask[b][:, None, None], y.transpose(0, 1), 0.0)
    return out


def pack(q, k, v, mask, offset):
    """The selected tokens of every sequence first, contiguously, in original order (as route_mod
    packs them), with sequence ids, positions (row b at offset[b] + 0..T-1) and cu_seq; the rows
    past the count hold NaN."""
    B, T = mask.shape
    order, count = sort_by_mask(mask.flatten())
    valid = (torch.arange(B * T) < count)[:, None, None]
    qp, kp, vp = (torch.where(valid, t.reshape(B * T, *t.shape[2:])[order], math.nan)
                  for t in (q, k, v))
    pos = (offset[:, None] + torch.arange(T)).flatten()[order]
    cu_seq = F.pad(mask.sum(1).cumsum(0), (1, 0))
    return qp, kp, vp, order // T, pos, count, cu_seq, order


def unpack(y, order, mask):
    B, T = mask.shape
    out = torch.zeros(B * T, *y.shape[1:], dtype=torch.float32)
    out[order] = y.float()
    return out.view(B, T, *y.shape[1:])


def draw_mask(B, T, kinds, seed):
    """Row b: 'none', 'one', 'all' selected, or 'random'."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for kind in kinds[:B] + ['random'] * (B - len(kinds)):
        if kind == 'one':
            rows.append(torch.arange(T) == int(torch.randint(0, T, (1,), generator=g)))
        else:
            rows.append(torch.full((T,), kind == 'all') if kind in ('none', 'all')
                        else torch.rand(T, generator=g) < 0.5)
    return torch.stack(rows)


def run(backend, *args, **kw):
    with warnings.catch_warnings():         # eager FlexAttention on the CPU warns it materialises
        warnings.simplefilter('ignore')
        return packed_causal_attention(*args, backend=backend, **kw)


@settings(**SETTINGS)
@given(seed=st.integers(0, 999), B=st.integers(1, 4), T=st.integers(1, 12), H=st.integers(1, 3),
       D=st.sampled_from([8, 16]), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       kinds=st.lists(st.sampled_from(['none', 'one', 'all', 'random']), max_size=4),
       backend=st.sampled_from(['sdpa', 'flex', 'varlen']))
def test_packed_attention_equals_masked_attention_on_the_full_sequences(
        seed, B, T, H, D, dtype, kinds, backend):
    """Every selected token's output equals attention over its whole sequence with the selected
    tokens as the only keys, for ragged counts; the rows past the count are zeros (their NaN
    never leaks), whatever the positions' offset."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, T, H, D, generator=g).to(dtype) for _ in range(3))
    mask = draw_mask(B, T, kinds, seed)
    offset = torch.randint(0, 5, (B,), generator=g)
    qp, kp, vp, seq_id, pos, count, cu_seq, order = pack(q, k, v, mask, offset)
    with pytest.MonkeyPatch.context() as mp:     # 'varlen': the 2.12 stand-in (no CPU kernel)
        mp.setattr(packed_attention, 'varlen_attn', varlen_2_12)
        mp.setattr(packed_attention, 'VARLEN_STYLE', 'window')
        y = run(backend, qp, kp, vp, seq_id, pos, count, cu_seq, T)
    assert y.dtype == dtype and y.shape == qp.shape
    assert torch.equal(y[int(count):], torch.zeros_like(y[int(count):]))
    torch.testing.assert_close(unpack(y, order, mask), masked_full_attention(q, k, v, mask),
                               **TOL[dtype])


def test_packed_attention_scale_and_positions_not_indices():
    """An explicit scale is applied; causality follows the positions given (a packed row attends to
    the keys of its sequence at positions <= its own, not to the rows before it)."""
    B, T, H, D = 2, 6, 2, 8
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(B, T, H, D, generator=g) for _ in range(3))
    mask = draw_mask(B, T, ['random', 'all'], 3)
    qp, kp, vp, seq_id, pos, count, cu_seq, order = pack(q, k, v, mask, torch.zeros(B).long())
    for backend in ('sdpa', 'flex'):
        y = run(backend, qp, kp, vp, seq_id, pos, count, cu_seq, T, scale=0.3)
        torch.testing.assert_close(unpack(y, order, mask),
                                   masked_full_attention(q, k, v, mask, scale=0.3), **TOL[q.dtype])
        reversed_pos = torch.where(torch.arange(B * T) < count, -pos, pos)
        y = run(backend, qp, kp, vp, seq_id, reversed_pos, count, cu_seq, T, scale=0.3)
        assert not torch.allclose(unpack(y, order, mask),
                                  masked_full_attention(q, k, v, mask, scale=0.3), atol=1e-3)


# --------------------------------------------------------------------------------------------------
# varlen_attn's three signatures, as stand-ins that record the call and compute its result

def attention_over_cu_seq(q, k, v, cu_seq_q, max_q, causal, scale):
    """What varlen_attn returns: each sequence's rows attend among themselves; the rows past the
    last offset are left unwritten (NaN here)."""
    out = torch.full_like(q, math.nan)
    cu = cu_seq_q.tolist()
    for lo, hi in zip(cu[:-1], cu[1:]):
        assert hi - lo <= max_q
        if hi > lo:
            y = F.scaled_dot_product_attention(*(t[lo:hi].transpose(0, 1) for t in (q, k, v)),
                                               is_causal=causal, scale=scale)
            out[lo:hi] = y.transpose(0, 1)
    return out


CALLS = []


def varlen_2_10(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False,
                return_aux=None):
    CALLS.append(dict(cu_seq_q=cu_seq_q, cu_seq_k=cu_seq_k, max_q=max_q, max_k=max_k,
                      is_causal=is_causal))
    return attention_over_cu_seq(query, key, value, cu_seq_q, max_q, is_causal, None)


def varlen_2_11(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None,
                scale=None, window_size=(-1, -1)):
    CALLS.append(dict(cu_seq_q=cu_seq_q, cu_seq_k=cu_seq_k, max_q=max_q, max_k=max_k,
                      window_size=window_size, scale=scale))
    is_causal = window_size == (-1, 0)          # as 2.11 reads it: a list would not match
    return attention_over_cu_seq(query, key, value, cu_seq_q, max_q, is_causal, scale)


def varlen_2_12(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None,
                scale=None, window_size=(-1, -1), enable_gqa=False, seqused_k=None,
                block_table=None, num_splits=None):
    CALLS.append(dict(cu_seq_q=cu_seq_q, cu_seq_k=cu_seq_k, max_q=max_q, max_k=max_k,
                      window_size=window_size, scale=scale, seqused_k=seqused_k))
    is_causal = window_size == (-1, 0)
    return attention_over_cu_seq(query, key, value, cu_seq_q, max_q, is_causal, scale)


STAND_INS = {'2.10': varlen_2_10, '2.11': varlen_2_11, '2.12': varlen_2_12}


@pytest.mark.parametrize('release', list(STAND_INS))
@pytest.mark.parametrize('scale', [None, 0.2])
def test_varlen_adapter_builds_each_releases_call(release, scale):
    """One call per release, read from its signature: causal (is_causal=True in 2.10, the tuple
    window_size=(-1, 0) from 2.11), the same int32 offsets for q and k, max_q = max_k = the static
    capacity; 2.10 has no scale, so q carries it; the result is causal attention per sequence."""
    fn = STAND_INS[release]
    B, T, H, D = 3, 7, 2, 8
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(B, T, H, D, generator=g) for _ in range(3))
    mask = draw_mask(B, T, ['none', 'all'], 5)
    qp, kp, vp, seq_id, pos, count, cu_seq, order = pack(q, k, v, mask, torch.zeros(B).long())
    CALLS.clear()
    y = varlen_call(fn, qp, kp, vp, cu_seq.to(torch.int32), T, scale)
    (call,) = CALLS
    assert call['max_q'] == call['max_k'] == T and type(call['max_q']) is int
    assert call['cu_seq_q'] is call['cu_seq_k'] and call['cu_seq_q'].dtype == torch.int32
    if release == '2.10':
        assert call['is_causal'] is True
    else:
        assert call['window_size'] == (-1, 0) and isinstance(call['window_size'], tuple)
        assert call['scale'] == scale
    if release == '2.12':
        assert call['seqused_k'] is None
    y = torch.where((torch.arange(B * T) < count)[:, None, None], y, 0.0)
    torch.testing.assert_close(unpack(y, order, mask),
                               masked_full_attention(q, k, v, mask, scale=scale), **TOL[q.dtype])


def test_varlen_style_is_read_from_the_signature():
    assert [packed_attention.varlen_style(f) for f in STAND_INS.values()] == [
        'is_causal', 'window', 'window']
    packed_attention.load_attention_apis()             # lazy on the CPU: another test may not
                                                        # have loaded them yet
    if packed_attention.varlen_attn is not None:        # the installed release's own
        assert packed_attention.VARLEN_STYLE in ('is_causal', 'window')
    with pytest.raises(TypeError, match='unknown varlen_attn signature'):
        packed_attention.varlen_style(lambda q, k, v: q)


# --------------------------------------------------------------------------------------------------
# the backend choice

BF, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
ALL = frozenset({'varlen', 'flex'})
BACKEND_CASES = [
    # torch, device, capability, dtype, apis, backend
    ('2.13.0', 'cuda', (9, 0), BF, ALL, 'varlen'),                 # H100: FlashAttention-2
    ('2.11.0+cu130', 'cuda', (8, 0), FP16, ALL, 'varlen'),         # A100
    ('2.10.0', 'cuda', (8, 9), BF, ALL, 'varlen'),                 # varlen's first release
    ('2.9.0', 'cuda', (9, 0), BF, frozenset({'flex'}), 'flex'),    # no varlen yet
    ('2.13.0', 'cuda', (9, 0), FP32, ALL, 'flex'),                 # FlashAttention: fp16/bf16 only
    ('2.12.0', 'cuda', (10, 0), FP32, ALL, 'flex'),                # B200
    ('2.4.0', 'cuda', (8, 0), FP32, frozenset(), 'sdpa'),          # neither API
    ('2.13.0', 'cuda', (7, 0), FP16, ALL, 'sdpa'),                 # V100: neither runs well
    ('2.13.0', 'cuda', (7, 5), FP16, ALL, 'sdpa'),                 # T4
    ('2.13.0+cpu', 'cpu', None, FP32, ALL, 'sdpa'),                # no CPU varlen kernel
    ('2.13.0+cpu', 'cpu', None, BF, ALL, 'sdpa'),
    ('2.11.0+rocm', 'rocm', None, BF, ALL, 'sdpa'),
]


@pytest.mark.parametrize('case', BACKEND_CASES, ids=lambda c: f"{c[0]}-{c[1]}-{c[2]}-{c[3]}")
def test_backend_choice_table(case):
    *args, want = case
    assert choose_backend(*args) == want


def test_installed_backend_on_this_machine():
    x = torch.zeros(1)
    assert packed_attention.default_backend(x) == 'sdpa'
    assert packed_attention.installed_apis() <= {'varlen', 'flex'}
    with pytest.raises(ValueError, match='backend must be one of'):
        packed_causal_attention(*(torch.zeros(2, 1, 8) for _ in range(3)), torch.zeros(2).long(),
                                torch.arange(2), 2, torch.tensor([0, 2]), 2, backend='math')
