"""What every routing family in the registry (model.FAMILIES) promises: eval-mode causality, sparse
execution equal to masked-dense execution, KV-cache decoding equal to full recomputation,
forced-open = the dense model, gradients reaching every router, FLOPs equal to torch's
FlopCounterMode, and ragged batched generation equal to each prompt alone. References are computed
here: a dense GPT carrying the same backbone weights, full recomputation, torch's counter. A family
is held to these with the option sets in conftest.EXAMPLES, or its defaults: one added to the
registry is checked without editing this file, and so is the example family of docs/new_family.md.
Each family's own tests are in its file (test_ffn.py, test_halt.py, test_mod.py, test_exit.py,
test_ensemble.py)."""
import math
import re
import types
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import flops
import model as model_module
import speculative
from conftest import (
    EXAMPLES,
    ROUTED_TOL,
    SETTINGS,
    V,
    assert_greedy_traces_agree,
    build,
    counted,
    dense_twin,
    greedy_trace,
    seeded,
    tokens,
)
from model import FAMILIES as REGISTRY, GPTConfig, KVCache
from route_exit import exit_depths
from routing import Dense

NEW_FAMILY_DOC = Path(__file__).resolve().parent.parent / 'docs' / 'new_family.md'
EXAMPLE_ROUTE = 'skip'          # the route docs/new_family.md registers


def new_family_example():
    """The module docs/new_family.md walks through: its one python block, run as route_skip.py."""
    blocks = re.findall(r'```python\n(.*?)```', NEW_FAMILY_DOC.read_text(), re.S)
    assert len(blocks) == 1, f"{NEW_FAMILY_DOC} must hold the whole family as one python block"
    module = types.ModuleType(f'route_{EXAMPLE_ROUTE}')
    exec(compile(blocks[0], str(NEW_FAMILY_DOC), 'exec'), module.__dict__)
    return module


EXAMPLE = new_family_example()

# every family in the registry, and the example, is held to the shared promises below, with its
# example option sets or its defaults: a new family is checked without editing this file. CASES:
# the registry's alone (other test modules draw from them, where the example is not registered)
FAMILIES = {route: EXAMPLES.get(route, [dict()]) for route in [*REGISTRY, EXAMPLE_ROUTE]}
CASES = [(route, i) for route in REGISTRY for i in range(len(FAMILIES[route]))]
ALL_CASES = CASES + [(EXAMPLE_ROUTE, i) for i in range(len(FAMILIES[EXAMPLE_ROUTE]))]


@pytest.fixture(scope='module')
def example_registered():
    """The example registered as docs/new_family.md says (its name in model.ROUTES: a FAMILIES
    entry, its Options a base of GPTConfig), for this module's tests only."""
    @dataclass
    class ConfigWithExample(model_module.GPTConfig, EXAMPLE.FAMILY.Options):
        pass
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(REGISTRY, EXAMPLE_ROUTE, EXAMPLE.FAMILY)
        mp.setattr(model_module, 'GPTConfig', ConfigWithExample)
        yield


# one_thread: tiny ops (see conftest.py)
pytestmark = pytest.mark.usefixtures('one_thread', 'example_registered')


def is_random(case):
    opt = FAMILIES[case[0]][case[1]]
    return 'random' in (opt.get('ffn_gate'), opt.get('mod_router'))


# --------------------------------------------------------------------------------------------------
# what every family promises

@settings(**SETTINGS)
@given(case=st.sampled_from(ALL_CASES), seed=st.integers(0, 999), T=st.integers(2, 20),
       B=st.integers(1, 3), sparse=st.booleans(), data=st.data())
def test_eval_is_causal_for_every_family(case, seed, T, B, sparse, data):
    """Perturbing the tokens after t never changes the logits at or before t (model.eval())."""
    model = build(*case, seed=seed).eval()
    t = data.draw(st.integers(0, T - 2))
    idx = tokens(seed, B, T)
    other = idx.clone()
    other[:, t + 1:] = tokens(seed + 1, B, T - t - 1)
    with torch.no_grad():
        a = seeded(lambda: model(idx, last_only=False, sparse=sparse)[0])
        b = seeded(lambda: model(other, last_only=False, sparse=sparse)[0])
    if is_random(case):
        return          # random decisions are per position (causal) but the draw order is per batch
    torch.testing.assert_close(a[:, :t + 1], b[:, :t + 1], rtol=1e-5, atol=1e-5)


