"""route='ensemble' (Mixture-of-Depths Ensemble, arXiv 2410.13077): the mixture and the distillation
loss against hand computation, a one-layer ensemble with copied norm being the dense model, and its
fine-tuning baseline trainable='last_layers' (dense models only; FLOPs equal FlopCounterMode's).
The promises every family keeps are in test_families.py."""
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import flops
from conftest import BASE, SETTINGS, build, counted, dense_twin, tokens
from model import GPT, GPTConfig

pytestmark = pytest.mark.usefixtures('one_thread')      # tiny ops: see conftest.py


@settings(**SETTINGS)
@given(seed=st.integers(0, 999), T=st.integers(1, 16),
       mix=st.sampled_from(['logit', 'logprob', 'prob']), r_in=st.sampled_from(['final', 'mean']),
       kl=st.sampled_from(['forward', 'reverse']), k=st.integers(1, 4),
       distill=st.sampled_from(['mixture', 'per_layer']), teacher_lm=st.sampled_from([0.0, 0.7]),
       masked=st.booleans())
def test_ensemble_matches_hand_computation(seed, T, mix, r_in, kl, k, distill, teacher_lm, masked):
    """The mixture, the distillation and the teacher's LM loss, recomputed by hand; with a task's
    loss mask (targets -1 on the prompt), the distillation too counts the answer positions only."""
    model = build(
        'ensemble',
        seed=seed,
        ens_mix=mix,
        ens_router_input=r_in,
        ens_kl=kl,
        ens_layers=k,
        ens_kl_weight=0.3,
        ens_distill=distill,
        ens_teacher_lm_weight=teacher_lm,
    ).train()
    idx, tgt = tokens(seed, 2, T), tokens(seed + 1, 2, T)
    if masked:
        tgt[:, :T // 2] = -1                        # a prompt the loss does not count
    counted = tgt != -1
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
        teacher_logits = model.lm_head(model.transformer.ln_f(x))
        teacher = F.log_softmax(teacher_logits, -1)

        def kl_to(student_logits):
            student = F.log_softmax(student_logits, -1)
            p, q = (teacher, student) if kl == 'forward' else (student, teacher)
            return (p.exp() * (p - q)).sum(-1)[counted].mean()
        # per_layer: each late layer's own prediction distilled, mean over the k; mixture: the
        # mixture's
        kl_val = kl_to(want) if distill == 'mixture' else sum(kl_to(lg) for lg in per) / k
        teacher_ce = F.cross_entropy(teacher_logits[counted], tgt[counted])
        torch.testing.assert_close(
            loss,
            F.cross_entropy(want[counted], tgt[counted])
            + 0.3 * kl_val
            + teacher_lm * teacher_ce,
            rtol=1e-4,
            atol=1e-5,
        )


def test_the_teacher_trains_only_through_its_own_lm_loss():
    """From scratch ln_f feeds only the stop-gradient teacher: no gradient without the teacher's LM
    loss, one with it; the distillation never reaches it either way."""
    for weight, reaches in ((0.0, False), (1.0, True)):
        model = build('ensemble', seed=3, ens_teacher_lm_weight=weight).train()
        model(tokens(3, 2, 8), tokens(4, 2, 8))[1].backward()
        g = model.transformer.ln_f.weight.grad
        assert (g is not None and g.abs().sum() > 0) == reaches


def test_ensemble_of_one_layer_with_copied_norm_is_the_dense_model():
    model = build('ensemble', 2, seed=5).eval()            # ens_layers=1, mixing logits
    model.family.after_load(model)
    idx = tokens(5, 2, 12)
    with torch.no_grad():
        assert torch.equal(
            model(idx, last_only=False)[0], dense_twin(model)(idx, last_only=False)[0]
        )


# --------------------------------------------------------------------------------------------------
# the dense fine-tuning baseline (trainable='last_layers')

def test_last_layers_step_flops_match_counter():
    cfg = GPTConfig(**BASE, n_layer=4, ens_layers=2)
    model = GPT(cfg).train()
    for p in model.parameters():
        p.requires_grad_(False)
    for p in [*model.transformer.h[-2:].parameters(), *model.transformer.ln_f.parameters()]:
        p.requires_grad_(True)
    idx = tokens(0, 2, 10)
    assert (
        counted(lambda: model(idx, idx)[1].backward())
        == 2 * flops.train_step_flops(cfg, 10, 'last_layers')['total']
    )


def test_last_layers_needs_a_dense_model():
    import train
    cfg = SimpleNamespace(trainable='last_layers', route='mod', mod_router='learned')
    with pytest.raises(train.TrainError, match='last_layers'):
        train.trainable_parameters(build('mod'), cfg)
    dense = GPT(GPTConfig(**BASE, n_layer=4, ens_layers=2))
    cfg.route = 'none'
    params = train.trainable_parameters(dense, cfg)
    want = {
        id(p) for p in [*dense.transformer.h[2:].parameters(), *dense.transformer.ln_f.parameters()]
    }
    assert {id(p) for p in params} == want
    assert all(p.requires_grad == (id(p) in want) for p in dense.parameters())
