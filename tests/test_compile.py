"""The GPU-execution contract, checked on a CPU: the training step, the eval prefill (sparse
execution in 'static' mode) and one cached decoding step of every family in the registry, with each
of its option sets in conftest.EXAMPLES (its defaults without any), trace with
torch.compile(fullgraph=True) without graph breaks and compile once per shape (new data of the same
shape never recompiles); 'static' execution makes the decisions of 'compact' execution and of the
masked-dense reference exactly, with values within tolerance. Compiled greedy decoding, plain and
self-speculative, gives the tokens of eager decoding (up to a near-tie), from logits within
tolerance."""
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings, strategies as st

import speculative
from conftest import (NO_CPU_GROUPED_MM, ROUTED_TOL, assert_greedy_traces_agree,
                      cpu_path_choices, greedy_trace, grouped_mm_on_cpu)
from model import FAMILIES as REGISTRY, GPT
from test_families import (CASES, SETTINGS, as_float, build, is_random, seeded,
                           speculative_trace_row, tokens)

pytestmark = pytest.mark.usefixtures('one_thread')      # tiny ops: see conftest.py

ROUTES = list(REGISTRY)
B, T = 2, 12


def train_loss(model):
    """The training step's forward + loss, with the family's per-step options of step 0."""
    run = SimpleNamespace(seed=0, ffn_oracle_layers_per_step=1, trainable='all')
    opts = model.family.step_options(model, 0, run)
    return lambda idx: model(idx, idx, **opts)[1]


def eval_prefill(model):
    return lambda idx: model(idx, last_only=False, exec_mode='static')[0]


def break_reasons(explained):
    return [
        f"{r.reason} at {r.user_stack[-1] if r.user_stack else '?'}"
        for r in explained.break_reasons
    ]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles its own models: no cache entries (or cache limits) carried over."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.skipif(not grouped_mm_on_cpu(), reason=NO_CPU_GROUPED_MM)
@pytest.mark.parametrize('route', ROUTES)
def test_grouped_mm_eval_and_decode_trace_without_graph_breaks_in_bf16(route):
    """The CPU's traced path under bf16 autocast (routed_rows.choose_path): the eval prefill and a
    decoding step of every family on the grouped GEMM path are one graph each, with the grouped
    GEMM in it wherever the family runs an FFN on a subset of tokens."""
    model = build(route).eval()
    model.exec_mode = 'grouped_mm'
    with torch.no_grad(), torch.autocast('cpu', dtype=torch.bfloat16):
        prefill = torch._dynamo.explain(
            lambda idx: model(idx, last_only=False)[0])(tokens(0, B, T))
        tok, pos, cache = prefilled(model, [6, 3])
        decode = torch._dynamo.explain(model.decode_step)(tok, pos, cache)
    for e in (prefill, decode):
        assert e.graph_break_count == 0, break_reasons(e)
        assert e.graph_count == 1
    if route in ('ffn', 'halt', 'exit', 'mod'):
        assert 'grouped_mm' in str(prefill.graphs[0].graph)


@pytest.mark.parametrize('case', CASES)
@pytest.mark.parametrize('training', [True, False])
def test_compiled_once_never_recompiles_on_new_data(case, training):
    """The training step and the static eval prefill trace whole (fullgraph: a graph break raises,
    naming its cause), and per-layer Python state (layer ids, the sets and dicts of the routing
    context, capacities) is constant per model, so a second batch of the same shape reuses the
    first compilation."""
    model = build(*case).train(training)
    fn = torch.compile(
        train_loss(model) if training else eval_prefill(model),
        backend='eager',
        fullgraph=True,
        dynamic=False,
    )
    with torch.set_grad_enabled(training):
        fn(tokens(0, B, T))
        with torch.compiler.set_stance('fail_on_recompile'):
            fn(tokens(1, B, T))
            fn(tokens(2, B, T))


@settings(**{**SETTINGS, 'max_examples': 16})
@given(case=st.sampled_from(CASES), seed=st.integers(0, 999), T=st.integers(1, 16),
       B=st.integers(1, 3))
def test_static_execution_equals_compact_and_masked_dense(case, seed, T, B):
    """Same decisions exactly; values within ROUTED_TOL: the paths run matmuls over different row
    sets (all rows, the gathered selected rows, each row padded to the longest, a grouped GEMM's
    group), which fp32 BLAS rounds differently in the last bits."""
    model = build(*case, seed=seed).eval()
    idx = tokens(seed, B, T)
    with torch.no_grad():
        ref = seeded(lambda: model(idx, idx, sparse=False))
        for mode in cpu_path_choices('static', 'compact', 'grouped_mm'):
            logits, _, aux = seeded(lambda: model(idx, idx, exec_mode=mode))
            torch.testing.assert_close(logits, ref[0], **ROUTED_TOL)
            assert aux.get('masks', {}).keys() == ref[2].get('masks', {}).keys()
            for l in aux.get('masks', {}):
                assert torch.equal(aux['masks'][l], ref[2]['masks'][l]), (mode, l)


