"""Tests for oracle_labels.py: the utility labels U_t = CE(cheap) - CE(full) of a routed FFN layer
equal hand-written forks, off-policy (later layers full) and on-policy (later layers by their
gates), per sequence and per token (one fork per switched token), and ignore dropout.

The ffn models and the hand-written references are test_ffn.py's."""
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings, strategies as st

import oracle_labels
from test_ffn import (
    SCORING_GATES,
    SEEDS,
    SETTINGS,
    build,
    ce_ref,
    ceil_frac,
    embed_ref,
    ffn_ref,
    full_mid_ref,
    logits_ref,
    suffix_ref,
    token_labels_ref,
    tokens,
)

pytestmark = pytest.mark.usefixtures('one_thread')      # tiny ops: see conftest.py


@settings(**SETTINGS)
@given(seed=SEEDS, B=st.integers(1, 3), T=st.integers(1, 24), n_layer=st.integers(1, 3),
       data=st.data(), gate=st.sampled_from(SCORING_GATES), training=st.booleans())
def test_off_policy_label_matches_hand_written_forks(seed, B, T, n_layer, data, gate, training):
    l = data.draw(st.integers(0, n_layer - 1))
    model = build(seed, n_layer, ffn_gate=gate, ffn_budget=0.5).train(training)
    idx, tgt = tokens(seed, B, T), tokens(seed + 1, B, T)
    with torch.no_grad():
        x_mid, block = full_mid_ref(model, idx, l), model.transformer.h[l]
        ce = {}
        for action in ('full', 'cheap'):
            y = x_mid + ffn_ref(block, x_mid, action)
            y = suffix_ref(model, y, l + 1, {})                  # every later layer full
            ce[action] = ce_ref(logits_ref(model, y), tgt)
        U_ref = (ce['cheap'] - ce['full']).float()
    U = oracle_labels.fork_utility(model, l, x_mid, tgt, None, later='full')
    assert U.shape == (B, T) and not U.requires_grad
    torch.testing.assert_close(U, U_ref, rtol=0, atol=1e-5)


@settings(**SETTINGS)
@given(seed=SEEDS, B=st.integers(1, 3), T=st.integers(2, 24), gate=st.sampled_from(SCORING_GATES),
       gate_grad=st.sampled_from(['ste', 'scale', 'none']),
       budget=st.integers(10, 90).map(lambda n: Fraction(n, 100)))
def test_on_policy_label_matches_hand_written_forks(seed, B, T, gate, gate_grad, budget):
    model = build(seed, 3, ffn_gate=gate, ffn_budget=float(budget), ffn_gate_grad=gate_grad).train()
    idx, tgt = tokens(seed, B, T, distinct_first=True), tokens(seed + 1, B, T)
    l = 0
    with torch.no_grad():
        block = model.transformer.h[0]
        x_mid = embed_ref(model, idx)
        x_mid = x_mid + block.attn(block.ln_1(x_mid))
        ce = {}
        for action in ('full', 'cheap'):
            y = x_mid + ffn_ref(block, x_mid, action)
            y = suffix_ref(model, y, 1, {1: 'policy', 2: 'policy'}, budget)   # later layers: top-k
            ce[action] = ce_ref(logits_ref(model, y), tgt)
        U_ref = (ce['cheap'] - ce['full']).float()
    U_on = oracle_labels.fork_utility(model, l, x_mid, tgt, None, later='policy')
    U_off = oracle_labels.fork_utility(model, l, x_mid, tgt, None, later='full')
    torch.testing.assert_close(U_on, U_ref, rtol=0, atol=1e-5)
    if ceil_frac(budget, T) < T:      # later layers route some tokens cheap: a different future
        assert not torch.allclose(U_on, U_off, rtol=0, atol=1e-4)
    elif gate_grad != 'scale':        # every token full (and unscaled): on-policy == off-policy
        torch.testing.assert_close(U_on, U_off, rtol=0, atol=1e-6)


@settings(**SETTINGS)
@given(seed=SEEDS, B=st.integers(1, 3), T=st.integers(1, 10), n_layer=st.integers(1, 3),
       data=st.data(), gate=st.sampled_from(SCORING_GATES),
       gate_grad=st.sampled_from(['ste', 'scale', 'none']),
       later=st.sampled_from(['full', 'policy']), pos=st.sampled_from(['learned', 'rope']))
def test_token_labels_match_one_fork_per_token(
    seed, B, T, n_layer, data, gate, gate_grad, later, pos
):
    """The two-pass 'token' labels (the switched token sees the base stream's keys before it) equal
    T separate forks, each switching one token, from any base decision at l (all full, as from the
    all-full state, or a routed mask)."""
    l = data.draw(st.integers(0, n_layer - 1))
    model = build(
        seed, n_layer, ffn_gate=gate, ffn_budget=0.5, ffn_gate_grad=gate_grad, pos=pos
    ).train()
    idx, tgt = tokens(seed, B, T, distinct_first=True), tokens(seed + 1, B, T)
    g = torch.Generator().manual_seed(seed + 3)
    base = (
        torch.ones(B, T, dtype=torch.bool)
        if data.draw(st.booleans())
        else torch.rand(B, T, generator=g) < 0.5
    )
    with torch.no_grad():
        x_mid = full_mid_ref(model, idx, l)
        U_ref = token_labels_ref(model, l, x_mid, base, tgt, later, Fraction(1, 2))
    U = oracle_labels.token_fork_utility(model, l, x_mid, base, tgt, None, later)
    assert U.shape == (B, T) and not U.requires_grad
    torch.testing.assert_close(U, U_ref, rtol=0, atol=1e-5)
    if later == 'full' and bool(base.all()):      # the first token has no prefix: both kinds of
                                                  # label agree there
        U_seq = oracle_labels.fork_utility(model, l, x_mid, tgt, None, later='full')
        torch.testing.assert_close(U[:, 0], U_seq[:, 0], rtol=0, atol=1e-5)


def test_oracle_labels_ignore_dropout():
    """With dropout on, the two forks of a label must differ only in the action: repeated labels
    agree."""
    model = build(0, 2, ffn_gate='mlp', dropout=0.5).train()
    idx = tokens(0, 2, 12)
    x_mid = torch.randn(2, 12, model.config.n_embd)
    a = oracle_labels.fork_utility(model, 1, x_mid, idx, None, later='full')
    b = oracle_labels.fork_utility(model, 1, x_mid, idx, None, later='full')
    assert torch.equal(a, b)
    assert model.transformer.drop.training          # dropout is back on afterwards
