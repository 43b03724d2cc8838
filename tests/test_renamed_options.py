"""The routing options' names from before each family's options took its prefix
(configurator.RENAMED) are refused, naming today's: on the command line and in config files (one
line, exit 2), and in stored checkpoints and config.json files. No config or result file under the
repository uses one, and no family carries an alias table. A stored config from before an option was
added still reads as it ran (the family's stored_before)."""
import json
import os
import re
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
import routing  # noqa: E402
import train  # noqa: E402
import train_checks  # noqa: E402
from checkpoint import load_model  # noqa: E402
from configurator import RENAMED, ConfigError, load_config  # noqa: E402
from conftest import run_group  # noqa: E402
from model import FAMILIES, GPT, GPTConfig, read_stored_config  # noqa: E402

TINY = dict(block_size=16, vocab_size=13, n_layer=3, n_head=2, n_embd=16)


def todays_names(old):
    """The option names RENAMED gives for an old one (ffn_budget, mod_capacity, ...)."""
    return re.findall(r"\b(?:ffn|mod)_[a-z_]+", RENAMED[old])


def test_the_table_names_only_todays_options_and_no_old_name_is_one():
    for old in RENAMED:
        assert old not in train.DEFAULTS
        assert todays_names(old) and set(todays_names(old)) <= set(train.DEFAULTS), old
    assert todays_names('budget') == ['ffn_budget', 'mod_capacity']
    assert "mod_router='learned'" in RENAMED['gate']        # the value MoD's learned router had


@pytest.mark.parametrize('where', ['cli', 'file'])
@pytest.mark.parametrize('old', sorted(RENAMED))
def test_an_old_name_is_refused_naming_the_new_one(tmp_path, old, where):
    argv = [f'--{old}=1']
    if where == 'file':
        path = tmp_path / 'old.py'
        path.write_text(f"n_layer = 2\n{old} = 1\n")
        argv = [str(path)]
    with pytest.raises(ConfigError) as e:
        load_config(train.DEFAULTS, ['--route=mod', *argv])
    assert str(e.value) == (
        f"config key '{old}' from {argv[0] if where == 'file' else repr(argv[0])}"
        f" was renamed: use {RENAMED[old]}"
    )


def test_a_script_without_todays_name_calls_an_old_one_unknown():
    with pytest.raises(ConfigError, match=r"^unknown config key 'budget'"):
        load_config({'out_dir': 'out', 'num_samples': 1}, ['--budget=0.5'])


@pytest.mark.parametrize('where', ['cli', 'file'])
def test_train_exits_2_with_one_line_naming_the_new_name(tmp_path, where):
    argv = ['--cheap_rank=4']
    if where == 'file':
        (tmp_path / 'old.py').write_text("route = 'ffn'\ncheap_rank = 4\n")
        argv = [str(tmp_path / 'old.py')]
    r = run_group([sys.executable, 'train.py', f'--out_dir={tmp_path / "out"}', *argv], 120,
                  cwd=REPO, env={**os.environ, 'OMP_NUM_THREADS': '1'})
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("error: config key 'cheap_rank'"), r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and 'use ffn_cheap_rank' in r.stderr
    assert not (tmp_path / 'out').exists()


# --------------------------------------------------------------------------------------------------
# stored checkpoints and config.json files

def test_a_stored_config_with_an_old_name_is_refused_naming_the_new_one(monkeypatch):
    model = GPT(GPTConfig(**TINY, route='mod', mod_capacity=0.25))
    margs = {('budget' if k == 'mod_capacity' else k): v for k, v in asdict(model.config).items()}
    ckpt = dict(model=model.state_dict(), model_args=margs, config={**margs, 'batch_size': 2})
    want = r"holds old option names: budget \(now ffn_budget, or mod_capacity under route=mod\)"
    with pytest.raises(ConfigError, match=want):
        load_model(ckpt, 'cpu')                        # sample.py, eval.py, stage 2
    monkeypatch.setattr(train_checks, 'check_checkpoint_data', lambda *args: None)
    cfg = train.SimpleNamespace(**{**train.DEFAULTS, **asdict(model.config)})
    with pytest.raises(ConfigError, match=want):       # resume
        train.check_against_checkpoint(cfg, {}, ckpt, train.RESUME_KEYS)
    with pytest.raises(ConfigError, match=r"cheap_rank \(now ffn_cheap_rank\), gate \(now "
                                          r"ffn_gate"):
        read_stored_config({'route': 'ffn', 'cheap_rank': 4, 'gate': 'mlp'})