# --------------------------------------------------------------------------------------------------
# decoding

def prefilled(model, lengths, seed=0):
    """A cache holding ragged prompts (row b: lengths[b] tokens) and the next step's inputs: each
    row's token at its own position, as generate's ragged path feeds them."""
    n = len(lengths)
    idx = tokens(seed, n, max(lengths))
    cache = model.new_cache(n, idx.device)
    with torch.no_grad():
        model(idx, pos=torch.arange(idx.size(1)).expand(n, -1), cache=cache)
    return tokens(seed + 1, n, 1), torch.tensor(lengths)[:, None], cache


@pytest.mark.parametrize('case', CASES)
def test_decode_step_compiles_once_for_every_step(case):
    """The decoding step traces whole (fullgraph: a graph break raises); positions are a device
    tensor, so later steps (and other rows' positions) reuse the graph."""
    model = build(*case).eval()
    tok, pos, cache = prefilled(model, [6, 3])
    step = torch.compile(model.decode_step, backend='eager', fullgraph=True, dynamic=False)
    with torch.no_grad():
        step(tok, pos, cache)
        with torch.compiler.set_stance('fail_on_recompile'):
            step(tok, pos + 1, cache)
            step(tokens(5, 2, 1), pos + 2, cache)



@pytest.mark.slow
def test_compiled_decode_step_writes_the_cache_in_place():
    """Inductor's decoding step writes the new K/V into the cache in place: no generated kernel
    loops over a whole layer's K. A cache stacked over layers (a write into the view k[layer]) and
    a scatter_ into a layer's own tensor were both compiled into a copy of everything they wrote
    into, at every layer and step (the compiled 124M step of the stacked cache took 2.4x the eager
    one on the CPU at batch 1, 7.4x at batch 8)."""
    import re
    from torch._inductor.utils import run_and_get_code
    model = build('none', n_layer=2, block_size=512).eval()
    tok, pos, cache = prefilled(model, [6, 3])
    step = torch.compile(model.decode_step, fullgraph=True, dynamic=False)
    with torch.no_grad():
        _, code = run_and_get_code(step, tok, pos, cache)
    bounds = [int(b) for b in re.findall(r'x\d+\s*<\s*(?:static_cast<int64_t>\()?(\d+)L?',
                                          '\n'.join(code))]
    assert bounds, 'no loop bounds found: the generated code changed form; update the pattern'
    assert max(bounds) < cache.k[0].numel(), sorted(set(bounds))


@pytest.mark.parametrize('route', ROUTES)
def test_decode_step_compiles_once_per_attended_bucket(route):
    """The attended length (KVCache.bucket) is static per bucket: steps within a bucket reuse its
    graph, a new bucket compiles one more, and returning to a bucket reuses its graph."""
    model = build(route, seed=2, block_size=160).eval()
    tok, pos, cache = prefilled(model, [62, 40])
    step = torch.compile(model.decode_step, backend='eager', fullgraph=True, dynamic=False)
    torch._dynamo.utils.counters.clear()
    with torch.no_grad():
        cache.attend_to(63)
        step(tok, pos, cache)
        with torch.compiler.set_stance('fail_on_recompile'):
            cache.attend_to(64)
            step(tok, pos + 1, cache)
        cache.attend_to(65)
        step(tokens(5, 2, 1), pos + 2, cache)
        with torch.compiler.set_stance('fail_on_recompile'):
            cache.attend_to(128)
            step(tok, pos + 3, cache)
            cache.attend_to(64)
            step(tok, pos + 1, cache)
    assert cache.attend_len == 64
    assert torch._dynamo.utils.counters['stats']['unique_graphs'] == 2

@pytest.mark.parametrize('route', ROUTES)
def test_static_decoding_equals_compact_decoding(route):
    """Eager greedy decoding in both modes, a ragged batch: every step's routing decisions equal,
    logits within ROUTED_TOL (matmuls over different row sets round differently in the last
    bits)."""
    model = build(route, seed=4).eval()
    idx, lengths = tokens(4, 3, 7), [7, 3, 5]
    traces = {}
    for mode in ('static', 'compact'):
        model.exec_mode = mode
        traces[mode] = greedy_trace(model, idx, 6, lengths=lengths)
    for a, b in zip(traces['static'], traces['compact']):
        assert_greedy_traces_agree(a, b, tol=ROUTED_TOL)


