"""Bad values on every option of every script: for each config key of train.py and each option of
eval.py, sample.py, bench.py, sweep.py and data/prepare.py, a wrong-typed, empty, negative, huge or
out-of-range value is refused by the script's one validation step (a UserError of one line naming
the option, exit 2), never by a traceback later, and nothing is written.

Each script's validation runs in-process (train.read_config + check_out_dir, eval.parse_args,
sample.check_config, bench.parse_args, sweep.parse_args, prepare.main with its builders stubbed), on
every key and kind (about 700 cases, a few seconds); one subprocess per script checks the real exit
code and stderr. A value a key legitimately takes (a negative bias, free text as a folder name) may
be accepted; the tables below name those, and any other acceptance fails."""
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
import bench  # noqa: E402
import eval as ev  # noqa: E402
import sample  # noqa: E402
import sweep  # noqa: E402
import train  # noqa: E402
from configurator import UserError  # noqa: E402
from data import prepare as P  # noqa: E402
from model import FAMILIES  # noqa: E402

pytestmark = pytest.mark.usefixtures('one_thread')


def bad_values(default):
    """{kind: text of a --key=value} for a key whose default is `default`."""
    if isinstance(default, bool):
        return {'wrong': 'maybe', 'empty': '', 'int': '2'}
    if isinstance(default, int):
        return {'wrong': 'abc', 'float': '1.5', 'empty': '', 'negative': '-1', 'huge': str(10**30)}
    if isinstance(default, float):
        return {'wrong': 'abc', 'empty': '', 'negative': '-1.0', 'huge': '1e999'}
    return {'empty': '', 'out_of_range': 'bogus_value'}


# values that are legitimate for these keys (the validation step rightly accepts them)
NEGATIVE_OK = {'halt_router_bias'}
EMPTY_OK = {'data_dir', 'lm_thresholds', 'budgets', 'out', 'prompts_file',
            'prefill_shapes',
            'draft', 'speculate',       # '': the family's default draft; bench: no speculation
            'log', 'wandb_run_name',    # '': no logger besides metrics.jsonl; W&B names the run
            'compile_cache'}            # '': bench keeps no compiled code
FREE_TEXT = {'out_dir', 'data_dir', 'dataset', 'start', 'out', 'name',   # any text is a valid name
             'wandb_project', 'wandb_run_name'}


def must_refuse(key, kind):
    if kind == 'negative':
        return key not in NEGATIVE_OK
    if kind == 'empty':
        return key not in EMPTY_OK
    if kind == 'out_of_range':
        return key not in FREE_TEXT
    return True


def check(validate, key, kind, text, folder):
    """Run one validation; return None if it behaved, else a line saying what went wrong."""
    before = sorted(os.listdir(folder))
    try:
        validate(f'--{key}={text}')
        outcome = 'accepted'
    except UserError as e:
        msg = str(e)
        if '\n' in msg:
            return f"{key}={text!r} ({kind}): message has several lines: {msg!r}"
        if key not in msg:
            return f"{key}={text!r} ({kind}): message does not name the option: {msg!r}"
        outcome = 'refused'
    except SystemExit as e:      # argparse (prepare.py) exits 2 itself
        outcome = 'refused' if e.code == 2 else f'exit {e.code}'
    except Exception as e:
        return f"{key}={text!r} ({kind}): {type(e).__name__}: {e}"
    if sorted(os.listdir(folder)) != before:
        return f"{key}={text!r} ({kind}): wrote files"
    if outcome != 'refused' and must_refuse(key, kind):
        return f"{key}={text!r} ({kind}): {outcome}"
    return None


def sweep_cases(validators, defaults, folder):
    failures = []
    for key, default in defaults.items():
        for kind, text in bad_values(default).items():
            failure = check(validators, key, kind, text, folder)
            if failure:
                failures.append(failure)
    return failures


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


def own_route(key):
    """The route whose family reads `key`, so that its value is checked as that family's."""
    return next((route for route, family in FAMILIES.items() if key in family.options), None)


