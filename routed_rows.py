"""
Routed execution with a device-side count: a routed layer computes only the rows its decision
selects, without a host sync, a graph break or a data-dependent shape, on the fastest kernel the
installed PyTorch and GPU offer.

    order, count = sort_by_mask(mask)           the selected rows first (stable), count = mask.sum()
    mlp_rows(x, order, lo, hi, mlp, out, path)  out[order[i]] = mlp(x[order[i]]) for lo <= i < hi
    prefix_linear(x, count, weight, bias, path) F.linear on the rows [0, count) of a packed buffer
    mlp_rows_reference(...)                     every row computed, the rows in range written: what
                                                every other path is tested against

A routed FFN layer runs both paths into one buffer:

    order, count = sort_by_mask(mask)
    out = torch.empty_like(x)
    mlp_rows(x, order, 0, count, full_mlp, out)           # full FFN: sorted positions [0, count)
    mlp_rows(x, order, count, x.size(0), cheap_mlp, out)  # cheap FFN: the rest

The paths (PATHS), all equal to the reference on the rows in range:
  - 'grouped_mm': torch's grouped GEMM (F.grouped_mm, torch._grouped_mm before 2.10) with one group
    whose end offset is the count. On sm_90/sm_100 in bf16 it is CUTLASS reading the offset on the
    device: rows past it are neither read nor written (they hold garbage, never used). Elsewhere
    torch runs a loop that copies the offset to the host (a sync; on the CPU harmless, and the only
    way the CPU computes fewer rows under torch.compile, which traces grouped_mm in bf16 only).
  - 'triton': two kernels on a static grid over all N rows, H[i] = gelu(x[order[i]] @ W_fc^T + b)
    with the gather fused into the load, then out[order[i]] = H[i] @ W_proj^T + b with the scatter
    fused into the store. Every program reads lo and hi from device memory and returns before it
    loads a weight when its block lies outside [lo, hi). Autotuned on the GPU over Ampere/Hopper
    tiles; Triton 3.3+ targets compute capability 8.0+ only (tl.dot lowers to FMA loops below).
  - 'compact': one host sync for the exact count, then cuBLAS (or the CPU's GEMM) on the gathered
    rows. The fastest where a sync costs less than the rows it saves (the CPU, V100/T4), but not
    traceable by torch.compile(fullgraph=True) nor capturable in a CUDA graph.
  - 'reference': every row computed, the rows in range written. Static and traceable; saves nothing.

choose_path picks one from (torch version, device, compute capability, dtype, APIs present, whether
torch.compile traces), never by trying a call and catching its error; NANODEPTH_PATH=<path> forces
one. Gradients always take the reference: the kernels are for sparse eval, which has no backward.
"""
import os

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:                     # optional: without triton every call runs the reference
    triton = None

# The tiles of the interpreter and of the tests that count programs; a GPU autotunes over
# AUTOTUNE_TILES instead. tl.dot needs every block dimension >= 16.
BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 32
MIN_CAPABILITY = (8, 0)                 # Triton 3.3+ supports NVIDIA compute capability 8.0+
# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages): the mm tiles Ampere and Hopper favour (small
# M for decode, large for prefill); a program reads lo/hi first, so a tile past the count is cheap.
AUTOTUNE_TILES = [(16, 64, 64, 4, 4), (32, 64, 64, 4, 4), (64, 64, 32, 4, 4), (64, 128, 32, 4, 4),
                  (128, 64, 32, 4, 4), (128, 128, 32, 8, 3), (128, 128, 64, 8, 3),
                  (64, 256, 32, 8, 4)]


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


TUNED = triton is not None and not _interpreted(_gather_fc_gelu_kernel)
if TUNED:       # on a GPU: the same kernels, their tiles autotuned once per (N, C, W)
    _TILES = [triton.Config(dict(BLOCK_M=m, BLOCK_N=n, BLOCK_K=k), num_warps=w, num_stages=s)
              for m, n, k, w, s in AUTOTUNE_TILES]
    _TUNED_KERNELS = {
        kernel: triton.autotune(_TILES, key=['N', 'C', 'W'])(kernel)
        for kernel in (_gather_fc_gelu_kernel, _proj_scatter_kernel)
    }


