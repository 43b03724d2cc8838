"""route='halt' (TSA, arXiv 2605.05222): a closed router reproduces the dense model, gradients reach
the router through (1 − p), the depth regulariser and TLOps follow their equations, eval (hard
skipping) is causal and KV-cached decoding equals recomputation, and FLOPs match FlopCounterMode."""

import torch
from hypothesis import given, settings, strategies as st
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

import flops
import route_halt
from conftest import (FP32_TOL, assert_greedy_traces_agree, decode_with_and_without_idle_shortcut,
                      greedy_trace)
from model import FAMILIES, GPT, GPTConfig

SETTINGS = dict(max_examples=15, deadline=None)
BASE = dict(block_size=24, vocab_size=29, n_head=2, n_embd=16)


def build(seed, n_layer=3, **kw):
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**BASE, n_layer=n_layer, route='halt', **kw))
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():                       # routers away from their init, so p varies per
                                                # token
        for r in model.halt:
            r.fc.weight.add_(torch.randn(r.fc.weight.shape, generator=g) * 0.5)
            r.out.weight.add_(torch.randn(r.out.weight.shape, generator=g) * 0.5)
    return model


def dense_twin(model):
    dense = GPT(GPTConfig(**BASE, n_layer=model.config.n_layer))
    dense.load_state_dict(
        {k: v for k, v in model.state_dict().items() if not k.startswith('halt.')}
    )
    return dense


def close_routers(model):
    with torch.no_grad():
        for r in model.halt:
            r.out.weight.zero_()
            r.out.bias.fill_(-1e4)              # sigmoid(-1e4) == 0 exactly in fp32


def router_probs(model, idx):
    """p_l recomputed independently: run the dense blocks by hand, applying (1 − p) scaling."""
    x = model.embed(idx)
    blocks = model.transformer.h
    x = blocks[0](x)
    ps = []
    for l, r in enumerate(model.halt):
        p = torch.sigmoid(r.out(torch.relu(r.fc(x)))).squeeze(-1)
        ps.append(p)
        b = blocks[l + 1]
        x = x + (1 - p)[..., None] * b.attn(b.ln_1(x))
        x = x + (1 - p)[..., None] * b.mlp(b.ln_2(x))
    return ps, model.lm_head(model.transformer.ln_f(x))


def test_router_init():
    model = GPT(GPTConfig(**BASE, n_layer=3, route='halt'))
    for r in model.halt:
        assert r.out.bias.item() == -1.0 and r.fc.out_features == 16     # max(16, d/4)
    p = model.halt[0](torch.randn(2, 5, 16))
    assert ((p > 0) & (p < 1)).all()
    # halt_router_bias: the λ = 0 control starts the routers at p ≈ 0.5 instead of ≈ 0.27
    model = GPT(GPTConfig(**BASE, n_layer=3, route='halt', halt_router_bias=0.0))
    assert all(r.out.bias.item() == 0.0 for r in model.halt)


def test_bench_bisects_tau_only_under_hard_skipping():
    """bench.py holds a budget by bisecting halt_tau; soft eval skips nothing whatever τ is."""
    halt = FAMILIES['halt']
    assert halt.bench_knob(GPTConfig(**BASE, n_layer=3, route='halt')) == ('halt_tau', 0.0, 1.0)
    assert halt.bench_knob(GPTConfig(**BASE, n_layer=3, route='halt', halt_soft_eval=True)) is None


@settings(**SETTINGS)
@given(seed=st.integers(0, 999), n_layer=st.integers(2, 4), T=st.integers(1, 24),
       pos=st.sampled_from(['learned', 'rope']))
def test_closed_router_is_the_dense_model(seed, n_layer, T, pos):
    model = build(seed, n_layer, pos=pos)
    close_routers(model)
    dense = GPT(GPTConfig(**BASE, n_layer=n_layer, pos=pos))
    dense.load_state_dict(
        {k: v for k, v in model.state_dict().items() if not k.startswith('halt.')}
    )
    idx = torch.randint(0, 29, (2, T))
    ref = dense.eval()(idx, idx)[0]
    assert torch.equal(model.train()(idx, idx)[0], ref)          # soft: (1 − 0)·Δ
    assert torch.equal(model.eval()(idx, idx)[0], ref)           # hard: nothing skipped


