"""Tests for routing.py: the Family base class is the dense model (its core and every optional
hook neutral, the registry's 'none' being it), the layer lists the families' options name,
LayerSkip's rate and its layer dropout in the forward (per-block skip shares against the rate,
pass-through against a hand-written forward, none in eval), TLOps saved, overridden's restore, and
sparse execution's row helpers."""
import math
from types import SimpleNamespace

import pytest
import torch

from conftest import build, tokens
from model import FAMILIES, GPT, GPTConfig
from routing import (Dense, Family, flop_costs, layer_dropout_prob, layer_ids, overridden,
                     parse_layer_list, rows_apply, split_apply, tlops_saved)


def test_rows_apply_writes_exactly_the_rows_in_range():
    x = torch.randn(7, 3)
    order = torch.tensor([4, 0, 6, 2, 1, 5, 3])
    out = torch.full((7, 3), -1.0)
    lo, hi = torch.tensor(2), torch.tensor(5)            # device-side bounds: no host sync
    rows_apply(x, order, lo, hi, lambda t: 2 * t, out)
    written = order[2:5]
    assert torch.equal(out[written], 2 * x[written])
    untouched = torch.tensor([r for r in range(7) if r not in written.tolist()])
    assert (out[untouched] == -1).all()


@pytest.mark.parametrize('mode', ['static', 'compact'])
def test_split_apply_modes_route_each_token_to_its_path(mode):
    x = torch.randn(2, 5, 3)
    mask = torch.rand(2, 5) < 0.5
    got = split_apply(x, mask, lambda t: t + 1, lambda t: t - 1, mode=mode)
    assert torch.equal(got, torch.where(mask[..., None], x + 1, x - 1))
    got = split_apply(x, mask, lambda t: 3 * t, mode=mode)
    assert torch.equal(got, torch.where(mask[..., None], 3 * x, 0.0))



def test_the_dense_family_is_the_base_class_with_nothing_routed():
    """The registry's 'none' is Dense, which adds only LayerSkip's rate to Family's neutral
    defaults: no options, no routing, the LM loss alone, dense FLOPs counted by hand."""
    dense = FAMILIES['none']
    assert type(dense) is Dense and isinstance(dense, Family)
    # (__slotnames__: what copyreg caches on a class once an instance was copied or pickled)
    own = set(vars(Dense)) - set(vars(object)) - {'__module__', '__doc__', '__slotnames__'}
    assert own == {'reads', 'routes'}
    assert dense.reads == ('layer_dropout',) and dense.routes is False and Family.routes is True
    config = GPTConfig(block_size=16, vocab_size=50, n_layer=3, n_head=2, n_embd=8)
    dense.validate(config)
    lm_loss = torch.tensor(2.5)
    assert dense.loss(None, None, lm_loss, None, {}) is lm_loss
    assert not dense.is_controller_key('transformer.h.0.mlp.c_fc.weight')
    assert dense.Options is None and dense.budget_field is None and dense.report_lines({}) == []
    assert dense.cannot_generate(config) is None and dense.executed_fracs({}) is None
    d, T, V = 8, 16, 50
    per_layer = 2 * d * 3 * d + 2 * d * d + 4 * T * d + 2 * 2 * d * 4 * d
    assert flop_costs(config, T)['head'] == 2 * d * V
    assert dense.forward_flops(config, T) == T * (2 * d * V + 3 * per_layer)


def test_the_dense_family_runs_every_block_on_every_token():
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=50, n_layer=2, n_head=2, n_embd=16)).eval()
    idx = torch.randint(0, 50, (2, 9))
    with torch.no_grad():
        x = model.transformer.wte(idx) + model.transformer.wpe(torch.arange(9))
        for block in model.transformer.h:
            x = x + block.attn(block.ln_1(x))
            x = x + block.mlp(block.ln_2(x))
        want = model.lm_head(model.transformer.ln_f(x))
        got = model(idx, idx)[0]                        # with targets: every position's logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_layer_lists_name_the_layers_or_are_refused_naming_the_option():
    assert parse_layer_list('5, 0,2,2', 0, 5, 'exit_layers') == [0, 2, 5]
    for bad in ('', '0,6', '-1', 'a,b'):
        with pytest.raises(ValueError, match=r"^exit_layers .* must name layers in 0\.\.5, e\.g\. "
                                             r"'0,5'$"):
            parse_layer_list(bad, 0, 5, 'exit_layers')
    config = SimpleNamespace(n_layer=6, ffn_layers='auto')
    assert layer_ids(config, 'ffn_layers', 'every_other') == [1, 3, 5]
    for spec, want in (('all', [0, 1, 2, 3, 4, 5]), ('every_other', [1, 3, 5]), ('4,1', [1, 4])):
        config.ffn_layers = spec
        assert layer_ids(config, 'ffn_layers', 'all') == want, spec
    config.ffn_layers = 'odd'
    with pytest.raises(ValueError, match="ffn_layers must be 'auto', 'all', 'every_other'"):
        layer_ids(config, 'ffn_layers', 'all')


