"""
GPU kernels for routed FFN execution with a device-side count: no host sync, no graph break, no
data-dependent shapes, and a row block beyond the count never loads the FFN's weights.

    order, count = sort_by_mask(mask)          the selected rows first (stable), count = mask.sum()
    mlp_rows(x, order, lo, hi, mlp, out)       out[order[i]] = mlp(x[order[i]]) for lo <= i < hi
    mlp_rows_reference(...)                    the same in pure PyTorch (every row computed, the
                                               rows in range written): what the kernels are tested
                                               against

A routed FFN layer runs both paths into one buffer:

    order, count = sort_by_mask(mask)
    out = torch.empty_like(x)
    mlp_rows(x, order, 0, count, full_mlp, out)          # full FFN: sorted positions [0, count)
    mlp_rows(x, order, count, x.size(0), cheap_mlp, out)  # cheap FFN: the rest

The Triton path is two kernels launched on a static grid over all N rows:
  1. H[i] = gelu(x[order[i]] @ W_fc^T + b_fc)     the gather fused into the load of x
  2. out[order[i]] = H[i] @ W_proj^T + b_proj     the scatter fused into the store
Every program reads lo and hi from device memory and returns, before it loads any weight, when its
block of sorted positions lies outside [lo, hi). So the count never reaches the host, the grid and
the H buffer have static shapes, and the cheap-path tokens cost the full FFN's kernels only programs
that exit at once (the one block that straddles the count computes rows it then masks out).

Which path runs (mlp_rows):
  - Triton when x is on a CUDA GPU of compute capability >= 8.0 (A100 8.0, H100 9.0, ...).
    Triton 3.3 and later support NVIDIA GPUs of compute capability 8.0+: the tensor-core (MMA)
    path for older GPUs was removed and tl.dot there lowers to FMA loops (these kernels, compiled
    for sm70/sm75 by triton 3.9, contain no MMA instruction). So V100 (7.0, fp16) and T4 (7.5) run
    the reference on cuBLAS's tensor cores: correct, static shapes, no sync, but every row goes
    through both paths.
  - Triton when NANODEPTH_TRITON=1, on any device: with TRITON_INTERPRET=1 the kernels run on CPU
    under Triton's interpreter (how the tests check them on a machine without a GPU).
  - the reference otherwise (CPU, MPS, ROCm, older GPUs, no triton installed), and whenever autograd
    needs gradients through the call: the kernels are for inference (sparse eval), with no backward.
NANODEPTH_TRITON=0 forces the reference everywhere.
"""
import os

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:                     # optional: without triton every call runs the reference
    triton = None

BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 32  # autotune-free; tl.dot needs every block dimension >= 16
MIN_CAPABILITY = (8, 0)                 # Triton 3.3+ supports NVIDIA compute capability 8.0 and
                                        # newer


# --------------------------------------------------------------------------------------------------
# the order and the count

def sort_by_mask(mask):
    """mask (N,) bool -> (order (N,) int64, count 0-dim int64), both on mask's device: the True rows
    first, then the False rows, each group in its original order; count = mask.sum(). A stable
    partition by two prefix sums (O(N), deterministic: every destination is written once), no
    sync."""
    mask = mask.reshape(-1).bool()
    m = mask.long()
    count = m.sum()
    rank_true = torch.cumsum(m, 0) - 1                   # position among the True rows
    rank_false = torch.cumsum(1 - m, 0) - 1              # position among the False rows
    dest = torch.where(mask, rank_true, count + rank_false)
    order = torch.empty_like(dest).scatter_(0, dest, torch.arange(mask.numel(), device=mask.device))
    return order, count


# --------------------------------------------------------------------------------------------------
# the reference

def _weights(mlp):
    return (mlp.c_fc.weight, mlp.c_fc.bias, mlp.c_proj.weight, mlp.c_proj.bias,
            getattr(mlp, 'approximate', 'none'))


def _in_range(order, lo, hi):
    """(N,) bool: row order[i] is selected iff lo <= i < hi (lo, hi: ints or device tensors)."""
    i = torch.arange(order.numel(), device=order.device)
    return torch.zeros_like(order, dtype=torch.bool).scatter_(0, order, (i >= lo) & (i < hi))


def mlp_rows_reference(x, order, lo, hi, mlp, out):
    """mlp_rows in pure PyTorch with static shapes: computes mlp (dropout off) on all N rows and
    writes the rows whose sorted position is in [lo, hi) into out; the other rows keep their
    bits."""
    w_fc, b_fc, w_proj, b_proj, approximate = _weights(mlp)
    y = F.linear(F.gelu(F.linear(x, w_fc, b_fc), approximate=approximate), w_proj, b_proj)
    keep = _in_range(order, lo, hi).unsqueeze(1)
    out.copy_(torch.where(keep, y.to(out.dtype), out))
    return out


# --------------------------------------------------------------------------------------------------
# the kernels