@settings(**SETTINGS)
@given(case=st.sampled_from(ALL_CASES), seed=st.integers(0, 999), T=st.integers(1, 20),
       B=st.integers(1, 3), dtype=st.sampled_from(['float32', 'bfloat16']))
def test_sparse_execution_equals_masked_dense(case, seed, T, B, dtype):
    """Gather -> compute -> scatter gives the masked-dense reference's numbers (tolerance by dtype:
    fp32, or bf16 autocast), and the same routing."""
    model = build(*case, seed=seed).eval()
    idx = tokens(seed, B, T)
    amp = torch.autocast('cpu', dtype=torch.bfloat16, enabled=dtype == 'bfloat16')
    with torch.no_grad(), amp:
        a_logits, _, a = seeded(lambda: model(idx, idx, sparse=True))
        b_logits, _, b = seeded(lambda: model(idx, idx, sparse=False))
    # gathered vs full-batch matmuls round differently; routed models' noisy weights reach ~0.2e-5
    # under some BLAS modes, so fp32 gets ROUTED_TOL and exact decisions. bf16 rounds to ~1e-2 of
    # the values' scale per op (one ulp of a logit of 4 is 0.03), so a router score within that of
    # the threshold can flip: bf16 allows one flipped decision per row and layer, and compares
    # logits only where none flipped
    assert a.get('masks', {}).keys() == b.get('masks', {}).keys()
    flips = {l: (a['masks'][l] != b['masks'][l]).flatten(1).sum(1) for l in a.get('masks', {})}
    if dtype == 'float32':
        assert all(int(f.sum()) == 0 for f in flips.values()), flips
        torch.testing.assert_close(a_logits.float(), b_logits.float(), **ROUTED_TOL)
    else:
        assert all(int(f.max()) <= 1 for f in flips.values()), flips
        if all(int(f.sum()) == 0 for f in flips.values()):
            scale = max(1.0, b_logits.float().abs().max().item())
            torch.testing.assert_close(
                a_logits.float(), b_logits.float(), rtol=3e-2, atol=3e-2 * scale
            )


@settings(**SETTINGS)
@given(case=st.sampled_from(ALL_CASES), seed=st.integers(0, 999), T0=st.integers(1, 10),
       new=st.integers(1, 8), B=st.integers(1, 3))
def test_kv_cache_decoding_equals_recompute(case, seed, T0, new, B):
    """Prefill T0 tokens into a KV cache, then feed one token at a time: every step's logits equal
    the full causal forward's logits at that position (routing decided per token in both)."""
    if is_random(case):
        return          # random decisions are redrawn per call
    model = build(*case, seed=seed).eval()
    idx = tokens(seed, B, T0 + new)
    with torch.no_grad():
        full = model(idx, last_only=False)[0]
        cache = KVCache(model.config, B, model.config.block_size, idx.device, torch.float32)
        pos = torch.arange(T0).expand(B, T0)
        steps = [model(idx[:, :T0], pos=pos, cache=cache, last_only=False)[0]]
        for t in range(T0, T0 + new):
            steps.append(model(idx[:, t:t + 1], pos=torch.full((B, 1), t), cache=cache)[0])
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-4, atol=1e-4)


@settings(**SETTINGS)
@given(case=st.sampled_from(ALL_CASES), seed=st.integers(0, 999), T=st.integers(1, 20),
       train_mode=st.booleans())
def test_forced_open_is_the_dense_model(case, seed, T, train_mode):
    """force='full' (every gate open, every token through every block, no exits) computes exactly
    what a dense GPT with the same backbone weights computes."""
    model = build(*case, seed=seed)
    model.train(train_mode)
    idx = tokens(seed, 2, T)
    with torch.no_grad():
        got = model(idx, force='full', last_only=False)[0]
        want = dense_twin(model)(idx, last_only=False)[0]
    assert torch.equal(got, want)


