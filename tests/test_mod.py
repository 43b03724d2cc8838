"""route='mod' (Mixture-of-Depths, arXiv 2404.02258): exact training capacity and unselected tokens
passing unchanged, selected tokens attending among themselves at their real positions, the causal
rule (router or predictor) and its reported accuracy, and which loss term trains the router. The
promises every family keeps are in test_families.py."""
import math
from contextlib import contextmanager

import pytest
import torch
from hypothesis import given, settings, strategies as st

from conftest import SETTINGS, build, tokens
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
