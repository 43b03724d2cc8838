"""Property tests of the per-token FFN routing (route='ffn', gates G1/G3 and baselines).

Every check compares the model against an independent computation written here: exact-fraction
capacities, a dense GPT with the same backbone weights, hand-written forwards built from the blocks'
submodules, gather/scatter execution, brute-force loss definitions. Models are tiny (n_layer <= 3,
n_embd = 16, T <= 24) so the file runs in well under a minute on 2 CPU cores."""
import math
from contextlib import contextmanager
from fractions import Fraction
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import flops
import gates
import losses
import train
from conftest import ROUTED_TOL, assert_greedy_traces_agree, greedy_trace
import oracle_labels
import route_ffn
from model import GPT, GPTConfig, controlled_layer_ids
from routing import RouteCtx

SETTINGS = dict(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])

V = 29
BASE = dict(
    block_size=24,
    vocab_size=V,
    n_head=2,
    n_embd=16,
    ffn_cheap_rank=4,
    ffn_gate_hidden=8,
    ffn_jepa_latent=6,
)
ZERO_AUX = dict(
    ffn_util_weight=0.0,
    ffn_rank_weight=0.0,
    ffn_jepa_weight=0.0,
    ffn_predictor_weight=0.0,
    ffn_mimic_weight=0.0,
)
SCORING_GATES = ('mlp', 'jepa')


# --------------------------------------------------------------------------------------------------
# helpers

def build(seed, n_layer=2, noise=0.3, **kw):
    """A tiny routed GPT; `noise` is added to every parameter so gate scores, predictors and the
    full/cheap difference are far from their near-zero initialisation (continuous values, no
    ties)."""
    args = dict(BASE, n_layer=n_layer, route='ffn', **ZERO_AUX)
    args.update(kw)
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**args))
    if noise:
        g = torch.Generator().manual_seed(seed + 7)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(noise * torch.randn(p.shape, generator=g))
    return model


def tokens(seed, B, T, vocab=V, distinct_first=False):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, vocab, (B, T), generator=g)
    if distinct_first:      # no two tokens share a hidden state (no score ties): rows start
                            # differently, and no row starts with a repeated token, since under
                            # rope every token of such a run has the run's first state (equal
                            # values make any attention weights give the same output)
        idx[:, 0] = torch.randperm(vocab, generator=g)[:B]
        if T > 1:
            idx[:, 1] = (idx[:, 0] + 1 + idx[:, 1] % (vocab - 1)) % vocab
    return idx


def calibration_tokens(seed, prompts):
    """A held-out (4, 24) batch to calibrate on whose rows start with tokens no prompt row starts
    with. τ is one of its scores, and a prompt prefix equal to a calibration prefix (most often just
    the first token: position 0's state is a function of its token id alone) scores exactly τ,
    leaving that decision to the last bit of whichever kernels computed it (~0.6% of examples had
    such a tie)."""
    cal = tokens(seed, 4, 24)
    free = torch.tensor(sorted(set(range(V)) - set(prompts[:, 0].tolist())))
    cal[:, 0] = free[
        torch.randint(0, len(free), (4,), generator=torch.Generator().manual_seed(seed))
    ]
    return cal


def ceil_frac(budget, T):
    """ceil(budget·T) in exact rational arithmetic."""
    return -((-budget.numerator * T) // budget.denominator)


# budgets as the decimals a user types (exact Fractions; the model gets float(budget))
BUDGETS = st.one_of(st.integers(1, 100).map(lambda n: Fraction(n, 100)),
                    st.integers(1, 10_000).map(lambda n: Fraction(n, 10_000)))
SEEDS = st.integers(0, 10_000)


pytestmark = pytest.mark.usefixtures('one_thread')      # tiny ops: see conftest.py


@st.composite
def layouts(draw, max_layers=3):
    """(n_layer, ffn_layers spec, the layer ids it means, computed here)."""
    n_layer = draw(st.integers(1, max_layers))
    kind = draw(st.sampled_from(['all', 'every_other', 'list']))
    if kind == 'all':
        return n_layer, 'all', list(range(n_layer))
    if kind == 'every_other' and n_layer >= 2:
        return n_layer, 'every_other', [i for i in range(n_layer) if i % 2 == 1]
    ids = draw(st.lists(st.integers(0, n_layer - 1), min_size=1, max_size=4))   # repeats, any order
    sep = draw(st.sampled_from([',', ', ', ' , ']))
    return n_layer, sep.join(map(str, ids)), sorted(set(ids))


def record_ln2(model, layers):
    """Forward hooks on ln_2 of the given blocks; calls[l] lists (input x, output h) per call. The
    routed pass calls ln_2 once per block, before any oracle fork."""
    calls = {l: [] for l in layers}
    handles = [
        model.transformer.h[l].ln_2.register_forward_hook(
            lambda mod, inp, out, l=l: calls[l].append((inp[0].detach(), out.detach()))
        )
        for l in layers
    ]
    return calls, handles


@contextmanager
def record_updates(model, layers):
    """Record what route_ffn.routed_ffn_update returns at the given layers of `model`, while
    inside."""
    out = {l: [] for l in layers}
    orig = route_ffn.routed_ffn_update

    def wrapped(block, cfg, x, ctx):
        u = orig(block, cfg, x, ctx)
        if block.layer in out and block is model.transformer.h[block.layer]:
            out[block.layer].append(u.detach())
        return u
    route_ffn.routed_ffn_update = wrapped
    try:
        yield out
    finally:
        route_ffn.routed_ffn_update = orig


def embed_ref(model, idx):
    x = model.transformer.wte(idx)
    if model.transformer.wpe is not None:
        x = x + model.transformer.wpe(torch.arange(idx.size(1)))
    return x


def topk_ref(score, k):
    """(B, T) bool: the k largest scores of each row (via a full sort, not topk)."""
    order = score.argsort(dim=-1, descending=True)[:, :k]
    mask = torch.zeros_like(score, dtype=torch.bool)
    for b in range(score.size(0)):
        mask[b, order[b]] = True
    return mask


def ffn_ref(block, x, action, budget=None, gate_grad='ste'):
    """One block's FFN update from its submodules. action: 'full', 'cheap', or 'policy' (training
    top-k of this block's gate scores at ceil(budget·T), hard mixture)."""
    h = block.ln_2(x)
    if action == 'full':
        return block.mlp(h)
    if action == 'cheap':
        return block.cheap(h)
    score = block.gate(h)
    mask = topk_ref(score, ceil_frac(budget, x.size(1)))
    full = block.mlp(h)
    if gate_grad == 'scale':
        full = torch.sigmoid(score)[..., None] * full
    return torch.where(mask[..., None], full, block.cheap(h))


def suffix_ref(model, x, start, actions, budget=None):
    """Run blocks start.. by hand: attention, then ffn_ref with actions[layer] (default 'full')."""
    for i in range(start, len(model.transformer.h)):
        block = model.transformer.h[i]
        x = x + block.attn(block.ln_1(x))
        x = x + ffn_ref(block, x, actions.get(i, 'full'), budget, model.config.ffn_gate_grad)
    return x


def full_mid_ref(model, idx, l):
    """The state after layer l's attention with every layer below it full (the all-full start)."""
    x = embed_ref(model, idx)
    for i in range(l):
        block = model.transformer.h[i]
        x = x + block.attn(block.ln_1(x))
        x = x + block.mlp(block.ln_2(x))
    return x + model.transformer.h[l].attn(model.transformer.h[l].ln_1(x))


def logits_ref(model, x):
    return model.lm_head(model.transformer.ln_f(x))


def ce_ref(logits, targets):
    """Per-token CE, 0 where the target is -1 (no label there)."""
    ce = -torch.log_softmax(logits.double(), -1).gather(-1, targets.clamp(min=0)[..., None])
    return ce.squeeze(-1) * (targets != -1)


def dense_twin(routed_model, seed):
    """A dense GPT (route='none') with random weights, loaded into the routed model's backbone."""
    cfg = routed_model.config
    torch.manual_seed(seed + 99)
    dense = GPT(GPTConfig(**dict(BASE, n_layer=cfg.n_layer, pos=cfg.pos, bias=cfg.bias,
                                 block_size=cfg.block_size)))
    g = torch.Generator().manual_seed(seed + 5)
    with torch.no_grad():
        for p in dense.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g))
    missing, unexpected = routed_model.load_state_dict(dense.state_dict(), strict=False)
    assert not unexpected
    assert all(
        any(s in k for s in ('.cheap.', '.gate.', '.predictor.')) or k.endswith('.tau')
        for k in missing
    )
    return dense


