"""The routing options' old names (before every family's options took its prefix) keep working: in
config files and --key=value (resolved by the route the arguments end with, one note per name), and in
stored checkpoints and config.json files (resolved by their own route, silently)."""
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
import configurator  # noqa: E402
import train  # noqa: E402
import train_checks  # noqa: E402
from checkpoint import load_model  # noqa: E402
from configurator import ConfigError, load_config  # noqa: E402
from model import ALIASES, FAMILIES, GPT, GPTConfig, resolve_aliases  # noqa: E402

FFN_RENAMES = {'gate': 'ffn_gate', 'budget': 'ffn_budget', 'controlled_layers': 'ffn_layers',
               'cheap_rank': 'ffn_cheap_rank', 'gate_hidden': 'ffn_gate_hidden', 'gate_grad': 'ffn_gate_grad',
               'infer_rule': 'ffn_infer_rule', 'jepa_latent': 'ffn_jepa_latent', 'jepa_outcome': 'ffn_jepa_outcome',
               'jepa_readout': 'ffn_jepa_readout', 'util_weight': 'ffn_util_weight', 'rank_weight': 'ffn_rank_weight',
               'rank_kind': 'ffn_rank_kind', 'rank_margin': 'ffn_rank_margin', 'rank_pairs': 'ffn_rank_pairs',
               'oracle_policy': 'ffn_oracle_policy', 'jepa_weight': 'ffn_jepa_weight',
               'predictor_weight': 'ffn_predictor_weight', 'mimic_weight': 'ffn_mimic_weight',
               'oracle_layers_per_step': 'ffn_oracle_layers_per_step', 'router_bce_weight': 'mod_bce_weight'}
MOD_RENAMES = {**FFN_RENAMES, 'budget': 'mod_capacity', 'controlled_layers': 'mod_layers', 'gate': 'mod_router',
               'infer_rule': 'mod_infer_rule', 'predictor_weight': 'mod_predictor_weight',
               'gate_hidden': 'mod_predictor_hidden'}
# a value each old key accepts, as a config file writes it and as the command line does
VALUES = {'gate': ("'random'", 'random'), 'budget': ('0.25', 0.25), 'controlled_layers': ("'0,2'", '0,2'),
          'cheap_rank': ('8', 8), 'gate_hidden': ('16', 16), 'gate_grad': ("'scale'", 'scale'),
          'infer_rule': ("'predictor'", 'predictor'), 'jepa_latent': ('12', 12), 'jepa_outcome': ("'hidden'", 'hidden'),
          'jepa_readout': ("'linear'", 'linear'), 'util_weight': ('0.5', 0.5), 'rank_weight': ('0.5', 0.5),
          'rank_kind': ("'margin'", 'margin'), 'rank_margin': ('0.2', 0.2), 'rank_pairs': ('64', 64),
          'oracle_policy': ("'on'", 'on'), 'jepa_weight': ('2.0', 2.0), 'predictor_weight': ('0.5', 0.5),
          'mimic_weight': ('0.5', 0.5), 'oracle_layers_per_step': ('2', 2), 'router_bce_weight': ('0.5', 0.5)}


@pytest.fixture(autouse=True)
def fresh_notes():
    configurator._noted.clear()        # one note per old name per process: start each test afresh
    yield
    configurator._noted.clear()


def notes(err):
    return [line for line in err.splitlines() if line.startswith('note: config key')]


def test_the_tables_here_are_the_families_tables():
    """Every old name the families accept is covered below, and none is a field today."""
    assert ALIASES.names() == set(FFN_RENAMES) == set(VALUES)
    fields = set(train.DEFAULTS)
    assert not ALIASES.names() & fields
    for route in FAMILIES:
        for old in ALIASES.names():
            assert ALIASES.resolve(old, None, route)[0] in fields


@pytest.mark.parametrize('route,renames', [('ffn', FFN_RENAMES), ('mod', MOD_RENAMES), ('halt', FFN_RENAMES),
                                           ('none', FFN_RENAMES)])
