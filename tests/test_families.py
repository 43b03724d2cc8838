"""Property tests of the routing families beyond 'ffn': Mixture-of-Depths (route='mod'), early exits
(route='exit') and the late-layer ensemble (route='ensemble'), plus what every family shares:
eval-mode causality, sparse execution equal to masked-dense execution, KV-cache decoding equal to full
recomputation, forced-open = the dense model, gradients reaching every router, and FLOPs equal to
torch's FlopCounterMode. References are computed here: a dense GPT carrying the same backbone
weights, blocks run by hand on gathered tokens, exact capacities, hand-written loss weights."""
import math
from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings, strategies as st
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

import flops
import losses
from conftest import ROUTED_TOL, assert_greedy_traces_agree, greedy_trace
from model import FAMILIES as REGISTRY, GPT, GPTConfig, KVCache, controlled_layer_ids
import route_mod
from route_exit import exit_depths
from routing import RouteCtx, layer_dropout_prob

SETTINGS = dict(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
V = 23
BASE = dict(block_size=24, vocab_size=V, n_head=2, n_embd=16, gate_hidden=8)

# the gates/options that change each family's code path
EXAMPLES = {
    'mod': [dict(), dict(infer_rule='predictor'), dict(gate='random'), dict(controlled_layers='all', pos='rope')],
    'exit': [dict(), dict(exit_head='own', exit_layers='every', exit_schedule='calm'), dict(exit_conf='margin', exit_threshold=0.05),
             dict(exit_conf='saturation', exit_threshold=0.5)],
    'ensemble': [dict(), dict(ens_mix='prob', ens_router_input='mean'), dict(ens_mix='logit', ens_layers=1)],
    'halt': [dict(), dict(halt_hard='binary', halt_tau=0.3)],
    'ffn': [dict(gate='mlp', cheap_rank=4), dict(gate='random', cheap_rank=4)],
}
# every family in the registry is held to the shared promises below, with its example option sets or,
# for a family added without examples, its defaults: a new family is checked without editing this file
FAMILIES = {route: EXAMPLES.get(route, [dict()]) for route in REGISTRY}
CASES = [(route, i) for route, opts in FAMILIES.items() for i in range(len(opts))]


pytestmark = pytest.mark.usefixtures('one_thread')      # tiny ops: see conftest.py


def build(route, opt=0, seed=0, n_layer=4, noise=0.3, **kw):
    """A tiny model of the family; `noise` moves every parameter off its init so routers, exits and
    mixtures make non-trivial, tie-free decisions."""
    args = dict(BASE, n_layer=n_layer, route=route, **FAMILIES[route][opt])
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
    cfg = GPTConfig(**{**model.config.__dict__, 'route': 'none', 'controlled_layers': 'auto'})
    dense = GPT(cfg)
    missing, _ = dense.load_state_dict(model.state_dict(), strict=False)
    assert not [k for k in missing if not k.endswith('.attn.bias')]
    return dense.eval()


def tokens(seed, B, T):
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


def is_random(case):
    return FAMILIES[case[0]][case[1]].get('gate') == 'random'


def seeded(fn, seed=0):
    """Run fn with the RNG reset, so random gates draw the same decisions each time."""
    torch.manual_seed(seed)
    return fn()


# ----------------------------------------------------------------------------------------------------
# what every family promises

@settings(**SETTINGS)
@given(case=st.sampled_from(CASES), seed=st.integers(0, 999), T=st.integers(2, 20), B=st.integers(1, 3),
       sparse=st.booleans(), data=st.data())
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
@given(case=st.sampled_from(CASES), seed=st.integers(0, 999), T=st.integers(1, 20), B=st.integers(1, 3),
       dtype=st.sampled_from(['float32', 'bfloat16']))
def test_sparse_execution_equals_masked_dense(case, seed, T, B, dtype):
    """Gather -> compute -> scatter gives the masked-dense reference's numbers (tolerance by dtype:
    fp32, or bf16 autocast), and the same routing."""
    model = build(*case, seed=seed).eval()
    idx = tokens(seed, B, T)
    amp = torch.autocast('cpu', dtype=torch.bfloat16, enabled=dtype == 'bfloat16')
    with torch.no_grad(), amp:
        a_logits, _, a = seeded(lambda: model(idx, idx, sparse=True))
        b_logits, _, b = seeded(lambda: model(idx, idx, sparse=False))
    # gathered vs full-batch matmuls round differently; routed models' noisy weights reach ~0.2e-5 under
    # some BLAS modes, so fp32 gets ROUTED_TOL; bf16 rounds to ~1e-2 per op
    tol = ROUTED_TOL if dtype == 'float32' else dict(rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(a_logits.float(), b_logits.float(), **tol)
    assert a.get('masks', {}).keys() == b.get('masks', {}).keys()
    for l in a.get('masks', {}):
        assert torch.equal(a['masks'][l], b['masks'][l])


@settings(**SETTINGS)
@given(case=st.sampled_from(CASES), seed=st.integers(0, 999), T0=st.integers(1, 10), new=st.integers(1, 8),
       B=st.integers(1, 3))
def test_kv_cache_decoding_equals_recompute(case, seed, T0, new, B):
    """Prefill T0 tokens into a KV cache, then feed one token at a time: every step's logits equal the
    full causal forward's logits at that position (routing decided per token in both)."""
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
@given(case=st.sampled_from([c for c in CASES if c[0] != 'ffn']), seed=st.integers(0, 999), T=st.integers(1, 20),
       train_mode=st.booleans())
def test_forced_open_is_the_dense_model(case, seed, T, train_mode):
    """force='full' (every gate open, every token through every block, no exits) computes exactly what a
    dense GPT with the same backbone weights computes."""
    model = build(*case, seed=seed)
    model.train(train_mode)
    idx = tokens(seed, 2, T)
    with torch.no_grad():
        got = model(idx, force='full', last_only=False)[0]
        want = dense_twin(model)(idx, last_only=False)[0]
    assert torch.equal(got, want)


@pytest.mark.parametrize('case', [c for c in CASES if c[0] in ('mod', 'exit', 'ensemble')])
def test_gradients_reach_every_router(case):
    """One training step's total loss gives every controller parameter (routers, predictors, exit
    heads, ensemble norms and router) and every backbone parameter a non-zero gradient."""
    if is_random(case):
        pytest.skip('no router')
    model = build(*case, seed=3).train()
    idx = tokens(3, 4, 20)
    model(idx, idx)[1].backward()
    unused = {'transformer.ln_f.weight'} if case[0] == 'ensemble' else set()    # ensemble: only the teacher's
    if model.config.route == 'ensemble' and model.config.ens_layers == 1:
        unused.add('ens_router.w.weight')          # softmax over one layer is constant 1
    for name, p in model.named_parameters():
        if name in unused:
            continue
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    if case[0] == 'ensemble':
        assert model.transformer.ln_f.weight.grad is None       # the teacher is stop-gradient


# ----------------------------------------------------------------------------------------------------
# Mixture-of-Depths

@settings(**SETTINGS)
@given(seed=st.integers(0, 999), T=st.integers(1, 24), B=st.integers(1, 3), budget=st.floats(0.01, 1.0),
       layout=st.sampled_from(['auto', 'all', '0,3']))
def test_mod_training_capacity_is_exact_and_unselected_tokens_pass_unchanged(seed, T, B, budget, layout):
    """Training: exactly ceil(budget·T) tokens per row at every routed layer (of the actual T, not
    block_size); routed layers are every other one by default; a token not selected leaves the block
    with the very hidden state it entered with."""
    model = build('mod', seed=seed, budget=budget, controlled_layers=layout).train()
    ids = controlled_layer_ids(model.config)
    assert ids == {'auto': [1, 3], 'all': [0, 1, 2, 3], '0,3': [0, 3]}[layout]
    k = max(1, min(T, math.ceil(budget * T - 1e-9)))
    with torch.no_grad(), record_mod_blocks(model) as seen:
        aux = model(tokens(seed, B, T), tokens(seed + 1, B, T))[2]
    assert sorted(aux['masks']) == ids
    for l in ids:
        mask = aux['masks'][l]
        assert (mask.sum(1) == k).all()
        x_in, x_out = seen[l]
        assert torch.equal(x_out[~mask], x_in[~mask])


@contextmanager
def record_mod_blocks(model):
    """{layer: (input, output)} of the routed blocks of `model` (route_mod.mod_block), while inside."""
    seen, orig = {}, route_mod.mod_block

    def wrapped(block, cfg, x, pos, cache, ctx):
        out = orig(block, cfg, x, pos, cache, ctx)
        if block is model.transformer.h[block.layer]:
            seen[block.layer] = (x, out)
        return out
    route_mod.mod_block = wrapped
    try:
        yield seen
    finally:
        route_mod.mod_block = orig


@settings(**SETTINGS)
@given(seed=st.integers(0, 999), T=st.integers(2, 20), pos=st.sampled_from(['learned', 'rope']))
def test_mod_selected_tokens_attend_among_themselves_at_real_positions(seed, T, pos):
    """A routed block equals, on its selected tokens, x + σ(r)·(block(x_sel) − x_sel) with the dense
    block run by hand on the gathered subsequence at its real positions; with RoPE, pretending the
    gathered tokens sit at 0..k−1 gives something else (the public-code pitfall)."""
    model = build('mod', seed=seed, pos=pos, budget=0.5).train()
    block = model.transformer.h[1]
    x = torch.randn(2, T, 16, generator=torch.Generator().manual_seed(seed))
    ctx = RouteCtx()
    with torch.no_grad():
        out = route_mod.mod_block(block, model.config, x, None, None, ctx)
        mask, r = ctx.masks[1], ctx.scores[1]
        for b in range(2):
            sel = mask[b].nonzero().squeeze(1)
            xs, p = x[b:b + 1, sel], sel[None]
            dense = xs + block.attn.forward(block.ln_1(xs), p)          # hand-run pre-LN block
            dense = dense + block.mlp(block.ln_2(dense))
            want = xs + torch.sigmoid(r[b, sel])[None, :, None] * (dense - xs)
            torch.testing.assert_close(out[b:b + 1, sel], want, rtol=1e-4, atol=1e-5)
            if pos == 'rope' and len(set((sel - torch.arange(len(sel))).tolist())) > 1:   # not a uniform shift
                wrong = xs + block.attn.forward(block.ln_1(xs), torch.arange(len(sel))[None])
                assert not torch.allclose(wrong, xs + block.attn.forward(block.ln_1(xs), p), atol=1e-6)


@settings(**SETTINGS)
@given(seed=st.integers(0, 999), T=st.integers(1, 20), rule=st.sampled_from(['threshold', 'predictor']))
def test_mod_causal_rule_and_predictor_accuracy(seed, T, rule):
    """Eval: selected where σ(router) > 0.5 (or σ(predictor) > 0.5), computed here from the modules; the
    reported accuracy is the agreement with top-k membership of the router scores."""
    model = build('mod', seed=seed, infer_rule=rule, budget=0.25).eval()
    idx = tokens(seed, 2, T)
    seen = {}                       # the routed block's input, as its router sees it
    hooks = [b.router.register_forward_hook(lambda m, a, out, l=l: seen.__setitem__(l, a[0]))
             for l, b in enumerate(model.transformer.h) if hasattr(b, 'router')]
    with torch.no_grad():
        aux = model(idx, idx)[2]
    for h in hooks:
        h.remove()
    accs = []
    for l in controlled_layer_ids(model.config):
        blk = model.transformer.h[l]
        x = seen[l]
        r = x @ blk.router.w.weight[0]
        rule_score = blk.predictor(x) if rule == 'predictor' else r
        assert torch.equal(aux['masks'][l], rule_score > 0)
        k = max(1, math.ceil(0.25 * T - 1e-9))
        topk = torch.zeros_like(r, dtype=torch.bool).scatter(1, r.topk(k, dim=1).indices, True)
        accs.append((aux['masks'][l] == topk).float().mean())
    torch.testing.assert_close(aux['mod_acc'], torch.stack(accs).mean())


def test_mod_losses_bce_or_predictor():
    model = build('mod', seed=1).train()
    aux = model(tokens(1, 2, 12), tokens(2, 2, 12))[2]
    assert 'router_loss' in aux and 'pred_loss' not in aux
    model = build('mod', 1, seed=1).train()
    aux = model(tokens(1, 2, 12), tokens(2, 2, 12))[2]
    assert 'pred_loss' in aux and 'router_loss' not in aux


# ----------------------------------------------------------------------------------------------------
# early exits

def test_exit_depths_and_loss_weights():
    assert exit_depths(GPTConfig(n_layer=8, route='exit')) == [2, 4, 6]
    assert exit_depths(GPTConfig(n_layer=4, route='exit')) == [2, 3]
    assert exit_depths(GPTConfig(n_layer=4, route='exit', exit_layers='every')) == [1, 2, 3]
    with pytest.raises(ValueError, match='exit_layers'):
        GPTConfig(n_layer=4, route='exit', exit_layers='4')
    w = losses.exit_loss_weights([1, 2, 3], 4, 'uniform', 0.6)
    assert w == pytest.approx({1: 0.2, 2: 0.2, 3: 0.2, 4: 1.0})
    assert losses.exit_loss_weights([1, 3], 4, 'calm') == pytest.approx({1: 0.25, 3: 0.75, 4: 1.0})
    assert losses.exit_loss_weights([1, 2, 3], 4, 'layerskip') == pytest.approx({1: 0.0, 2: 0.25, 3: 0.75, 4: 1.0})
    assert losses.exit_loss_weights([1], 4, 'layerskip') == {1: 0.0, 4: 1.0}
    assert losses.exit_loss_weights([1, 2, 3], 4, 'mean') == pytest.approx({1: .25, 2: .25, 3: .25, 4: .25})
    cfg = GPTConfig(n_layer=5, route='exit', layer_dropout=0.2)
    assert layer_dropout_prob(cfg, 0) == 0 and layer_dropout_prob(cfg, 4) == pytest.approx(0.2)
    model = GPT(GPTConfig(n_layer=6, route='exit', exit_layers='every', exit_rotation=2, vocab_size=V))
    assert model.family.step_options(model, 0)['exits'] == (2, 4) and model.family.step_options(model, 7)['exits'] == (1, 3, 5)


@settings(**SETTINGS)
@given(seed=st.integers(0, 999), T=st.integers(1, 16), head=st.sampled_from(['shared', 'own']),
       schedule=st.sampled_from(['uniform', 'calm', 'layerskip', 'mean']))
def test_exit_training_loss_matches_hand_computation(seed, T, head, schedule):
    """L = w_n·CE(final) + Σ_d α_d·CE(exit d), the exits read by hand from the blocks' outputs."""
    model = build('exit', seed=seed, exit_head=head, exit_schedule=schedule, exit_layers='every', exit_weight=0.7).train()
    idx, tgt = tokens(seed, 2, T), tokens(seed + 1, 2, T)
    with torch.no_grad():
        loss = model(idx, tgt)[1]
        x = model.transformer.wte(idx) + model.transformer.wpe(torch.arange(T))
        ce = {}
        for l, blk in enumerate(model.transformer.h):
            x = blk(x)
            d = l + 1
            if d < 4:
                lg = (model.exit_heads[str(d)].proj(model.exit_heads[str(d)].ln(x)) if head == 'own'
                      else model.lm_head(model.transformer.ln_f(x)))
                ce[d] = F.cross_entropy(lg.flatten(0, 1), tgt.flatten())
        ce[4] = F.cross_entropy(model.lm_head(model.transformer.ln_f(x)).flatten(0, 1), tgt.flatten())
    raw = {'uniform': [1, 1, 1], 'calm': [1, 2, 3], 'layerskip': [0, 1, 3], 'mean': None}[schedule]
    if raw is None:
        want = sum(ce.values()) / 4
    else:
        want = ce[4] + sum(0.7 * r / sum(raw) * ce[d] for d, r in zip((1, 2, 3), raw))
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)


@settings(**SETTINGS)
@given(seed=st.integers(0, 999), T0=st.integers(1, 10), new=st.integers(0, 6), opt=st.integers(0, 3))
def test_exit_unreachable_threshold_is_the_full_model(seed, T0, new, opt):
    """No token can reach a threshold above 1 (confidences are <= 1): outputs equal the full model's
    exactly, in one forward and through KV-cached generation."""
    model = build('exit', opt, seed=seed, exit_threshold=1.5).eval()
    idx = tokens(seed, 2, T0)
    with torch.no_grad():
        got = model(idx, last_only=False)[0]
        want = model(idx, last_only=False, force='full')[0]
        assert torch.equal(got, want)
        assert torch.equal(got, dense_twin(model)(idx, last_only=False)[0])
        if new:
            a = model.generate(idx, new, temperature=0, use_cache=True)
            b = dense_twin(model).generate(idx, new, temperature=0, use_cache=True)
            assert torch.equal(a, b)


@settings(**SETTINGS)
@given(seed=st.integers(0, 999), T=st.integers(2, 16), thr=st.floats(0.0, 1.0))
def test_exited_tokens_copy_their_state_and_others_still_attend_to_it(seed, T, thr):
    """Hand-computed CALM reference: run the blocks on every token, but after an exit a token's
    hidden state stays frozen (copied upward) and its output is its exit's logits (own heads)."""
    model = build('exit', 1, seed=seed, exit_threshold=thr).eval()
    idx = tokens(seed, 2, T)
    with torch.no_grad():
        got = model(idx, last_only=False, sparse=False)[0]
        x = model.transformer.wte(idx) + model.transformer.wpe(torch.arange(T))
        done = torch.zeros(2, T, dtype=torch.bool)
        out = torch.zeros(2, T, V)
        for l, blk in enumerate(model.transformer.h):
            y = blk(x)
            x = torch.where(done[..., None], x, y)
            if l + 1 < 4:
                lg = model.exit_heads[str(l + 1)](x)
                newly = ~done & (F.softmax(lg, -1).max(-1).values >= thr)
                out = torch.where(newly[..., None], lg, out)
                done |= newly
        out = torch.where(done[..., None], out, model.lm_head(model.transformer.ln_f(x)))
    torch.testing.assert_close(got, out, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------------------------
# the late-layer ensemble

@settings(**SETTINGS)
@given(seed=st.integers(0, 999), T=st.integers(1, 16), mix=st.sampled_from(['logit', 'logprob', 'prob']),
       r_in=st.sampled_from(['final', 'mean']), kl=st.sampled_from(['forward', 'reverse']), k=st.integers(1, 4))
def test_ensemble_matches_hand_computation(seed, T, mix, r_in, kl, k):
    model = build('ensemble', seed=seed, ens_mix=mix, ens_router_input=r_in, ens_kl=kl, ens_layers=k,
                  ens_kl_weight=0.3).train()
    idx, tgt = tokens(seed, 2, T), tokens(seed + 1, 2, T)
    with torch.no_grad():
        logits, loss, _ = model(idx, tgt)
        x = model.transformer.wte(idx) + model.transformer.wpe(torch.arange(T))
        states = []
        for blk in model.transformer.h:
            x = blk(x)
            states.append(x)
        normed = [n(h) for n, h in zip(model.ens_norms, states[-k:])]
        router_in = model.transformer.ln_f(x) if r_in == 'final' else sum(normed) / k
        g = F.softmax(router_in @ model.ens_router.w.weight.t(), -1)
        per = [model.lm_head(h) for h in normed]
        if mix == 'logit':
            want = sum(g[..., j:j + 1] * per[j] for j in range(k))
        elif mix == 'logprob':
            want = sum(g[..., j:j + 1] * F.log_softmax(per[j], -1) for j in range(k))
        else:
            want = torch.log(sum(g[..., j:j + 1] * F.softmax(per[j], -1) for j in range(k)))
        torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-5)
        teacher = F.log_softmax(model.lm_head(model.transformer.ln_f(x)), -1)
        student = F.log_softmax(want, -1)
        p, q = (teacher, student) if kl == 'forward' else (student, teacher)
        kl_val = (p.exp() * (p - q)).sum(-1).mean()
        torch.testing.assert_close(loss, F.cross_entropy(want.flatten(0, 1), tgt.flatten()) + 0.3 * kl_val,
                                   rtol=1e-4, atol=1e-5)


def test_ensemble_of_one_layer_with_copied_norm_is_the_dense_model():
    model = build('ensemble', 2, seed=5).eval()            # ens_layers=1, mixing logits
    model.family.after_load(model)
    idx = tokens(5, 2, 12)
    with torch.no_grad():
        assert torch.equal(model(idx, last_only=False)[0], dense_twin(model)(idx, last_only=False)[0])


# ----------------------------------------------------------------------------------------------------
# FLOPs against torch's counter

def counted(fn):
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fc:
        fn()
    return fc.get_total_flops()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=st.sampled_from([c for c in CASES if c[0] in ('mod', 'exit', 'ensemble')]), seed=st.integers(0, 99),
       T=st.integers(2, 16), B=st.integers(1, 2), budget=st.floats(0.05, 1.0), pw=st.sampled_from([0.0, 1.0]),
       trainable=st.sampled_from(['all', 'controller']), kl=st.sampled_from([0.0, 1.0]), data=st.data())
