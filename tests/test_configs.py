"""Every shipped config file parses with train.py's typed keys and builds its model."""
import os
from types import SimpleNamespace

import pytest

import train
from configurator import load_config
from model import GPT

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(
    f
    for f in os.listdir(os.path.join(HERE, 'config'))
    if f.endswith('.py') and not f.startswith('study_')
)


@pytest.mark.parametrize('name', CONFIGS)
def test_config_parses_and_builds(name):
    defaults = train.DEFAULTS
    if name.startswith('bench_'):                  # bench.py's configs take its extra keys too
        import bench
        defaults = {**train.DEFAULTS, **bench.BENCH_DEFAULTS}
    cfg = load_config(defaults, [os.path.join(HERE, 'config', name)])
    c = SimpleNamespace(**cfg)
    mcfg = train.model_config(c, vocab_size=cfg['vocab_size'] or 65)
    if mcfg.n_embd * mcfg.n_layer <= 256 * 6:          # build the CPU-sized ones for real
        model = GPT(mcfg)
        assert model.get_num_params() > 0
    if cfg['trainable'] == 'controller':
        assert (cfg['route'] == 'ffn' and cfg['ffn_gate'] in ('mlp', 'jepa')) or cfg['route'] in (
            'halt',
            'mod',
            'ensemble',
        )
        assert cfg['init_from'].endswith('ckpt.pt')


STUDIES = sorted(f for f in os.listdir(os.path.join(HERE, 'config')) if f.startswith('study_'))


@pytest.mark.parametrize('name', STUDIES)
def test_every_study_arm_parses(name):
    """Each arm's overrides on the study's base config are valid train.py keys and a valid model."""
    import sweep
    study = sweep.load_study(os.path.join(HERE, 'config', name))
    for extra in study['arms'].values():
        cfg = load_config(
            train.DEFAULTS, [os.path.join(HERE, study['base']), *study['overrides'], *extra]
        )
        train.model_config(SimpleNamespace(**cfg), vocab_size=cfg['vocab_size'] or 65)
