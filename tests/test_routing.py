"""Tests for routing.py: the Family base class is the dense model (its core and every optional
hook neutral, the registry's 'none' being it), the layer lists the families' options name,
LayerSkip's rate, TLOps saved, overridden's restore, and sparse execution's row helpers."""
from types import SimpleNamespace

import pytest
import torch

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
