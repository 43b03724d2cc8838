"""
Causal attention among the tokens of a packed buffer: the selected tokens of several sequences laid
out contiguously (sequence 0's first, then sequence 1's, ...), each sequence's in original order,
with every token's sequence id and absolute position; the rows past `count` are not tokens (they
may hold anything, NaN included) and come out as zeros. A query attends to the keys of its own
sequence at positions <= its own. Shapes stay static: the buffer keeps all N = B·T rows, counts
and offsets live on the device, and the per-sequence capacity (T) bounds every sequence.

    backend = choose_backend(torch.__version__, device_type, capability, dtype, installed_apis())
    y = packed_causal_attention(q, k, v, seq_id, pos, count, cu_seq, max_len, backend)

The backends, all equal on the rows [0, count):
  - 'varlen': torch.nn.attention.varlen.varlen_attn (PyTorch's FlashAttention-2 over cu_seq
    offsets; NVIDIA sm_80+, fp16/bf16), through varlen_call, one adapter over the three signatures
    the releases shipped (2.10, 2.11, 2.12+), max_q = max_k = the capacity.
  - 'flex': FlexAttention with a document-and-causal block mask on the packed buffer; tiles past
    the count or across two sequences are skipped whole (where varlen is absent on the GPU).
  - 'sdpa': scaled_dot_product_attention over each sequence's window of `max_len` rows of the
    buffer, with the explicit mask same sequence & causal by position & both valid: the CPU's
    path and the reference (it computes B·max_len² scores, as dense attention does).

choose_backend is a pure function of (torch version, device type, compute capability, dtype, APIs
present), never a call tried and its error caught.
"""
import inspect

import torch
import torch.nn.functional as F

from routed_rows import device_facts, version_tuple

# varlen_attn and FlexAttention, imported by load_attention_apis: importing either loads torch's
# compiler stack (about 2 s a process), which a CPU process that never asks for them need not pay
_UNLOADED = object()
varlen_attn = flex_attention = create_block_mask = VARLEN_STYLE = _UNLOADED

BACKENDS = ('varlen', 'flex', 'sdpa')
VARLEN_CAPABILITY = (8, 0)              # FlashAttention-2: "only supports Ampere GPUs or newer"
FLEX_CAPABILITY = (8, 0)                # Triton 3.3+ targets sm_80+ (tl.dot is FMA loops below)


# --------------------------------------------------------------------------------------------------
# varlen_attn's signatures

def varlen_style(fn):
    """How fn (a varlen_attn) asks for causal attention, read from its signature: 'is_causal'
    (2.10: is_causal=True, no scale argument) or 'window' (2.11 and later: keyword-only
    window_size=(-1, 0) and scale=)."""
    params = inspect.signature(fn).parameters
    if 'window_size' in params and 'scale' in params:
        return 'window'
    if 'is_causal' in params:
        return 'is_causal'
    raise TypeError(f"unknown varlen_attn signature {inspect.signature(fn)}: expected PyTorch "
                    f"2.10's is_causal= or 2.11's window_size=")


def load_attention_apis():
    """Import varlen_attn (2.10+) and FlexAttention (2.5+) once; None where absent. A name
    already set (e.g. a test's stand-in) is kept. Done at import where CUDA is available, so a
    compiled forward there finds them loaded; on the CPU at the first call that needs them."""
    global varlen_attn, flex_attention, create_block_mask, VARLEN_STYLE
    if varlen_attn is _UNLOADED:
        try:
            from torch.nn.attention.varlen import varlen_attn
        except ImportError:                     # before 2.10
            varlen_attn = None
    if flex_attention is _UNLOADED or create_block_mask is _UNLOADED:
        try:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        except ImportError:                     # before 2.5
            flex_attention = create_block_mask = None
    if VARLEN_STYLE is _UNLOADED:
        VARLEN_STYLE = varlen_style(varlen_attn) if varlen_attn is not None else None


if torch.cuda.is_available():
    load_attention_apis()


def varlen_call(fn, q, k, v, cu_seq, max_len, scale, style=None):
    """Causal fn(q, k, v, ...) (a varlen_attn of any release) over the sequences cu_seq (B+1,)
    int32 offsets into q, k, v (N, H, D), each at most max_len (a Python int, the static capacity,
    so the call's shapes never change) rows long. style: varlen_style(fn), read here when None
    (pass it precomputed under torch.compile). 2.10 takes no scale: q is scaled instead."""
    style = varlen_style(fn) if style is None else style
    if style == 'is_causal':
        default = q.size(-1) ** -0.5
        q = q if scale is None or scale == default else q * (scale / default)
        return fn(q, k, v, cu_seq, cu_seq, max_len, max_len, is_causal=True)
    return fn(q, k, v, cu_seq, cu_seq, max_len, max_len, scale=scale, window_size=(-1, 0))


# --------------------------------------------------------------------------------------------------
# which backend runs

def choose_backend(torch_version, device_type, capability, dtype, apis):
    """The backend for a packed buffer: a pure function of the torch version text, the device type
    ('cuda' for NVIDIA only), its compute capability ((9, 0); None off NVIDIA), the dtype, and the
    APIs present (a set holding 'varlen' and/or 'flex').

      NVIDIA sm_80+, fp16/bf16, varlen_attn (2.10+)    varlen   FlashAttention-2 over cu_seq
      NVIDIA sm_80+, FlexAttention (2.5+)              flex     skips tiles across sequences
      anything else (the CPU, sm_7x, ROCm)             sdpa     per-sequence windows, masked
    """
    version = version_tuple(torch_version)
    if device_type != 'cuda' or capability is None or capability < VARLEN_CAPABILITY:
        return 'sdpa'
    if 'varlen' in apis and version >= (2, 10) and dtype in (torch.float16, torch.bfloat16):
        return 'varlen'
    if 'flex' in apis and version >= (2, 5) and capability >= FLEX_CAPABILITY:
        return 'flex'
    return 'sdpa'