@pytest.mark.parametrize('case', ALL_CASES)
def test_gradients_reach_every_router(case):
    """One training step's total loss gives every controller parameter (routers, predictors, exit
    heads, ensemble norms and router) and every backbone parameter a non-zero gradient, except those
    the family says its loss never reaches (Family.no_gradient: the ensemble's ln_f feeds only its
    stop-gradient teacher), which get none."""
    if is_random(case):
        pytest.skip('no router')
    model = build(*case, seed=3).train()
    idx = tokens(3, 4, 20)
    model(idx, idx)[1].backward()
    unused = set(model.family.no_gradient(model.config))
    assert unused <= dict(model.named_parameters()).keys()
    for name, p in model.named_parameters():
        if name in unused:
            assert p.grad is None or not p.grad.any(), name
        else:
            assert p.grad is not None and p.grad.abs().sum() > 0, name


# --------------------------------------------------------------------------------------------------
# FLOPs against torch's counter

# every family in the registry (ffn and halt included), with as many examples per case as when only
# mod, exit and ensemble were drawn here
@settings(max_examples=36, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=st.sampled_from(ALL_CASES), seed=st.integers(0, 99),
       T=st.integers(2, 16), B=st.integers(1, 2), budget=st.floats(0.05, 1.0),
       pw=st.sampled_from([0.0, 1.0]), trainable=st.sampled_from(['all', 'controller']),
       kl=st.sampled_from([0.0, 1.0]), data=st.data())
def test_family_flops_match_counter(case, seed, T, B, budget, pw, trainable, kl, data):
    """Training forward, a whole training step (joint or controller-only), the masked eval forward
    and the sparse eval forward (at the realised fractions) equal FlopCounterMode's count."""
    route, opt = case
    model = build(
        route,
        opt,
        seed=seed,
        ffn_budget=budget,
        mod_capacity=budget,
        ffn_predictor_weight=pw,
        mod_predictor_weight=pw,
        ens_kl_weight=kl,
    )
    cfg = model.config
    if trainable == 'controller':
        ctrl = {id(p) for p in model.controller_parameters()}
        if not ctrl:
            trainable = 'all'
        for p in model.parameters():
            p.requires_grad_(trainable == 'all' or id(p) in ctrl)
    exits = None
    # the exit families' step option
    if 'exit_layers' in model.family.options and data.draw(st.booleans()):
        exits = tuple(sorted(data.draw(st.sets(st.sampled_from(exit_depths(cfg))))))
    idx = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))
    model.train()
    with torch.no_grad():
        assert counted(lambda: seeded(lambda: model(idx, idx, exits=exits))) == \
            B * flops.forward_flops(cfg, T, 'train', exits=exits)

    def step():
        loss = seeded(lambda: model(idx, idx, exits=exits)[1])
        if loss.requires_grad:
            loss.backward()
    assert counted(step) == B * flops.train_step_flops(cfg, T, trainable, exits=exits)['total']
    model.eval()
    with torch.no_grad():
        assert counted(
            lambda: seeded(lambda: model(idx, idx, sparse=False))
        ) == B * flops.forward_flops(cfg, T, 'eval')
        out = []
        got = counted(lambda: out.append(seeded(lambda: model(idx, idx))[2].get('masks', {})))
    masks = out[0]
    # e.g. MoD pads rows to the longest
    run = model.family.executed_fracs(masks) if masks else None
    frac = (
        run.tolist()
        if run is not None
        else [int(m.sum()) / m.numel() for _, m in sorted(masks.items())] or None
    )
    assert math.isclose(
        got, B * flops.forward_flops(cfg, T, 'sparse', full_frac=frac, path='compact'),
        rel_tol=1e-9
    )


# LoRA adapters on the block projections, as lora_targets names them: kinds in every block, or
# named blocks' projections
LORA_TARGETS = ['attn.c_attn,attn.c_proj,mlp.c_fc,mlp.c_proj', 'attn.c_attn', 'attn.c_proj',
                'mlp.c_fc', 'mlp.c_proj,attn.c_proj', 'h.1.mlp.c_fc',
                'h.2.attn.c_attn,h.0.mlp.c_proj', 'h.3.attn.c_proj']


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=st.sampled_from(ALL_CASES), seed=st.integers(0, 99), T=st.integers(2, 16),
       B=st.integers(1, 2), budget=st.floats(0.05, 1.0), rank=st.integers(1, 4),
       targets=st.sampled_from(LORA_TARGETS),
       trainable=st.sampled_from(['lora', 'controller+lora']), data=st.data())