@pytest.mark.parametrize('where', ['cli', 'file'])
def test_every_old_key_resolves_per_route_with_one_note(tmp_path, capsys, route, renames, where):
    for old, new in renames.items():
        configurator._noted.clear()
        text, value = VALUES[old]
        if where == 'cli':
            argv = [f'--{old}={value}', f'--route={route}']          # the route may come after the old key
        else:
            p = tmp_path / f'{old}.py'
            p.write_text(f"{old} = {text}\nroute = '{route}'\n")
            argv = [str(p)]
        cfg = load_config(train.DEFAULTS, argv + argv, ALIASES)       # twice: still one note
        want = 'learned' if (route, old, value) == ('mod', 'gate', 'mlp') else value
        assert cfg[new] == want and type(cfg[new]) is type(train.DEFAULTS[new]), (old, new)
        assert old not in cfg
        err = notes(capsys.readouterr().err)
        assert err == [f"note: config key '{old}' is now '{new}' for route={route!r} (the old name still works)"]


@pytest.mark.parametrize('argv,key,value', [
    (['--route=mod', '--gate=mlp'], 'mod_router', 'learned'),      # MoD's learned router was gate='mlp'
    (['--gate=mlp', '--route=mod'], 'mod_router', 'learned'),
    (['--route=mod', '--gate=random'], 'mod_router', 'random'),
    (['--route=ffn', '--gate=mlp'], 'ffn_gate', 'mlp'),
    (['--budget=0.125', '--route=mod'], 'mod_capacity', 0.125),
    (['--route=mod', '--budget=0.125', '--route=ffn'], 'ffn_budget', 0.125),   # the final route decides
    (['--route=mod', '--controlled_layers=0,2'], 'mod_layers', '0,2'),         # as written, not a tuple
    (['--controlled_layers=1'], 'ffn_layers', '1'),
])
def test_route_and_value_resolution(argv, key, value):
    cfg = load_config(train.DEFAULTS, argv, ALIASES)
    assert cfg[key] == value and type(cfg[key]) is type(value)


@pytest.mark.parametrize('argv,value', [
    (['--budget=0.3', '--ffn_budget=0.4'], 0.4),
    (['--ffn_budget=0.4', '--budget=0.3'], 0.3),
    (['--route=mod', '--mod_capacity=0.2', '--budget=0.3'], 0.3),
])
def test_old_and_new_spelling_apply_left_to_right(argv, value):
    cfg = load_config(train.DEFAULTS, argv, ALIASES)
    assert cfg['mod_capacity' if '--route=mod' in argv else 'ffn_budget'] == value


def test_file_then_command_line_precedence(tmp_path):
    p = tmp_path / 'base.py'
    p.write_text("route = 'ffn'\nffn_budget = 0.4\nbudget = 0.3\n")          # later line wins
    assert load_config(train.DEFAULTS, [str(p)], ALIASES)['ffn_budget'] == 0.3
    assert load_config(train.DEFAULTS, [str(p), '--ffn_budget=0.6'], ALIASES)['ffn_budget'] == 0.6
    assert load_config(train.DEFAULTS, ['--budget=0.6', str(p)], ALIASES)['ffn_budget'] == 0.3


def test_a_wrong_type_under_an_old_name_names_the_new_key():
    with pytest.raises(ConfigError, match="'ffn_cheap_rank'.*must be int"):
        load_config(train.DEFAULTS, ['--cheap_rank=big'], ALIASES)


@pytest.mark.parametrize('argv,hint', [
    (['--ffn_budgte=0.3'], 'ffn_budget'),
    (['--budgett=0.3'], 'ffn_budget'),                    # close to an old name: today's name is suggested
    (['--route=mod', '--budgett=0.3'], 'mod_capacity'),
    (['--cheap_rnk=4'], 'ffn_cheap_rank'),
    (['--mod_capacty=0.2'], 'mod_capacity'),
])
def test_unknown_keys_suggest_todays_names(argv, hint):
    with pytest.raises(ConfigError, match=rf"unknown config key .*did you mean '{hint}'"):
        load_config(train.DEFAULTS, argv, ALIASES)


def test_without_aliases_old_names_are_unknown():
    with pytest.raises(ConfigError, match="unknown config key 'budget'"):
        load_config(train.DEFAULTS, ['--budget=0.3'])


