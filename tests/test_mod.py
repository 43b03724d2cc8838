"""route='mod' (Mixture-of-Depths, arXiv 2404.02258): exact training capacity and unselected tokens
passing unchanged, selected tokens attending among themselves at their real positions, the causal
rule (router or predictor) and its reported accuracy, and which loss term trains the router. The
promises every family keeps are in test_families.py."""
import math
from contextlib import contextmanager

import pytest
import torch
from hypothesis import given, settings, strategies as st

from conftest import (NO_CPU_GROUPED_MM, ROUTED_TOL, SETTINGS, build, cpu_path_choices,
                      grouped_mm_on_cpu, seeded, tokens)
from model import controlled_layer_ids
import route_mod
from routing import RouteCtx

pytestmark = pytest.mark.usefixtures('one_thread')      # tiny ops: see conftest.py


@settings(**SETTINGS)
@given(seed=st.integers(0, 999), T=st.integers(1, 24), B=st.integers(1, 3),
       budget=st.floats(0.01, 1.0),
       layout=st.sampled_from(['auto', 'all', '0,3']))
def test_mod_training_capacity_is_exact_and_unselected_tokens_pass_unchanged(
    seed, T, B, budget, layout
):
    """Training: exactly ceil(budget·T) tokens per row at every routed layer (of the actual T, not
    block_size); routed layers are every other one by default; a token not selected leaves the block
    with the very hidden state it entered with."""
    model = build('mod', seed=seed, mod_capacity=budget, mod_layers=layout).train()
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
    """{layer: (input, output)} of the routed blocks of `model` (route_mod.mod_block), while
    inside."""
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
    model = build('mod', seed=seed, pos=pos, mod_capacity=0.5).train()
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
            # not a uniform shift
            if pos == 'rope' and len(set((sel - torch.arange(len(sel))).tolist())) > 1:
                wrong = xs + block.attn.forward(block.ln_1(xs), torch.arange(len(sel))[None])
                assert not torch.allclose(
                    wrong, xs + block.attn.forward(block.ln_1(xs), p), atol=1e-6
                )


@settings(**SETTINGS)
@given(seed=st.integers(0, 999), T=st.integers(1, 20),
       rule=st.sampled_from(['threshold', 'predictor']))
def test_mod_causal_rule_and_predictor_accuracy(seed, T, rule):
    """Eval: selected where σ(router) > 0.5 (or σ(predictor) > 0.5), computed here from the modules;
    the reported accuracy is the agreement with top-k membership of the router scores."""
    model = build('mod', seed=seed, mod_infer_rule=rule, mod_capacity=0.25).eval()
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


# --------------------------------------------------------------------------------------------------
# sparse eval on static paths: the selected tokens packed (route_mod.mod_packed)

def ragged_mask(B, T, kinds, seed):
    """Row b: 'none', 'one', 'all' of its tokens selected, or 'random'."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for kind in kinds[:B] + ['random'] * (B - len(kinds)):
        one = torch.arange(T) == int(torch.randint(0, T, (1,), generator=g))
        rand = torch.rand(T, generator=g) < 0.5
        rows.append({'none': torch.zeros(T, dtype=torch.bool),
                     'all': torch.ones(T, dtype=torch.bool), 'one': one, 'random': rand}[kind])
    return torch.stack(rows)


BF16_TOL = dict(rtol=3e-2, atol=3e-2)


@settings(**SETTINGS)
@given(seed=st.integers(0, 999), B=st.integers(1, 3), T=st.integers(1, 16),
       pos=st.sampled_from(['learned', 'rope']), router=st.sampled_from(['learned', 'random']),
       kinds=st.lists(st.sampled_from(['none', 'one', 'all', 'random']), max_size=3),
       path=st.sampled_from(cpu_path_choices('reference', 'grouped_mm', 'compact')),
       dtype=st.sampled_from(['float32', 'bfloat16']))
def test_mod_packed_equals_the_masked_dense_block_on_ragged_counts(
        seed, B, T, pos, router, kinds, path, dtype):
    """The packed block (each sequence's selected tokens packed, attention among them at their
    real positions, every matmul on the packed prefix by `path`) equals the masked-dense reference
    on the selected tokens for ragged per-sequence counts (none, one, all, random), positions
    offset per row; the other tokens pass unchanged, bit for bit. fp32 within ROUTED_TOL, bf16
    autocast within bf16's rounding."""
    model = build('mod', seed=seed, pos=pos, mod_router=router).eval()
    block = model.transformer.h[1]
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, 16, generator=g)
    positions = torch.randint(0, 8, (B, 1), generator=g) + torch.arange(T)
    mask = ragged_mask(B, T, kinds, seed)
    amp = torch.autocast('cpu', dtype=torch.bfloat16, enabled=dtype == 'bfloat16')
    with torch.no_grad(), amp:
        r = block.router(x) if block.router is not None else None
        got = route_mod.mod_packed(block, x, positions, None, mask, r, path)
        want = route_mod.mod_masked(block, x, positions, None, mask, r)
    assert torch.equal(got[~mask], x[~mask])
    torch.testing.assert_close(got, want, **(ROUTED_TOL if dtype == 'float32' else BF16_TOL))