@settings(**SETTINGS)
@given(seed=st.integers(0, 999), n_layer=st.integers(2, 4), T=st.integers(1, 24))
def test_soft_forward_and_regulariser_match_hand_computation(seed, n_layer, T):
    model = build(seed, n_layer, halt_lambda=0.3).train()
    idx = torch.randint(0, 29, (2, T))
    logits, loss, aux = model(idx, idx)
    ps, ref_logits = router_probs(model, idx)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    depth = sum((1 - p).mean() for p in ps) / (n_layer - 1)
    torch.testing.assert_close(aux['depth_loss'], depth)
    torch.testing.assert_close(loss, aux['lm_loss'] + 0.3 * depth)
    alpha = depth
    torch.testing.assert_close(aux['alpha'], alpha)
    torch.testing.assert_close(aux['tlops_saved'], 1 - (1 + (n_layer - 1) * alpha) / n_layer)


@settings(**SETTINGS)
@given(seed=st.integers(0, 999), tau=st.floats(0.05, 0.95), T=st.integers(1, 24),
       mode=st.sampled_from(['scaled', 'binary']))
def test_hard_eval_skips_where_p_exceeds_tau(seed, tau, T, mode):
    model = build(seed, 3, halt_tau=tau, halt_hard=mode).eval()
    idx = torch.randint(0, 29, (2, T))
    aux = model(idx, idx)[2]
    x = model.embed(idx)
    blocks = model.transformer.h
    x = blocks[0](x)
    for l, r in enumerate(model.halt):              # independent hard-skip reference
        p = torch.sigmoid(r.out(torch.relu(r.fc(x)))).squeeze(-1)
        active = (p <= tau).float()
        assert torch.equal(aux['masks'][l + 1], active)
        scale = active * (1 - p) if mode == 'scaled' else active
        b = blocks[l + 1]
        x = x + scale[..., None] * b.attn(b.ln_1(x))
        x = x + scale[..., None] * b.mlp(b.ln_2(x))
    torch.testing.assert_close(
        model(idx, idx)[0], model.lm_head(model.transformer.ln_f(x)), rtol=1e-5, atol=1e-5
    )
    # tau = 1 skips nothing: 'scaled' is then the soft model, 'binary' the dense model
    model.config.halt_tau = 1.0
    if mode == 'binary':
        assert torch.equal(model(idx, idx)[0], dense_twin(model).eval()(idx, idx)[0])
    else:
        ref = model(idx, idx)[0]
        model.config.halt_soft_eval = True
        assert torch.equal(model(idx, idx)[0], ref)


def test_gradient_reaches_every_router_from_the_lm_loss_alone():
    model = build(0, 4, halt_lambda=0.0).train()
    idx = torch.randint(0, 29, (3, 16))
    _, loss, aux = model(idx, idx)
    torch.testing.assert_close(loss.detach(), aux['lm_loss'])
    loss.backward()
    for r in model.halt:
        assert r.fc.weight.grad is not None and r.fc.weight.grad.abs().sum() > 0
        assert r.out.weight.grad.abs().sum() > 0


@settings(**SETTINGS)
@given(seed=st.integers(0, 999), T=st.integers(2, 24), soft=st.booleans(), data=st.data())
def test_eval_is_causal(seed, T, soft, data):
    model = build(seed, 3, halt_soft_eval=soft).eval()
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, 29, (2, T), generator=g)
    t = data.draw(st.integers(0, T - 2))
    other = idx.clone()
    other[:, t + 1:] = torch.randint(0, 29, (2, T - t - 1), generator=g)
    (a, _, aux_a), (b, _, aux_b) = model(idx, idx), model(other, other)
    assert sorted(aux_a['masks']) == sorted(aux_b['masks']) == [1, 2]
    for l in aux_a['masks']:        # skip decisions (hard) or active fractions (soft) at <= t:
                                    # exactly equal
        assert torch.equal(aux_a['masks'][l][:, :t + 1], aux_b['masks'][l][:, :t + 1])
    if soft:                        # soft eval is dense: same kernels on the same (2, T) shapes
        assert torch.equal(a[:, :t + 1], b[:, :t + 1])
        return
    # hard eval runs the FFN on the kept tokens only, gathered over the batch, and the future tokens
    # change how many are kept: other matmul shapes, so values within FP32_TOL (see conftest) ...
    torch.testing.assert_close(a[:, :t + 1], b[:, :t + 1], **FP32_TOL)
    changed = (other != idx).any(0).nonzero()
    if len(changed):                # ... a tolerance far below what changing a token does to its
                                    # logits
        p = changed[0, 0].item()
        assert not torch.allclose(a[:, p], b[:, p], **FP32_TOL)
    # ... and bitwise in masked-dense eval (every op on the whole batch in both passes)
    da, db = model(idx, idx, sparse=False)[0], model(other, other, sparse=False)[0]
    assert torch.equal(da[:, :t + 1], db[:, :t + 1])


