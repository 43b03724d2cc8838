"""route='exit' (early exits: LayerSkip, arXiv 2404.16710; CALM, arXiv 2207.07061): exit depths,
loss-weight schedules, layer dropout and the rotational curriculum, the training loss against hand
computation, an unreachable threshold being the full model, and CALM's copied-state early exit
against a hand-written reference. The promises every family keeps are in test_families.py."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import losses
from conftest import (BASE, ROUTED_TOL, SETTINGS, V, build,
                      decode_with_and_without_idle_shortcut, dense_twin, tokens)
from model import GPT, GPTConfig
import route_exit
from route_exit import exit_depths
from routing import layer_dropout_prob

pytestmark = pytest.mark.usefixtures('one_thread')      # tiny ops: see conftest.py


def test_exit_depths_and_loss_weights():
    assert exit_depths(GPTConfig(n_layer=8, route='exit')) == [2, 4, 6]
    assert exit_depths(GPTConfig(n_layer=4, route='exit')) == [2, 3]
    assert exit_depths(GPTConfig(n_layer=4, route='exit', exit_layers='every')) == [1, 2, 3]
    with pytest.raises(ValueError, match='exit_layers'):
        GPTConfig(n_layer=4, route='exit', exit_layers='4')
    w = losses.exit_loss_weights([1, 2, 3], 4, 'uniform', 0.6)
    assert w == pytest.approx({1: 0.2, 2: 0.2, 3: 0.2, 4: 1.0})
    assert losses.exit_loss_weights([1, 3], 4, 'calm') == pytest.approx({1: 0.25, 3: 0.75, 4: 1.0})
    assert losses.exit_loss_weights([1, 2, 3], 4, 'layerskip') == pytest.approx(
        {1: 0.0, 2: 0.25, 3: 0.75, 4: 1.0}
    )
    assert losses.exit_loss_weights([1], 4, 'layerskip') == {1: 0.0, 4: 1.0}
    assert losses.exit_loss_weights([1, 2, 3], 4, 'mean') == pytest.approx(
        {1: 0.25, 2: 0.25, 3: 0.25, 4: 0.25}
    )
    cfg = GPTConfig(n_layer=5, route='exit', layer_dropout=0.2)
    assert layer_dropout_prob(cfg, 0) == 0 and layer_dropout_prob(cfg, 4) == pytest.approx(0.2)
    model = GPT(
        GPTConfig(n_layer=6, route='exit', exit_layers='every', exit_rotation=2, vocab_size=V)
    )
    assert model.family.step_options(model, 0)['exits'] == (2, 4) and model.family.step_options(
        model, 7
    )['exits'] == (1, 3, 5)


@settings(**SETTINGS)
@given(seed=st.integers(0, 999), T=st.integers(1, 16), head=st.sampled_from(['shared', 'own']),
       schedule=st.sampled_from(['uniform', 'calm', 'layerskip', 'mean']))
def test_exit_training_loss_matches_hand_computation(seed, T, head, schedule):
    """L = w_n·CE(final) + Σ_d α_d·CE(exit d), the exits read by hand from the blocks' outputs."""
    model = build(
        'exit',
        seed=seed,
        exit_head=head,
        exit_schedule=schedule,
        exit_layers='every',
        exit_weight=0.7,
    ).train()
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
        ce[4] = F.cross_entropy(
            model.lm_head(model.transformer.ln_f(x)).flatten(0, 1), tgt.flatten()
        )
    raw = {'uniform': [1, 1, 1], 'calm': [1, 2, 3], 'layerskip': [0, 1, 3], 'mean': None}[schedule]
    if raw is None:
        want = sum(ce.values()) / 4
    else:
        want = ce[4] + sum(0.7 * r / sum(raw) * ce[d] for d, r in zip((1, 2, 3), raw))
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)


@settings(**SETTINGS)
@given(seed=st.integers(0, 999), T0=st.integers(1, 10), new=st.integers(0, 6),
       opt=st.integers(0, 3))
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


def test_resume_compares_exit_layers_by_the_depths_meant():
    """An exit checkpoint saved with exit_layers='auto' resumes under the same depths spelt out."""
    import train
    from dataclasses import asdict
    from types import SimpleNamespace
    ck = dict(model_args=asdict(GPTConfig(**BASE, n_layer=4, route='exit')))
    spelt = ','.join(str(d) for d in exit_depths(GPTConfig(**BASE, n_layer=4, route='exit')))
    cfg = SimpleNamespace(
        **asdict(GPTConfig(**BASE, n_layer=4, route='exit', exit_layers=spelt)), dataset='synthetic'
    )
    train.check_against_checkpoint(cfg, {}, ck, ['exit_layers'])
    cfg.exit_layers = '1'
    with pytest.raises(train.TrainError, match="exit_layers"):
        train.check_against_checkpoint(cfg, {}, ck, ['exit_layers'])


@settings(**SETTINGS)
@given(seed=st.integers(0, 999), opt=st.integers(0, 3), B=st.integers(1, 3),
       T0=st.integers(1, 8), new=st.integers(1, 8), everyone_exits=st.booleans(),
       prefill_pos=st.booleans())
def test_blocks_after_every_token_exited_write_only_their_kv(seed, opt, B, T0, new,
                                                             everyone_exits, prefill_pos):
    """Eager cached decoding on the compact path: once every token of the batch has exited, each
    later block runs only its K/V write (Block.write_kv), bit for bit what the same sparse path
    gives with that shortcut off, and the masked reference's decisions, logits and cache
    (sparse=False; within ROUTED_TOL: the running tokens' FFN is gathered). everyone_exits sets
    the threshold so that every token leaves at the first exit (confidence -1 or above passes);
    otherwise the example's threshold decides. Prefill positions given or left to None."""
    model = build('exit', opt, seed=seed).eval()
    if everyone_exits:
        model.config.exit_threshold = -1.0
    idle, writes = decode_with_and_without_idle_shortcut(
        model, route_exit, tokens(seed, B, T0 + new), T0, prefill_pos, ROUTED_TOL
    )
    first = exit_depths(model.config)[0]
    assert writes == idle
    assert not everyone_exits or idle == (model.config.n_layer - first) * (1 + new)


@pytest.mark.parametrize('opt', [0, 1])
def test_each_exits_loss_counts_the_targets_the_lm_loss_counts(opt):
    """The end-of-run report's loss of each exit head read alone is the LM loss of that exit on the
    targets the LM loss counts: on a task whose loss counts answer tokens only (target -1 at the
    prompt), the mean CE over the answer positions, as the validation loss beside it."""
    from contextlib import nullcontext

    from eval import evaluate
    model = build('exit', opt, seed=2).eval()
    x, y = tokens(3, 2, 12), tokens(4, 2, 12)
    y[:, :5] = -1                       # prompt positions: not counted
    # a batch without a counted target (a window of prompts alone) has no loss: not a 0 in the mean
    report = route_exit.exit_report(model, [(x, y), (x, torch.full_like(y, -1))], nullcontext(),
                                    evaluate, thresholds=(0.5,))
    with torch.no_grad():
        for d in model.exit_ids:
            h = model.transformer.wte(x) + model.transformer.wpe(torch.arange(12))
            for block in model.transformer.h[:d]:
                h = block(h)
            logits = route_exit.exit_logits(model, d, h)[:, 5:]
            want = F.cross_entropy(logits.flatten(0, 1), y[:, 5:].flatten()).item()
            assert report['per_exit_loss'][d] == pytest.approx(want, rel=1e-5, abs=1e-6)