@settings(**{**SETTINGS, 'max_examples': 8})
@given(opt=st.integers(0, 2), seed=st.integers(0, 999), T=st.integers(1, 16), B=st.integers(1, 3),
       mode=st.sampled_from(cpu_path_choices('reference', 'grouped_mm')))
def test_mod_static_eval_packs_and_makes_the_masked_dense_decisions(opt, seed, T, B, mode):
    """The model's sparse eval on a static path runs the packed block (its attention is called
    once per routed layer) and makes the masked-dense reference's decisions exactly, its logits
    within ROUTED_TOL."""
    model = build('mod', opt, seed=seed).eval()
    idx = tokens(seed, B, T)
    calls, orig = [], route_mod.packed_causal_attention

    def counted(*args, **kw):
        calls.append(args[0].shape)
        return orig(*args, **kw)
    with torch.no_grad(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(route_mod, 'packed_causal_attention', counted)
        ref = seeded(lambda: model(idx, idx, sparse=False))
        assert calls == []
        logits, _, aux = seeded(lambda: model(idx, idx, exec_mode=mode))
    assert calls == [(B * T, 2, 8)] * len(controlled_layer_ids(model.config))
    torch.testing.assert_close(logits, ref[0], **ROUTED_TOL)
    for l in ref[2]['masks']:
        assert torch.equal(aux['masks'][l], ref[2]['masks'][l]), l


@pytest.mark.parametrize('mode,dtype', [
    ('reference', 'float32'),
    pytest.param('grouped_mm', 'bfloat16', marks=pytest.mark.skipif(not grouped_mm_on_cpu(),
                                                                     reason=NO_CPU_GROUPED_MM))])
def test_mod_packed_eval_forward_compiles_without_graph_breaks(mode, dtype):
    """torch.compile(fullgraph=True) traces the packed eval forward in one graph (grouped_mm under
    bf16 autocast: its meta check takes bf16 only), and the traced forward makes the eager one's
    decisions, its logits within tolerance."""
    model = build('mod', seed=3, pos='rope').eval()
    idx = tokens(3, 2, 12)
    amp = torch.autocast('cpu', dtype=torch.bfloat16, enabled=dtype == 'bfloat16')

    def forward(i):
        logits, _, aux = model(i, last_only=False, exec_mode=mode)
        return logits, aux['masks']
    torch._dynamo.reset()
    try:
        with torch.no_grad(), amp:
            e = torch._dynamo.explain(forward)(idx)
            assert e.graph_break_count == 0, [str(r.reason) for r in e.break_reasons]
            assert e.graph_count == 1
            code = e.graphs[0].code
            assert ('grouped_mm' in code) == (mode == 'grouped_mm')
            traced = torch.compile(forward, backend='eager', fullgraph=True)(idx)
            eager = forward(idx)
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(traced[0], eager[0], **ROUTED_TOL)
    for l in eager[1]:
        assert torch.equal(traced[1][l], eager[1][l])


def test_mod_packed_with_a_cache_keeps_the_static_path():
    """With a KV cache the static path writes every selected token's K/V at its position and leaves
    the skipped tokens' slots empty; the cached prefill's logits equal the uncached (packed)
    one's."""
    model = build('mod', seed=4, pos='rope').eval()
    idx = tokens(4, 2, 10)
    with torch.no_grad():
        plain = model(idx, last_only=False, exec_mode='reference')
        cache = model.new_cache(2, idx.device)
        cached = model(idx, last_only=False, exec_mode='reference', cache=cache)
    torch.testing.assert_close(cached[0], plain[0], **ROUTED_TOL)
    for l in cached[2]['masks']:
        mask = cached[2]['masks'][l]
        assert torch.equal(mask, plain[2]['masks'][l])
        assert 0 < mask.sum() < mask.numel()
        assert torch.equal(cache.kpos[l][:, :10], torch.where(mask, torch.arange(10), -1))
