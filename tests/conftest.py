"""Shared pytest fixtures for nanodepth, the Hypothesis profiles, and the helpers for comparisons
whose two sides run different kernels (tests import them: `from conftest import FP32_TOL, ...`)."""
import os
import shutil
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

# --------------------------------------------------------------------------------------------------
# Hypothesis profiles, chosen here on purpose rather than by Hypothesis's own CI detection.
# Hypothesis (6.1xx+) loads a built-in 'ci' profile (derandomize=True, database=None,
# print_blob=True, deadline=None, too_slow suppressed) by itself whenever CI is set to *any* value
# (CI=false included) or a vendor variable (GITHUB_ACTIONS, ...) is present. Derandomized runs draw
# the same examples on every run, so a check that depends on a machine's floating-point kernels
# fails on that machine every time and nowhere else (a bitwise comparison of sparse-eval logits
# fails for some seeds on some CPUs only). We want that determinism in CI, stated here, the same in
# every Hypothesis version, and random exploration elsewhere:
#   ci : derandomize=True (the examples are a function of the test alone: no flakes, reproducible),
#        print_blob=True (a failure prints its @reproduce_failure blob), deadline=None (2 shared
#        cores: timings are noise), too_slow suppressed (a timing-based health check).
#   dev: randomized (new examples every run), deadline=None, too_slow suppressed; failures are kept
#        in the local .hypothesis/ database (gitignored) and replayed first.
# max_examples: every @given test sets its own budget with @settings(max_examples=...), and values
# given explicitly to @settings take precedence over the loaded profile, so both profiles run the
# same number of examples and differ only in how they are drawn. The profiles' 100 (Hypothesis's
# default) is a fallback for a test that names none.
# Selection: CI set and not '', 'false' or '0' (any case) -> 'ci', else 'dev'. Loaded when this
# conftest is imported, i.e. before any test module: @settings(...) is evaluated at decoration time
# and takes its unset fields from the profile loaded then.
# Both derive from Hypothesis's 'default' profile, not from whichever profile its CI detection
# already loaded (a profile registered without parent inherits the loaded one: 'dev' would get
# database=None).
_BASE = settings.get_profile('default')
settings.register_profile(
    'ci',
    _BASE,
    derandomize=True,
    database=None,
    print_blob=True,
    deadline=None,
    max_examples=100,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    'dev',
    _BASE,
    derandomize=False,
    print_blob=False,
    deadline=None,
    max_examples=100,
    suppress_health_check=[HealthCheck.too_slow],
)
HYPOTHESIS_PROFILE = (
    'ci' if os.environ.get('CI', '').strip().lower() not in ('', 'false', '0') else 'dev'
)
settings.load_profile(HYPOTHESIS_PROFILE)

# --------------------------------------------------------------------------------------------------
# processes the tests start
#
# Every process a test starts goes through start() / started() / run_group() / finish(): it runs
# in a session of its own (a group signal reaches it and whatever it forks without leaving the
# group), and its environment carries a tag of its own, NANODEPTH_TEST_GROUP, that every descendant
# inherits, also one that leaves the group (torchrun starts each worker in a new session). Ending a
# process ends its group and every process carrying its tag: SIGTERM, a grace period, then SIGKILL.
# Every process the tests start also inherits NANODEPTH_TEST_SESSION (set below in os.environ, so
# processes started some other way carry it too): at the end of the session one still alive fails
# the run (see pytest_sessionfinish). A pytest started by a test tags its processes under this tag.

SESSION_VAR, GROUP_VAR = 'NANODEPTH_TEST_SESSION', 'NANODEPTH_TEST_GROUP'
SESSION_TAG = '/'.join(filter(None, [os.environ.get(SESSION_VAR),
                                     f'nanodepth-tests-{os.getpid()}']))
os.environ[SESSION_VAR] = SESSION_TAG
_groups = []                    # every process start() started, for the end-of-session check


def start(args, **kw):
    """subprocess.Popen(args, **kw) in a new session, tagged; stdout/stderr piped as text unless kw
    says otherwise. End it with stop() (or use started() / finish() / run_group(), which do)."""
    tag = f'{SESSION_TAG}:{len(_groups)}'
    env = dict(kw.pop('env', None) or os.environ, **{SESSION_VAR: SESSION_TAG, GROUP_VAR: tag})
    kw.setdefault('stdout', subprocess.PIPE)
    kw.setdefault('stderr', subprocess.PIPE)
    kw.setdefault('text', True)
    proc = subprocess.Popen([str(a) for a in args], env=env, start_new_session=True, **kw)
    proc.group_tag = tag
    _groups.append(proc)
    return proc