def _launch(kernel, args, rows, cols, consts, block_m, started):
    """kernel on a grid of (row blocks over rows, column blocks over cols): autotuned on a GPU, the
    fixed tiles (block_m rows) under the interpreter or when a test counts programs (started)."""
    consts = dict(consts, COUNT_STARTED=started is not None)
    if TUNED and started is None and block_m is None:
        grid = lambda meta: (triton.cdiv(rows, meta['BLOCK_M']), triton.cdiv(cols, meta['BLOCK_N']))
        torch.library.wrap_triton(_TUNED_KERNELS[kernel])[grid](*args, **consts)
        return
    block_m = block_m or BLOCK_M
    grid = (triton.cdiv(rows, block_m), triton.cdiv(cols, BLOCK_N))
    # wrap_triton lets triton_op's tracing see a compiled kernel; an interpreted one runs inside an
    # opaque custom_op, as it is (torch 2.11's wrap_triton refuses it)
    (kernel if _interpreted(kernel) else torch.library.wrap_triton(kernel))[grid](
        *args, **consts, BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)


def _dot_fp32(x):
    """fp32 inputs: TF32 tensor cores only where torch's matmuls also use them. Triton's interpreter
    (triton 3.9) computes tl.dot of bf16 operands wrongly, so there they are upcast first: exact (a
    product of two bf16 values fits in fp32), the same sums as the GPU's bf16 dot with fp32 acc."""
    ieee = x.dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32
    return ieee or (x.dtype == torch.bfloat16 and _interpreted(_gather_fc_gelu_kernel))


def launch_proj_rows(h, order, lo, hi, w, b, out, block_m=None, started=None):
    """The second kernel alone: out[order[i]] = h[i] @ w^T + b for sorted positions lo <= i < hi.
    With order = arange(N) it is a linear layer on the rows [lo, hi) of a packed buffer."""
    N, W = h.shape
    C = w.shape[0]
    args = (h, order, lo, hi, w, b if b is not None else w, out,
            started if started is not None else lo,         # an unused pointer when not counting
            N, C, W, h.stride(0), h.stride(1), w.stride(0), w.stride(1),
            out.stride(0), out.stride(1))
    _launch(_proj_scatter_kernel, args, N, C,
            dict(HAS_BIAS=b is not None, DOT_FP32=_dot_fp32(h)), block_m, started)


def launch_mlp_rows(x, order, lo, hi, w_fc, b_fc, w_proj, b_proj, approximate, out,
                    block_m=None, started=None):
    """The two kernels. lo, hi: 0-dim int tensors on x's device. started: None, or a 1-element int32
    tensor to which every program that passed the range check adds 1 (tests count the skipping)."""
    N, C = x.shape
    W = w_fc.shape[0]
    h = torch.empty((N, W), dtype=x.dtype, device=x.device)   # static: indexed by sorted position
    args = (x, order, lo, hi, w_fc, b_fc if b_fc is not None else w_fc, h,
            started if started is not None else lo,
            N, C, W, x.stride(0), x.stride(1), w_fc.stride(0), w_fc.stride(1),
            h.stride(0), h.stride(1))
    consts = dict(HAS_BIAS=b_fc is not None, TANH=approximate == 'tanh', DOT_FP32=_dot_fp32(x))
    _launch(_gather_fc_gelu_kernel, args, N, W, consts, block_m, started)
    launch_proj_rows(h, order, lo, hi, w_proj, b_proj, out, block_m, started)


def _mlp_rows_op(x: torch.Tensor, order: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
                 w_fc: torch.Tensor, b_fc: torch.Tensor | None, w_proj: torch.Tensor,
                 b_proj: torch.Tensor | None, approximate: str, out: torch.Tensor) -> None:
    launch_mlp_rows(x, order, lo, hi, w_fc, b_fc, w_proj, b_proj, approximate, out)


def _proj_rows_op(h: torch.Tensor, order: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
                  w: torch.Tensor, b: torch.Tensor | None, out: torch.Tensor) -> None:
    launch_proj_rows(h, order, lo, hi, w, b, out)