def sampled_trace(model, idx, new, **kw):
    """generate(idx, new, temperature=1.0, top_k=1, **kw) (greedy: top_k=1 is an argmax),
    recording the logits each token was picked from; one greedy_trace-like row (tokens, logits,
    masks, margins) per prompt. The compiled step returns statistics, not masks: every step's masks
    and margins are {} here."""
    calls, orig = [], model.sample_next

    def sample_next(logits, *args):
        calls.append(logits.detach().clone())
        return orig(logits, *args)
    model.sample_next = sample_next     # the instance attribute shadows the static method
    try:
        out = model.generate(idx, new, temperature=1.0, top_k=1, **kw)
    finally:
        del model.sample_next
    assert len(calls) == new
    lengths = kw.get('lengths') or [idx.size(1)] * idx.size(0)
    return [
        (out[b][n : n + new], torch.stack([c[b] for c in calls]), [{}] * new, [{}] * new)
        for b, n in enumerate(lengths)
    ]


def compiled_decoding_case(route, batches, backend=None, monkeypatch=None):
    """Greedy tokens (top_k=1) of generate(compile=True) are eager generate's, for each of batches
    (generate's keyword arguments: {} equal prompts, {'lengths': ...} a ragged batch), and so are
    the logits they are picked from, within ROUTED_TOL: the compiled step runs sparse execution
    'static' (every row, device-side counts) where eager runs it 'compact' (the gathered rows),
    matmuls of other shapes, so a near-tie may pick the other token (assert_greedy_traces_agree).
    backend: replace the default compiler (inductor) by a cheaper one. Returns how many graphs each
    generate compiled."""
    model = build(route, seed=3).eval()
    if backend is not None:
        monkeypatch.setattr(
            model,
            'decode_step_fn',
            lambda device, compile: (
                torch.compile(model.decode_step, backend=backend, fullgraph=True, dynamic=False)
                if compile
                else model.decode_step
            ),
        )
    idx = tokens(3, 2, 6)
    graphs = []
    with torch.no_grad():
        for kw in batches:
            eager = sampled_trace(model, idx, 5, **kw)
            torch._dynamo.reset()
            torch._dynamo.utils.counters.clear()
            compiled = sampled_trace(model, idx, 5, compile=True, **kw)
            graphs.append(torch._dynamo.utils.counters['stats']['unique_graphs'])
            for a, b in zip(eager, compiled):
                assert_greedy_traces_agree(a, b, tol=ROUTED_TOL)
    return graphs


@pytest.mark.parametrize('route', ROUTES)
def test_traced_greedy_decoding_gives_the_eager_tokens(route, monkeypatch):
    """The captured step graph (static execution) replayed without code generation, for every
    family, on equal prompts and on a ragged batch (rows at different positions); each decoding
    compiles its step once (positions are a device tensor, the fed token a fresh tensor of fixed
    strides)."""
    assert compiled_decoding_case(route, [dict(), dict(lengths=[6, 2])], 'eager', monkeypatch) == [
        1,
        1,
    ]


def with_every_draft():
    """Each family's first deterministic option set, and any other that offers a draft it lacks
    (ffn's distilled draft)."""
    def drafts(case):
        model = build(*case)
        return set(model.family.drafts(model.config))
    chosen, seen = [], {}
    for case in (c for c in CASES if not is_random(c)):
        new = drafts(case) - seen.get(case[0], set())
        if case[0] not in seen or new:
            chosen.append(case)
            seen[case[0]] = seen.get(case[0], set()) | new
    return chosen


def speculative_trace_cases():
    """(case, passes): every family's drafts apart and chained (whose graph calls the whole pass,
    one_graph's function), but ffn's first option set (every layer routed) apart only, as ffn2
    (two layers routed, a distilled draft besides) is traced chained with the same draft names;
    one_graph alone for two families (its own graph count)."""
    cases = [(c, p) for c in with_every_draft() for p in ('apart', 'chained')
             if (c, p) != (('ffn', 0), 'chained')]
    return [pytest.param(c, p, id=f'{c[0]}{c[1]}-{p}')
            for c, p in [*cases, (('exit', 0), 'one_graph'), (('mod', 0), 'one_graph')]]