if triton is not None:

    @triton.jit
    def _gather_fc_gelu_kernel(
        x_ptr,
        order_ptr,
        lo_ptr,
        hi_ptr,
        w_ptr,
        b_ptr,
        h_ptr,
        started_ptr,
        N,
        C,
        W,
        stride_xm,
        stride_xk,
        stride_wn,
        stride_wk,
        stride_hm,
        stride_hn,
        HAS_BIAS: tl.constexpr,
        TANH: tl.constexpr,
        COUNT_STARTED: tl.constexpr,
        DOT_FP32: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """H[i, n] = gelu(x[order[i]] . W_fc[n] + b_fc[n]) for sorted positions lo <= i < hi."""
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        lo, hi = tl.load(lo_ptr), tl.load(hi_ptr)
        first = pid_m * BLOCK_M
        if first >= hi or first + BLOCK_M <= lo:           # the whole block is out of range:
            return                                         # exit before any weight is loaded
        if COUNT_STARTED:                                  # tests: count the programs that did work
            tl.atomic_add(started_ptr, 1)
        rm = first + tl.arange(0, BLOCK_M)
        rm64 = rm.to(tl.int64)                             # H offsets: N·width may pass 2^31
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        live = (rm >= lo) & (rm < hi) & (rm < N)
        rows = tl.load(order_ptr + rm, mask=live, other=0)  # the gather: x's rows through order
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, C, BLOCK_K):
            kk = k0 + rk
            a = tl.load(x_ptr + rows[:, None] * stride_xm + kk[None, :] * stride_xk,
                        mask=live[:, None] & (kk[None, :] < C), other=0.0)
            b = tl.load(w_ptr + rn[None, :] * stride_wn + kk[:, None] * stride_wk,
                        mask=(rn[None, :] < W) & (kk[:, None] < C), other=0.0)
            if DOT_FP32:
                acc += tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(a, b)
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=rn < W, other=0.0).to(tl.float32)[None, :]
        if TANH:        # 0.5·z·(1 + tanh(u)) = z·sigmoid(2u), u = sqrt(2/pi)·(z + 0.044715·z^3)
            h = acc * tl.sigmoid(1.5957691216057308 * (acc + 0.044715 * acc * acc * acc))
        else:           # exact GELU
            h = 0.5 * acc * (1.0 + tl.math.erf(acc * 0.7071067811865476))
        tl.store(
            h_ptr + rm64[:, None] * stride_hm + rn[None, :] * stride_hn,
            h.to(h_ptr.dtype.element_ty),
            mask=live[:, None] & (rn[None, :] < W),
        )

    @triton.jit
    def _proj_scatter_kernel(
            h_ptr, order_ptr, lo_ptr, hi_ptr, w_ptr, b_ptr, out_ptr, started_ptr,
            N, C, W,
            stride_hm, stride_hk, stride_wn, stride_wk, stride_om, stride_on,
            HAS_BIAS: tl.constexpr, COUNT_STARTED: tl.constexpr, DOT_FP32: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """out[order[i], n] = H[i] . W_proj[n] + b_proj[n] for sorted positions lo <= i < hi."""
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        lo, hi = tl.load(lo_ptr), tl.load(hi_ptr)
        first = pid_m * BLOCK_M
        if first >= hi or first + BLOCK_M <= lo:
            return
        if COUNT_STARTED:
            tl.atomic_add(started_ptr, 1)
        rm = first + tl.arange(0, BLOCK_M)
        rm64 = rm.to(tl.int64)                             # H offsets: N·width may pass 2^31
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        live = (rm >= lo) & (rm < hi) & (rm < N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, W, BLOCK_K):
            kk = k0 + rk
            a = tl.load(h_ptr + rm64[:, None] * stride_hm + kk[None, :] * stride_hk,
                        mask=live[:, None] & (kk[None, :] < W), other=0.0)
            b = tl.load(w_ptr + rn[None, :] * stride_wn + kk[:, None] * stride_wk,
                        mask=(rn[None, :] < C) & (kk[:, None] < W), other=0.0)
            if DOT_FP32:
                acc += tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(a, b)
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=rn < C, other=0.0).to(tl.float32)[None, :]
        rows = tl.load(order_ptr + rm, mask=live, other=0)  # the scatter: out's rows through order
        tl.store(
            out_ptr + rows[:, None] * stride_om + rn[None, :] * stride_on,
            acc.to(out_ptr.dtype.element_ty),
            mask=live[:, None] & (rn[None, :] < C),
        )


def _interpreted(kernel):
    return type(kernel).__name__ == 'InterpretedFunction'     # made under TRITON_INTERPRET=1


