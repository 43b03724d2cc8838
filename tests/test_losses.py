"""losses.py: the ffn family's utility regression and pairwise rank losses against brute-force
definitions written here."""
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import losses

SETTINGS = dict(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SEEDS = st.integers(0, 10_000)

def rank_brute(score, U, i, j, kind, margin, valid=None):
    vals = []
    for b in range(score.size(0)):
        for p in range(i.size(1)):
            a, c = i[b, p].item(), j[b, p].item()
            du = U[b, a].item() - U[b, c].item()
            if du == 0 or (valid is not None and not (valid[b, a] and valid[b, c])):
                continue
            hi, lo = (a, c) if du > 0 else (c, a)
            d = score[b, hi].item() - score[b, lo].item()
            vals.append(math.log1p(math.exp(-d)) if kind == 'logistic' else max(0.0, margin - d))
    return sum(vals) / len(vals) if vals else 0.0


@settings(**dict(SETTINGS, max_examples=25))
@given(seed=SEEDS, B=st.integers(1, 3), T=st.integers(1, 12), n_pairs=st.integers(1, 40),
       kind=st.sampled_from(['logistic', 'margin']), margin=st.floats(0.0, 2.0),
       levels=st.integers(1, 4))
def test_pairwise_rank_equals_brute_force(seed, B, T, n_pairs, kind, margin, levels):
    g = torch.Generator().manual_seed(seed)
    score = torch.randn(B, T, generator=g)
    U = torch.randint(0, levels, (B, T), generator=g).float()       # few levels: ties get dropped
    pairs = torch.Generator().manual_seed(seed)
    loss = losses.pairwise_rank(score, U, n_pairs, kind, margin, generator=pairs)
    g2 = torch.Generator().manual_seed(seed)
    i = torch.randint(0, T, (B, n_pairs), generator=g2)
    j = torch.randint(0, T, (B, n_pairs), generator=g2)
    assert loss.item() == pytest.approx(
        rank_brute(score, U, i, j, kind, margin), rel=1e-5, abs=1e-6
    )
    # positions without a label (valid False) leave every pair they are in out
    valid = torch.rand(B, T, generator=g) < 0.6
    pairs = torch.Generator().manual_seed(seed)
    loss = losses.pairwise_rank(score, U, n_pairs, kind, margin, generator=pairs, valid=valid)
    assert loss.item() == pytest.approx(
        rank_brute(score, U, i, j, kind, margin, valid), rel=1e-5, abs=1e-6
    )


@settings(**SETTINGS)
@given(seed=SEEDS, B=st.integers(1, 3), T=st.integers(2, 16))
def test_pairwise_rank_is_small_when_ordered_and_large_when_reversed(seed, B, T):
    g = torch.Generator().manual_seed(seed)
    # distinct utilities
    U = torch.stack([torch.randperm(T, generator=g) for _ in range(B)]).float()
    gen = lambda: torch.Generator().manual_seed(seed)
    ordered = 50.0 * U                 # every untied pair has a score gap >= 50 in the right
                                       # direction
    assert losses.pairwise_rank(ordered, U, 64, 'logistic', generator=gen()).item() < 1e-6
    assert losses.pairwise_rank(ordered, U, 64, 'margin', 0.1, generator=gen()).item() == 0.0
    rev = losses.pairwise_rank(-ordered, U, 64, 'logistic', generator=gen()).item()
    rev_margin = losses.pairwise_rank(-ordered, U, 64, 'margin', 0.1, generator=gen()).item()
    g2 = gen()
    i, j = torch.randint(0, T, (B, 64), generator=g2), torch.randint(0, T, (B, 64), generator=g2)
    if (i != j).any():                 # some untied pair drawn: each costs >= 50 when reversed
        assert rev >= 50.0 * 0.999 and rev_margin >= 50.0
    else:
        assert rev == 0.0 and rev_margin == 0.0


@settings(**SETTINGS)
@given(seed=SEEDS, B=st.integers(1, 3), T=st.integers(1, 16))
def test_utility_regression_equals_brute_force(seed, B, T):
    g = torch.Generator().manual_seed(seed)
    s, U = torch.randn(B, T, generator=g), torch.randn(B, T, generator=g)
    brute = sum((s[b, t].item() - U[b, t].item()) ** 2 for b in range(B) for t in range(T)) / (
        B * T
    )
    assert losses.utility_regression(s, U).item() == pytest.approx(brute, rel=1e-5, abs=1e-7)
    assert losses.utility_regression(U, U).item() == 0.0
    valid = torch.rand(B, T, generator=g) < 0.6
    kept = [(s[b, t].item() - U[b, t].item()) ** 2
            for b in range(B) for t in range(T) if valid[b, t]]
    brute = sum(kept) / len(kept) if kept else 0.0
    assert losses.utility_regression(s, U, valid).item() == pytest.approx(
        brute, rel=1e-5, abs=1e-7
    )


def test_lm_loss_of_targets_all_ignored_is_zero_with_no_gradient():
    """A task's window can hold no answer the loss counts (every target -1, e.g. arith at a short
    block_size): its loss is 0, not the NaN of a mean over no tokens, and it moves nothing."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 7, generator=g, requires_grad=True)
    none = torch.full((2, 5), -1)
    loss = losses.lm_loss(logits, none)
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(logits.grad, torch.zeros_like(logits))
    some = none.clone()
    some[1, 2], some[0, 4] = 3, 6
    want = torch.nn.functional.cross_entropy(logits.detach().flatten(0, 1), some.flatten(),
                                             ignore_index=-1)
    assert torch.equal(losses.lm_loss(logits.detach(), some), want)      # unchanged otherwise