@pytest.mark.parametrize('case, passes', speculative_trace_cases())
def test_traced_speculative_decoding_gives_plain_decodings_tokens(case, passes, monkeypatch):
    """speculative.generate(compile=True) with each of the family's drafts: each pass's draft and
    verification traced whole (fullgraph, static execution; the graphs run without code
    generation), apart, with one_graph as one function or with two passes chained in one
    (passes_per_graph=2), on a ragged batch, gives each prompt's plain eager greedy decode (tokens
    up to a near-tie, decisions, logits within ROUTED_TOL). At most one graph for the draft and
    one for the verifier, one in all with one_graph, and with chained passes one for them and at
    most one for the passes after (this model has one attended bucket and one window length); a
    second decoding compiles nothing."""
    import collections
    graphs = collections.Counter()

    def compiled(step, device):
        def backend(gm, example_inputs):        # eager, counting each step's graphs
            graphs[step.__name__] += 1
            return gm.forward
        return torch.compile(step, backend=backend, fullgraph=True, dynamic=False)
    monkeypatch.setattr(GPT, 'compiled', staticmethod(compiled))
    model = build(*case, seed=5).eval()
    lens, new, K = [6, 3], 9, 3
    idx = tokens(5, 2, 6)
    # (the verification is the same function whatever the draft: compiled for the first one only)
    want = {'apart': ({'draft_pass': 1, 'verify_pass': 1}, {'draft_pass': 1}),
            'one_graph': ({'whole_pass': 1},),
            'chained': ({'chained_passes': 1}, {'chained_passes': 1, 'whole_pass': 1})}[passes]
    for draft in sorted(model.family.drafts(model.config)):
        runs = []
        for _ in range(2):
            graphs.clear()
            trace = {}
            out = speculative.generate(model, idx, new, K, draft, temperature=0, lengths=lens,
                                       trace=trace, compile=True, one_graph=passes != 'apart',
                                       passes_per_graph=2 if passes == 'chained' else 1)
            runs.append(dict(graphs))
        assert runs[0] in want and runs[1] == {}, f'draft {draft!r}: graphs per run {runs}'
        for b, n in enumerate(lens):
            alone = as_float(greedy_trace(model, idx[b:b + 1, :n], new)[0])
            spec = speculative_trace_row(trace, out, b, n, new)
            assert_greedy_traces_agree(spec, alone, ROUTED_TOL)


@pytest.mark.skipif(speculative.repeated_pass is speculative.whole_pass,
                    reason='this torch has no hierarchical compilation of a pass that writes the '
                           'cache: chained passes unroll')
def test_chained_passes_hold_their_pass_once(monkeypatch):
    """passes_per_graph=P: the graph of P chained passes calls one compiled pass P times, rather
    than holding P copies of it, each compiled anew (a cold compile of 4 chained passes took 83-101
    s on a GPU machine unrolled); the decode is plain decoding's (the test above)."""
    chained = []

    def compiled(step, device):
        def backend(gm, example_inputs):
            if step.__name__ == 'chained_passes':
                chained.append([n.args[0].target for n in gm.graph.nodes
                                if n.target is torch.ops.higher_order.invoke_subgraph])
            return gm.forward
        return torch.compile(step, backend=backend, fullgraph=True, dynamic=False)
    monkeypatch.setattr(GPT, 'compiled', staticmethod(compiled))
    model = build('exit', seed=5).eval()
    speculative.generate(model, tokens(5, 2, 6), 16, 2, temperature=0, compile=True,
                         passes_per_graph=3)
    assert len(chained) == 1 and len(chained[0]) == 3 and len(set(chained[0])) == 1, chained


