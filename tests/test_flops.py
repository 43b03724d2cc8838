"""Analytic FLOPs (flops.py) against torch's FlopCounterMode, for random routed configs: the
forward, and a whole training step (forward, backward, oracle passes) with the backbone trainable,
frozen, or frozen with LoRA adapters."""
import math
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

import flops
from lora import apply_lora, lora_parameters
from model import GPT, GPTConfig, controlled_layer_ids


def counted(fn):
    # fused CPU SDPA is uncounted
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fc:
        fn()
    return fc.get_total_flops()


@st.composite
def routed_configs(draw):
    n_layer = draw(st.integers(1, 4))
    n_head = draw(st.sampled_from([1, 2]))
    gate = draw(st.sampled_from(['mlp', 'jepa', 'random', 'static_full', 'static_cheap', 'oracle']))
    spec = draw(st.sampled_from(['all', 'every_other', 'list']))
    if spec == 'every_other' and n_layer < 2:
        spec = 'all'
    if spec == 'list':
        spec = ','.join(
            str(i) for i in sorted(draw(st.sets(st.integers(0, n_layer - 1), min_size=1)))
        )
    scored = gate in ('mlp', 'jepa')
    cfg = GPTConfig(
        block_size=16,
        vocab_size=draw(st.integers(5, 40)),
        n_layer=n_layer,
        n_head=n_head,
        n_embd=n_head * draw(st.sampled_from([4, 8])),
        bias=draw(st.booleans()),
        route='ffn',
        ffn_gate=gate,
        ffn_budget=draw(st.floats(0.05, 1.0)),
        ffn_layers=spec,
        ffn_cheap_rank=draw(st.integers(1, 6)),
        ffn_gate_hidden=draw(st.integers(1, 6)),
        ffn_gate_grad=draw(st.sampled_from(['ste', 'scale', 'none'])),
        ffn_infer_rule=draw(st.sampled_from(['threshold', 'predictor'])),
        ffn_jepa_latent=draw(st.integers(1, 5)),
        ffn_jepa_readout=draw(st.sampled_from(['utility', 'distance', 'linear'])),
        ffn_jepa_weight=draw(st.sampled_from([0.0, 1.0])),
        ffn_util_weight=draw(st.sampled_from([0.0, 1.0])) if scored else 0.0,
        ffn_rank_weight=draw(st.sampled_from([0.0, 0.5])) if scored else 0.0,
        ffn_oracle_policy=draw(st.sampled_from(['off', 'on'])),
        ffn_oracle_start=draw(st.sampled_from(['auto', 'full', 'routed'])),
        ffn_oracle_label=draw(st.sampled_from(['token', 'sequence'])),
        ffn_aux_grad=draw(st.sampled_from(['own', 'leak'])),
        ffn_predictor_weight=draw(st.sampled_from([0.0, 1.0])),
        ffn_mimic_weight=draw(st.sampled_from([0.0, 0.5])),
        ffn_draft_rank=draw(st.sampled_from([0, 0, 1, 3])),
    )
    return cfg


@settings(max_examples=40, deadline=None)
@given(cfg=routed_configs(), T=st.integers(2, 16), B=st.integers(1, 2), seed=st.integers(0, 99))
def test_forward_flops_match_counter(cfg, T, B, seed):
    torch.manual_seed(seed)
    model = GPT(cfg)
    idx = torch.randint(0, cfg.vocab_size, (B, T))
    with torch.no_grad():
        model.train()
        assert counted(lambda: model(idx, idx)) == B * flops.forward_flops(cfg, T, mode='train')
        model.eval()
        assert counted(lambda: model(idx, idx, sparse=False)) == B * flops.forward_flops(
            cfg, T, mode='eval'
        )
        out = []                                            # sparse execution: each path on its own
                                                            # tokens
        got = counted(lambda: out.append(model(idx, idx)[2].get('masks', {})))
        frac = [int(m.sum()) / m.numel() for _, m in sorted(out[0].items())] or None
        assert math.isclose(
            got, B * flops.forward_flops(cfg, T, mode='sparse', full_frac=frac), rel_tol=1e-9
        )


@settings(max_examples=50, deadline=None)
@given(cfg=routed_configs(), T=st.integers(2, 16), B=st.integers(1, 2), seed=st.integers(0, 99),
       trainable=st.sampled_from(['all', 'controller', 'draft', 'lora', 'controller+lora']),
       data=st.data())