def test_lora_step_flops_match_counter(case, seed, T, B, budget, rank, targets, trainable, data):
    """A training step with LoRA adapters on a frozen backbone (the controller frozen too, or
    trained beside them) costs what flops.train_step_flops says: the adapters' matmuls at the rows
    their projections run on (MoD: its capacity), and the input gradients from the first adapter
    (or trained router) up, not below."""
    from lora import apply_lora
    route, opt = case
    model = build(route, opt, seed=seed, ffn_budget=budget, mod_capacity=budget)
    cfg = model.config
    ctrl = {id(p) for p in model.controller_parameters()}
    apply_lora(model, rank, 2.0 * rank, 0.0, targets)
    for p in model.parameters():
        if id(p) in ctrl:
            p.requires_grad_(trainable == 'controller+lora')
    exits = None
    if 'exit_layers' in model.family.options and data.draw(st.booleans()):
        exits = tuple(sorted(data.draw(st.sets(st.sampled_from(exit_depths(cfg))))))
    idx = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))
    model.train()

    def step():
        loss = seeded(lambda: model(idx, idx, exits=exits)[1])
        if loss.requires_grad:
            loss.backward()
    expect = flops.train_step_flops(cfg, T, trainable, lora_rank=rank, lora_targets=targets,
                                    exits=exits)
    assert counted(step) == B * expect['total'], expect


@pytest.mark.parametrize('route', ['halt', 'exit'])
def test_sparse_flops_count_no_block_that_every_token_skips(route):
    """Where every token skips a block (halt: routers' bias +20; exit: threshold 0, so every token
    leaves at the first exit), sparse eval on the compact path runs nothing of it without a KV
    cache: FlopCounterMode's count is the sparse formula at fractions with zeros and
    path='compact', about half the masked forward's here."""
    model = build(route, 0, seed=3).eval()
    cfg = model.config
    if route == 'halt':
        with torch.no_grad():
            for r in model.halt:
                r.out.bias.fill_(20.0)
    else:
        cfg.exit_threshold = 0.0
    idx = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out = []
        got = counted(lambda: out.append(model(idx, idx)[2]['masks']))
        masked = counted(lambda: model(idx, idx, sparse=False))
    frac = [int(m.sum()) / m.numel() for _, m in sorted(out[0].items())]
    assert 0.0 in frac
    assert got == 2 * flops.forward_flops(cfg, 12, 'sparse', full_frac=frac, path='compact')
    assert got < 0.7 * masked
    # a static path runs those blocks' attention: counted where no path says otherwise
    assert flops.forward_flops(cfg, 12, 'sparse', full_frac=frac) > 1.2 * got / 2


@settings(**SETTINGS)
@given(case=st.sampled_from([c for c in ALL_CASES if not is_random(c)]), seed=st.integers(0, 999),
       lens=st.lists(st.integers(1, 9), min_size=1, max_size=3), new=st.integers(1, 6))
def test_ragged_batched_generation_equals_each_prompt_alone(case, seed, lens, new):
    """Prompts of different lengths decoded together (right-padded, each row at its own positions,
    one shared KV cache) give each prompt's greedy continuation decoded alone: the same routing
    decisions, logits within ROUTED_TOL (the batch has other B and T, masked attention and sparse
    gathers over all rows: other matmul shapes than one prompt alone), and the same tokens unless a
    near-tie (see conftest.assert_greedy_traces_agree)."""
    model = build(*case, seed=seed).eval()
    idx = tokens(seed, len(lens), max(lens))
    stats = {}
    together = greedy_trace(model, idx, new, lengths=lens, stats=stats)
    for b, n in enumerate(lens):
        alone = greedy_trace(model, idx[b:b + 1, :n], new)[0]
        assert_greedy_traces_agree(together[b], alone, ROUTED_TOL)
    with torch.no_grad():
        reported = 'full_frac' in model(idx[:1])[2]         # the family reports its realised
                                                            # fractions
    if reported:
        assert len(stats['full_frac']) > 0 and all(0 <= f <= 1 for f in stats['full_frac'])