def test_traced_speculative_decoding_across_batches_buckets_and_short_windows(monkeypatch):
    """One process decoding compiled at batch 1 (K = 1) and 2 (K = 4), each decode crossing the
    attended buckets (64, then all 100 slots) and ending in passes whose window is cut short by
    block_size: the verifier compiles a graph per batch, bucket and window length, over dynamo's
    recompile limit (torch's default is 8; lowered to 3 here, so that fewer graphs show the same),
    which GPT.compiled raises rather than fail; every decode gives plain eager greedy decoding's
    tokens (up to a near-tie). A deep copy of the model decodes with its own weights."""
    import collections
    import copy
    graphs = collections.Counter()
    torch_compile = torch.compile

    def counting_compile(step, **options):
        options.pop('options', None)            # inductor's, for a backend that is not inductor

        def backend(gm, example_inputs):        # eager, counting each step's graphs
            graphs[step.__name__] += 1
            return gm.forward
        return torch_compile(step, backend=backend, **options)
    monkeypatch.setattr(torch, 'compile', counting_compile)
    # config.patch, not monkeypatch, whose undo deletes a config module's entry (under torch 2.11
    # recompile_limit is then gone for the rest of the process)
    with torch._dynamo.config.patch(recompile_limit=3):
        model = build('none', block_size=100, seed=2).eval()
        new = 40
        idx = tokens(2, 2, 60)
        plain = [as_float(greedy_trace(model, idx[b:b + 1], new)[0]) for b in range(2)]
        for B, K in ((1, 1), (2, 4)):
            trace = {}
            out = speculative.generate(model, idx[:B], new, K, temperature=0, trace=trace,
                                       compile=True)
            for b in range(B):
                spec = speculative_trace_row(trace, out, b, 60, new)
                assert_greedy_traces_agree(spec, plain[b], ROUTED_TOL)
        assert graphs['verify_pass'] > 3, graphs
        twin = copy.deepcopy(model)
        with torch.no_grad():
            for p in twin.parameters():
                p.mul_(-1.0)
        idx = tokens(3, 1, 60)
        got = speculative.generate(twin, idx, 8, 2, temperature=0, compile=True)
        assert torch.equal(got, twin.generate(idx, 8, temperature=0))


# Inductor's own code generation (about a minute per family on 2 cores with a cold cache, as on a
# fresh CI machine) for a few families only: every family's graph is held to eager without code
# generation above; these check that the generated kernels run it too, for the token-level FFN
# routing and MoD's masked blocks. The dense model's blocks are among MoD's (its unrouted ones).
INDUCTOR_ROUTES = ('ffn', 'mod')


def test_compiled_steps_draw_random_numbers_as_eager_decoding_does():
    """GPT.compiled (inductor, as on a GPU) draws random numbers from torch's own generator: the
    same draws as eagerly under the same seed, at full float64 resolution. Inductor's own random
    numbers draw a float64 torch.rand as a float32 one, on whose grid speculative.draw (inside a
    compiled pass) could never draw a token whose interval falls between two float32 values."""
    def uniform(x):
        return torch.rand(x.shape, dtype=torch.float64) * x
    x = torch.ones(4096, dtype=torch.float64)
    compiled = GPT.compiled(uniform, torch.device('cpu'))
    try:
        torch.manual_seed(7)
        eager = uniform(x)
        torch.manual_seed(7)
        u = compiled(x)
    finally:
        torch._dynamo.reset()
    off_float32_grid = (u.float().double() != u).double().mean().item()
    assert off_float32_grid > 0.99, off_float32_grid
    assert torch.equal(u, eager)


@pytest.mark.slow
@pytest.mark.parametrize('route', INDUCTOR_ROUTES)
def test_compiled_greedy_decoding_gives_the_eager_tokens(route):
    """generate(compile=True) as a CPU runs it: inductor's code."""
    assert compiled_decoding_case(route, [dict(), dict(lengths=[6, 2])]) == [1, 1]


@pytest.mark.slow
@pytest.mark.parametrize('route', INDUCTOR_ROUTES)
def test_inductor_compiles_training_step_and_static_prefill(route):
    """torch.compile(fullgraph=True, dynamic=False) with the default compiler: the training loss and
    its gradients, and the static eval prefill, equal eager's (decisions exactly; values within
    ROUTED_TOL: generated kernels fuse and reassociate sums). Two blocks (for MoD one unrouted and
    one routed), to keep code generation short (MoD: 41 C++ kernels, 52 with four blocks)."""
    model = build(route, n_layer=2)
    idx = tokens(0, B, T)
    loss_fn = train_loss(model.train())
    eager = seeded(lambda: loss_fn(idx))
    eager.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    compiled = seeded(lambda: torch.compile(loss_fn, fullgraph=True, dynamic=False)(idx))
    compiled.backward()
    torch.testing.assert_close(compiled, eager, **ROUTED_TOL)
    for n, p in model.named_parameters():
        if n in grads:
            torch.testing.assert_close(p.grad, grads[n], **ROUTED_TOL, msg=n)
    model.eval()
    with torch.no_grad():
        ref = seeded(lambda: model(idx, last_only=False, exec_mode='static'))
        got = seeded(lambda: torch.compile(lambda i: model(i, last_only=False, exec_mode='static'),
                                           fullgraph=True, dynamic=False)(idx))
    torch.testing.assert_close(got[0], ref[0], **ROUTED_TOL)
    for l in ref[2].get('masks', {}):
        assert torch.equal(got[2]['masks'][l], ref[2]['masks'][l]), l