@settings(**SETTINGS)
@given(seed=st.integers(0, 999), T0=st.integers(1, 12), new=st.integers(1, 14))
def test_kv_cache_decoding_equals_recompute(seed, T0, new):
    model = build(seed, 3).eval()
    idx = torch.randint(0, 29, (2, T0), generator=torch.Generator().manual_seed(seed))
    # a cache step (T=1, masked attention, FFN gathered over the kept tokens) and recomputation run
    # other shapes: skip decisions exactly equal, logits within FP32_TOL, tokens equal unless a
    # near-tie
    cached = greedy_trace(model, idx, new, use_cache=True)
    recomputed = greedy_trace(model, idx, new, use_cache=False)
    for a, b in zip(cached, recomputed):
        assert_greedy_traces_agree(a, b, FP32_TOL)


@settings(**SETTINGS)
@given(seed=st.integers(0, 999), B=st.integers(1, 3), T0=st.integers(1, 8),
       new=st.integers(1, 8), skip_all=st.booleans(), prefill_pos=st.booleans())
def test_a_block_every_token_skips_writes_only_their_kv(seed, B, T0, new, skip_all, prefill_pos):
    """Eager cached decoding on the compact path runs a block that every token of the batch skips
    as its K/V write alone (Block.write_kv): bit for bit what the same sparse path gives with that
    shortcut off (the whole block run, its update multiplied by 0), and the masked reference's
    decisions, logits and cache (sparse=False: bit for bit where every token skips every block
    after the stem, routers' bias +20; within FP32_TOL with build's routers at bias 0, where p
    straddles τ = 0.5, the kept tokens' FFN gathered). Prefill positions given or left to None."""
    model = build(seed, 4).eval()
    with torch.no_grad():
        for r in model.halt:
            r.out.bias.fill_(20.0 if skip_all else 0.0)
    idx = torch.randint(0, 29, (B, T0 + new), generator=torch.Generator().manual_seed(seed))
    idle, writes = decode_with_and_without_idle_shortcut(
        model, route_halt, idx, T0, prefill_pos, dict(atol=0.0, rtol=0.0) if skip_all else FP32_TOL
    )
    assert writes == idle and (not skip_all or idle == 3 * (1 + new))


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 999), n_layer=st.integers(2, 4), T=st.integers(2, 16),
       trainable=st.sampled_from(['all', 'controller']), lam=st.sampled_from([0.0, 0.01]))
def test_flops_match_flop_counter(seed, n_layer, T, trainable, lam):
    model = build(seed, n_layer, halt_lambda=lam).train()
    cfg = model.config
    if trainable == 'controller':
        ctrl = {id(p) for p in model.controller_parameters()}
        assert len(ctrl) == 4 * (n_layer - 1)          # each router: fc and out, weight and bias
        for p in model.parameters():
            p.requires_grad_(id(p) in ctrl)
    idx = torch.randint(0, 29, (2, T))

    def count(fn):
        with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fc:
            fn()
        return fc.get_total_flops()
    with torch.no_grad():
        assert count(lambda: model(idx, idx)) == 2 * flops.forward_flops(cfg, T, mode='train')
    assert (
        count(lambda: model(idx, idx)[1].backward())
        == 2 * flops.train_step_flops(cfg, T, trainable)['total']
    )


def test_soft_eval_flops_at_its_fractions_are_what_runs():
    """halt_soft_eval scales every update by (1 − p) and skips nothing: its eval forward, sparse or
    not, runs every block on every token. Its reported fractions are the soft α's shares (about
    0.4-0.9 here), so the sparse formula at them must still count every block whole: the masked
    eval forward's FLOPs, as FlopCounterMode counts the forward."""
    model = build(3, n_layer=4, halt_soft_eval=True).eval()
    cfg, T = model.config, 12
    idx = torch.randint(0, 29, (2, T), generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fc:
        frac = model(idx, idx)[2]['full_frac'].tolist()
    assert max(frac) < 0.99                 # soft shares: a formula reading them as kept
                                            # fractions would count less than runs
    for path in (None, 'compact'):
        got = flops.forward_flops(cfg, T, 'sparse', full_frac=frac, path=path)
        assert 2 * got == fc.get_total_flops() == 2 * flops.forward_flops(cfg, T, 'eval')