def launch_mlp_rows(x, order, lo, hi, w_fc, b_fc, w_proj, b_proj, approximate, out,
                    block_m=BLOCK_M, started=None):
    """The two kernels. lo, hi: 0-dim int tensors on x's device. started: None, or a 1-element int32
    tensor to which every program that passed the range check adds 1 (tests count the skipping)."""
    N, C = x.shape
    W = w_fc.shape[0]
    h = torch.empty((N, W), dtype=x.dtype, device=x.device)   # static: indexed by sorted position
    wrap = torch.library.wrap_triton
    count = started is not None
    started = started if count else lo                         # an unused pointer when not counting
    # fp32 inputs: TF32 tensor cores only where torch's matmuls also use them. Triton's interpreter
    # (triton 3.9) computes tl.dot of bf16 operands wrongly, so there they are upcast first: exact
    # (a product of two bf16 values fits in fp32), the same sums as the GPU's bf16 dot with fp32
    # acc.
    ieee = x.dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32
    dot_fp32 = ieee or (x.dtype == torch.bfloat16 and _interpreted(_gather_fc_gelu_kernel))
    blocks = dict(BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    wrap(_gather_fc_gelu_kernel)[(triton.cdiv(N, block_m), triton.cdiv(W, BLOCK_N))](
        x,
        order,
        lo,
        hi,
        w_fc,
        b_fc if b_fc is not None else w_fc,
        h,
        started,
        N,
        C,
        W,
        x.stride(0),
        x.stride(1),
        w_fc.stride(0),
        w_fc.stride(1),
        h.stride(0),
        h.stride(1),
        HAS_BIAS=b_fc is not None,
        TANH=approximate == 'tanh',
        COUNT_STARTED=count,
        DOT_FP32=dot_fp32,
        **blocks,
    )
    wrap(_proj_scatter_kernel)[(triton.cdiv(N, block_m), triton.cdiv(C, BLOCK_N))](
        h, order, lo, hi, w_proj, b_proj if b_proj is not None else w_proj, out, started, N, C, W,
        h.stride(0), h.stride(1), w_proj.stride(0), w_proj.stride(1), out.stride(0), out.stride(1),
        HAS_BIAS=b_proj is not None, COUNT_STARTED=count, DOT_FP32=dot_fp32, **blocks)


def _mlp_rows_op(x: torch.Tensor, order: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
                 w_fc: torch.Tensor, b_fc: torch.Tensor | None, w_proj: torch.Tensor,
                 b_proj: torch.Tensor | None, approximate: str, out: torch.Tensor) -> None:
    launch_mlp_rows(x, order, lo, hi, w_fc, b_fc, w_proj, b_proj, approximate, out)


if triton is not None:
    # A custom op, so torch.compile(fullgraph=True) traces mlp_rows as one node (no graph break).
    # Compiled kernels: triton_op, which lets the compiler see the kernels themselves. Interpreted
    # kernels (TRITON_INTERPRET=1 when this file is imported) are plain Python that reads the data,
    # which triton_op's tracing cannot run on fake tensors: an opaque custom_op with a stated fake.
    if _interpreted(_gather_fc_gelu_kernel):
        _op = torch.library.custom_op("nanodepth::mlp_rows", _mlp_rows_op, mutates_args={"out"})

        @_op.register_fake
        def _(x, order, lo, hi, w_fc, b_fc, w_proj, b_proj, approximate, out):
            return None                 # it only writes into out
    else:
        torch.library.triton_op("nanodepth::mlp_rows", _mlp_rows_op, mutates_args={"out"})


# --------------------------------------------------------------------------------------------------
# dispatch

def use_triton(x):
    """Whether mlp_rows runs the kernels for x (see the module docstring). Read on every call, so
    NANODEPTH_TRITON can be set after import."""
    if triton is None:
        return False
    forced = os.environ.get('NANODEPTH_TRITON', '')
    if forced in ('0', '1'):
        return forced == '1'
    return (
        x.is_cuda
        and torch.version.hip is None
        and torch.cuda.get_device_capability(x.device) >= MIN_CAPABILITY
    )


def _as_count(v, device):
    """A Python int or a device tensor -> a 0-dim int64 tensor on device (no host round trip)."""
    if isinstance(v, torch.Tensor):
        return v.reshape(()).to(device=device, dtype=torch.int64)
    return torch.full((), int(v), dtype=torch.int64, device=device)


def mlp_rows(x, order, lo, hi, mlp, out):
    """For every lo <= i < hi: out[order[i]] = mlp(x[order[i]]) (dropout off); other rows of out are
    untouched; returns out. x, out (N, C); order (N,) from sort_by_mask; lo, hi: ints or 0-dim int
    tensors on x's device; mlp: c_fc, c_proj (nn.Linear, bias optional) and `approximate` for
    F.gelu."""
    w_fc, b_fc, w_proj, b_proj, approximate = _weights(mlp)
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x, w_fc, b_fc, w_proj, b_proj))
    if needs_grad or not use_triton(x):         # the kernels have no backward: training takes the
                                                # reference
        return mlp_rows_reference(x, order, lo, hi, mlp, out)
    if torch.is_autocast_enabled(x.device.type):   # as autocast casts F.linear's operands in the
                                                   # reference
        dtype = torch.get_autocast_dtype(x.device.type)
        x, w_fc, b_fc, w_proj, b_proj = (
            t if t is None else t.to(dtype) for t in (x, w_fc, b_fc, w_proj, b_proj)
        )
    torch.ops.nanodepth.mlp_rows(x, order, _as_count(lo, x.device), _as_count(hi, x.device),
                                 w_fc, b_fc, w_proj, b_proj, approximate, out)
    return out