def test_train_step_flops_match_counter(cfg, T, B, seed, trainable, data):
    if trainable == 'draft' and cfg.ffn_draft_rank == 0:
        cfg = replace(cfg, ffn_draft_rank=2)           # trainable='draft' needs a draft FFN
    torch.manual_seed(seed)
    model = GPT(cfg).train()
    ctrl = {id(p) for p in model.controller_parameters()}
    if trainable == 'draft':
        ctrl = {id(p) for n, p in model.named_parameters() if model.family.is_draft_key(n)}
    lora = {}
    if 'lora' in trainable:         # adapters on some block projections; the controller frozen or
                                    # trained beside them
        lora = dict(lora_rank=data.draw(st.integers(1, 3)), lora_targets=data.draw(
            st.sampled_from(['attn.c_attn,attn.c_proj,mlp.c_fc,mlp.c_proj', 'mlp.c_fc',
                             'attn.c_proj', f'h.{cfg.n_layer - 1}.attn.c_attn'])))
        apply_lora(model, lora['lora_rank'], 2.0, 0.0, lora['lora_targets'])
        if trainable == 'lora':
            ctrl = set()
        ctrl |= {id(p) for p in lora_parameters(model)}
    if trainable != 'all':
        for p in model.parameters():
            p.requires_grad_(id(p) in ctrl)
    ids = controlled_layer_ids(cfg)
    oracle_layers = ()
    if cfg.ffn_gate in ('mlp', 'jepa') and (cfg.ffn_util_weight > 0 or cfg.ffn_rank_weight > 0):
        oracle_layers = tuple(
            sorted(data.draw(st.sets(st.sampled_from(ids), min_size=1, max_size=2)))
        )
    idx = torch.randint(0, cfg.vocab_size, (B, T))

    def step():
        loss = model(idx, idx, oracle_layers=oracle_layers)[1]
        if loss.requires_grad:
            loss.backward()
    expect = flops.train_step_flops(cfg, T, trainable, oracle_layers=oracle_layers, **lora)
    assert counted(step) == B * expect['total'], expect


def test_dense_config_costs_match_dense_formula():
    cfg = GPTConfig(n_layer=3, n_embd=32, n_head=2, vocab_size=50)
    assert flops.forward_flops(cfg, 20) == flops.dense_forward_flops(cfg, 20)
    assert flops.train_step_flops(cfg, 20)['total'] == 3 * flops.dense_forward_flops(cfg, 20)


def test_sparse_flops_interpolate_between_paths():
    cfg = GPTConfig(
        n_layer=2, n_embd=32, n_head=2, vocab_size=50, route='ffn', ffn_gate='mlp', ffn_cheap_rank=4
    )
    lo = flops.forward_flops(cfg, 20, mode='sparse', full_frac=0.0)
    hi = flops.forward_flops(cfg, 20, mode='sparse', full_frac=1.0)
    mid = flops.forward_flops(cfg, 20, mode='sparse', full_frac=0.5)
    assert lo < mid < hi and abs(mid - (lo + hi) / 2) < 1e-6
    assert hi > flops.dense_forward_flops(cfg, 20)          # gates cost something


def test_flops_cli_prints_the_breakdown(capsys):
    """python flops.py CONFIG: one row per gate and util/rank setting, proxy = the function's
    value."""
    import os
    import train
    from configurator import load_config
    from dataclasses import replace

    path = os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'config', 'ffn_paper_157m.py'
    )
    assert flops.main([path]) == 0
    rows = [l for l in capsys.readouterr().out.splitlines() if l.startswith('| G')]
    assert len(rows) == 4
    cfg = train.model_config(
        SimpleNamespace(**load_config(train.DEFAULTS, [path])), vocab_size=50304
    )
    off = replace(cfg, ffn_gate='mlp', ffn_util_weight=0.0, ffn_rank_weight=0.0)
    assert rows[1].split('|')[5].strip() == f"{flops.flops_proxy(off, cfg.block_size):.3f}"
    assert float(rows[0].split('|')[4]) > 0.5                   # util/rank on: oracle passes
    # a draft run draws no oracle labels (train.py's count): 'on' costs what 'off' costs
    draft = os.path.join(os.path.dirname(path), 'ffn_distilled_drafter_shakespeare.py')
    assert flops.main([draft]) == 0
    rows = [l.split('|')[3:] for l in capsys.readouterr().out.splitlines() if l.startswith('| G')]
    assert rows[0] == rows[1] and rows[2] == rows[3] and float(rows[0][1]) == 0.0


@pytest.mark.parametrize('gate', ['mlp', 'jepa'])
@pytest.mark.parametrize('aux_grad', ['own', 'leak'])
@pytest.mark.parametrize('trainable', ['all', 'controller'])
@pytest.mark.parametrize('policy,start',
                         [('off', 'auto'), ('on', 'auto'), ('off', 'routed'), ('on', 'full')])