def speculative_trace_row(trace, out, b, n, new):
    """Row b of speculative.generate's trace (prompt length n) as a greedy_trace row: the tokens,
    the verifier's logits each was picked from, and per step the routing decisions of the positions
    the step fed (step 0 the prompt, step s the generated token s − 1) and their margins; decisions
    as floats."""
    def per_step(key):
        steps = [{l: m[b, :n].float() for l, m in trace['prefill_' + key].items()}]
        return steps + [{l: m[b, s:s + 1] for l, m in trace[key].items()} for s in range(new - 1)]
    return out[b][n:n + new], trace['logits'][b], per_step('masks'), per_step('margins')


def as_float(row):
    tokens_, logits, masks, margins = row
    return tokens_, logits, [{l: v.float() for l, v in m.items()} for m in masks], margins


@settings(**{**SETTINGS, 'max_examples': 30})
@given(case=st.sampled_from([c for c in ALL_CASES if not is_random(c)]), seed=st.integers(0, 999),
       lens=st.lists(st.integers(1, 9), min_size=1, max_size=3), new=st.integers(1, 8),
       K=st.integers(1, 5), ragged=st.booleans(), data=st.data())
def test_greedy_speculative_decoding_equals_plain_decoding(case, seed, lens, new, K, ragged, data):
    """Self-speculative greedy decoding (any draft of the family, any depth, K drafted tokens per
    verifier pass, prompts of different lengths in one batch or of one length) gives each prompt's
    plain greedy decode, KV-cached and fully recomputed: the verifier routes every token it keeps as
    plain decoding routes it (the same decisions), its logits are within ROUTED_TOL (its window of
    K + 1 tokens runs other matmul shapes), and the tokens are the same unless a near-tie (see
    conftest.assert_greedy_traces_agree)."""
    model = build(*case, seed=seed).eval()
    drafts = model.family.drafts(model.config)
    draft = data.draw(st.sampled_from(sorted(drafts)))
    depths = model.family.draft_depths(model.config, draft)
    depth = data.draw(st.sampled_from(depths[0])) if depths else None
    lens = lens if ragged else [lens[0]] * len(lens)
    idx = tokens(seed, len(lens), max(lens))
    trace = {}
    out = speculative.generate(model, idx, new, K, draft, depth, temperature=0,
                               lengths=lens if ragged else None, trace=trace)
    for b, n in enumerate(lens):
        spec = speculative_trace_row(trace, out, b, n, new)
        for use_cache in (True, False):
            alone = as_float(greedy_trace(model, idx[b:b + 1, :n], new, use_cache=use_cache)[0])
            assert_greedy_traces_agree(spec, alone, ROUTED_TOL)


def every_draft():
    """(case, draft, depth) for every deterministic option set of the registered families (the
    example family is registered by a fixture, after collection), each of its drafts and each depth
    the draft can stop at (None: it has none)."""
    out = []
    for case in (c for c in CASES if not is_random(c)):
        model = build(*case)
        for draft in sorted(model.family.drafts(model.config)):
            depths = model.family.draft_depths(model.config, draft)
            out += [(case, draft, depth) for depth in (depths[0] if depths else [None])]
    return out


@pytest.mark.parametrize('case,draft,depth', every_draft())
def test_every_draft_decodes_greedily_as_plain_decoding(case, draft, depth):
    """The property above on one fixed example per option set, draft and depth, which a run's
    Hypothesis examples may not all draw: two prompts of different lengths, K = 3."""
    inner = test_greedy_speculative_decoding_equals_plain_decoding.hypothesis.inner_test
    drawn = Drawn(draft) if depth is None else Drawn(draft, depth)
    inner(case, 11, [4, 7], 6, 3, True, drawn)





@pytest.mark.parametrize('case', [c for c in ALL_CASES if not is_random(c)])
def test_decode_layout_decodes_every_family_as_before(case):
    """GPT.decode_layout (column-major Linear weights, what sample.py decodes with) changes only the
    summation order: every family's greedy decode, its routing decisions and its logits are the
    row-major model's, up to a near-tie of ROUTED_TOL, and its state dict is the same."""
    model = build(*case, seed=3).eval()
    twin = build(*case, seed=3).eval().decode_layout()
    ref, got = model.state_dict(), twin.state_dict()
    assert ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref)
    assert any(p.dim() == 2 and not p.is_contiguous() for p in twin.parameters())
    idx = tokens(3, 2, 6)
    for a, b in zip(greedy_trace(twin, idx, 8), greedy_trace(model, idx, 8)):
        assert_greedy_traces_agree(as_float(a), as_float(b), ROUTED_TOL)


