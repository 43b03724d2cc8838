"""lora.py: an adapted model starts as its base model bit for bit, merging keeps its function,
only the adapters learn (the saved base weights stay the backbone's, bit for bit), a target that
names nothing is refused, and the forward and trainable-parameter count match peft's LoRA."""
import copy
import json

import pytest
import torch
import torch.nn as nn

import train
from checkpoint import load_checkpoint, load_model
from conftest import build, tokens
from data import prepare as P
from lora import DEFAULT_TARGETS, LoRALinear, apply_lora, lora_parameters, merge_lora
from model import is_controller_key, is_draft_key

pytestmark = pytest.mark.usefixtures('one_thread')      # tiny ops: see conftest.py

MERGE_TOL = 1e-5        # fp32: W x + s·B(A x) against (W + s·BA) x, two summation orders


def adapted(route='none', seed=0, targets=DEFAULT_TARGETS, rank=4, alpha=8.0):
    model = build(route, seed=seed, n_layer=2, **({'ens_layers': 2} if route == 'ensemble' else {}))
    base = copy.deepcopy(model)
    apply_lora(model, rank, alpha, 0.0, targets)
    return base, model


def move_b(model, seed=1):
    """Nonzero B, so the adapters change the function."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LoRALinear):
                m.lora_B.copy_(0.05 * torch.randn(m.lora_B.shape, generator=g))


@pytest.mark.parametrize('route', ['none', 'ensemble'])
def test_zero_b_is_the_base_model_bit_for_bit(route):
    base, model = adapted(route)
    idx = tokens(0, 2, 12)
    assert torch.equal(model.eval()(idx, idx)[0], base.eval()(idx, idx)[0])
    move_b(model)                     # the check can fail: a nonzero B moves the logits
    assert (model(idx, idx)[0] - base(idx, idx)[0]).abs().max() > 1e-3


def test_every_named_projection_is_adapted_and_nothing_else():
    _, model = adapted(targets='attn.c_attn,mlp.c_proj')
    wrapped = sorted(n for n, m in model.named_modules() if isinstance(m, LoRALinear))
    assert wrapped == [f'transformer.h.{i}.{t}' for i in range(2)
                       for t in ('attn.c_attn', 'mlp.c_proj')]
    _, one = adapted(targets='h.1.mlp.c_fc')
    assert [n for n, m in one.named_modules() if isinstance(m, LoRALinear)] == [
        'transformer.h.1.mlp.c_fc']


def test_merged_equals_unmerged_and_is_plain_linear():
    _, model = adapted()
    move_b(model)
    idx = tokens(1, 2, 12)
    before = model.eval()(idx, idx)[0]
    merge_lora(model)
    assert not any(isinstance(m, LoRALinear) for m in model.modules())
    assert isinstance(model.transformer.h[0].attn.c_attn, nn.Linear)
    after = model(idx, idx)[0]
    assert (after - before).abs().max() < MERGE_TOL
    assert (after - before).abs().max() < (before.abs().max() * 1e-5)


def test_weight_property_is_the_merged_weight():
    """Code that reads a projection's weight (sparse kernels) sees the adapted one."""
    _, model = adapted()
    move_b(model)
    m = model.transformer.h[0].mlp.c_fc
    want = m.base.weight + m.scale * m.lora_B @ m.lora_A
    assert torch.equal(m.weight, want) and not torch.equal(m.weight, m.base.weight)


def test_only_adapter_tensors_receive_gradients():
    _, model = adapted('ensemble')
    move_b(model)                     # with B = 0, A's gradient would be zero by construction
    idx = tokens(2, 2, 12)
    model.train()(idx, tokens(3, 2, 12))[1].backward()
    adapters = {id(p) for p in lora_parameters(model)}
    assert len(adapters) == 2 * 4 * 2            # A and B, 4 projections, 2 blocks
    for name, p in model.named_parameters():
        if id(p) in adapters:
            assert p.requires_grad and p.grad is not None and p.grad.abs().max() > 1e-6, name
        else:
            assert not p.requires_grad and p.grad is None, name


def test_a_target_that_names_nothing_is_refused_with_the_names_there_are():
    model = build('none', n_layer=2)
    with pytest.raises(ValueError, match="'attn.q_proj' matches no projection") as e:
        apply_lora(model, 4, 8.0, 0.0, 'attn.c_attn,attn.q_proj')
    assert 'attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj' in str(e.value)
    assert '\n' not in str(e.value)
    assert not any(isinstance(m, LoRALinear) for m in model.modules())   # nothing half-applied