def test_another_familys_old_option_is_refused_by_its_new_name(capsys):
    """--route=halt --gate=jepa: the old name reads as ffn_gate, an option route=halt does not read."""
    cfg = load_config(train.DEFAULTS, ['--route=halt', '--gate=jepa'], ALIASES)
    assert cfg['ffn_gate'] == 'jepa'
    with pytest.raises(train.TrainError, match="--ffn_gate is an option of route=ffn"):
        train.check_family_options(train.SimpleNamespace(**cfg), ['--route=halt', '--gate=jepa'],
                                   train.DEFAULTS)


# ----------------------------------------------------------------------------------------------------
# stored files: checkpoints and config.json written with the old names

def old_names(d):
    """A model_args / config.json dict as written before the rename: under route='mod' the names MoD
    shared with the ffn family held MoD's values (and gate='mlp' was its learned router)."""
    mod = d.get('route') == 'mod'
    shared = {old for old in MOD_RENAMES if MOD_RENAMES[old] != FFN_RENAMES[old]}
    out = {}
    for k, v in d.items():
        if k.startswith('ffn_') and mod and {o for o, n in FFN_RENAMES.items() if n == k} & shared:
            continue
        if k.startswith('mod_') and not mod and k != 'mod_bce_weight':
            continue
        old = next((o for o, n in (MOD_RENAMES if mod else FFN_RENAMES).items() if n == k), k)
        out[old] = 'mlp' if (k == 'mod_router' and v == 'learned') else v
    return out


TINY = dict(block_size=16, vocab_size=13, n_layer=3, n_head=2, n_embd=16)


@pytest.mark.parametrize('kw', [
    dict(route='ffn', ffn_gate='jepa', ffn_budget=0.25, ffn_layers='0,2', ffn_cheap_rank=4, ffn_gate_hidden=8,
         ffn_jepa_latent=6, ffn_infer_rule='predictor'),
    dict(route='mod', mod_capacity=0.25, mod_layers='all', mod_infer_rule='predictor', mod_predictor_hidden=8),
    dict(route='mod', mod_router='random', mod_capacity=0.5),
])
def test_an_old_checkpoint_loads(kw):
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY, **kw)).eval()
    margs = old_names(asdict(model.config))
    assert not set(margs) & {'ffn_budget', 'mod_capacity', 'ffn_gate', 'mod_router'}
    ckpt = dict(model=model.state_dict(), model_args=margs, config={**margs, 'batch_size': 2})
    loaded = load_model(ckpt, 'cpu').eval()
    assert loaded.config == model.config
    idx = torch.randint(0, 13, (2, 16), generator=torch.Generator().manual_seed(1))
    outs = []
    for m in (loaded, model):
        torch.manual_seed(2)            # mod_router='random' draws its decisions
        outs.append(m(idx)[0])
    assert torch.equal(*outs)
    # the resume and stage-2 checks read the checkpoint's fields under today's names
    for k in train.RESUME_KEYS:
        assert resolve_aliases(margs).get(k, getattr(GPTConfig(), k)) == getattr(model.config, k), k


def test_an_old_checkpoint_passes_the_resume_check_and_a_changed_field_fails(monkeypatch):
    monkeypatch.setattr(train_checks, 'check_checkpoint_data', lambda cfg, meta, ckpt: None)
    model_cfg = GPTConfig(**TINY, route='ffn', ffn_cheap_rank=4, ffn_layers='all')
    ckpt = dict(model_args=old_names(asdict(model_cfg)))
    cfg = train.SimpleNamespace(**{**train.DEFAULTS, **asdict(model_cfg), 'ffn_layers': 'auto'})  # 'auto' = all
    train.check_against_checkpoint(cfg, {}, ckpt, train.RESUME_KEYS)
    cfg.ffn_cheap_rank = 8
    with pytest.raises(train.TrainError, match="'ffn_cheap_rank' differs from the checkpoint: checkpoint has 4"):
        train.check_against_checkpoint(cfg, {}, ckpt, train.RESUME_KEYS)