def test_family_flops_match_counter(case, seed, T, B, budget, pw, trainable, kl, data):
    """Training forward, a whole training step (joint or controller-only), the masked eval forward and
    the sparse eval forward (at the realised fractions) equal FlopCounterMode's count."""
    route, opt = case
    model = build(route, opt, seed=seed, budget=budget, predictor_weight=pw, ens_kl_weight=kl)
    cfg = model.config
    if trainable == 'controller':
        ctrl = {id(p) for p in model.controller_parameters()}
        if not ctrl:
            trainable = 'all'
        for p in model.parameters():
            p.requires_grad_(trainable == 'all' or id(p) in ctrl)
    exits = None
    if route == 'exit' and data.draw(st.booleans()):
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
        assert counted(lambda: seeded(lambda: model(idx, idx, sparse=False))) == B * flops.forward_flops(cfg, T, 'eval')
        out = []
        got = counted(lambda: out.append(seeded(lambda: model(idx, idx))[2].get('masks', {})))
    masks = out[0]
    if route == 'mod':          # sparse rows are padded to the longest
        frac = [int(masks[l].sum(1).max()) / T for l in sorted(masks)]
    else:
        frac = [int(m.sum()) / m.numel() for _, m in sorted(masks.items())] or None
    assert math.isclose(got, B * flops.forward_flops(cfg, T, 'sparse', full_frac=frac), rel_tol=1e-9)