@pytest.mark.parametrize('arg, needle', [
    ('--lora_targets=attn.q_proj', "'attn.q_proj' matches no projection"),
    ('--lora_targets=,', 'names no module'),
    ('--lora_rank=0', 'lora_rank must be in 1..8192'),
    ('--lora_alpha=0', 'lora_alpha must be > 0'),
    ('--lora_dropout=1.0', 'lora_dropout must be in'),
    ('--trainable=loRA', 'trainable must be one of'),
    # (the default route is ffn: its cheap FFNs' c_fc and its gates are no block projections)
    ('--lora_targets=c_fc', "names transformer.h.0.cheap.c_fc and 3 more, not a block projection"),
    ('--lora_targets=mlp.c_fc,gate.fc', 'names transformer.h.0.gate.fc and 3 more'),
])
def test_train_refuses_bad_lora_options_before_any_work(tmp_path, arg, needle):
    out = tmp_path / 'out'
    with pytest.raises(train.TrainError, match=needle) as e:
        train.main(['--trainable=lora', arg, f'--out_dir={out}', '--device=cpu'])
    assert '\n' not in str(e.value) and not out.exists()


@pytest.mark.parametrize('trainable', ['lora', 'controller+lora'])
def test_train_refuses_adapters_only_on_projections_that_never_run(tmp_path, trainable):
    """Under ffn_gate='static_cheap' the full FFN never runs: adapters on it alone would leave a
    loss that reaches nothing (a traceback at the first backward). Refused before any work; an
    attention target, which runs, is not."""
    out = tmp_path / 'out'
    args = ['--route=ffn', '--ffn_gate=static_cheap', f'--trainable={trainable}',
            f'--out_dir={out}', '--device=cpu']
    with pytest.raises(train.TrainError, match="adapts only projections this model never runs"):
        train.main([*args, '--lora_targets=mlp.c_fc,mlp.c_proj'])
    assert not out.exists()
    train.read_config([*args, '--lora_targets=mlp.c_fc,attn.c_proj'])      # checked, accepted


# --------------------------------------------------------------------------------------------------
# a LoRA run from a backbone checkpoint

TINY = ['--n_layer=2', '--n_head=2', '--n_embd=16', '--block_size=16', '--batch_size=2',
        '--eval_iters=1', '--eval_interval=3', '--log_interval=1', '--warmup_iters=0',
        '--device=cpu', '--route=none',]


@pytest.fixture(scope='module')
def backbone(tmp_path_factory):
    root = tmp_path_factory.mktemp('lora')
    P.prepare('synthetic', out_dir=root / 'data' / 'synthetic', num_tokens=4000, seed=1)
    args = [*TINY, f'--data_dir={root / "data"}']
    assert train.main([*args, f'--out_dir={root / "backbone"}', '--max_iters=2']) == 0
    return root, args


def test_the_controller_gradient_norm_is_logged_where_the_controller_trains(backbone):
    """ctrl_grad_norm of a routed model: a finite, non-zero norm under 'controller' and
    'controller+lora', and absent (None, not a 0.0 from a frozen controller) under 'lora'."""
    root, args = backbone
    routed = [*args, '--route=ffn', '--ffn_cheap_rank=2', '--max_iters=2']
    assert train.main([*routed, f'--out_dir={root / "routed"}']) == 0
    init = f'--init_from={root / "routed" / "ckpt.pt"}'
    norms = {}
    for trainable in ('controller', 'controller+lora', 'lora'):
        out = root / f'ctrl_{trainable}'
        assert train.main([*routed, init, f'--trainable={trainable}', '--lora_rank=2',
                           f'--out_dir={out}']) == 0
        rows = [json.loads(line) for line in open(out / 'metrics.jsonl')]
        norms[trainable] = [r['ctrl_grad_norm'] for r in rows if r['type'] == 'train']
    for trainable in ('controller', 'controller+lora'):
        assert all(1e-6 < n < 1e3 for n in norms[trainable]), norms
    assert norms['lora'] and all(n is None for n in norms['lora']), norms


def test_lora_run_keeps_the_backbones_weights_bit_for_bit(backbone):
    root, args = backbone
    out = root / 'tuned'
    init = root / 'backbone' / 'ckpt.pt'
    assert train.main([*args, f'--out_dir={out}', f'--init_from={init}', '--trainable=lora',
                       '--lora_rank=2', '--learning_rate=1e-2', '--max_iters=3']) == 0
    before, after = load_checkpoint(str(init))['model'], load_checkpoint(str(out / 'ckpt.pt'))
    state = after['model']
    lora_keys = [k for k in state if '.lora_' in k]
    assert len(lora_keys) == 2 * 4 * 2
    assert max(state[k].abs().max() for k in lora_keys if k.endswith('lora_B')) > 1e-4  # it learnt
    for k, v in before.items():           # each backbone tensor, under its name or as `.base`
        mine = state.get(k, state.get(k.replace('.weight', '.base.weight')
                                      .replace('.bias', '.base.bias')))
        assert mine is not None and torch.equal(mine, v), k
    summary = [json.loads(line) for line in open(out / 'metrics.jsonl')][-1]
    assert summary['trainable_params'] == sum(state[k].numel() for k in lora_keys)
    # eval and sample load it merged: plain projections, the LoRA model's function
    merged = load_model(after, 'cpu').eval()
    assert not any(isinstance(m, LoRALinear) for m in merged.modules())
    plain = load_model(load_checkpoint(str(init)), 'cpu')
    apply_lora(plain, 2, 16.0, 0.0, DEFAULT_TARGETS)
    plain.load_state_dict(state)
    idx = tokens(4, 2, 12) % 34
    assert (merged(idx, idx)[0] - plain.eval()(idx, idx)[0]).abs().max() < MERGE_TOL
    # and a resume goes on from the adapters it saved
    assert train.main([*args, f'--out_dir={out}', '--init_from=resume', '--trainable=lora',
                       '--lora_rank=2', '--learning_rate=1e-2', '--max_iters=4']) == 0
    with pytest.raises(train.TrainError, match="'lora_rank' differs"):
        train.main([*args, f'--out_dir={out}', '--init_from=resume', '--trainable=lora',
                    '--lora_rank=4', '--max_iters=5'])