def _stat(pid):
    """(state, parent pid) of a process, from /proc/<pid>/stat."""
    with open(f'/proc/{pid}/stat', 'rb') as f:
        fields = f.read().rpartition(b')')[2].split()
    return fields[0].decode(), int(fields[1])


def tagged_processes(var, value):
    """Live processes (not zombies, not this one) whose environment has var == value or var ==
    value/...; Linux (/proc) only: elsewhere [] (stop() then ends the process group alone)."""
    found, want, under = [], f'{var}={value}'.encode(), f'{var}={value}/'.encode()
    for entry in os.scandir('/proc') if os.path.isdir('/proc') else []:
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if _stat(entry.name)[0] == 'Z':
                continue
            with open(f'/proc/{entry.name}/environ', 'rb') as f:
                env = f.read().split(b'\0')
        except (OSError, IndexError, ValueError):       # gone meanwhile, or not ours to read
            continue
        if any(e == want or e.startswith(under) for e in env):
            found.append(int(entry.name))
    return found


def _signal_all(proc, sig):
    """sig to proc's process group and to every process carrying its tag; the pids signalled."""
    pids = tagged_processes(GROUP_VAR, proc.group_tag)
    for kill, target in [(os.killpg, proc.pid)] + [(os.kill, pid) for pid in pids]:
        try:
            kill(target, sig)
        except (ProcessLookupError, PermissionError):
            pass
    return pids


def _wait_all(proc, seconds):
    """Wait until proc has exited and nothing carries its tag; True if so within `seconds`."""
    deadline = time.time() + seconds
    while True:
        if proc.poll() is not None and not tagged_processes(GROUP_VAR, proc.group_tag):
            return True
        if time.time() > deadline:
            return False
        time.sleep(0.05)


def stop(proc, grace=10):
    """End proc, its process group and every process carrying its tag: SIGTERM, up to `grace` s for
    them to exit, then SIGKILL. Closes proc's pipes (read what you need first)."""
    if not _wait_all(proc, 0):
        _signal_all(proc, signal.SIGTERM)
        if not _wait_all(proc, grace):
            _signal_all(proc, signal.SIGKILL)
            _wait_all(proc, 10)
    for pipe in (proc.stdin, proc.stdout, proc.stderr):
        if pipe is not None:
            pipe.close()
    proc.wait()


@contextmanager
def started(args, **kw):
    """with started(args) as proc: ... the process and all it started end on leaving, however."""
    proc = start(args, **kw)
    try:
        yield proc
    finally:
        stop(proc)


def finish(proc, timeout=180, input=None):
    """proc.communicate within timeout, as a CompletedProcess. On a timeout, everything proc
    started is ended and TimeoutExpired raised; a process of its group or tag that outlives it by
    more than 5 s is ended and fails the test (a command that exits leaves nothing running)."""
    deadline, exited, left = time.time() + timeout, None, []
    try:
        while True:
            try:        # in short slices: an orphan holding the pipes would block to the timeout
                slice_s = max(0.01, min(1, deadline - time.time()))
                stdout, stderr = proc.communicate(input, timeout=slice_s)
                break
            except subprocess.TimeoutExpired:
                input = None            # sent by the first call (a retry may not pass it again)
                if time.time() > deadline:
                    raise
                if proc.poll() is not None:
                    exited = exited or time.time()
                    if time.time() > exited + 5 and not left:
                        left = _signal_all(proc, signal.SIGKILL)
        if not left and not _wait_all(proc, 5):
            left = _signal_all(proc, signal.SIGKILL)
    finally:
        stop(proc)
    assert not left, f"{proc.args} exited ({proc.returncode}) but left {left} running (killed)"
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def run_group(args, timeout, input=None, **kw):
    """subprocess.run(args, capture_output=True, text=True, timeout=timeout, **kw), the process in a
    session of its own and ended with all it started on every path (see finish)."""
    if input is not None:
        kw.setdefault('stdin', subprocess.PIPE)
    return finish(start(args, **kw), timeout, input)


# worker pools that libraries run under the pytest process and end with it: not leaks
LIBRARY_POOLS = (b'torch/_inductor/compile_worker',)      # torch.compile's parallel compile workers