def test_last_layers_step_flops_match_counter():
    cfg = GPTConfig(**BASE, n_layer=4, ens_layers=2)
    model = GPT(cfg).train()
    for p in model.parameters():
        p.requires_grad_(False)
    for p in [*model.transformer.h[-2:].parameters(), *model.transformer.ln_f.parameters()]:
        p.requires_grad_(True)
    idx = tokens(0, 2, 10)
    assert counted(lambda: model(idx, idx)[1].backward()) == 2 * flops.train_step_flops(cfg, 10, 'last_layers')['total']


@settings(**SETTINGS)
@given(case=st.sampled_from([c for c in CASES if not is_random(c)]), seed=st.integers(0, 999),
       lens=st.lists(st.integers(1, 9), min_size=1, max_size=3), new=st.integers(1, 6))
def test_ragged_batched_generation_equals_each_prompt_alone(case, seed, lens, new):
    """Prompts of different lengths decoded together (right-padded, each row at its own positions,
    one shared KV cache) give each prompt's greedy continuation decoded alone: the same routing
    decisions, logits within ROUTED_TOL (the batch has other B and T, masked attention and sparse gathers
    over all rows: other matmul shapes than one prompt alone), and the same tokens unless a near-tie
    (see conftest.assert_greedy_traces_agree)."""
    model = build(*case, seed=seed).eval()
    idx = tokens(seed, len(lens), max(lens))
    stats = {}
    together = greedy_trace(model, idx, new, lengths=lens, stats=stats)
    for b, n in enumerate(lens):
        alone = greedy_trace(model, idx[b:b + 1, :n], new)[0]
        assert_greedy_traces_agree(together[b], alone, ROUTED_TOL)
    if case[0] in ('ffn', 'mod', 'halt', 'exit'):
        assert len(stats['full_frac']) > 0 and all(0 <= f <= 1 for f in stats['full_frac'])