def test_layer_dropout_rate_rises_from_0_at_the_first_block_to_p_max_at_the_last():
    config = SimpleNamespace(n_layer=5, layer_dropout=0.2)
    rates = [layer_dropout_prob(config, l) for l in range(5)]
    want = [0.2 * (2 ** (l / 4) - 1) for l in range(5)]
    assert rates == pytest.approx(want, rel=1e-12, abs=1e-15)
    assert rates[0] == 0 and rates[-1] == pytest.approx(0.2)
    assert layer_dropout_prob(SimpleNamespace(n_layer=1, layer_dropout=0.2), 0) == 0.0


# LayerSkip's layer dropout in the forward: the families that read layer_dropout run Family's
# stack, which in training skips block l for a whole sequence with probability
# layer_dropout_prob(config, l), independently per sequence, block and forward, and passes the
# residual stream through unscaled where it skips; eval never skips.
LAYER_DROPOUT_ROUTES = [r for r, f in FAMILIES.items() if 'layer_dropout' in f.options]


def traced_forward(model, idx, **kw):
    """model(idx, idx)'s logits (every position), each block's input and output, and the state the
    final norm reads first (the stack's output), recorded by hooks."""
    ins, outs, final = [], [], []

    def record(module, args, out):                  # returns None: the output stands
        ins.append(args[0])
        outs.append(out)

    hooks = [b.register_forward_hook(record) for b in model.transformer.h]
    hooks.append(model.transformer.ln_f.register_forward_pre_hook(
        lambda module, args: final.append(args[0])))
    try:
        with torch.no_grad():
            logits = model(idx, idx, **kw)[0]
    finally:
        for h in hooks:
            h.remove()
    assert len(ins) == len(outs) == model.config.n_layer and final
    return logits, ins, outs, final[0]


def skipped_positions(ins, outs, final):
    """(L, B, T): where each block was skipped. The state after block l (the next block's input, or
    the stack's output) must be the block's input there, bit for bit, and the block's own output,
    unscaled, everywhere else: a position that is neither fails."""
    skipped = []
    for l, (x, y, after) in enumerate(zip(ins, outs, ins[1:] + [final])):
        # every block moves every token well beyond the tolerance: the two cases are told apart
        assert ((y - x).abs().amax(-1) > 1e-3).all()
        passed = (after == x).all(-1)
        ran = torch.isclose(after, y, rtol=1e-6, atol=1e-6).all(-1)
        assert (passed ^ ran).all(), f"block {l}: a position that is neither skipped nor run"
        skipped.append(passed)
    return torch.stack(skipped)


def five_sigma(n, q):
    """The half-width of a 5-sigma binomial bound on a count of n draws at rate q."""
    return 5 * math.sqrt(n * q * (1 - q))