@pytest.mark.parametrize('label', ['token', 'sequence'])
def test_aux_loss_gradient_modes_and_oracle_starts_match_counter(
    gate, aux_grad, trainable, policy, start, label
):
    """Every aux-loss gradient mode and oracle start with util, rank and JEPA on (the drawn configs
    above reach these combinations only now and then): 'own' scores the detached gate input
    again."""
    cfg = GPTConfig(
        n_layer=3,
        n_head=2,
        n_embd=8,
        vocab_size=11,
        block_size=16,
        route='ffn',
        ffn_gate=gate,
        ffn_cheap_rank=2,
        ffn_gate_hidden=4,
        ffn_jepa_latent=3,
        ffn_jepa_weight=1.0,
        ffn_util_weight=1.0,
        ffn_rank_weight=0.5,
        ffn_layers='all',
        ffn_aux_grad=aux_grad,
        ffn_oracle_policy=policy,
        ffn_oracle_start=start,
        ffn_oracle_label=label,
    )
    torch.manual_seed(0)
    model = GPT(cfg).train()
    ctrl = {id(p) for p in model.controller_parameters()}
    if trainable == 'controller':
        for p in model.parameters():
            p.requires_grad_(id(p) in ctrl)
    idx = torch.randint(0, 11, (2, 9))
    expect = flops.train_step_flops(cfg, 9, trainable, oracle_layers=(0, 2))
    assert (
        counted(lambda: model(idx, idx, oracle_layers=(0, 2))[1].backward()) == 2 * expect['total']
    ), expect


def test_flops_cli_costs_every_config_file(capsys, monkeypatch):
    """python flops.py CONFIG for every file in config/: a table for every train and bench config
    (one row, the config as it is, for a family without FFN gates); a study file is refused in one
    line naming the command that costs its reference arm, and that command works."""
    import os
    import shlex
    from configurator import ConfigError
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    monkeypatch.chdir(here)            # config files name each other relative to the repository
    for name in sorted(os.listdir('config')):
        path = os.path.join('config', name)
        try:
            assert flops.main([path]) == 0, path
        except ConfigError as e:
            assert name.startswith('study_'), f"{path}: {e}"
            command = str(e).split(' with: ', 1)[1]
            assert command.startswith('python flops.py config/'), command
            assert flops.main(shlex.split(command)[2:]) == 0, command
        out = capsys.readouterr().out
        rows = [line for line in out.splitlines() if line.startswith(('| G', '| —'))]
        assert len(rows) in (1, 4), (path, out)
        ratios = [float(v) for row in rows for v in row.split('|')[3:7]]
        assert all(0 <= v < 20 for v in ratios), (path, rows)


def test_flops_help_lists_the_config_keys_it_costs(capsys):
    """--help exits 0 before any work (a missing config file is not read), on stdout: train.py's
    keys and every family's, each with its default and comment."""
    assert flops.main(['--help', 'missing.py']) == 0
    out, err = capsys.readouterr()
    assert out.startswith('The training-FLOPs breakdown') and err == ''
    assert 'UNDOCUMENTED' not in out and 'route=exit options (route_exit.py):' in out
    assert '  --trainable=all ' in out and '  --exit_threshold=0.9 ' in out


def test_flops_cli_says_when_it_assumes_the_vocabulary(tmp_path, capsys):
    # the LM head's FLOPs depend on the vocabulary: without the data's meta.json it is assumed
    assert flops.main([f'--data_dir={tmp_path}']) == 0
    out, err = capsys.readouterr()
    assert 'vocab 50304' in out.splitlines()[0]
    assert 'vocab_size taken as 50304' in err and '--vocab_size' in err
    assert flops.main([f'--data_dir={tmp_path}', '--vocab_size=96']) == 0
    out, err = capsys.readouterr()
    assert 'vocab 96' in out.splitlines()[0] and err == ''


def test_flops_cli_averages_the_exit_rotation(tmp_path, capsys):
    """route=exit with exit_rotation=R trains other exits at each of R steps (train.py counts each
    step at its own exits): the row is the mean over the rotation, not every exit at every step."""
    args = [f'--data_dir={tmp_path}', '--vocab_size=50', '--n_layer=4', '--n_head=2',
            '--n_embd=16', '--block_size=16', '--route=exit', '--exit_layers=every',
            '--exit_rotation=2']
    assert flops.main(args) == 0
    rows = [l.split('|') for l in capsys.readouterr().out.splitlines() if l.startswith('| —')]
    cfg = GPTConfig(n_layer=4, n_head=2, n_embd=16, block_size=16, vocab_size=50, route='exit',
                    exit_layers='every', exit_rotation=2)
    dense = flops.dense_forward_flops(cfg, 16)
    steps = [(2,), (1, 3)]                      # d % 2 == step % 2
    fwd = sum(flops.forward_flops(cfg, 16, 'train', exits=e) for e in steps) / 2
    step = sum(flops.train_step_flops(cfg, 16, exits=e)['total'] for e in steps) / 2
    assert len(rows) == 1
    assert rows[0][3].strip() == f"{fwd / dense:.3f}" == "1.079"
    assert rows[0][6].strip() == f"{step / (3 * dense):.3f}"
    assert f"{flops.forward_flops(cfg, 16, 'train') / dense:.3f}" == "1.159"    # every exit