def test_the_trace_check_passes_near_ties_and_fails_divergences():
    """conftest.assert_greedy_traces_agree, on hand-made traces of 3 steps (vocabulary 4, one
    routed layer): a token or a decision may differ only at a near-tie of ROUTED_TOL."""
    def row(tokens_, decisions, margins, logits=None):
        lg = torch.tensor(logits or [[0.0, 3.0, 1.0, 2.0]] * 3)
        return (torch.tensor(tokens_), lg, [{1: torch.tensor([d])} for d in decisions],
                [{1: torch.tensor([m])} for m in margins])
    ok = row([1, 1, 1], [True, False, True], [0.5, -2e-5, 0.3])
    assert_greedy_traces_agree(ok, ok, ROUTED_TOL)
    tie = row([1, 1, 1], [True, True, True], [0.5, 2e-5, 0.3])          # step 1 flips on a tie,
    assert_greedy_traces_agree(ok, tie, ROUTED_TOL)                       # the rest is not compared
    agree_after = row([1, 2, 3], [True, True, True], [0.5, 2e-5, 0.3])
    assert_greedy_traces_agree(ok, agree_after, ROUTED_TOL)
    failing = {
        'not a near-tie': row([1, 1, 1], [True, True, True], [0.5, 0.2, 0.3]),
        'margins agree': row([1, 1, 1], [True, True, True], [0.5, -2e-5, 0.3]),
        'no margin': (ok[0], ok[1], row([1, 1, 1], [True, True, True], [0, 0, 0])[2],
                      [{}, {}, {}]),
        'greedy tokens': row([1, 3, 1], [True, False, True], [0.5, -2e-5, 0.3]),
    }
    for why, bad in failing.items():
        with pytest.raises(AssertionError, match=why):
            assert_greedy_traces_agree(ok, bad, ROUTED_TOL)
    near = [[0.0, 3.0, 1.0, 3.0 - 1e-4]] * 3                           # tokens 1 and 3 tie
    assert_greedy_traces_agree(row([1, 1, 1], [1, 0, 1], [1, -1, 1], near),
                               row([1, 3, 0], [1, 0, 1], [1, -1, 1], near), ROUTED_TOL)
    far = [[0.0, 3.0, 1.0, 3.1]] * 3
    with pytest.raises(AssertionError):
        assert_greedy_traces_agree(row([1, 1, 1], [1, 0, 1], [1, -1, 1], far),
                                   row([1, 1, 1], [1, 0, 1], [1, -1, 1], near), ROUTED_TOL)


def shift_thresholds(model, s):
    """Move every causal decision's threshold by s in margin units (aux['margins']): a decision
    whose margin is m then takes the full path iff m > s, ties aside. Per family: how its own
    comparison reads."""
    cfg, blocks = model.config, model.transformer.h
    if cfg.route == 'ffn':
        for block in blocks:
            if hasattr(block, 'tau'):
                block.tau += s
    elif cfg.route == 'mod':            # decides σ(logit) > 0.5: the logit moves instead
        for block in blocks:
            decider = getattr(block, 'predictor', None) or getattr(block, 'router', None)
            if decider is not None:
                decider.register_forward_hook(lambda mod, args, out: out - s)
    else:
        attr, sign = dict(halt=('halt_tau', -1), exit=('exit_threshold', -1),
                          skip=('skip_threshold', 1))[cfg.route]
        setattr(cfg, attr, getattr(cfg, attr) + sign * s)