def installed_apis():
    """The APIs of choose_backend this process has."""
    load_attention_apis()
    return frozenset(name for name, fn in (('varlen', varlen_attn), ('flex', flex_attention))
                     if fn is not None)


def default_backend(x):
    """choose_backend for tensor x (its device and dtype) in this process."""
    kind, capability = device_facts(x.device)
    # off CUDA the answer is sdpa whatever is installed: no need to import the APIs to know it
    apis = installed_apis() if kind == 'cuda' else frozenset()
    return choose_backend(torch.__version__, kind, capability, x.dtype, apis)


# --------------------------------------------------------------------------------------------------
# the attention

def packed_causal_attention(q, k, v, seq_id, pos, count, cu_seq, max_len, backend=None,
                            scale=None):
    """Causal attention among the tokens of a packed buffer (see the module docstring). q, k, v
    (N, H, D); seq_id, pos (N,) int: each row's sequence and absolute position (read on the rows
    [0, count) only); count: 0-dim int tensor (or int), the number of token rows; cu_seq (B+1,)
    int: each sequence's first row, and count at the end; max_len: a Python int >= every sequence's
    count. Returns (N, H, D): the rows past count are zeros. backend: one of BACKENDS, None for
    default_backend(q)."""
    N = q.size(0)
    valid = torch.arange(N, device=q.device) < count
    rows = valid[:, None, None]
    # the rows past count may hold garbage (NaN): 0·NaN would leak through masked-out scores
    q, k, v = (torch.where(rows, t, torch.zeros((), dtype=t.dtype, device=t.device))
               for t in (q, k, v))
    backend = default_backend(q) if backend is None else backend
    if backend in ('varlen', 'flex'):
        load_attention_apis()
    if backend == 'varlen':
        y = varlen_call(varlen_attn, q, k, v, cu_seq.to(torch.int32), max_len, scale,
                        VARLEN_STYLE)
    elif backend == 'flex':
        y = flex_packed(q, k, v, seq_id, pos, valid, scale)
    elif backend == 'sdpa':
        y = sdpa_packed(q, k, v, seq_id, pos, valid, cu_seq, max_len, scale)
    else:
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")
    return torch.where(rows, y, torch.zeros((), dtype=y.dtype, device=y.device))


def sdpa_packed(q, k, v, seq_id, pos, valid, cu_seq, max_len, scale=None):
    """SDPA on each sequence's window: rows cu_seq[b] .. cu_seq[b] + max_len - 1 of the buffer
    (static shapes; the rows past the sequence's count are masked out as keys), gathered as a
    (B, H, max_len, D) batch, then each packed row read back from its own window."""
    N, starts = q.size(0), cu_seq[:-1].long()
    j = torch.arange(max_len, device=q.device)
    inwin = j < (cu_seq[1:].long() - starts)[:, None]                    # (B, max_len)
    idx = torch.where(inwin, starts[:, None] + j, 0).clamp(0, max(N - 1, 0))
    qw, kw, vw = (t[idx].transpose(1, 2) for t in (q, k, v))           # (B, H, max_len, D)
    sw, pw = seq_id[idx], pos[idx]
    mask = ((sw[:, :, None] == sw[:, None, :]) & (pw[:, :, None] >= pw[:, None, :])
            & inwin[:, :, None] & inwin[:, None, :])
    mask = mask | torch.eye(max_len, dtype=torch.bool, device=q.device)   # no empty row: no NaN
    yw = F.scaled_dot_product_attention(qw, kw, vw, attn_mask=mask[:, None], scale=scale)
    yw = yw.transpose(1, 2).reshape(-1, *q.shape[1:])                    # (B·max_len, H, D)
    i = torch.arange(N, device=q.device)
    s = torch.where(valid, seq_id.long(), 0).clamp(0, starts.numel() - 1)
    back = s * max_len + (i - starts[s]).clamp(0, max_len - 1)
    return yw[back]


def flex_packed(q, k, v, seq_id, pos, valid, scale=None):
    """FlexAttention on the whole packed buffer with a document-and-causal mask: the tiles across
    two sequences, above the diagonal or past the count are skipped whole. The rows past the count
    attend to nothing (FlexAttention returns zeros there). Compiled on the GPU when called eagerly
    (eager FlexAttention materialises the scores)."""
    N = q.size(0)

    def mask_mod(b, h, qi, ki):
        return ((seq_id[qi] == seq_id[ki]) & (pos[qi] >= pos[ki]) & valid[qi] & valid[ki])

    block_mask = create_block_mask(mask_mod, None, None, N, N, device=q.device)
    fn = flex_attention
    if q.device.type != 'cpu' and not torch.compiler.is_compiling():
        fn = _compiled_flex()
    y = fn(*(t.transpose(0, 1)[None] for t in (q, k, v)), block_mask=block_mask, scale=scale)
    return y[0].transpose(0, 1)


_COMPILED_FLEX = []


def _compiled_flex():
    if not _COMPILED_FLEX:
        _COMPILED_FLEX.append(torch.compile(flex_attention, dynamic=False))
    return _COMPILED_FLEX[0]