# --------------------------------------------------------------------------------------------------
# 1. training decisions: exactly ceil(budget·T) full tokens per row, and they are the top-k scores

@settings(**SETTINGS)
@given(seed=SEEDS, B=st.integers(1, 3), T=st.integers(1, 24), budget=BUDGETS,
       gate=st.sampled_from(['mlp', 'jepa', 'random']), layout=layouts(),
       readout=st.sampled_from(['distance', 'linear']), block_size=st.sampled_from([24, 48]),
       gate_grad=st.sampled_from(['ste', 'scale', 'none']))
def test_train_masks_hold_exactly_ceil_budget_T_top_scoring_tokens(
    seed, B, T, budget, gate, layout, readout, block_size, gate_grad
):
    n_layer, spec, ids = layout
    model = build(
        seed,
        n_layer,
        ffn_gate=gate,
        ffn_budget=float(budget),
        ffn_layers=spec,
        ffn_jepa_readout=readout,
        block_size=block_size,
        ffn_gate_grad=gate_grad,
    ).train()
    assert controlled_layer_ids(model.config) == ids
    idx = tokens(seed, B, T, distinct_first=True)
    calls, handles = record_ln2(model, ids)
    torch.manual_seed(seed)
    aux = model(idx, idx)[2]
    for hnd in handles:
        hnd.remove()
    k = ceil_frac(budget, T)            # of the actual T, never of block_size
    assert sorted(aux['masks']) == ids
    torch.manual_seed(seed)             # the random gate draws one (B, T) uniform tensor per layer,
                                        # in order
    with torch.no_grad():
        scores = {
            l: (
                torch.rand(B, T)
                if gate == 'random'
                else model.transformer.h[l].gate(calls[l][0][1])
            )
            for l in ids
        }
    for l in ids:
        mask = aux['masks'][l]
        assert mask.shape == (B, T) and mask.dtype == torch.bool
        assert mask.sum(1).tolist() == [k] * B
        s = scores[l]
        for b in range(B):
            if 0 < k < T:
                assert s[b][mask[b]].min() >= s[b][~mask[b]].max()
    torch.testing.assert_close(aux['full_frac'], torch.full((len(ids),), k / T), rtol=0, atol=1e-6)


# --------------------------------------------------------------------------------------------------
# 2. gate forced open (or budget 1.0) == the dense model; forced shut == a hand-written cheap
# forward

DENSE_EQ = dict(seed=SEEDS, B=st.integers(1, 3), T=st.integers(1, 24), layout=layouts(),
                pos=st.sampled_from(['learned', 'rope']), bias=st.booleans())


@settings(**SETTINGS)
@given(**DENSE_EQ, gate=st.sampled_from(SCORING_GATES),
       readout=st.sampled_from(['distance', 'linear']),
       infer_rule=st.sampled_from(['threshold', 'predictor']))
def test_budget_one_no_grad_equals_dense_bitwise(
    seed, B, T, layout, pos, bias, gate, readout, infer_rule
):
    n_layer, spec, ids = layout
    model = build(seed, n_layer, ffn_gate=gate, ffn_budget=1.0, ffn_layers=spec, pos=pos, bias=bias,
                  ffn_jepa_readout=readout, ffn_gate_grad='none', ffn_infer_rule=infer_rule)
    dense = dense_twin(model, seed)
    idx = tokens(seed, B, T)
    ref = dense.eval()(idx, idx)[0]
    out, _, aux = model.train()(idx, idx)
    assert all(m.all() for m in aux['masks'].values())
    assert torch.equal(out, ref)
    model.calibrate(tokens(seed + 1, 2, T))      # budget 1.0: every token passes the causal
                                                 # threshold
    out, _, aux = model.eval()(idx, idx)
    assert all(m.all() for m in aux['masks'].values())
    assert torch.equal(out, ref)


STE_CASES = [(seed, gate, readout) for seed, (gate, readout) in
             enumerate([('mlp', 'distance'), ('jepa', 'distance'), ('jepa', 'linear')])]


def check_budget_one_ste_equals_dense(seed, B, T, layout, pos, bias, gate, readout, exact):
    n_layer, spec, ids = layout
    model = build(seed, n_layer, ffn_gate=gate, ffn_budget=1.0, ffn_layers=spec, pos=pos, bias=bias,
                  ffn_jepa_readout=readout, ffn_gate_grad='ste')
    dense = dense_twin(model, seed)
    idx = tokens(seed, B, T)
    out, ref = model.train()(idx, idx)[0], dense.eval()(idx, idx)[0]
    if exact:
        assert torch.equal(out, ref)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


# Regression: straight_through once computed (m + σ) − σ, which rounds 1 to 1 − 2**-24 for ~20% of
# tokens; fixed cases here, hypothesis below.
@pytest.mark.parametrize('seed,gate,readout', STE_CASES)
def test_budget_one_ste_equals_dense_bitwise(seed, gate, readout):
    check_budget_one_ste_equals_dense(
        seed, 2, 16, (3, 'all', [0, 1, 2]), 'learned', False, gate, readout, True
    )