@pytest.mark.parametrize('case', [c for c in ALL_CASES if not is_random(c)], ids=str)
def test_a_routing_decision_flips_where_its_margin_says(case):
    """aux['margins'] is how far each causal decision is from flipping, in the units of the gate's
    own comparison: moving the threshold of the first layer with margins by s (between two margins
    seen, so no ties) flips exactly the decisions whose margin is below s; and every decision that
    takes the full path has a margin >= 0. The exactness tests rest on it: a margin too large would
    call a near-tie a divergence, one too small would let a divergence pass as a near-tie."""
    idx = tokens(1, 2, 16)

    def routing(s=0.0):
        model = build(*case, seed=1).eval()
        if s:
            shift_thresholds(model, s)
        with torch.no_grad():
            aux = model(idx, last_only=False)[2]
        return aux.get('masks', {}), aux.get('margins', {})
    masks, margins = routing()
    if case[0] in ('none', 'ensemble'):
        assert not masks and not margins, 'a family without decisions records no margins'
        return
    assert margins and set(margins) <= set(masks)
    for l, m in margins.items():
        assert (m[masks[l].bool()] >= 0).all(), f'layer {l}: a full-path decision, margin < 0'
    first = min(margins)
    seen = margins[first].flatten().unique()
    assert len(seen) >= 8, 'the decisions must spread for the test to mean something'
    for q in (0.2, 0.5, 0.8):
        i = int(q * (len(seen) - 1))
        s = float(seen[i] + seen[i + 1]) / 2
        shifted = routing(s)[0][first].bool()
        assert torch.equal(shifted, margins[first] > s), (q, s)
        assert 0 < shifted.sum() < shifted.numel()


@pytest.mark.parametrize('case', ALL_CASES)
def test_bucketed_decoding_equals_full_cache_decoding(case, monkeypatch):
    """generate attends over the first KVCache.bucket(n) slots only (n: the positions filled so
    far); every family decodes a ragged batch and an equal-prompt batch whose positions cross a
    bucket boundary (64) into the capped last bucket (block_size 80) as it decodes over all
    block_size slots: the same routing decisions, logits within ROUTED_TOL (attention reduces over
    another length), the same tokens unless a near-tie."""
    model = build(*case, seed=5, block_size=80).eval()
    idx, lengths = tokens(5, 3, 62), [62, 3, 40]

    def traces():
        return [seeded(lambda: greedy_trace(model, idx, 12, **kw), seed=5)
                for kw in (dict(lengths=lengths), dict())]
    bucketed = traces()
    monkeypatch.setattr(KVCache, 'MIN_ATTEND', 10**9)       # every forward attends over all slots
    full = traces()
    for rows_a, rows_b in zip(bucketed, full):
        for a, b in zip(rows_a, rows_b):
            assert_greedy_traces_agree(a, b, ROUTED_TOL)

def test_every_family_but_the_dense_one_routes():
    """train.py reports the routing at the end of a run, and refuses trainable='last_layers' (plain
    fine-tuning of a dense model), by the family's `routes`: only route='none' is dense."""
    assert [name for name, family in REGISTRY.items() if not family.routes] == ['none']


# --------------------------------------------------------------------------------------------------
# the contract (routing.py's docstring)

CORE = ('Options', 'validate', 'loss', 'is_controller_key', 'forward_flops', 'backward_flops')


@pytest.mark.parametrize('route', [*REGISTRY, EXAMPLE_ROUTE])
def test_every_family_defines_the_core(route):
    """Each family's class (the dense model aside, whose core is the base class's) defines every
    core member itself, and its forward: run_blocks, logits or both."""
    family = REGISTRY[route]
    if type(family) is Dense:
        return
    own = {k for c in type(family).__mro__ if c not in Dense.__mro__ for k in vars(c)}
    assert [k for k in CORE if k not in own] == []
    assert {'run_blocks', 'logits'} & own


def test_the_new_family_example_is_one_short_block():
    """docs/new_family.md's example stays a short read: at most ~80 lines, none over 100 columns."""
    block = re.findall(r'```python\n(.*?)```', NEW_FAMILY_DOC.read_text(), re.S)[0].splitlines()
    assert len(block) <= 80 and max(map(len, block)) <= 100, (len(block), max(map(len, block)))


def test_the_example_registers_with_one_name():
    """Registered, the example's options are config fields that validate, and training with it gives
    the gate a gradient and a loss term of its own: what ROUTES and the file alone must provide."""
    cfg = model_module.GPTConfig(route=EXAMPLE_ROUTE, skip_weight=0.5, n_layer=2, n_embd=16,
                                 n_head=2)
    with pytest.raises(ValueError, match='skip_threshold'):
        model_module.GPTConfig(route=EXAMPLE_ROUTE, skip_threshold=1.5)
    m = model_module.GPT(cfg).train()
    idx = tokens(0, 2, 8)
    _, loss, aux = m(idx, idx)
    # the mean gate over the blocks: σ of a small-init linear, near 0.5
    assert 0.3 < float(aux['skip_loss'].detach()) < 0.7
    want = (aux['lm_loss'] + 0.5 * aux['skip_loss']).detach()
    assert math.isclose(float(loss.detach()), float(want), rel_tol=1e-6)
    loss.backward()
    assert all(p.grad.abs().sum() > 0 for p in m.controller_parameters())
    assert len(m.controller_parameters()) == 2 * cfg.n_layer       # each block's gate: weight, bias