def _cmdline(pid):
    with open(f'/proc/{pid}/cmdline', 'rb') as f:
        return f.read().replace(b'\0', b' ')


def leftover_processes():
    """Processes started during this session that are still alive: every process carrying this
    session's tag (children, orphans, helpers' descendants), except a library's worker pool under
    this process (LIBRARY_POOLS) and what it started; plus, where /proc is missing, the helpers'."""
    left = set()
    for pid in tagged_processes(SESSION_VAR, SESSION_TAG):
        chain, ancestor = [], pid
        try:
            while ancestor not in (0, 1, os.getpid()) and len(chain) < 64:
                chain.append(_cmdline(ancestor))
                ancestor = _stat(ancestor)[1]
        except (OSError, IndexError, ValueError):   # an ancestor exited meanwhile
            pass
        if not any(pool in cmd for cmd in chain for pool in LIBRARY_POOLS):
            left.add(pid)
    for proc in _groups:
        if proc.poll() is None:
            left.add(proc.pid)
    return sorted(left)


def pytest_sessionfinish(session, exitstatus):
    """Fail the run if a process the tests started outlived them (and kill it)."""
    left = leftover_processes()
    if not left:
        return
    lines = []
    for pid in left:
        try:
            lines.append(f"  {pid}: {_cmdline(pid).decode(errors='replace')[:200]}")
        except OSError:
            lines.append(f"  {pid}")
        for kill, target in ((os.kill, pid), (os.killpg, pid)):
            try:
                kill(target, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    msg = (f"{len(left)} process(es) started by the tests were still running at the end of the "
           f"session (now killed):\n" + '\n'.join(lines))
    reporter = session.config.pluginmanager.get_plugin('terminalreporter')
    if reporter is not None:
        reporter.write_line(msg, red=True, bold=True)
    else:
        print(msg, file=sys.stderr)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


SHARED_GPT2 = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "gpt2"
TIKTOKEN_FILES = {"vocab.bpe": "6d1cbeee0f20b3d9449abfede4726ed8212e3aee",
                  "encoder.json": "6c7ea1a7e38e3a7f062df639a5b80947f075ffe6"}


@pytest.fixture(scope="session", autouse=True)
def tiktoken_cache(tmp_path_factory):
    """Serve tiktoken's gpt2 files offline from <repo>/../shared/data/gpt2 via TIKTOKEN_CACHE_DIR.

    Yields the cache folder, or None when the shared files are absent; tests that need the gpt2
    encoding should then skip (`if tiktoken_cache is None: pytest.skip(...)`).
    """
    if not all((SHARED_GPT2 / name).is_file() for name in TIKTOKEN_FILES):
        yield None
        return
    cache = tmp_path_factory.mktemp("tiktoken_cache")
    for name, key in TIKTOKEN_FILES.items():
        shutil.copyfile(SHARED_GPT2 / name, cache / key)
    old = os.environ.get("TIKTOKEN_CACHE_DIR")
    os.environ["TIKTOKEN_CACHE_DIR"] = str(cache)
    yield cache
    if old is None:
        os.environ.pop("TIKTOKEN_CACHE_DIR", None)
    else:
        os.environ["TIKTOKEN_CACHE_DIR"] = old


@pytest.fixture(scope="session", autouse=True)
def threads_per_worker():
    """Under pytest-xdist each of N workers, and the processes its tests start, get cpu_count // N
    intra-op threads (at least 1), unless OMP_NUM_THREADS is set: N workers each using every core
    oversubscribe the machine, and an op's threads then wait on each other (a test of 1 s alone
    took 15-20 s beside another worker on 2 cores)."""
    import torch
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1 and "OMP_NUM_THREADS" not in os.environ:
        threads = max(1, (os.cpu_count() or 1) // workers)
        os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)
    yield


@pytest.fixture(scope="module")
def one_thread():
    """Tiny ops: intra-op threads only add synchronisation (10-100x slower on a loaded 2-core box).
    Modules opt in with `pytestmark = pytest.mark.usefixtures('one_thread')`."""
    import torch
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


# --------------------------------------------------------------------------------------------------
# a tiny trained run the script tests read (sample.py, eval.py and the command-line errors)

@pytest.fixture(scope="session")
def run(tmp_path_factory):
    """A 2-iteration routed run on the synthetic corpus (prepared into its own data_dir), trained
    once per pytest run. Only read: a test that damages a checkpoint copies it first."""
    root = tmp_path_factory.mktemp("run")
    r = run_group(
        [
            sys.executable,
            "train.py",
            "--max_iters=2",
            "--eval_interval=2",
            "--eval_iters=1",
            "--batch_size=2",
            "--block_size=16",
            "--n_layer=1",
            "--n_embd=32",
            "--n_head=2",
            "--device=cpu",
            f"--out_dir={root / 'out'}",
            f"--data_dir={root / 'data'}",
        ],
        180,
        cwd=Path(__file__).resolve().parents[1],
        env={**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return root


# --------------------------------------------------------------------------------------------------
# comparisons across kernels
#
# Bitwise equality (torch.equal) is right only when both sides run the same kernels on the same
# shapes. Where they do not (sparse eval gathers a data-dependent number of tokens into one matmul;
# a KV-cache step has T=1 and a masked attention where recomputation has T and is_causal; a ragged
# batch has other B and T than a prompt alone), CPU BLAS/oneDNN may block and vectorise the same
# sums differently, so values differ in the last bits on some machines (4e-7 seen on one). Those
# checks compare decisions (routing masks, tokens) exactly and values within a stated tolerance.

# fp32 tolerances for such checks. Reassociation error is ~1 ulp (6e-8 relative) per op and
# compounds over layers and decoding steps; a real bug (a token routed wrongly, a future token
# leaking, a wrong position) moves logits by >> 1e-3.
# FP32_TOL: the dense model and TSA (backbones at init scale): differences measured <= 0.007 of
# FP32_TOL over this machine's kernel variants (ATEN_CPU_CAPABILITY=default/avx2,
# MKL_CBWR=COMPATIBLE, 1-2 threads).
FP32_TOL = dict(rtol=1e-5, atol=1e-5)
# ROUTED_TOL: routed models whose every weight is noised by 0.3 (large activations, up to 4 layers):
# differences of 4e-7 seen on another machine; measured here up to 0.12 of FP32_TOL in one forward
# and 0.39 of it over step-by-step decoding, so 1e-4 (as test_families' KV-cache check uses) for >
# 25x room.
ROUTED_TOL = dict(rtol=1e-4, atol=1e-4)


def greedy_trace(model, idx, new, **kw):
    """Greedy-decode with model.generate(idx, new, temperature=0, **kw), recording every forward it
    makes. Returns one (tokens (new,), logits (new, V), masks, margins) per row: the logits each
    step's token is the argmax of, and per step {layer: the routing decisions of the positions that
    step added} (step 0: the prompt, row b's first lengths[b] positions when kw has lengths; later:
    the new one) and {layer: those decisions' margins} (aux['margins']: how far each was from
    flipping)."""
    import torch
    lengths = kw.get('lengths')
    calls, orig = [], model.forward

    def forward(*args, **kwargs):
        out = orig(*args, **kwargs)
        calls.append((out[0], out[2].get('masks', {}), out[2].get('margins', {})))
        return out
    model.forward = forward             # the instance attribute shadows GPT.forward for __call__
    try:
        out = model.generate(idx, new, temperature=0, **kw)
    finally:
        del model.forward
    assert len(calls) == new
    rows = []
    for b in range(idx.size(0)):
        n = lengths[b] if lengths is not None else idx.size(1)
        logits, masks, margins = [], [], []
        for s, (lg, m, g) in enumerate(calls):
            ragged_prefill = s == 0 and lengths is not None      # all positions of the padded batch
            logits.append(lg[b, n - 1] if ragged_prefill else lg[b, -1])
            masks.append({l: v[b, :n] if s == 0 else v[b, -1:] for l, v in m.items()})
            margins.append({l: v[b, :n] if s == 0 else v[b, -1:] for l, v in g.items()})
        rows.append((out[b][n:n + new], torch.stack(logits), masks, margins))
    return rows


def assert_greedy_traces_agree(a, b, tol=FP32_TOL):
    """a, b: greedy_trace rows of one prompt decoded two ways that run different kernels (KV cache
    vs recompute, a ragged batch vs the prompt alone). While both decoders see the same context and
    route it the same way, their logits are equal within tol. The same context: the steps up to
    and including the first whose tokens differ. The same routing: up to the first (step, layer)
    whose decisions differ. Both may end early only at a near-tie that tol covers (the setup cannot
    exclude them: random weights give top-2 gaps down to ~1e-4 in a few hundred steps):
    - tokens: logits within atol + rtol·|l| of each other can pick different argmaxes only if the
      gap between the two picks is <= 2·(atol + rtol·max|l|);
    - routing decisions: each is the sign of a margin (aux['margins'], a gate's score minus its
      threshold), and the two decoders' margins of a flipped decision must straddle 0 within tol
      of each other, so both are within atol + rtol·|margin| of the threshold. A flip in a layer
      with no margin (a decision no gate took) is a divergence.
    After either, the contexts differ, and the rest is not compared."""
    import torch
    (ta, la, ma, ga), (tb, lb, mb, gb) = a, b
    assert ta.shape == tb.shape and la.shape == lb.shape
    flips = (ta != tb).nonzero()
    n = flips[0, 0].item() + 1 if len(flips) else len(ta)        # steps with a common context
    for s in range(n):
        assert ma[s].keys() == mb[s].keys()
        for l in sorted(ma[s]):
            differ = ma[s][l] != mb[s][l]
            if not differ.any():
                continue
            assert l in ga[s] and l in gb[s], f'step {s}, layer {l}: decisions differ, no margin'
            x, y = ga[s][l][differ], gb[s][l][differ]
            assert (x * y <= 0).all(), f'step {s}, layer {l}: decisions differ, margins agree'
            torch.testing.assert_close(
                x, y, **tol, msg=lambda m: f'step {s}, layer {l}: decisions differ, not a near-tie'
                                           f' (margins {x.tolist()} vs {y.tolist()}): {m}')
            torch.testing.assert_close(la[:s], lb[:s], **tol)
            return                      # this step's hidden states differ from here on
    torch.testing.assert_close(la[:n], lb[:n], **tol)
    if len(flips):
        s, x, y = n - 1, ta[n - 1].item(), tb[n - 1].item()
        gap = (lb[s, y] - lb[s, x]).abs().item()
        assert gap <= 2 * (tol['atol'] + tol['rtol'] * lb[s].abs().max().item()), \
            f'step {s}: greedy tokens {x} vs {y}, not a near-tie (gap {gap:.3g})'


# --------------------------------------------------------------------------------------------------
# tiny models of the routing families: test_families.py (the promises every family keeps) and the
# per-family files (test_mod.py, test_exit.py, test_ensemble.py) build them the same way

SETTINGS = dict(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
V = 23
BASE = dict(
    block_size=24, vocab_size=V, n_head=2, n_embd=16, ffn_gate_hidden=8, mod_predictor_hidden=8
)

# the gates/options that change each family's code path; build(route, opt) takes option set `opt`,
# and a family without an entry here is built with its defaults
EXAMPLES = {
    'mod': [
        dict(),
        dict(mod_infer_rule='predictor'),
        dict(mod_router='random'),
        dict(mod_layers='all', pos='rope'),
    ],
    'exit': [
        dict(),
        dict(exit_head='own', exit_layers='every', exit_schedule='calm'),
        dict(exit_conf='margin', exit_threshold=0.05),
        dict(exit_conf='saturation', exit_threshold=0.5),
    ],
    'ensemble': [
        dict(),
        dict(ens_mix='prob', ens_router_input='mean', ens_distill='mixture'),
        dict(ens_mix='logit', ens_layers=1, ens_teacher_lm_weight=0.5),
    ],
    'halt': [dict(), dict(halt_hard='binary', halt_tau=0.3)],
    'ffn': [
        dict(ffn_gate='mlp', ffn_cheap_rank=4),
        dict(ffn_gate='random', ffn_cheap_rank=4),
        dict(ffn_gate='mlp', ffn_cheap_rank=4, ffn_layers='1,2', ffn_draft_rank=3),
    ],
}


def build(route, opt=0, seed=0, n_layer=4, noise=0.3, **kw):
    """A tiny model of the family; `noise` moves every parameter off its init so routers, exits and
    mixtures make non-trivial, tie-free decisions."""
    import torch
    from model import GPT, GPTConfig
    args = dict(BASE, n_layer=n_layer, route=route, **EXAMPLES.get(route, [dict()])[opt])
    args.update(kw)
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**args))
    g = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(noise * torch.randn(p.shape, generator=g))
    return model


def dense_twin(model):
    """A route='none' GPT carrying model's backbone weights (its routing modules dropped)."""
    from model import GPT, GPTConfig
    cfg = GPTConfig(**{**model.config.__dict__, 'route': 'none', 'ffn_layers': 'auto'})
    dense = GPT(cfg)
    missing, _ = dense.load_state_dict(model.state_dict(), strict=False)
    assert not [k for k in missing if not k.endswith('.attn.bias')]
    return dense.eval()


def tokens(seed, B, T):
    import torch
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


def seeded(fn, seed=0):
    """Run fn with the RNG reset, so random gates draw the same decisions each time."""
    import torch
    torch.manual_seed(seed)
    return fn()


def cached_decode(model, idx, T0, sparse, prefill_pos=True):
    """A cached prefill of idx[:, :T0] (positions given, or None for 0..T0-1) and one-token steps
    over the rest: (last-position logits per forward, each forward's masks, the cache)."""
    import torch
    B = idx.size(0)
    cache, steps, masks = model.new_cache(B, 'cpu'), [], []
    for lo, hi in [(0, T0)] + [(t, t + 1) for t in range(T0, idx.size(1))]:
        pos = torch.arange(lo, hi).expand(B, -1) if lo or prefill_pos else None
        logits, _, aux = model(idx[:, lo:hi], pos=pos, cache=cache, sparse=sparse)
        steps.append(logits[:, -1])
        masks.append(aux['masks'])
    return torch.stack(steps), masks, cache


def assert_decodes_agree(a, b, tol):
    """Two cached_decode results: equal decisions and cache positions, logits and K/V within
    tol."""
    import torch
    for x, y in zip(a[1], b[1]):
        assert x.keys() == y.keys() and all(torch.equal(x[l], y[l]) for l in x)
    torch.testing.assert_close(a[0], b[0], **tol)
    assert torch.equal(a[2].kpos, b[2].kpos)
    for x, y in zip(a[2].k + a[2].v, b[2].k + b[2].v):
        torch.testing.assert_close(x, y, **tol)


def decode_with_and_without_idle_shortcut(model, family_module, idx, T0, prefill_pos, tol):
    """cached_decode of a halt or exit model on the compact path three ways: as it runs (blocks no
    token runs write only their K/V), with that shortcut off (family_module's exec_path patched:
    the whole block runs) and masked (sparse=False). Asserts the first bit for bit equal to the
    second and within tol of the third. Returns (idle blocks over all forwards, Block.write_kv
    calls)."""
    from unittest import mock

    from model import Block
    writes, write_kv = [], Block.write_kv
    with mock.patch.object(Block, 'write_kv', lambda *a: writes.append(1) or write_kv(*a)):
        got = cached_decode(model, idx, T0, True, prefill_pos)
    with mock.patch.object(family_module, 'exec_path', lambda *a: 'shortcut off'):
        whole = cached_decode(model, idx, T0, True, prefill_pos)
    masked = cached_decode(model, idx, T0, False, prefill_pos)
    assert_decodes_agree(got, whole, dict(atol=0.0, rtol=0.0))
    assert_decodes_agree(got, masked, tol)
    return sum(int(m[l].sum() == 0) for m in got[1] for l in m), len(writes)


def counted(fn):
    """FLOPs of fn() by torch's FlopCounterMode, attention in the math kernel (the fused CPU one is
    not counted)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fc:
        fn()
    return fc.get_total_flops()


def grouped_mm_on_cpu():
    """Whether this torch runs grouped_mm on the CPU (2.9 and later; 2.8 has it on CUDA only):
    a test that forces the path on the CPU skips without it (NO_CPU_GROUPED_MM)."""
    import torch
    import routed_rows
    return 'grouped_mm' in routed_rows.available_paths(torch.device('cpu'), torch.float32)


NO_CPU_GROUPED_MM = 'torch before 2.9 has no CPU kernel for grouped_mm'


def cpu_paths(*paths):
    """paths as test parameters, grouped_mm's skipping where the CPU cannot run it."""
    return [pytest.param(p, marks=pytest.mark.skipif(not grouped_mm_on_cpu(),
                                                     reason=NO_CPU_GROUPED_MM))
            if p == 'grouped_mm' else p for p in paths]


def cpu_path_choices(*paths):
    """paths less grouped_mm where the CPU cannot run it (Hypothesis's sampled_from)."""
    return [p for p in paths if p != 'grouped_mm' or grouped_mm_on_cpu()]