@settings(**SETTINGS)
@given(**DENSE_EQ, gate=st.sampled_from(SCORING_GATES),
       readout=st.sampled_from(['distance', 'linear']))
def test_budget_one_ste_equals_dense_property(seed, B, T, layout, pos, bias, gate, readout):
    check_budget_one_ste_equals_dense(seed, B, T, layout, pos, bias, gate, readout, True)


@settings(**SETTINGS)
@given(**DENSE_EQ, gate=st.sampled_from(['mlp', 'jepa', 'random', 'static_full']),
       gate_grad=st.sampled_from(['ste', 'scale', 'none']), budget=BUDGETS, training=st.booleans())
def test_forced_full_and_static_full_equal_dense_bitwise(
    seed, B, T, layout, pos, bias, gate, gate_grad, budget, training
):
    n_layer, spec, ids = layout
    model = build(
        seed,
        n_layer,
        ffn_gate=gate,
        ffn_budget=float(budget),
        ffn_layers=spec,
        pos=pos,
        bias=bias,
        ffn_gate_grad=gate_grad,
    ).train(training)
    dense = dense_twin(model, seed)
    idx = tokens(seed, B, T)
    ref = dense.eval()(idx, idx)[0]
    assert torch.equal(model(idx, idx, force='full')[0], ref)
    if gate == 'static_full':
        assert torch.equal(model(idx, idx)[0], ref)


@settings(**SETTINGS)
@given(**DENSE_EQ, gate=st.sampled_from(['mlp', 'jepa', 'random', 'static_cheap']),
       gate_grad=st.sampled_from(['ste', 'scale', 'none']), training=st.booleans())
def test_forced_cheap_and_static_cheap_equal_hand_written_forward(
    seed, B, T, layout, pos, bias, gate, gate_grad, training
):
    n_layer, spec, ids = layout
    model = build(seed, n_layer, ffn_gate=gate, ffn_layers=spec, pos=pos, bias=bias,
                  ffn_gate_grad=gate_grad).train(training)
    idx = tokens(seed, B, T)
    with torch.no_grad():
        x = embed_ref(model, idx)
        for i, block in enumerate(model.transformer.h):
            x = x + block.attn(block.ln_1(x))
            x = x + (block.cheap if i in ids else block.mlp)(block.ln_2(x))
        ref = model.lm_head(model.transformer.ln_f(x))
        assert torch.equal(model(idx, idx, force='cheap')[0], ref)
        if gate == 'static_cheap':
            assert torch.equal(model(idx, idx)[0], ref)
        # and the cheap model is a different function from the full one
        assert not torch.equal(model(idx, idx, force='full')[0], ref)


@pytest.mark.parametrize('src_gate,gate,rule', [
    ('mlp', 'mlp', 'threshold'), ('random', 'mlp', 'predictor'),
    ('random', 'jepa', 'threshold'), ('mlp', 'jepa', 'predictor')])
def test_routed_model_from_checkpoint_file_keeps_backbone_and_gets_fresh_gates(
    src_gate, gate, rule
):
    """train.build_model with init_from=<ckpt file> (stage 2: typically a random-gate backbone):
    backbone (incl. cheap FFNs) from the file, gates fresh; forced full/cheap logits equal the
    source model's."""
    src = build(11, 2, ffn_gate=src_gate, ffn_layers='all')
    ckpt = dict(model_args=dict(src.config.__dict__), model=src.state_dict())
    fields = dict(src.config.__dict__, ffn_gate=gate, ffn_infer_rule=rule)
    cfg = SimpleNamespace(**fields, init_from='stage1/ckpt.pt', dataset='synthetic',
                          trainable='controller')
    model = train.build_model(cfg, dict(vocab_size=V), ckpt)
    idx = tokens(3, 2, 12)
    for force in ('full', 'cheap'):
        assert torch.equal(model(idx, idx, force=force)[0], src(idx, idx, force=force)[0])
    g_src = dict(src.named_parameters())
    assert any(
        n not in g_src or not torch.equal(p, g_src[n])
        for n, p in model.named_parameters()
        if '.gate.' in n
    )


# --------------------------------------------------------------------------------------------------
# 3. masked mixture == gather -> compute -> scatter

@settings(**SETTINGS)
@given(seed=SEEDS, B=st.integers(1, 3), T=st.integers(1, 24), p=st.floats(0.0, 1.0),
       gate=st.sampled_from(SCORING_GATES), gate_grad=st.sampled_from(['ste', 'scale', 'none']),
       layer=st.integers(0, 1))
def test_masked_update_equals_gather_scatter(seed, B, T, p, gate, gate_grad, layer):
    model = build(seed, 2, ffn_gate=gate, ffn_gate_grad=gate_grad).eval()
    block = model.transformer.h[layer]
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, T, generator=g) < p
    mag = 0.1 + 3 * torch.rand(B, T, generator=g)
    score = torch.where(mask, mag, -mag)           # the decision: score > tau = 0
    if gate == 'mlp':
        block.gate.forward = lambda h: score
    else:
        block.gate.score = lambda h, p_full, p_cheap: score
    block.tau.fill_(0.0)
    x = torch.randn(B, T, model.config.n_embd, generator=g)
    ctx = RouteCtx()
    with torch.no_grad():
        out = route_ffn.routed_ffn_update(block, model.config, x, ctx)
        h = block.ln_2(x)
        sel, rest = mask.nonzero(as_tuple=True), (~mask).nonzero(as_tuple=True)
        full = block.mlp(h[sel])                          # (N, C): only the selected tokens
        if gate_grad == 'scale':
            full = torch.sigmoid(score[sel])[:, None] * full
        ref = torch.zeros_like(h)
        ref[sel] = full
        ref[rest] = block.cheap(h[rest])
    assert torch.equal(ctx.masks[layer], mask)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------------------------------
# 4. eval mode is causal for every gate and decision rule

@settings(**SETTINGS)
@given(seed=SEEDS, B=st.integers(1, 3), T=st.integers(2, 24), budget=BUDGETS, layout=layouts(),
       gate=st.sampled_from(['mlp', 'jepa', 'random', 'static_full', 'static_cheap']),
       infer_rule=st.sampled_from(['threshold', 'predictor']),
       gate_grad=st.sampled_from(['ste', 'scale', 'none']),
       readout=st.sampled_from(['distance', 'linear']), pos=st.sampled_from(['learned', 'rope']),
       data=st.data())