def test_a_lora_runs_checkpoint_starts_another_run_with_its_adapters_merged(backbone):
    """init_from=<a LoRA run's ckpt.pt> (a controller on the tuned model, or its draft) starts from
    the weights eval.py and sample.py load: every projection W + (alpha / r) · B A, bit for bit."""
    root, args = backbone
    routed = [*args, '--route=ffn', '--ffn_cheap_rank=2', '--max_iters=2']
    lora_run = root / 'ffn_lora'
    assert train.main([*routed, f'--out_dir={root / "ffn_base"}']) == 0
    assert train.main([*routed, f'--init_from={root / "ffn_base" / "ckpt.pt"}',
                       '--trainable=lora', '--lora_rank=2', '--learning_rate=1e-2',
                       f'--out_dir={lora_run}']) == 0
    tuned = load_checkpoint(str(lora_run / 'ckpt.pt'))
    merged = load_model(tuned, 'cpu').state_dict()
    assert any(not torch.equal(merged[k.replace('.lora_A', '.weight')],
                               tuned['model'][k.replace('.lora_A', '.base.weight')])
               for k in tuned['model'] if k.endswith('.lora_A'))       # the adapters moved W
    init = f'--init_from={lora_run / "ckpt.pt"}'
    for name, extra in (('on_lora_controller', ['--trainable=controller']),
                        ('on_lora_draft', ['--trainable=draft', '--ffn_draft_rank=2'])):
        out = root / name
        assert train.main([*routed, init, *extra, f'--out_dir={out}']) == 0, name
        state = load_checkpoint(str(out / 'ckpt.pt'))['model']
        frozen = [k for k in merged if not (is_controller_key(k) or is_draft_key(k))]
        assert any('.mlp.c_fc.weight' in k for k in frozen)
        for k in frozen:                        # trained by neither: the LoRA model's, merged
            assert torch.equal(state[k], merged[k]), (name, k)


# --------------------------------------------------------------------------------------------------
# against peft's LoRA

def test_forward_and_trainable_count_match_peft():
    peft = pytest.importorskip('peft')
    targets = 'attn.c_attn,mlp.c_fc,mlp.c_proj'
    base, mine = adapted(targets=targets, rank=4, alpha=8.0)
    move_b(mine)
    theirs = peft.inject_adapter_in_model(
        peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets.split(',')),
        base)
    copied = 0
    with torch.no_grad():
        for name, m in mine.named_modules():
            if isinstance(m, LoRALinear):
                other = theirs.get_submodule(name)
                other.lora_A['default'].weight.copy_(m.lora_A)
                other.lora_B['default'].weight.copy_(m.lora_B)
                copied += 1
    assert copied == 2 * 3
    idx = tokens(5, 2, 12)
    a, b = mine.eval()(idx, idx)[0], theirs.eval()(idx, idx)[0]
    assert (a - b).abs().max() < 1e-5
    count = lambda model: sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert count(mine) == count(theirs) == sum(p.numel() for p in lora_parameters(mine))


def test_lora_step_flops_equal_the_counter():
    """flops.train_step_flops(trainable='lora') counts the adapters' matmuls and the frozen body's
    input gradients from the first adapter up: FlopCounterMode's count (every family, other
    targets and ranks: tests/test_families.py). train.py's LoRA keys reach it as they are."""
    import flops
    from conftest import counted
    _, model = adapted(rank=5, alpha=2.0, targets='attn.c_proj,mlp.c_fc')
    idx = tokens(6, 2, 24)
    exact = counted(lambda: model.train()(idx, idx)[1].backward())
    run = dict(train.DEFAULTS, lora_rank=5, lora_targets='attn.c_proj,mlp.c_fc')
    assert 2 * flops.train_step_flops(model.config, 24, 'lora',
                                      **flops.lora_options(run))['total'] == exact
    assert flops.LORA_DEFAULTS == {k: train.DEFAULTS[k] for k in flops.LORA_DEFAULTS}
    other = 2 * flops.train_step_flops(model.config, 24, 'lora', lora_rank=5)['total']
    assert abs(other - exact) > 0.05 * exact        # the targets matter: every projection's
    frozen = 2 * flops.train_step_flops(model.config, 24, 'controller')['total']   # no backward
    assert abs(frozen - exact) > 0.25 * exact