def test_an_old_config_json_reads_under_todays_names():
    stored = {'route': 'mod', 'gate': 'mlp', 'budget': 0.125, 'controlled_layers': 'auto', 'cheap_rank': 4,
              'router_bce_weight': 0.5, 'n_layer': 4, 'max_iters': 600}
    d = resolve_aliases(stored)
    assert d == {'route': 'mod', 'mod_router': 'learned', 'mod_capacity': 0.125, 'mod_layers': 'auto',
                 'ffn_cheap_rank': 4, 'mod_bce_weight': 0.5, 'n_layer': 4, 'max_iters': 600}
    assert list(d) == ['route', 'mod_router', 'mod_capacity', 'mod_layers', 'ffn_cheap_rank', 'mod_bce_weight',
                       'n_layer', 'max_iters']
    c = GPTConfig.from_dict(stored)
    assert (c.mod_router, c.mod_capacity, c.ffn_cheap_rank, c.mod_bce_weight) == ('learned', 0.125, 4, 0.5)
    assert resolve_aliases({'route': 'ffn', 'budget': 0.3, 'ffn_budget': 0.4}) == \
        {'route': 'ffn', 'ffn_budget': 0.4, 'ffn_aux_grad': 'leak', 'ffn_oracle_label': 'sequence',
         'ffn_jepa_readout': 'distance', 'ffn_jepa_action_std': 0.02}


@pytest.mark.parametrize('route,key,before,today', [('ffn', 'ffn_aux_grad', 'leak', 'own'),
                                                    ('ffn', 'ffn_oracle_label', 'sequence', 'token'),
                                                    ('ensemble', 'ens_distill', 'mixture', 'per_layer')])
def test_a_stored_config_from_before_an_option_keeps_its_behaviour(route, key, before, today):
    """An option added with a default unlike what the code did before it: a checkpoint or config.json
    without it reads as it ran; one that has it, and a fresh config, as written."""
    assert getattr(GPTConfig(route=route), key) == today
    assert resolve_aliases({'route': route, 'n_layer': 2})[key] == before
    assert getattr(GPTConfig.from_dict({'route': route, 'n_layer': 4}), key) == before
    assert resolve_aliases({'route': route, key: today})[key] == today
    assert key not in resolve_aliases({'route': 'none', 'n_layer': 2})


# ----------------------------------------------------------------------------------------------------
# the family budget API

def test_family_budget_api():
    ffn, mod = GPTConfig(route='ffn', ffn_budget=0.3), GPTConfig(route='mod', mod_capacity=0.2)
    assert FAMILIES['ffn'].budget(ffn) == 0.3 and FAMILIES['mod'].budget(mod) == 0.2
    assert FAMILIES['ffn'].with_budget(ffn, 0.7).ffn_budget == 0.7
    assert FAMILIES['mod'].with_budget(mod, 0.7).mod_capacity == 0.7 and mod.mod_capacity == 0.2
    for route in ('none', 'halt', 'exit', 'ensemble'):
        assert FAMILIES[route].budget(GPTConfig(route=route)) is None
        with pytest.raises(ValueError, match='has no budget'):
            FAMILIES[route].with_budget(GPTConfig(route=route), 0.5)


def test_a_run_from_before_ffn_aux_grad_resumes_only_as_it_ran(monkeypatch):
    """An ffn checkpoint written before ffn_aux_grad existed trained with 'leak': resuming it under
    today's default 'own' is refused, naming the field; with --ffn_aux_grad=leak it resumes."""
    monkeypatch.setattr(train_checks, 'check_checkpoint_data', lambda cfg, meta, ckpt: None)
    model_cfg = GPTConfig(**TINY, route='ffn', ffn_cheap_rank=4, ffn_layers='all')
    margs = {k: v for k, v in asdict(model_cfg).items() if k != 'ffn_aux_grad'}
    cfg = train.SimpleNamespace(**{**train.DEFAULTS, **asdict(model_cfg)})
    with pytest.raises(train.TrainError, match="'ffn_aux_grad' differs from the checkpoint: checkpoint has 'leak'"):
        train.check_against_checkpoint(cfg, {}, dict(model_args=margs), train.RESUME_KEYS)
    cfg.ffn_aux_grad = 'leak'
    train.check_against_checkpoint(cfg, {}, dict(model_args=margs), train.RESUME_KEYS)