# the Triton kernels run on a CUDA device or under the interpreter; elsewhere they are never
# launched, and registering them would import the compiler stack (about 2 s a process)
TRITON_RUNS = triton is not None and (_interpreted(_gather_fc_gelu_kernel)
                                      or torch.cuda.is_available())
if TRITON_RUNS:
    # Custom ops, so torch.compile(fullgraph=True) traces each call as one node (no graph break).
    # Compiled kernels: triton_op, which lets the compiler see the kernels themselves. Interpreted
    # kernels (TRITON_INTERPRET=1 when this file is imported) are plain Python that reads the data,
    # which triton_op's tracing cannot run on fake tensors: an opaque custom_op with a stated fake.
    for _name, _fn in (('mlp_rows', _mlp_rows_op), ('proj_rows', _proj_rows_op)):
        if _interpreted(_gather_fc_gelu_kernel):
            torch.library.custom_op(f"nanodepth::{_name}", _fn, mutates_args={"out"}).register_fake(
                lambda *args: None)                 # it only writes into out
        else:
            torch.library.triton_op(f"nanodepth::{_name}", _fn, mutates_args={"out"})


# --------------------------------------------------------------------------------------------------
# which path runs

PATHS = ('grouped_mm', 'triton', 'compact', 'reference')


def version_tuple(text):
    """'2.11.0+cu130' -> (2, 11)."""
    major, minor = text.split('+')[0].split('.')[:2]
    return int(major), int(minor)


def choose_path(torch_version, device_type, capability, dtype, apis, compiling=False):
    """The path a sparse eval layer runs: a pure function of the installed torch (its version text),
    the device type ('cuda' for NVIDIA GPUs only), the GPU's compute capability ((9, 0); None off
    NVIDIA), the dtype its matmuls run in, the APIs present (a set holding 'grouped_mm' and/or
    'triton') and whether torch.compile is tracing (which excludes the compact path's sync).

      NVIDIA sm_90/sm_100, bf16, torch >= 2.8    grouped_mm   CUTLASS reads the count on the device
        (sm_100 from 2.9: 2.8's kernel is sm_90's alone)
      NVIDIA sm_80+ with triton                  triton       tiles that stop at the device count
      other NVIDIA (sm_7x), or no triton         compact      one sync, cuBLAS on the rows (eager)
      the CPU, eager                             compact      one sync is cheap on the CPU
      the CPU compiling bf16, torch >= 2.9       grouped_mm   computes [0, count) rows only
      anything else while compiling              reference
    """
    version, grouped = version_tuple(torch_version), 'grouped_mm' in apis
    if device_type == 'cuda' and capability is not None:
        # 2.8 has the sm_90 CUTLASS kernel alone: it refuses sm_100
        cutlass = (9,) if version < (2, 9) else (9, 10)
        if capability[0] in cutlass and dtype == torch.bfloat16 and grouped and version >= (2, 8):
            return 'grouped_mm'
        if capability >= MIN_CAPABILITY and 'triton' in apis:
            return 'triton'
    elif device_type == 'cpu' and compiling:
        if dtype == torch.bfloat16 and grouped and version >= (2, 9):
            return 'grouped_mm'
    return 'reference' if compiling else 'compact'


def installed_apis():
    """The APIs of choose_path this process has."""
    grouped = hasattr(F, 'grouped_mm') or hasattr(torch, '_grouped_mm')
    return frozenset({'grouped_mm'} if grouped else set()) | (
        {'triton'} if triton is not None else set())


def device_facts(device):
    """(device type as choose_path reads it, compute capability or None)."""
    device = torch.device(device)
    if device.type == 'cuda' and torch.version.hip is None:
        return 'cuda', torch.cuda.get_device_capability(device)
    return ('rocm' if device.type == 'cuda' else device.type), None


def matmul_dtype(x):
    """The dtype x's matmuls run in: autocast's where it is on."""
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype


def default_path(x):
    """choose_path for tensor x in this process; NANODEPTH_PATH=<path> forces one. Read on every
    call, so the variable can be set after import."""
    forced = os.environ.get('NANODEPTH_PATH', '')
    if forced:
        if forced not in PATHS:
            raise ValueError(f"NANODEPTH_PATH must be one of {', '.join(PATHS)}, got {forced!r}")
        return forced
    kind, capability = device_facts(x.device)
    return choose_path(torch.__version__, kind, capability, matmul_dtype(x), installed_apis(),
                       torch.compiler.is_compiling())