def test_eval_routing_is_causal(
    seed, B, T, budget, layout, gate, infer_rule, gate_grad, readout, pos, data
):
    n_layer, spec, ids = layout
    model = build(
        seed,
        n_layer,
        ffn_gate=gate,
        ffn_budget=float(budget),
        ffn_layers=spec,
        ffn_infer_rule=infer_rule,
        ffn_gate_grad=gate_grad,
        ffn_jepa_readout=readout,
        pos=pos,
    )
    idx = tokens(seed, B, T)
    model.calibrate(calibration_tokens(seed + 1, idx))
    model.eval()
    t = data.draw(st.integers(0, T - 2))
    other = idx.clone()
    other[:, t + 1:] = tokens(seed + 2, B, T - t - 1)
    torch.manual_seed(seed)
    la, _, aux_a = model(idx, last_only=False)
    torch.manual_seed(seed)
    lb, _, aux_b = model(other, last_only=False)
    expect_masks = ids if gate in ('mlp', 'jepa', 'random') else []
    assert sorted(aux_a.get('masks', {})) == expect_masks
    for l in expect_masks:          # the decisions at positions <= t: exactly equal
        assert torch.equal(aux_a['masks'][l][:, :t + 1], aux_b['masks'][l][:, :t + 1])
    # Sparse eval gathers the selected tokens of the whole batch into one matmul, and the future
    # tokens change how many there are: BLAS may then block the same dot products differently (seen:
    # 3 vs 2 rows, logits off by 4e-7 on some CPUs). So values within ROUTED_TOL (see conftest) here
    # ...
    torch.testing.assert_close(la[:, :t + 1], lb[:, :t + 1], **ROUTED_TOL)
    changed = (other != idx).any(0).nonzero()
    if len(changed):                # ... a tolerance far below what changing a token does to its
                                    # logits
        p = changed[0, 0].item()
        assert not torch.allclose(la[:, p], lb[:, p], **ROUTED_TOL)
    # ... and bitwise in masked-dense eval, where both passes run every op on the whole (B, T) batch
    torch.manual_seed(seed)
    da = model(idx, last_only=False, sparse=False)[0]
    torch.manual_seed(seed)
    db = model(other, last_only=False, sparse=False)[0]
    assert torch.equal(da[:, :t + 1], db[:, :t + 1])


@settings(**SETTINGS)
@given(seed=SEEDS, B=st.integers(1, 2), T0=st.integers(1, 10), new=st.integers(1, 8),
       gate=st.sampled_from(['mlp', 'jepa', 'static_full', 'static_cheap']),
       infer_rule=st.sampled_from(['threshold', 'predictor']),
       gate_grad=st.sampled_from(['ste', 'scale', 'none']),
       pos=st.sampled_from(['learned', 'rope']), layout=layouts())
def test_eval_routing_kv_cache_decoding_equals_recompute(
    seed, B, T0, new, gate, infer_rule, gate_grad, pos, layout
):
    """Per-token causal decisions: one token at a time through the KV cache routes exactly as the
    full recompute does, and predicts the same (logits within ROUTED_TOL: a cache step runs T=1 and
    masked attention, recomputation T and is_causal, and sparse gathers of other sizes; tokens equal
    unless a near-tie, see conftest.assert_greedy_traces_agree)."""
    n_layer, spec, ids = layout
    model = build(
        seed,
        n_layer,
        ffn_gate=gate,
        ffn_layers=spec,
        ffn_infer_rule=infer_rule,
        ffn_gate_grad=gate_grad,
        pos=pos,
    )
    idx = tokens(seed, B, T0)
    model.calibrate(calibration_tokens(seed + 1, idx))
    model.eval()
    cached = greedy_trace(model, idx, new, use_cache=True)
    recomputed = greedy_trace(model, idx, new, use_cache=False)
    for a, b in zip(cached, recomputed):
        assert_greedy_traces_agree(a, b, ROUTED_TOL)


@pytest.mark.parametrize('training', [True, False])
def test_oracle_gate_needs_targets(training):
    model = build(0, 2, ffn_gate='oracle').train(training)
    idx = tokens(0, 2, 8)
    with pytest.raises(ValueError, match='target'):
        model(idx)
    if training:        # with targets it routes ceil(budget·T) tokens by their utility labels
        aux = model(idx, idx)[2]
        assert all(m.sum(1).tolist() == [4, 4] for m in aux['masks'].values())


# --------------------------------------------------------------------------------------------------
# 5. the LM loss alone trains the gate (ste, scale); ffn_gate_grad='none' cuts it off

def gate_params_on_score(block):
    """Gate parameters the score is a function of. JEPA: the output bias cancels in
    P(h, full) - P(h, cheap), so the score does not depend on it."""
    return {n: p for n, p in block.gate.named_parameters()
            if not (isinstance(block.gate, gates.JEPAGate) and n == 'out.bias')}


@settings(**SETTINGS)
@given(seed=SEEDS, B=st.integers(1, 3), T=st.integers(2, 24), budget=BUDGETS, layout=layouts(),
       gate=st.sampled_from(SCORING_GATES), readout=st.sampled_from(['distance', 'linear']),
       gate_grad=st.sampled_from(['ste', 'scale', 'none']),
       infer_rule=st.sampled_from(['threshold', 'predictor']))
def test_lm_loss_alone_reaches_the_gate(
    seed, B, T, budget, layout, gate, readout, gate_grad, infer_rule
):
    n_layer, spec, ids = layout
    model = build(
        seed,
        n_layer,
        ffn_gate=gate,
        ffn_jepa_readout=readout,
        ffn_budget=float(budget),
        ffn_layers=spec,
        ffn_gate_grad=gate_grad,
        ffn_infer_rule=infer_rule,
    ).train()
    idx = tokens(seed, B, T)
    _, loss, aux = model(idx, idx)
    assert torch.equal(loss.detach(), aux['lm_loss'])              # no auxiliary term in the loss
    assert not any(k.endswith('_loss') and k != 'lm_loss' for k in aux)
    loss.backward()
    for l in ids:
        block = model.transformer.h[l]
        for n, p in gate_params_on_score(block).items():
            if gate_grad == 'none':
                assert p.grad is None or not p.grad.any(), n
            else:
                assert p.grad is not None and p.grad.abs().sum() > 0, (l, n)
        if block.predictor is not None:           # ffn_predictor_weight = 0: nothing trains it
            assert all(p.grad is None or not p.grad.any() for p in block.predictor.parameters())


