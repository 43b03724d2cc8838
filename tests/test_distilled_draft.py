"""ffn's distilled draft (ffn_draft_rank): a draft-only low-rank FFN per routed layer, trained by
self-distillation with the model frozen (trainable='draft'). Checked against independent
computations: the draft is the model with a static cheap path carrying the draft FFNs' weights, its
loss is torch's KL divergence, its gradient reaches only the draft FFNs under trainable='draft', and
a distillation run leaves every other tensor of the checkpoint bitwise as it was."""
import json
import os
import sys
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import losses
import route_ffn
import speculative
from conftest import SETTINGS, run_group
from model import GPT, GPTConfig

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures('one_thread')
BASE = dict(block_size=24, vocab_size=29, n_head=2, n_embd=16, route='ffn', ffn_cheap_rank=4,
            ffn_gate_hidden=8)


def noised(cfg, seed):
    """GPT(cfg) with every parameter moved off its init (so no path is near zero)."""
    torch.manual_seed(seed)
    model = GPT(cfg)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g))
    return model


@settings(**SETTINGS)
@given(seed=st.integers(0, 999), n_layer=st.integers(1, 3), rank=st.integers(1, 5),
       layers=st.data(), T=st.integers(1, 12))
def test_distilled_draft_is_the_model_with_draft_ffns_on_its_routed_layers(
        seed, n_layer, rank, layers, T):
    """The 'distilled' draft's logits are those of a twin whose routed layers all take a static
    cheap path whose weights are the draft FFNs' (ffn_gate='static_cheap' runs its own forward)."""
    ids = sorted(layers.draw(st.sets(st.integers(0, n_layer - 1), min_size=1)))
    cfg = GPTConfig(**BASE, n_layer=n_layer, ffn_layers=','.join(map(str, ids)),
                    ffn_draft_rank=rank)
    model = noised(cfg, seed).eval()
    twin = GPT(GPTConfig(**{**BASE, 'ffn_cheap_rank': rank}, n_layer=n_layer,
                         ffn_layers=cfg.ffn_layers, ffn_gate='static_cheap')).eval()
    state = {k: v for k, v in model.state_dict().items() if '.cheap.' not in k
             and '.draft_ffn.' not in k and '.gate.' not in k and not k.endswith('.tau')}
    state.update({k.replace('.draft_ffn.', '.cheap.'): v for k, v in model.state_dict().items()
                  if '.draft_ffn.' in k})
    missing, unexpected = twin.load_state_dict(state, strict=False)
    assert not unexpected and not [k for k in missing if '.cheap.' in k or 'mlp' in k]
    idx = torch.randint(0, cfg.vocab_size, (2, T), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        want = twin(idx, last_only=False)[0]
        got = model.family.draft_logits(model, 'distilled', idx, None, None, None)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@settings(**SETTINGS)
@given(seed=st.integers(0, 999), n_layer=st.integers(1, 3), T=st.integers(1, 10),
       rope=st.booleans())
def test_distillation_reads_what_the_first_drafted_token_reads(seed, n_layer, T, rope):
    """draft_logits_in_model_context at position t is the draft's logits for the first token of a
    speculative pass after the model has decoded positions < t: the model's K/V in the cache, the
    draft's own at t (the decode path, one position at a time)."""
    cfg = GPTConfig(**BASE, n_layer=n_layer, ffn_draft_rank=3, pos='rope' if rope else 'learned')
    model = noised(cfg, seed).eval()
    idx = torch.randint(0, cfg.vocab_size, (2, T), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        full = model.new_cache(2, idx.device)
        model(idx, cache=full)
        kv = [(full.k[layer][:, :, :T], full.v[layer][:, :, :T]) for layer in range(n_layer)]
        got = route_ffn.draft_logits_in_model_context(model, idx, None, kv)
        for t in range(T):
            cache = model.new_cache(2, idx.device)
            if t:
                model(idx[:, :t], cache=cache)
            pos = torch.full((2, 1), t)
            want = model.family.draft_logits(model, 'distilled', idx[:, t:t + 1], pos, cache, None)
            torch.testing.assert_close(got[:, t], want[:, 0], rtol=1e-4, atol=1e-4)


def test_draft_distillation_is_the_kl_divergence_of_the_draft_from_the_model():
    g = torch.Generator().manual_seed(0)
    p, q = torch.randn(3, 5, 11, generator=g) * 3, torch.randn(3, 5, 11, generator=g) * 3
    want = F.kl_div(q.log_softmax(-1).flatten(0, 1), p.log_softmax(-1).flatten(0, 1),
                    log_target=True, reduction='batchmean')
    torch.testing.assert_close(losses.draft_distillation(p, q), want)
    assert losses.draft_distillation(p, p).abs() < 1e-6 and want > 0.5


@pytest.mark.parametrize('trainable', ['draft', 'all'])
def test_the_draft_loss_trains_what_trainable_says(trainable):
    """Under trainable='draft' (everything else frozen) only the draft FFNs get a gradient, and the
    LM loss gives them none: theirs is L_draft's. Under 'all', L_draft reaches the backbone too."""
    cfg = GPTConfig(**BASE, n_layer=3, ffn_layers='1,2', ffn_draft_rank=3)
    model = noised(cfg, 0).train()
    draft_keys = {n for n, _ in model.named_parameters() if model.family.is_draft_key(n)}
    assert draft_keys and all('.draft_ffn.' in n for n in draft_keys)
    assert not any('h.0.' in n for n in draft_keys)          # layer 0 is not routed
    if trainable == 'draft':
        for n, p in model.named_parameters():
            p.requires_grad_(n in draft_keys)
    idx = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    _, loss, aux = model(idx, idx)
    assert aux['draft_loss'] > 0.01
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    for n in draft_keys:
        assert grads[n] is not None and grads[n].norm() > 1e-4, n
    if trainable == 'draft':
        assert all(grads[n] is None for n in grads if n not in draft_keys)
        # the same gradient as L_draft's alone, computed from the model's own logits
        model.zero_grad()
        inputs = {}                     # each block's attention input in the model's forward
        hooks = [b.attn.register_forward_hook(      # (returns None: the output is kept)
            lambda m, args, out, layer=b.layer: inputs.__setitem__(layer, args[0]))
            for b in model.transformer.h]
        with torch.no_grad():
            p = model(idx, idx)[0]
            kv = [b.attn.heads(inputs[b.layer])[1:] for b in model.transformer.h]
        for h in hooks:
            h.remove()
        q = route_ffn.draft_logits_in_model_context(model, idx, None, kv)
        losses.draft_distillation(p, q).backward()
        for n in draft_keys:
            torch.testing.assert_close(model.get_parameter(n).grad, grads[n])
    else:                               # LM + L_draft, L_draft's context K/V held constant
        model.zero_grad()
        inputs = {}
        hooks = [b.attn.register_forward_hook(
            lambda m, args, out, layer=b.layer: inputs.__setitem__(layer, args[0]))
            for b in model.transformer.h]
        logits = model(idx, idx)[0]
        for h in hooks:
            h.remove()
        with torch.no_grad():
            kv = [b.attn.heads(inputs[b.layer])[1:] for b in model.transformer.h]
        q = route_ffn.draft_logits_in_model_context(model, idx, None, kv)
        (losses.lm_loss(logits, idx) + losses.draft_distillation(logits, q)).backward()
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad, grads[n], msg=n)
        attn = 'transformer.h.1.attn.c_attn.weight'     # and L_draft moves the backbone
        model.zero_grad()
        losses.lm_loss(model(idx, idx)[0], idx).backward()
        lm_only = model.get_parameter(attn).grad
        assert (grads[attn] - lm_only).norm() > 0.05 * lm_only.norm()


def test_the_draft_report_measures_the_draft_against_the_model():
    """distilled_draft_report (the end-of-run summary's line): a draft carrying the full FFNs'
    weights under a gate that sends every token to them is the model (KL 0, all kept, the model's
    loss); a draft of its own gives the values an independent computation gives (torch's KL,
    1 − TV as 1 − ½·Σ|p − q|, the model without a cache, K/V from its attention's inputs)."""
    import eval as evaluation
    g = torch.Generator().manual_seed(5)
    batches = [(torch.randint(0, 29, (2, 10), generator=g), torch.randint(0, 29, (2, 10),
                                                                          generator=g))
               for _ in range(2)]
    twin = noised(GPTConfig(**BASE, n_layer=2, ffn_gate='static_full', ffn_draft_rank=64), 3)
    for b in twin.transformer.h:
        b.draft_ffn.load_state_dict(b.mlp.state_dict())
    r = route_ffn.distilled_draft_report(twin, batches, nullcontext())
    assert r['kl'] < 1e-5 and r['kept'] > 1 - 1e-4 and r['agrees'] == 1.0
    assert abs(r['loss'] - evaluation.evaluate(twin, batches)['loss']) < 1e-4
    model = noised(GPTConfig(**BASE, n_layer=2, ffn_draft_rank=3), 3)
    r = route_ffn.distilled_draft_report(model, batches, nullcontext())
    want = dict(loss=0.0, kl=0.0, kept=0.0, agrees=0.0)
    model.eval()
    for x, y in batches:
        inputs = {}
        hooks = [b.attn.register_forward_hook(
            lambda m, args, out, layer=b.layer: inputs.__setitem__(layer, args[0]))
            for b in model.transformer.h]
        with torch.no_grad():
            p = model(x, last_only=False)[0].log_softmax(-1)
            kv = [b.attn.heads(inputs[b.layer])[1:] for b in model.transformer.h]
            q = route_ffn.draft_logits_in_model_context(model, x, None, kv).log_softmax(-1)
        for h in hooks:
            h.remove()
        want['loss'] += F.nll_loss(q.flatten(0, 1), y.flatten()).item() / 2
        want['kl'] += F.kl_div(q.flatten(0, 1), p.flatten(0, 1), log_target=True,
                               reduction='batchmean').item() / 2
        want['kept'] += (1 - 0.5 * (p.exp() - q.exp()).abs().sum(-1)).mean().item() / 2
        want['agrees'] += (p.argmax(-1) == q.argmax(-1)).float().mean().item() / 2
    for k in want:
        assert abs(r[k] - want[k]) < 1e-4, (k, r[k], want[k])
    assert r['kl'] > 0.05 and r['kept'] < 0.95


def test_a_draft_run_draws_no_oracle_labels():
    """Oracle labels train only the gates: a trainable='draft' run, which freezes them, runs no
    oracle pass even where the model has util/rank losses on."""
    from types import SimpleNamespace
    model = GPT(GPTConfig(**BASE, n_layer=3, ffn_draft_rank=2, ffn_util_weight=0.5))
    for trainable, want in (('all', 2), ('draft', None)):
        run = SimpleNamespace(seed=0, ffn_oracle_layers_per_step=2, trainable=trainable)
        opts = model.family.step_options(model, 7, run)
        assert len(opts['oracle_layers']) == want if want else opts == {}


def test_the_distilled_draft_is_the_default_where_there_is_one():
    with_draft = GPTConfig(**BASE, n_layer=2, ffn_draft_rank=2)
    family = GPT(with_draft).family
    assert speculative.resolve_draft(with_draft, family) == ('distilled', None)
    assert list(family.drafts(GPTConfig(**BASE, n_layer=2)))[0] == 'cheap'
    with pytest.raises(ValueError, match='ffn_draft_weight'):
        GPTConfig(**BASE, n_layer=2, ffn_draft_rank=2, ffn_draft_weight=0.0)


@pytest.mark.slow
def test_a_distillation_run_trains_the_draft_and_leaves_the_model_as_it_was(tmp_path):
    """train.py --trainable=draft from a checkpoint: every tensor but the draft FFNs' (thresholds
    included: they are not recalibrated) is bitwise the checkpoint's, the draft's KL falls to well
    below where it started, and the run's checkpoint decodes with the distilled draft by default."""
    from data import prepare
    data = tmp_path / 'syn'
    prepare.prepare('synthetic', out_dir=data, num_tokens=30000)
    common = ['--n_layer=2', '--n_head=2', '--n_embd=32', '--block_size=32',
              '--eval_iters=2', '--log_interval=5', '--device=cpu', f'--data_dir={tmp_path}',
              '--dataset=syn', '--ffn_cheap_rank=4', '--ffn_util_weight=0.5']
    env = {**{k: v for k, v in os.environ.items() if k not in ('RANK', 'WORLD_SIZE')},
           'OMP_NUM_THREADS': '1', 'MKL_NUM_THREADS': '1'}
    base = tmp_path / 'base'
    r = run_group([sys.executable, 'train.py', *common, '--max_iters=40', '--eval_interval=40',
                   '--batch_size=8',
                   f'--out_dir={base}'], 240, cwd=REPO, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    out = tmp_path / 'draft'
    r = run_group([sys.executable, 'train.py', *common, '--max_iters=60', '--eval_interval=30',
                   '--warmup_iters=5', '--learning_rate=3e-3', '--trainable=draft',
                   '--batch_size=4',    # other calibration batches: thresholds would move
                   '--ffn_draft_rank=8', f'--init_from={base / "ckpt.pt"}', f'--out_dir={out}'],
                  240, cwd=REPO, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    before = torch.load(base / 'ckpt.pt', map_location='cpu', weights_only=False)['model']
    after = torch.load(out / 'ckpt.pt', map_location='cpu', weights_only=False)['model']
    drafted = {k for k in after if '.draft_ffn.' in k}
    assert drafted and set(after) - drafted == set(before)
    for k, v in before.items():
        assert torch.equal(after[k], v), k
    rows = [json.loads(line) for line in (out / 'metrics.jsonl').read_text().splitlines()]
    train = [row for row in rows if row['type'] == 'train']
    kl = [row['draft_loss'] for row in train]
    assert kl[-1] < 0.5 * kl[0], kl
    # no oracle pass (the model has util on, and its base run ran them) and no controller norm
    import flops
    model_cfg = GPTConfig.from_dict(torch.load(out / 'ckpt.pt', weights_only=False)['model_args'])
    per_seq = flops.train_step_flops(model_cfg, 32, 'draft')['total']
    assert per_seq < flops.train_step_flops(model_cfg, 32, 'draft', oracle_layers=(0,))['total']
    a, b = train[-2], train[-1]
    assert b['train_flops'] - a['train_flops'] == (b['iter'] - a['iter']) * 4 * per_seq
    assert all(row['ctrl_grad_norm'] is None for row in train)
    evals = [row for row in rows if row['type'] == 'eval']
    assert len({row['val_loss'] for row in evals}) == 1     # the model itself does not move
    summary = [row for row in rows if row['type'] == 'summary'][-1]
    assert summary['routing']['val_loss']['loss'] == evals[-1]['val_loss']   # not recalibrated
    assert 0.3 < summary['routing']['draft']['kept'] <= 1
    assert "distilled draft, in the model's context" in r.stdout
    # refused in one line: a draft of another rank over this one, a resume that moves the budget
    for args in ([*common, '--trainable=draft', '--ffn_draft_rank=4', '--batch_size=4',
                  f'--init_from={out / "ckpt.pt"}', f'--out_dir={tmp_path / "other"}'],
                 [*common, '--trainable=draft', '--ffn_draft_rank=8', '--batch_size=4',
                  '--max_iters=80', '--init_from=resume', '--ffn_budget=0.25',
                  f'--out_dir={out}']):
        r = run_group([sys.executable, 'train.py', *args], 240, cwd=REPO, env=env)
        assert r.returncode == 2 and r.stderr.startswith('error: '), r.stderr[-2000:]
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert 'differ' in r.stderr
    # a distilled checkpoint still starts a stage-2 run: its draft goes with its gates
    r = run_group([sys.executable, 'train.py', *common, '--trainable=controller', '--max_iters=2',
                   '--batch_size=4', f'--init_from={out / "ckpt.pt"}',
                   f'--out_dir={tmp_path / "stage2"}'], 240, cwd=REPO, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