def available_paths(device, dtype, compiling=False):
    """Every path that runs correctly for this device and dtype (fast or not): what a benchmark can
    force. The reference always; compact when not compiling; grouped_mm where torch has it for this
    device (under torch.compile in bf16 only: its meta kernel refuses other dtypes); triton on
    NVIDIA sm_80+ or under Triton's interpreter."""
    kind, capability = device_facts(device)
    version, apis = version_tuple(torch.__version__), installed_apis()
    paths = []
    # 2.8's grouped_mm is the sm_90 CUTLASS kernel alone, bf16 only; 2.9 added the loop that
    # runs the rest (sm_80+, fp16/fp32, the CPU)
    grouped_device = (kind == 'cpu' and version >= (2, 9)) or (
        kind == 'cuda' and (version >= (2, 9) and capability >= MIN_CAPABILITY
                            or version >= (2, 8) and capability[0] == 9
                            and dtype == torch.bfloat16))
    if 'grouped_mm' in apis and grouped_device and (dtype == torch.bfloat16 or not compiling):
        paths.append('grouped_mm')
    interpreted = triton is not None and _interpreted(_gather_fc_gelu_kernel)
    if 'triton' in apis and (interpreted or kind == 'cuda' and capability >= MIN_CAPABILITY):
        paths.append('triton')
    if not compiling:
        paths.append('compact')
    return paths + ['reference']


# --------------------------------------------------------------------------------------------------
# the paths

def _as_count(v, device):
    """A Python int or a device tensor -> a 0-dim int64 tensor on device (no host round trip)."""
    if isinstance(v, torch.Tensor):
        return v.reshape(()).to(device=device, dtype=torch.int64)
    return torch.full((), int(v), dtype=torch.int64, device=device)


def _grouped_linear(x, n, weight):
    """x @ weight^T on the rows [0, n) of x by one grouped GEMM group ending at n (0-dim int32 on
    x's device); the rows past n are garbage."""
    mm = getattr(F, 'grouped_mm', None) or torch._grouped_mm
    return mm(x, weight.unsqueeze(0).transpose(-2, -1), offs=n.reshape(1))


def _grouped_aligned(dtype, *tensors):
    """grouped_mm's stride rule, for operands cast to dtype: every operand's non-unit stride a
    multiple of 16 bytes (a row's length for a row-major matrix, a column's for a column-major one:
    GPT.decode_layout)."""
    return all(max(t.stride()[-2:]) * dtype.itemsize % 16 == 0 for t in tensors)


def mlp_rows_grouped(x, order, lo, hi, w_fc, b_fc, w_proj, b_proj, approximate, out):
    """mlp_rows by grouped GEMMs: the rows of sorted positions lo, lo+1, ... gathered to the front
    (static N rows, wrapping past N), one group of hi - lo rows, then scattered back; the gathered
    rows past the group are garbage and only ever discarded."""
    N = x.size(0)
    # a range past the last row must not wrap around to the first ones
    lo, hi = lo.clamp(0, N), hi.clamp(0, N)
    i = torch.arange(N, device=x.device)
    rows = order.index_select(0, (i + lo) % max(N, 1))
    n = (hi - lo).clamp(0, N).to(torch.int32)
    h = _grouped_linear(x.index_select(0, rows), n, w_fc)
    h = F.gelu(h + b_fc if b_fc is not None else h, approximate=approximate)
    y = _grouped_linear(h.contiguous(), n, w_proj)
    y = y + b_proj if b_proj is not None else y
    keep = (i < n)[:, None]
    out.index_copy_(0, rows, torch.where(keep, y.to(out.dtype), out.index_select(0, rows)))


def mlp_rows_compact(x, order, lo, hi, w_fc, b_fc, w_proj, b_proj, approximate, out):
    """mlp_rows on exactly the rows in range: lo and hi read on the host (a sync)."""
    rows = order[int(lo):int(hi)]
    h = F.gelu(F.linear(x.index_select(0, rows), w_fc, b_fc), approximate=approximate)
    out.index_copy_(0, rows, F.linear(h, w_proj, b_proj).to(out.dtype))