@pytest.mark.parametrize('route,key,before,today', [
    ('ffn', 'ffn_aux_grad', 'leak', 'own'),
    ('ffn', 'ffn_oracle_label', 'sequence', 'token'),
    ('ensemble', 'ens_distill', 'mixture', 'per_layer')])
def test_a_stored_config_from_before_an_option_keeps_its_behaviour(route, key, before, today):
    """An option added with a default unlike what the code did before it: a checkpoint or
    config.json without it reads as it ran; one that has it, and a fresh config, as written."""
    assert getattr(GPTConfig(route=route), key) == today
    assert read_stored_config({'route': route, 'n_layer': 2})[key] == before
    assert getattr(GPTConfig.from_dict({'route': route, 'n_layer': 4}), key) == before
    assert read_stored_config({'route': route, key: today})[key] == today
    assert key not in read_stored_config({'route': 'none', 'n_layer': 2})


def test_a_run_from_before_ffn_aux_grad_resumes_only_as_it_ran(monkeypatch):
    """An ffn checkpoint written before ffn_aux_grad existed trained with 'leak': resuming it under
    today's default 'own' is refused, naming the field; with --ffn_aux_grad=leak it resumes."""
    monkeypatch.setattr(train_checks, 'check_checkpoint_data', lambda *args: None)
    model_cfg = GPTConfig(**TINY, route='ffn', ffn_cheap_rank=4, ffn_layers='all')
    margs = {k: v for k, v in asdict(model_cfg).items() if k != 'ffn_aux_grad'}
    cfg = train.SimpleNamespace(**{**train.DEFAULTS, **asdict(model_cfg)})
    with pytest.raises(train.TrainError,
                       match="'ffn_aux_grad' differs from the checkpoint: checkpoint has 'leak'"):
        train.check_against_checkpoint(cfg, {}, dict(model_args=margs), train.RESUME_KEYS)
    cfg.ffn_aux_grad = 'leak'
    train.check_against_checkpoint(cfg, {}, dict(model_args=margs), train.RESUME_KEYS)


# --------------------------------------------------------------------------------------------------
# the files in the repository

def old_names_in_config_file(text):
    """Old names assigned at the top level, given as --old=..., or used as a dict key."""
    names = '|'.join(RENAMED)
    return re.findall(rf"^({names})\s*=|--({names})=|['\"]({names})['\"]\s*:", text, re.M)


def json_records(path):
    text = path.read_text()
    if path.suffix == '.jsonl':
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    return [json.loads(text)]


def old_names_in_record(x, found, top=True):
    """Old names as keys anywhere, or as --old= in strings (a study's overrides). 'budget' is also
    today's name of a report field (a family's routing summary, bench.py's records): it is an old
    name only among the options, at the top of a config.json."""
    if isinstance(x, dict):
        for k, v in x.items():
            if k in RENAMED and k != 'budget':
                found.add(k)
            old_names_in_record(v, found, top=False)
    elif isinstance(x, list):
        for v in x:
            old_names_in_record(v, found, top=False)
    elif isinstance(x, str):
        found.update(re.findall(rf"--({'|'.join(RENAMED)})=", x))
    return found


def test_no_config_or_result_file_uses_an_old_name():
    configs = sorted((REPO / 'config').glob('*.py'))
    results = sorted(p for p in (REPO / 'results').rglob('*') if p.suffix in ('.json', '.jsonl'))
    assert len(configs) >= 20 and len(results) >= 100
    for path in configs:
        assert not old_names_in_config_file(path.read_text()), path
    for path in results:
        for record in json_records(path):
            found = old_names_in_record(record, set())
            if path.name.endswith('config.json'):
                found |= {'budget'} & set(record)
            assert not found, (path, found)


def test_the_detectors_find_old_names():
    assert old_names_in_config_file("budget = 0.3\n") and old_names_in_config_file(
        "x = ['--gate=mlp']"
    )
    assert old_names_in_config_file("arms = {'cheap_rank': 4}")
    assert not old_names_in_config_file(
        "ffn_budget = 0.3\n# the budget = half\nx = '--ffn_gate=mlp'"
    )
    assert old_names_in_record({'route': 'ffn', 'cheap_rank': 4}, set()) == {'cheap_rank'}
    assert old_names_in_record({'overrides': ['--gate=mlp']}, set()) == {'gate'}
    assert old_names_in_record({'routing': {'budget': 0.5}}, set()) == set()


def test_no_family_carries_an_alias_table():
    for family in [routing.Family, *FAMILIES.values()]:
        assert not hasattr(family, 'aliases'), family
    for path in [REPO / 'routing.py', *REPO.glob('route_*.py')]:
        assert 'aliases' not in path.read_text(), path