def test_resume_compares_the_layers_meant_not_the_spelling():
    """An ffn checkpoint saved with controlled_layers='all' resumes under the default 'auto' (the same
    layers); a different layer set is refused by name."""
    import train
    from dataclasses import asdict
    ck = dict(model_args=asdict(GPTConfig(**BASE, n_layer=4, route='ffn', controlled_layers='all')))
    cfg = type('C', (), dict(**asdict(GPTConfig(**BASE, n_layer=4, route='ffn')), dataset='synthetic'))()
    train.check_against_checkpoint(cfg, {}, ck, ['controlled_layers'])
    cfg.controlled_layers = 'every_other'
    with pytest.raises(train.TrainError, match="controlled_layers"):
        train.check_against_checkpoint(cfg, {}, ck, ['controlled_layers'])


def test_last_layers_needs_a_dense_model():
    import train
    cfg = type('C', (), dict(trainable='last_layers', route='mod', gate='mlp'))()
    with pytest.raises(train.TrainError, match='last_layers'):
        train.trainable_parameters(build('mod'), cfg)
    dense = GPT(GPTConfig(**BASE, n_layer=4, ens_layers=2))
    cfg.route = 'none'
    params = train.trainable_parameters(dense, cfg)
    want = {id(p) for p in [*dense.transformer.h[2:].parameters(), *dense.transformer.ln_f.parameters()]}
    assert {id(p) for p in params} == want
    assert all(p.requires_grad == (id(p) in want) for p in dense.parameters())


def test_every_family_but_the_dense_one_routes():
    """train.py reports the routing at the end of a run, and refuses trainable='last_layers' (plain
    fine-tuning of a dense model), by the family's `routes`: only route='none' is dense."""
    assert [name for name, family in REGISTRY.items() if not family.routes] == ['none']


def test_resume_compares_exit_layers_by_the_depths_meant():
    """An exit checkpoint saved with exit_layers='auto' resumes under the same depths spelt out."""
    import train
    from dataclasses import asdict
    ck = dict(model_args=asdict(GPTConfig(**BASE, n_layer=4, route='exit')))
    spelt = ','.join(str(d) for d in exit_depths(GPTConfig(**BASE, n_layer=4, route='exit')))
    cfg = type('C', (), dict(**asdict(GPTConfig(**BASE, n_layer=4, route='exit', exit_layers=spelt)),
                             dataset='synthetic'))()
    train.check_against_checkpoint(cfg, {}, ck, ['exit_layers'])
    cfg.exit_layers = '1'
    with pytest.raises(train.TrainError, match="exit_layers"):
        train.check_against_checkpoint(cfg, {}, ck, ['exit_layers'])