def test_jepa_target_projection_is_a_fixed_buffer():
    model = build(
        4, 2, ffn_gate='jepa', ffn_jepa_weight=1.0, ffn_util_weight=1.0, ffn_rank_weight=1.0
    ).train()
    names = {n for n, _ in model.named_parameters()}
    targets = {n: b.clone() for n, b in model.named_buffers() if n.endswith('gate.target')}
    assert sorted(targets) == ['transformer.h.0.gate.target', 'transformer.h.1.gate.target']
    assert not any(n.endswith('gate.target') for n in names)
    gate_before = [p.detach().clone() for p in model.controller_parameters()]
    opt = model.configure_optimizers(0.1, 1e-2, (0.9, 0.95), 'cpu')
    for step in range(3):
        idx = tokens(step, 2, 16)
        loss = model(idx, idx, oracle_layers=(step % 2,))[1]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    bufs = dict(model.named_buffers())
    assert all(torch.equal(bufs[n], b) for n, b in targets.items())
    assert any(not torch.equal(a, p) for a, p in zip(gate_before, model.controller_parameters()))


# --------------------------------------------------------------------------------------------------
# 6. straight-through: forward value is the hard mixture

def check_hard_mixture(seed, B, T, budget, layout, gate, gate_grad, readout, exact=True):
    n_layer, spec, ids = layout
    model = build(
        seed,
        n_layer,
        ffn_gate=gate,
        ffn_jepa_readout=readout,
        ffn_budget=float(budget),
        ffn_layers=spec,
        ffn_gate_grad=gate_grad,
    ).train()
    idx = tokens(seed, B, T)
    calls, handles = record_ln2(model, ids)
    with record_updates(model, ids) as updates:
        aux = model(idx, idx)[2]
    for hnd in handles:
        hnd.remove()
    with torch.no_grad():
        for l in ids:
            block = model.transformer.h[l]
            x = calls[l][0][0]
            h = block.ln_2(x)
            full, cheap = block.mlp(h), block.cheap(h)
            if gate_grad == 'scale':
                full = torch.sigmoid(block.gate(h))[..., None] * full
            ref = torch.where(aux['masks'][l][..., None], full, cheap)
            if exact:
                assert torch.equal(updates[l][0], ref), l
            torch.testing.assert_close(updates[l][0], ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize('seed,gate,readout', STE_CASES)
def test_ste_forward_is_the_hard_mixture_bitwise(seed, gate, readout):
    check_hard_mixture(seed, 2, 16, Fraction(1, 2), (3, 'all', [0, 1, 2]), gate, 'ste', readout)


@settings(**SETTINGS)
@given(seed=SEEDS, B=st.integers(1, 3), T=st.integers(1, 24), budget=BUDGETS, layout=layouts(),
       gate=st.sampled_from(SCORING_GATES), readout=st.sampled_from(['distance', 'linear']))
def test_ste_forward_is_the_hard_mixture_property(seed, B, T, budget, layout, gate, readout):
    check_hard_mixture(seed, B, T, budget, layout, gate, 'ste', readout, exact=True)


@settings(**SETTINGS)
@given(seed=SEEDS, B=st.integers(1, 3), T=st.integers(1, 24), budget=BUDGETS, layout=layouts(),
       gate=st.sampled_from(SCORING_GATES), readout=st.sampled_from(['distance', 'linear']),
       gate_grad=st.sampled_from(['scale', 'none']))
def test_scale_and_none_forward_is_the_hard_mixture(
    seed, B, T, budget, layout, gate, readout, gate_grad
):
    check_hard_mixture(seed, B, T, budget, layout, gate, gate_grad, readout)


# --------------------------------------------------------------------------------------------------
# 7. calibration hits the budget

@settings(**SETTINGS)
@given(seed=SEEDS, B=st.integers(1, 4), T=st.integers(1, 24), budget=BUDGETS, layout=layouts(),
       gate=st.sampled_from(SCORING_GATES), infer_rule=st.sampled_from(['threshold', 'predictor']),
       readout=st.sampled_from(['distance', 'linear']))
def test_calibration_hits_budget_on_its_own_batch(
    seed, B, T, budget, layout, gate, infer_rule, readout
):
    n_layer, spec, ids = layout
    model = build(
        seed,
        n_layer,
        ffn_gate=gate,
        ffn_budget=float(budget),
        ffn_layers=spec,
        ffn_infer_rule=infer_rule,
        ffn_jepa_readout=readout,
    ).train()
    x_cal = tokens(seed, B, T, distinct_first=True)
    fracs = model.calibrate(x_cal)
    assert model.training                   # calibrate restores the mode
    frac = model.eval()(x_cal)[2]['full_frac']
    assert torch.equal(fracs, frac)
    assert (frac - float(budget)).abs().max().item() <= 1 / (B * T) + 1e-6


# Held-out batch: 32 sequences of 24 tokens. Were every token's decision independent, the
# calibration quantile and the fresh batch's fraction would differ by std <= sqrt(2·0.25/768)
# ≈ 0.026; but scores within a sequence are correlated and the check takes the worst layer, so the
# measured worst-layer gaps reach 0.115 in 60 random examples. ±0.2 is about 5 std of those, and a
# calibration that misses the budget (a threshold left at 0, a wrong quantile) misses by 0.3-0.5.
# derandomize=True keeps the drawn examples fixed for a given test source.
@settings(**dict(SETTINGS, derandomize=True))
@given(seed=SEEDS, budget=st.integers(5, 95).map(lambda n: Fraction(n, 100)), layout=layouts(),
       gate=st.sampled_from(SCORING_GATES), infer_rule=st.sampled_from(['threshold', 'predictor']))
def test_calibration_generalises_to_a_fresh_batch(seed, budget, layout, gate, infer_rule):
    n_layer, spec, ids = layout
    model = build(
        seed,
        n_layer,
        ffn_gate=gate,
        ffn_budget=float(budget),
        ffn_layers=spec,
        ffn_infer_rule=infer_rule,
        vocab_size=61,
    )
    model.calibrate(tokens(seed, 32, 24, vocab=61))
    frac = model.eval()(tokens(seed + 1, 32, 24, vocab=61))[2]['full_frac']
    assert (frac - float(budget)).abs().max().item() <= 0.2


@pytest.mark.parametrize('gate', ['random', 'static_full', 'static_cheap'])
def test_calibrate_without_scores_returns_none(gate):
    assert build(0, 2, ffn_gate=gate).calibrate(tokens(0, 2, 8)) is None


# --------------------------------------------------------------------------------------------------
# 8. a weight of 0 means the computation does not run

def boom(*args, **kwargs):
    raise AssertionError('this computation should not run')


@pytest.mark.parametrize('gate', SCORING_GATES)
def test_no_oracle_pass_without_oracle_layers(gate):
    model = build(0, 2, ffn_gate=gate, ffn_util_weight=1.0, ffn_rank_weight=1.0).train()
    idx = tokens(0, 2, 12)
    # every oracle fork goes through one
    saved = oracle_labels.fork_utility, oracle_labels.token_fork_utility
    oracle_labels.fork_utility = oracle_labels.token_fork_utility = boom
    try:
        no_oracle_pass_without_oracle_layers(model, idx)
    finally:
        oracle_labels.fork_utility, oracle_labels.token_fork_utility = saved


def no_oracle_pass_without_oracle_layers(model, idx):
    model(idx, idx)
    model(idx, idx, oracle_layers=())
    model.eval()(idx, idx)
    with pytest.raises(AssertionError):        # the patch is live: an oracle layer does call it
        model.train()(idx, idx, oracle_layers=(0,))


def test_jepa_weight_zero_never_projects_targets(monkeypatch):
    idx = tokens(0, 2, 12)
    monkeypatch.setattr(gates.JEPAGate, 'target_of', boom)
    build(0, 2, ffn_gate='jepa', ffn_jepa_weight=0.0).train()(idx, idx)
    with pytest.raises(AssertionError):
        build(0, 2, ffn_gate='jepa', ffn_jepa_weight=1.0).train()(idx, idx)


def test_predictor_weight_zero_never_runs_predictor_in_training(monkeypatch):
    idx = tokens(0, 2, 12)
    monkeypatch.setattr(gates.MembershipPredictor, 'forward', boom)
    build(0, 2, ffn_gate='mlp', ffn_infer_rule='predictor', ffn_predictor_weight=0.0).train()(
        idx, idx
    )
    with pytest.raises(AssertionError):
        build(0, 2, ffn_gate='mlp', ffn_infer_rule='predictor', ffn_predictor_weight=1.0).train()(
            idx, idx
        )


def test_mimic_weight_zero_never_runs_mimic(monkeypatch):
    idx = tokens(0, 2, 12)
    monkeypatch.setattr(losses, 'cheap_mimic', boom)
    build(0, 2, ffn_gate='mlp', ffn_mimic_weight=0.0).train()(idx, idx)
    with pytest.raises(AssertionError):
        build(0, 2, ffn_gate='mlp', ffn_mimic_weight=1.0).train()(idx, idx)


def test_util_and_rank_weight_zero_compute_no_util_or_rank_term(monkeypatch):
    """With ffn_util_weight = ffn_rank_weight = 0 no oracle pass runs even when a caller passes
    oracle_layers."""
    monkeypatch.setattr(losses, 'utility_regression', boom)
    monkeypatch.setattr(losses, 'pairwise_rank', boom)
    model = build(0, 2, ffn_gate='mlp').train()
    monkeypatch.setattr(oracle_labels, 'fork_utility', boom)
    monkeypatch.setattr(oracle_labels, 'token_fork_utility', boom)
    idx = tokens(0, 2, 12)
    _, loss, aux = model(idx, idx, oracle_layers=(1,))
    assert 'util_loss' not in aux and 'rank_loss' not in aux and 'utility_mean' not in aux
    assert torch.equal(loss.detach(), aux['lm_loss'])


# --------------------------------------------------------------------------------------------------
# 9. the util loss regressed onto oracle labels from hand-written forks (the labels themselves:
# test_oracle_labels.py)

def from_full_start(start, policy):
    return start == 'full' or (start == 'auto' and policy == 'off')


def labelled_pass(model, seed, B, T, l, masked=0):
    """One training forward with oracle labels at layer l: (idx, targets, loss, aux, the routed
    state at l after attention, layer l's gate score on it). The first `masked` targets of each row
    are -1, as a task's prompt is."""
    idx, tgt = tokens(seed, B, T, distinct_first=True), tokens(seed + 1, B, T)
    tgt[:, :masked] = -1
    calls, handles = record_ln2(model, [l])
    _, loss, aux = model(idx, tgt, oracle_layers=(l,))
    for hnd in handles:
        hnd.remove()
    x_routed, h_routed = calls[l][0]
    with torch.no_grad():
        score = model.transformer.h[l].gate(h_routed)
    return idx, tgt, loss, aux, x_routed, score


@settings(**SETTINGS)
@given(seed=SEEDS, B=st.integers(1, 3), T=st.integers(2, 24), gate=st.sampled_from(SCORING_GATES),
       policy=st.sampled_from(['off', 'on']), start=st.sampled_from(['auto', 'full', 'routed']),
       aux_grad=st.sampled_from(['own', 'leak']), data=st.data())
def test_util_loss_regresses_routed_score_onto_reference_labels(
    seed, B, T, gate, policy, start, aux_grad, data
):
    """End to end through forward(oracle_layers=...): the forks start from the all-full state (start
    'full'; 'auto' with off-policy labels) or from this routed pass's own state ('routed'; 'auto'
    with on-policy labels), and the later layers run all full (off) or by the gates (on); the
    regressed score is this pass's gate score (whichever graph its gradient takes)."""
    l = data.draw(st.integers(0, 2))
    model = build(
        seed,
        3,
        ffn_gate=gate,
        ffn_budget=0.5,
        ffn_util_weight=1.0,
        ffn_oracle_policy=policy,
        ffn_oracle_start=start,
        ffn_aux_grad=aux_grad,
        ffn_oracle_label='sequence',
    ).train()
    idx, tgt, loss, aux, x_routed, score = labelled_pass(
        model, seed, B, T, l, masked=data.draw(st.integers(0, T - 1))
    )
    budget = Fraction(1, 2)
    with torch.no_grad():
        x_mid = full_mid_ref(model, idx, l) if from_full_start(start, policy) else x_routed
        later = {} if policy == 'off' else {i: 'policy' for i in range(l + 1, 3)}
        ce = {}
        for action in ('full', 'cheap'):
            y = x_mid + ffn_ref(model.transformer.h[l], x_mid, action)
            ce[action] = ce_ref(logits_ref(model, suffix_ref(model, y, l + 1, later, budget)), tgt)
        U_ref = (ce['cheap'] - ce['full']).float()
    labelled = tgt != -1                # no CE at a -1 target: no label to regress onto
    torch.testing.assert_close(
        aux['util_loss'].detach(), ((score - U_ref) ** 2)[labelled].mean(), rtol=1e-5, atol=1e-5
    )
    torch.testing.assert_close(aux['utility_mean'], U_ref[labelled].mean(), rtol=0, atol=1e-5)
    torch.testing.assert_close(
        loss.detach(), aux['lm_loss'] + aux['util_loss'].detach(), rtol=1e-6, atol=1e-6
    )


def token_labels_ref(model, l, x_mid, base, tgt, later, budget):
    """'token' labels by brute force: for every token t and action, a separate fork in which only
    t's action at l differs from base, through the ordinary causal attention; the later layers all
    full, or by the decisions the base fork's gates took (held for every fork; 'scale' by each
    fork's own score)."""
    blocks, T = model.transformer.h, x_mid.size(1)

    def run(sel, held=None):
        x, masks = (
            x_mid
            + torch.where(
                sel[..., None],
                ffn_ref(blocks[l], x_mid, 'full'),
                ffn_ref(blocks[l], x_mid, 'cheap'),
            ),
            {},
        )
        for i in range(l + 1, len(blocks)):
            block = blocks[i]
            x = x + block.attn(block.ln_1(x))
            h = block.ln_2(x)
            if later == 'full' or not hasattr(block, 'cheap'):
                x = x + block.mlp(h)
                continue
            score = block.gate(h)
            masks[i] = topk_ref(score, ceil_frac(budget, T)) if held is None else held[i]
            full = (
                torch.sigmoid(score)[..., None] * block.mlp(h)
                if model.config.ffn_gate_grad == 'scale'
                else block.mlp(h)
            )
            x = x + torch.where(masks[i][..., None], full, block.cheap(h))
        return ce_ref(logits_ref(model, x), tgt), masks

    _, held = run(base)
    ce = {a: torch.zeros(x_mid.shape[:2], dtype=torch.float64) for a in ('full', 'cheap')}
    for t in range(T):
        for action in ('full', 'cheap'):
            sel = base.clone()
            sel[:, t] = action == 'full'
            ce[action][:, t] = run(sel, held)[0][:, t]
    return (ce['cheap'] - ce['full']).float()


@settings(**SETTINGS)
@given(seed=SEEDS, B=st.integers(1, 2), T=st.integers(2, 10), gate=st.sampled_from(SCORING_GATES),
       policy=st.sampled_from(['off', 'on']), start=st.sampled_from(['auto', 'full', 'routed']),
       data=st.data())
def test_util_loss_regresses_onto_token_labels_from_either_start(
    seed, B, T, gate, policy, start, data
):
    """End to end with the default 'token' labels: from the all-full state every other token is full
    at l; from the routed state every other token keeps this pass's own training decision at l."""
    l = data.draw(st.integers(0, 2))
    model = build(
        seed,
        3,
        ffn_gate=gate,
        ffn_budget=0.5,
        ffn_util_weight=1.0,
        ffn_oracle_policy=policy,
        ffn_oracle_start=start,
    ).train()
    assert model.config.ffn_oracle_label == 'token'
    idx, tgt, _, aux, x_routed, score = labelled_pass(
        model, seed, B, T, l, masked=data.draw(st.integers(0, T - 1))
    )
    with torch.no_grad():
        if from_full_start(start, policy):
            x_mid = full_mid_ref(model, idx, l)
            base = torch.ones(B, T, dtype=torch.bool)
        else:
            x_mid, base = x_routed, topk_ref(score, ceil_frac(Fraction(1, 2), T))
        U_ref = token_labels_ref(
            model, l, x_mid, base, tgt, 'full' if policy == 'off' else 'policy', Fraction(1, 2)
        )
    labelled = tgt != -1
    torch.testing.assert_close(
        aux['util_loss'].detach(), ((score - U_ref) ** 2)[labelled].mean(), rtol=1e-5, atol=1e-5
    )
    torch.testing.assert_close(aux['utility_mean'], U_ref[labelled].mean(), rtol=0, atol=1e-5)


# --------------------------------------------------------------------------------------------------
# 10. utility regression and pairwise rank against brute force: tests/test_losses.py


# --------------------------------------------------------------------------------------------------
# 11. controller-only training touches the controller and nothing else

@pytest.mark.parametrize('gate,infer_rule', [('mlp', 'threshold'), ('jepa', 'predictor'),
                                             ('mlp', 'predictor')])
def test_controller_only_training_freezes_the_backbone(gate, infer_rule):
    model = build(
        1,
        3,
        ffn_gate=gate,
        ffn_infer_rule=infer_rule,
        ffn_layers='0,2',
        ffn_util_weight=1.0,
        ffn_rank_weight=1.0,
        ffn_jepa_weight=1.0,
        ffn_predictor_weight=1.0,
        ffn_mimic_weight=1.0,
    ).train()
    cfg = SimpleNamespace(trainable='controller', route='ffn', ffn_gate=gate)
    params = train.trainable_parameters(model, cfg)
    opt = model.configure_optimizers(0.1, 1e-2, (0.9, 0.95), 'cpu', params=params)
    in_opt = {id(p) for group in opt.param_groups for p in group['params']}
    ctrl = {n for n, _ in model.named_parameters() if '.gate.' in n or '.predictor.' in n}
    assert in_opt == {id(p) for p in model.controller_parameters()}
    assert in_opt == {id(p) for n, p in model.named_parameters() if n in ctrl}
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for step in range(3):
        idx = tokens(step, 2, 16)
        loss = model(idx, idx, oracle_layers=((0, 2)[step % 2],))[1]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    after = model.state_dict()
    for k, v in before.items():
        if k not in ctrl:
            assert torch.equal(after[k], v), k
    changed = {k for k in ctrl if not torch.equal(after[k], before[k])}
    for l in (0, 2):
        assert any(k.startswith(f'transformer.h.{l}.gate.') for k in changed)
        if infer_rule == 'predictor':
            assert any(k.startswith(f'transformer.h.{l}.predictor.') for k in changed)


@pytest.mark.parametrize('kw', [dict(ffn_gate='random'), dict(ffn_gate='static_full'),
                                dict(route='none')])
def test_controller_only_needs_gate_parameters(kw):
    model = build(0, 2, **kw)
    cfg = SimpleNamespace(
        trainable='controller', route=model.config.route, ffn_gate=model.config.ffn_gate
    )
    with pytest.raises(train.TrainError, match='controller'):
        train.trainable_parameters(model, cfg)


# --------------------------------------------------------------------------------------------------
# 12. config validation names the field

@pytest.mark.parametrize('field,value', [
    ('ffn_budget', 0.0), ('ffn_budget', 1.5), ('ffn_budget', -0.5), ('ffn_budget', float('nan')),
    ('ffn_gate', 'g2'), ('route', 'moe'), ('ffn_gate_grad', 'gumbel'), ('ffn_infer_rule', 'topk'),
    ('ffn_jepa_outcome', 'x'), ('ffn_jepa_readout', 'x'), ('ffn_rank_kind', 'hinge'),
    ('ffn_oracle_policy', 'both'),
    ('ffn_layers', '7'), ('ffn_layers', 'x'), ('ffn_layers', '-1'),
    ('ffn_layers', '0,3'), ('ffn_layers', ''), ('ffn_layers', '1.5')])
def test_config_validation_names_the_field(field, value):
    args = dict(BASE, n_layer=3, route='ffn')
    args[field] = value
    with pytest.raises(ValueError, match=field):
        GPTConfig(**args)


@settings(**SETTINGS)
@given(layout=layouts(), budget=BUDGETS)
def test_valid_config_accepted(layout, budget):
    n_layer, spec, ids = layout
    cfg = GPTConfig(
        **dict(BASE, n_layer=n_layer, route='ffn', ffn_layers=spec, ffn_budget=float(budget))
    )
    assert controlled_layer_ids(cfg) == ids
    assert [i for i, b in enumerate(GPT(cfg).transformer.h) if hasattr(b, 'cheap')] == ids


# --------------------------------------------------------------------------------------------------
# regressions from review

@pytest.mark.parametrize('gate,readout,rule', [('mlp', 'distance', 'threshold'),
                                                ('jepa', 'distance', 'threshold'),
                                                ('jepa', 'linear', 'predictor')])
def test_gate_scores_are_fp32_under_bf16_autocast(gate, readout, rule):
    model = build(0, 2, ffn_gate=gate, ffn_jepa_readout=readout, ffn_infer_rule=rule)
    block = model.transformer.h[0]
    h = torch.randn(2, 7, model.config.n_embd)
    with torch.autocast('cpu', dtype=torch.bfloat16):
        assert block.gate(h).dtype == torch.float32
        if block.predictor is not None:
            assert block.predictor(h).dtype == torch.float32


def test_jepa_pred_std_is_reported_without_alignment():
    """A1 (ffn_jepa_weight=0) is the arm that needs the collapse monitor."""
    model = build(0, 2, ffn_gate='jepa', ffn_jepa_weight=0.0).train()
    aux = model(tokens(0, 2, 12), tokens(1, 2, 12))[2]
    assert 'jepa_pred_std' in aux and aux['jepa_pred_std'] > 0


@pytest.mark.parametrize('gate', ['mlp', 'random'])
@pytest.mark.parametrize('aux_grad', ['own', 'leak'])
@pytest.mark.parametrize('trainable', ['all', 'controller'])
def test_mimic_flops_match_flop_counter(gate, aux_grad, trainable):
    """A training step with the imitation on: under 'own' it runs each routed layer's cheap FFN
    again on the detached input (and its weight gradients when the backbone trains), under 'leak'
    nothing more; the analytic step equals FlopCounterMode's count."""
    from conftest import counted
    model = build(0, 3, ffn_gate=gate, ffn_mimic_weight=1.0, ffn_aux_grad=aux_grad).train()
    if trainable == 'controller':
        ctrl = {id(p) for p in model.controller_parameters()}
        if not ctrl:
            return
        for p in model.parameters():
            p.requires_grad_(id(p) in ctrl)
    idx = tokens(0, 2, 12)

    def step():
        torch.manual_seed(0)
        model(idx, idx)[1].backward()
    want = 2 * flops.train_step_flops(model.config, 12, trainable)['total']
    assert counted(step) == want


@settings(**SETTINGS)
@given(seed=SEEDS, T=st.integers(4, 16), aux_grad=st.sampled_from(['own', 'leak']))
def test_mimic_loss_trains_only_its_own_cheap_ffn(seed, T, aux_grad):
    """ffn_aux_grad='own': the mimic loss moves each layer's cheap FFN and nothing else, so it
    cannot pull the input it imitates the full FFN on; 'leak': it also reaches the backbone below
    (every block's attention, through layer 1's input), with at least 1e-2 of the cheap FFNs' norm
    (measured ~1)."""
    model = build(seed, 2, ffn_gate='mlp', ffn_mimic_weight=1.0, ffn_aux_grad=aux_grad).train()
    aux = model(*[tokens(seed, 2, T, distinct_first=True)] * 2)[2]
    model.zero_grad(set_to_none=True)
    aux['mimic_loss'].backward()

    def norm(keep):
        return math.sqrt(sum(float(p.grad.double().pow(2).sum()) for n, p in
                             model.named_parameters() if keep(n) and p.grad is not None))
    cheap = norm(lambda n: '.cheap.' in n)
    attention = norm(lambda n: '.attn.' in n)
    assert cheap > 1e-3
    if aux_grad == 'own':
        assert norm(lambda n: '.cheap.' not in n) == 0.0
    else:
        assert attention >= 1e-2 * cheap, (attention, cheap)


@settings(**SETTINGS)
@given(seed=SEEDS, T=st.integers(4, 16), gate=st.sampled_from(SCORING_GATES),
       aux_grad=st.sampled_from(['own', 'leak']))
def test_aux_loss_gradients_reach_only_their_own_gate(seed, T, gate, aux_grad):
    """ffn_aux_grad='own': the util loss at layer 1 moves layer 1's gate only, and the JEPA loss
    only the gates; 'leak': both also move the backbone below, and the util loss layer 0's gate,
    through layer 1's input (the straight-through mix at layer 0). Gates at their real
    initialisation (only the backbone is moved off its init): a gradient that must not reach a
    module is exactly zero; one that must reaches the backbone with at least 1e-3 of its norm on
    layer 1's gate (300 random draws: at least 0.007, 0.5% of them below 0.01), and layer 0's gate
    with at least 1e-6 of it (a second-order path: through layer 1's gate input, whose Jacobian is
    the product of two layers initialised at std 0.02; measured ~2e-4)."""
    model = build(seed, 2, noise=0.0, ffn_gate=gate, ffn_budget=0.5, ffn_util_weight=1.0,
                  ffn_jepa_weight=1.0, ffn_aux_grad=aux_grad).train()
    g = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():                  # a stand-in for a trained backbone; gates at their init
        for n, p in model.named_parameters():
            if '.gate.' not in n:
                p.add_(0.05 * torch.randn(p.shape, generator=g))
    idx = tokens(seed, 2, T, distinct_first=True)
    aux = model(idx, idx, oracle_layers=(1,))[2]
    gates = [{id(p) for p in model.transformer.h[i].gate.parameters()} for i in (0, 1)]

    def norm(params):
        return math.sqrt(sum(float(p.grad.double().pow(2).sum())
                             for p in params if p.grad is not None))
    for term in ['util_loss'] + (['jepa_loss'] if gate == 'jepa' else []):
        model.zero_grad(set_to_none=True)
        aux[term].backward(retain_graph=True)
        backbone = [p for p in model.parameters() if id(p) not in gates[0] | gates[1]]
        own = norm(model.transformer.h[1].gate.parameters())
        assert own > 1e-6, term
        below = {'backbone': norm(backbone)}
        if term == 'util_loss':
            below['gate 0'] = norm(model.transformer.h[0].gate.parameters())
        for name, value in below.items():
            if aux_grad == 'leak':
                floor = 1e-3 if name == 'backbone' else 1e-6
                assert value >= floor * own, (term, name, value, own)
            else:
                assert value == 0.0, (term, name, value)