@pytest.mark.usefixtures('one_thread')
@pytest.mark.parametrize('route', LAYER_DROPOUT_ROUTES)
@pytest.mark.parametrize('n_layer, p', [(4, 0.0), (4, 0.5), (8, 0.9)])
def test_layer_dropout_skips_whole_sequences_at_the_rate_of_each_block(route, n_layer, p):
    """Training: over 2 forwards of B sequences, the share of sequences block l skips is
    layer_dropout_prob within a 5-sigma binomial bound (0 exactly at rate 0, hence everywhere at
    layer_dropout=0), a sequence's tokens share the decision, the blocks draw independently (the
    share skipped by two blocks is the product of rates) and each forward draws anew."""
    model = build(route, n_layer=n_layer, layer_dropout=p).train()
    B, T = 1500, 3
    masks = []
    for seed in (1, 2):
        idx = tokens(seed, B, T)
        masks.append(skipped_positions(*traced_forward(model, idx)[1:]))
    skipped = torch.cat(masks, dim=1)                                  # (L, 2B, T)
    assert (skipped == skipped[..., :1]).all(), "a sequence's tokens skipped a block apart"
    seq = skipped[..., 0]                                              # (L, n)
    n = seq.size(1)
    rates = [layer_dropout_prob(model.config, l) for l in range(n_layer)]
    for l, q in enumerate(rates):
        k = int(seq[l].sum())
        assert abs(k - n * q) <= five_sigma(n, q), f"block {l}: {k}/{n} skipped, rate {q:.4f}"
    for i in range(n_layer):
        for j in range(i + 1, n_layer):
            k, q = int((seq[i] & seq[j]).sum()), rates[i] * rates[j]
            assert abs(k - n * q) <= five_sigma(n, q), f"blocks {i},{j}: {k}/{n} both skipped"
    if p > 0:
        assert not torch.equal(masks[0][..., :B], masks[1][..., :B])  # a fresh draw per forward
    else:
        assert not skipped.any()


@pytest.mark.usefixtures('one_thread')
@pytest.mark.parametrize('route', LAYER_DROPOUT_ROUTES)
def test_layer_dropout_passes_skipped_sequences_through_and_runs_the_rest(route):
    """Training: the logits are those of a forward written here that runs every block on every
    sequence and keeps its output only where the hooks saw it kept, the stream passing unchanged
    (unscaled) through the skipped blocks: the same model in eval mode is not that forward."""
    model = build(route, n_layer=6, layer_dropout=0.6).train()
    B, T = 48, 8
    idx = tokens(3, B, T)
    logits, *trace = traced_forward(model, idx)
    skipped = skipped_positions(*trace)
    assert skipped[1:].any() and not skipped[-1].all() and not skipped[0].any()
    tr = model.transformer
    with torch.no_grad():
        x = tr.wte(idx) + tr.wpe(torch.arange(T))
        for block, skip in zip(tr.h, skipped):
            x = torch.where(skip[..., None], x, block(x))
        want = model.lm_head(tr.ln_f(x))
        with model.mode(False):
            dense = model(idx, idx, force='full')[0]
    torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(logits, dense, rtol=1e-3, atol=1e-3)


@pytest.mark.usefixtures('one_thread')
@pytest.mark.parametrize('route', LAYER_DROPOUT_ROUTES)
@pytest.mark.parametrize('p', [0.5, 0.9])
@pytest.mark.parametrize('force', [None, 'full'])
def test_layer_dropout_never_skips_in_eval(route, p, force):
    """Eval: the logits are the model's at layer_dropout=0 whatever the RNG state, and where
    Family's stack runs (every route under force='full', the dense one always) the hooks see every
    block run on every sequence."""
    model = build(route, n_layer=6, layer_dropout=p).eval()
    idx = tokens(4, 64, 6)
    with torch.no_grad(), overridden(model.config, layer_dropout=0.0):
        want = model(idx, idx, force=force)[0]
    stack = force == 'full' or route == 'none'      # Family's stack (early exits run their own)
    for seed in (0, 1):
        torch.manual_seed(seed)
        if stack:
            logits, *trace = traced_forward(model, idx, force=force)
            assert not skipped_positions(*trace).any()
        else:
            with torch.no_grad():
                logits = model(idx, idx, force=force)[0]
        assert torch.equal(logits, want)


def test_tlops_saved_counts_unrouted_layers_as_run():
    # 2 routed layers of 4 running half and a quarter of the tokens: 1 - (0.5 + 0.25 + 2) / 4
    assert float(tlops_saved(torch.tensor([0.5, 0.25]), 4)) == pytest.approx(0.3125)
    assert float(tlops_saved(torch.ones(3), 3)) == 0.0


def test_overridden_restores_the_fields_also_on_error():
    config = SimpleNamespace(ffn_gate='mlp', ffn_budget=0.5)
    with pytest.raises(RuntimeError):
        with overridden(config, ffn_gate='oracle', ffn_budget=1.0):
            assert (config.ffn_gate, config.ffn_budget) == ('oracle', 1.0)
            raise RuntimeError
    assert vars(config) == dict(ffn_gate='mlp', ffn_budget=0.5)