def _rows_path(x, path, tensors):
    """The path a row function runs: the reference whenever autograd needs gradients through one
    of tensors (the kernels have no backward); for path None, default_path, its 'compact' read as
    the reference (a caller that passes no path asks for static shapes)."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        return 'reference'
    if path is None:
        path = default_path(x)
        return 'reference' if path == 'compact' else path
    return path


def mlp_rows(x, order, lo, hi, mlp, out, path=None):
    """For every lo <= i < hi: out[order[i]] = mlp(x[order[i]]) (dropout off); other rows of out are
    untouched; returns out. x, out (N, C); order (N,) from sort_by_mask; lo, hi: ints or 0-dim int
    tensors on x's device; mlp: c_fc, c_proj (nn.Linear, bias optional) and `approximate` for
    F.gelu. path: one of PATHS, None for default_path (its 'compact' read as the reference: a
    caller that passes no path asks for static shapes)."""
    w_fc, b_fc, w_proj, b_proj, approximate = _weights(mlp)
    path = _rows_path(x, path, (x, w_fc, b_fc, w_proj, b_proj))
    if path == 'reference':
        return mlp_rows_reference(x, order, lo, hi, mlp, out)
    check_triton_runs(path)
    dtype = matmul_dtype(x)             # as autocast casts F.linear's operands in the reference
    x, w_fc, b_fc, w_proj, b_proj = (
        t if t is None else t.to(dtype) for t in (x, w_fc, b_fc, w_proj, b_proj))
    if path == 'compact':
        mlp_rows_compact(x, order, lo, hi, w_fc, b_fc, w_proj, b_proj, approximate, out)
    elif path == 'grouped_mm' and _grouped_aligned(dtype, x, w_fc, w_proj):
        lo, hi = _as_count(lo, x.device), _as_count(hi, x.device)
        mlp_rows_grouped(x, order, lo, hi, w_fc, b_fc, w_proj, b_proj, approximate, out)
    elif path == 'grouped_mm':          # a width grouped_mm's strides cannot take
        return mlp_rows_reference(x, order, lo, hi, mlp, out)
    else:
        torch.ops.nanodepth.mlp_rows(x, order, _as_count(lo, x.device), _as_count(hi, x.device),
                                     w_fc, b_fc, w_proj, b_proj, approximate, out)
    return out


def check_triton_runs(path):
    if path == 'triton' and triton is None:
        raise RuntimeError("path 'triton' needs triton: pip install triton")
    if path == 'triton' and not TRITON_RUNS:
        raise RuntimeError("path 'triton' runs on a CUDA device, or on the CPU under "
                           "TRITON_INTERPRET=1 (set before routed_rows.py is imported)")


def prefix_linear(x, count, weight, bias=None, path=None):
    """F.linear(x, weight, bias) on the rows [0, count) of a packed buffer x (N, C); the rows past
    count hold unspecified values (garbage on the grouped_mm path, zeros or the product elsewhere).
    count: an int or a 0-dim int tensor on x's device. path as for mlp_rows."""
    path = _rows_path(x, path, (x, weight, bias))
    dtype = matmul_dtype(x)
    if path == 'reference' or (path == 'grouped_mm' and not _grouped_aligned(dtype, x, weight)):
        return F.linear(x, weight, bias)
    x, weight, bias = (t if t is None else t.to(dtype) for t in (x, weight, bias))
    if path == 'compact':
        n = int(count)
        out = x.new_zeros(x.size(0), weight.size(0))
        out[:n] = F.linear(x[:n], weight, bias)
        return out
    check_triton_runs(path)
    count = _as_count(count, x.device)
    if path == 'grouped_mm':
        y = _grouped_linear(x, count.clamp(0, x.size(0)).to(torch.int32), weight)
        return y + bias if bias is not None else y
    out = torch.empty(x.size(0), weight.size(0), dtype=x.dtype, device=x.device)
    order = torch.arange(x.size(0), device=x.device)
    torch.ops.nanodepth.proj_rows(x, order, torch.zeros_like(count), count, weight, bias, out)
    return out