def train_validation(workdir):
    def validate(arg):
        route = own_route(arg[2:].partition('=')[0])
        cfg, _ = train.read_config([f'--out_dir={workdir / "out"}',
                                    f'--data_dir={workdir / "data"}',
                                    *[f'--route={route}'] * (route is not None), arg])
        train.check_out_dir(cfg)
    return validate


def test_train_config_keys(workdir):
    failures = sweep_cases(train_validation(workdir), dict(train.DEFAULTS), workdir)
    assert not failures, '\n'.join(failures)


@pytest.fixture
def ckpt(tmp_path_factory):
    folder = tmp_path_factory.mktemp('ck')
    (folder / 'out').mkdir()
    (folder / 'out' / 'ckpt.pt').write_bytes(b'not read by the validation')
    return folder


def test_eval_options(workdir, ckpt):
    defaults = dict(eval_iters=0, calib_iters=0, device='auto', dtype='float32', data_dir='',
                    batch_size=0, out='', ckpt='')
    failures = []
    for flags in ([], ['--routing_map']):
        def validate(arg):
            ev.parse_args([f'--ckpt={ckpt / "out" / "ckpt.pt"}', *flags, arg])
        keys = {k: v for k, v in defaults.items() if flags or k != 'out'}
        failures += sweep_cases(validate, keys, workdir)
    assert not failures, '\n'.join(failures)


def test_sample_options(workdir, ckpt):
    failures = sweep_cases(lambda arg: sample.check_config([f'--out_dir={ckpt / "out"}', arg]),
                           sample.DEFAULTS, workdir)
    assert not failures, '\n'.join(failures)


def test_bench_options(workdir):
    def validate(arg):
        route = own_route(arg[2:].partition('=')[0])
        bench.parse_args(['--device=cpu', *[f'--route={route}'] * (route is not None), arg])
    ignored = ('out_dir', 'dataset', 'data_dir')      # random tokens and no run: bench reads none
    keys = {k: v for k, v in {**train.DEFAULTS, **bench.BENCH_DEFAULTS}.items() if k not in ignored}
    failures = sweep_cases(validate, keys, workdir)
    assert not failures, '\n'.join(failures)


def test_sweep_options(workdir):
    study = workdir / 'study.py'
    study.write_text(f"base = 'config/quickstart.py'\narms = {{'a': []}}\nseeds = [0]\n"
                     f"out_root = {str(workdir / 'study_out')!r}\n")
    failures = sweep_cases(lambda arg: sweep.parse_args([str(study), arg]), {'jobs': 1}, workdir)
    for flag in sweep.FLAGS:
        failures += [f for f in [check(lambda arg: sweep.parse_args([str(study), arg]),
                                       flag[2:], 'value', 'yes', workdir)] if f]
    assert not failures, '\n'.join(failures)


@pytest.mark.parametrize('dataset', ['synthetic', 'text', 'fineweb_edu'])
def test_prepare_options(workdir, monkeypatch, capsys, dataset):
    (workdir / 'in.txt').write_text('some text ' * 50)
    monkeypatch.setitem(P.BUILDERS, dataset, lambda a: (_ for _ in ()).throw(AcceptedError()))

    def validate(arg):
        needs_input = dataset != 'synthetic' and not arg.startswith('--input=')
        extra = [f'--input={workdir / "in.txt"}'] * needs_input
        capsys.readouterr()
        try:
            code = P.main([dataset, f'--out_dir={workdir / "out"}', *extra, arg])
        except SystemExit as e:            # argparse's own refusal of a wrong type
            code = e.code
        except AcceptedError:              # the builder was reached: accepted
            return
        err = capsys.readouterr().err
        assert code == 2 and err.count('\n') == 1 and 'Traceback' not in err, (code, err)
        raise UserError(err.strip())
    defaults = {**P.COMMON_DEFAULTS, **P.DEFAULTS[dataset]}
    numeric = {'seed': 1, 'num_tokens': 1, 'max_docs': 1, 'val_fraction': 0.1}
    typed = {k: numeric.get(k, '') for k in defaults}
    failures = sweep_cases(validate, {**typed, 'out_dir': ''}, workdir)
    assert not failures, '\n'.join(failures)


class AcceptedError(Exception):
    """The builder was reached: every option passed validation."""