class Drawn:
    """Stands in for Hypothesis's `data` with fixed draws, to run a property test's body on one
    example."""

    def __init__(self, *values):
        self.values = list(values)

    def draw(self, strategy):
        return self.values.pop(0)


@pytest.mark.parametrize('route', [EXAMPLE_ROUTE])
def test_the_example_is_held_to_every_promise(route):
    """The property tests above draw their cases at random; here every one of them runs on the
    example of docs/new_family.md (their bodies on fixed examples), so each promise checks it."""
    case = (route, 0)
    for seed, T, B in [(0, 9, 2), (5, 3, 1)]:
        test_eval_is_causal_for_every_family.hypothesis.inner_test(
            case, seed, T, B, True, Drawn(T // 2)
        )
        test_sparse_execution_equals_masked_dense.hypothesis.inner_test(case, seed, T, B, 'float32')
        test_kv_cache_decoding_equals_recompute.hypothesis.inner_test(case, seed, T, 3, B)
        test_forced_open_is_the_dense_model.hypothesis.inner_test(case, seed, T, seed % 2 == 0)
        for trainable in ('all', 'controller'):
            flops_match = test_family_flops_match_counter.hypothesis.inner_test
            flops_match(case, seed, T, B, 0.5, 1.0, trainable, 1.0, Drawn())
        ragged = test_ragged_batched_generation_equals_each_prompt_alone.hypothesis.inner_test
        ragged(case, seed, [T, 1 + T // 2], 3)
        speculative_decoding = test_greedy_speculative_decoding_equals_plain_decoding
        for K in (1, 3):
            speculative_decoding.hypothesis.inner_test(
                case, seed, [T, 1 + T // 2], 5, K, True, Drawn('layers', 1 + seed % 3)
            )
    test_gradients_reach_every_router(case)


def test_family_budget_api():
    ffn, mod = GPTConfig(route='ffn', ffn_budget=0.3), GPTConfig(route='mod', mod_capacity=0.2)
    assert REGISTRY['ffn'].budget(ffn) == 0.3 and REGISTRY['mod'].budget(mod) == 0.2
    assert REGISTRY['ffn'].with_budget(ffn, 0.7).ffn_budget == 0.7
    assert REGISTRY['mod'].with_budget(mod, 0.7).mod_capacity == 0.7 and mod.mod_capacity == 0.2
    for route in ('none', 'halt', 'exit', 'ensemble'):
        assert REGISTRY[route].budget(GPTConfig(route=route)) is None
        with pytest.raises(ValueError, match='has no budget'):
            REGISTRY[route].with_budget(GPTConfig(route=route), 0.5)


@pytest.mark.parametrize('case', [('mod', 0), ('exit', 2), ('ffn', 0), ('halt', 0)])
def test_executed_fractions_on_the_reference_path_are_what_it_runs(case):
    """The reference path computes every row (static shapes, saving nothing): the fractions
    eval.evaluate reports as executed there are all 1, and the sparse formula on that path costs
    what FlopCounterMode counts, the masked forward's FLOPs (ffn: both FFNs on every row), not
    the savings of the realised routing."""
    from eval import evaluate
    model = build(*case, seed=3).eval()
    model.exec_mode = 'reference'
    cfg = model.config
    idx = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        got = counted(lambda: model(idx, idx))
    r = evaluate(model, [(idx, idx)])
    assert min(r['full_frac']) < 0.6                    # the routing would save something
    assert r['exec_frac'] == [1.0] * len(r['full_frac']) and r['exec_path'] == 'reference'
    assert got == 2 * flops.forward_flops(cfg, 12, 'sparse', full_frac=r['full_frac'],
                                          path='reference')
    assert got == 2 * flops.forward_flops(cfg, 12, 'eval')
