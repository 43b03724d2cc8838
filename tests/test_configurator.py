"""Tests for configurator.load_config: config files, typed --key=value overrides, and the errors
that name the key (and the closest valid key) before any work is done."""
import re
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from configurator import ConfigError, load_config, parse_value  # noqa: E402

DEFAULTS = dict(
    out_dir='out/quickstart',
    dataset='synthetic',
    n_layer=4,
    batch_size=16,
    learning_rate=2e-3,
    dropout=0.0,
    decay_lr=True,
    compile=False,
    ffn_layers='all',
    lm_thresholds='',
    device='auto',
    init_from='scratch',
)


def write(tmp_path, text, name='cfg.py'):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


# --------------------------------------------------------------------------------------------------
# values

def test_no_args_returns_a_copy_of_the_defaults():
    d = dict(DEFAULTS)
    out = load_config(d, [])
    assert out == DEFAULTS and out is not d
    out['n_layer'] = 99
    assert d['n_layer'] == 4                       # the defaults are not mutated


@pytest.mark.parametrize("arg,key,value", [
    ("--n_layer=6", "n_layer", 6),
    ("--batch_size=0", "batch_size", 0),
    ("--learning_rate=3e-4", "learning_rate", 3e-4),
    ("--learning_rate=1", "learning_rate", 1.0),         # an int is accepted for a float key ...
    ("--dropout=0.25", "dropout", 0.25),
    ("--decay_lr=False", "decay_lr", False),
    ("--compile=True", "compile", True),
    ("--dataset=shakespeare_char", "dataset", "shakespeare_char"),   # a bare word is a string
    ("--init_from=gpt2-medium", "init_from", "gpt2-medium"),
    ("--out_dir=out/run 1", "out_dir", "out/run 1"),
    ("--device=cuda:1", "device", "cuda:1"),
    # a quoted string loses its quotes
    ("--dataset='quoted'", "dataset", "quoted"),
    ('--dataset="dq"', "dataset", "dq"),
    ("--lm_thresholds=", "lm_thresholds", ""),
])
def test_typed_overrides(arg, key, value):
    out = load_config(DEFAULTS, [arg])
    assert out[key] == value and type(out[key]) is type(value)
    assert {k: v for k, v in out.items() if k != key} == {
        k: v for k, v in DEFAULTS.items() if k != key
    }


def test_int_for_float_key_becomes_float():
    assert type(load_config(DEFAULTS, ["--learning_rate=1"])["learning_rate"]) is float


def test_later_arguments_override_earlier_ones(tmp_path):
    cfg = write(tmp_path, "n_layer = 8\nbatch_size = 32\n")
    out = load_config(DEFAULTS, ["--n_layer=2", cfg, "--batch_size=4"])
    # the file overrode --n_layer=2
    assert out["n_layer"] == 8 and out["batch_size"] == 4
    out = load_config(DEFAULTS, [cfg, "--n_layer=2", "--n_layer=3"])
    assert out["n_layer"] == 3
    cfg2 = write(tmp_path, "n_layer = 5\n", "b.py")
    assert load_config(DEFAULTS, [cfg, cfg2])["n_layer"] == 5


@settings(max_examples=50, deadline=None)
@given(values=st.lists(st.integers(-10**6, 10**6), min_size=1, max_size=6))
def test_last_of_many_overrides_wins(values):
    assert load_config(DEFAULTS, [f"--n_layer={v}" for v in values])["n_layer"] == values[-1]


@settings(max_examples=50, deadline=None)
@given(x=st.floats(allow_nan=False, allow_infinity=False))
def test_float_round_trips(x):
    assert load_config(DEFAULTS, [f"--learning_rate={x!r}"])["learning_rate"] == x


def test_config_file_assigns_keys(tmp_path):
    cfg = write(tmp_path, "import math\n"
                          "_private = 3\n"
                          "def helper():\n    return 1\n"
                          "n_layer = 2 * 3\n"
                          "learning_rate = 6e-4\n"
                          "dataset = 'shakespeare_char'\n"
                          "decay_lr = False\n"
                          "dropout = 0\n")
    out = load_config(DEFAULTS, [cfg])
    assert (
        out["n_layer"] == 6
        and out["learning_rate"] == 6e-4
        and out["dataset"] == "shakespeare_char"
    )
    assert out["decay_lr"] is False and out["dropout"] == 0.0 and type(out["dropout"]) is float
    assert "math" not in out and "helper" not in out and "_private" not in out


def test_repo_train_config_files_load():
    """Every config/*.py meant for train.py loads with train's defaults (sweep configs, which assign
    `arms`, are for sweep.py, and bench_*.py configs are for bench.py: tests/test_configs.py loads
    those with bench's keys)."""
    import ast
    import train
    checked = 0
    for cfg in sorted((REPO / "config").glob("*.py")):
        names = {t.id for node in ast.parse(cfg.read_text()).body if isinstance(node, ast.Assign)
                 for t in node.targets if isinstance(t, ast.Name)}
        if "arms" in names or cfg.name.startswith("bench_"):
            continue
        out = load_config(train.DEFAULTS, [str(cfg)])
        assert set(out) == set(train.DEFAULTS), cfg
        checked += 1
    assert checked >= 2


# --------------------------------------------------------------------------------------------------
# errors

@pytest.mark.parametrize("arg,bad,close", [
    ("--n_layers=2", "n_layers", "n_layer"),
    ("--batchsize=2", "batchsize", "batch_size"),
    ("--learning_rat=1e-3", "learning_rat", "learning_rate"),
])
def test_unknown_key_names_it_and_the_closest(arg, bad, close):
    with pytest.raises(ConfigError) as e:
        load_config(DEFAULTS, [arg])
    assert f"'{bad}'" in str(e.value) and f"'{close}'" in str(e.value)


def test_unknown_key_without_close_match():
    with pytest.raises(ConfigError, match="zzzzqqq"):
        load_config(DEFAULTS, ["--zzzzqqq=1"])


@pytest.mark.parametrize("arg,key", [
    ("--batch_size=abc", "batch_size"),
    ("--batch_size=2.5", "batch_size"),
    ("--batch_size=True", "batch_size"),           # a bool is not an int here
    ("--decay_lr=1", "decay_lr"),
    ("--decay_lr=yes", "decay_lr"),
    ("--learning_rate=fast", "learning_rate"),
    ("--learning_rate=True", "learning_rate"),
    ("--n_layer=[2]", "n_layer"),
])
def test_wrong_type_names_the_key(arg, key):
    with pytest.raises(ConfigError) as e:
        load_config(DEFAULTS, [arg])
    assert f"'{key}'" in str(e.value)


def test_config_file_unknown_key(tmp_path):
    cfg = write(tmp_path, "n_layer = 2\nn_heads = 4\n")
    with pytest.raises(ConfigError) as e:
        load_config(DEFAULTS, [cfg])
    assert "'n_heads'" in str(e.value)


def test_config_file_wrong_type(tmp_path):
    cfg = write(tmp_path, "batch_size = '32'\n")
    with pytest.raises(ConfigError) as e:
        load_config(DEFAULTS, [cfg])
    assert "'batch_size'" in str(e.value) and "cfg.py" in str(e.value)


def test_missing_config_file(tmp_path):
    missing = str(tmp_path / "nope.py")
    with pytest.raises(ConfigError, match="not found"):
        load_config(DEFAULTS, [missing])


@pytest.mark.parametrize("arg", ["--n_layer", "--n_layer 2", "n_layer=2", "-n_layer=2",
                                 "config/thing.txt"])
def test_malformed_arguments(arg):
    with pytest.raises(ConfigError):
        load_config(DEFAULTS, [arg])


def test_arg_without_equals_mentions_key_value():
    with pytest.raises(ConfigError, match="--key=value"):
        load_config(DEFAULTS, ["--n_layer"])


def test_parse_value():
    assert parse_value("3") == 3 and parse_value("3.5") == 3.5 and parse_value("False") is False
    assert (
        parse_value("word") == "word" and parse_value("'q'") == "q" and parse_value("a b") == "a b"
    )


# --------------------------------------------------------------------------------------------------
# regressions: None for a typed key, and str keys given number-like or tuple-like text

@pytest.mark.parametrize("arg", ["--batch_size=None", "--learning_rate=None", "--decay_lr=None"])
def test_none_for_a_typed_key_is_an_error(arg):
    try:
        load_config(DEFAULTS, [arg])
    except ConfigError as e:
        assert arg[2:].split("=")[0] in str(e)
    else:
        raise AssertionError(f"{arg} was accepted")


@pytest.mark.parametrize("arg,key,value", [
    ("--ffn_layers=0,2,5", "ffn_layers", "0,2,5"),
    ("--ffn_layers=1", "ffn_layers", "1"),
    ("--lm_thresholds=2.5,2.0", "lm_thresholds", "2.5,2.0"),
    ("--out_dir=2024", "out_dir", "2024"),
])
def test_str_key_takes_numeric_looking_text(arg, key, value):
    try:
        out = load_config(DEFAULTS, [arg])
    except ConfigError as e:
        raise AssertionError(str(e)) from None
    assert out[key] == value


@pytest.mark.parametrize("body,needle", [("n_layer = 2\nbatch_size = (\n", "line 2"),
                                         ("n_layer = 2\nx = 1 / 0\n", "ZeroDivisionError"),
                                         ("n_layer = undefined_name\n", "NameError")])
def test_config_file_with_an_error_is_one_line(tmp_path, body, needle):
    """A config file that does not parse or raises while it runs: a ConfigError naming the file and
    the line, not a traceback."""
    path = tmp_path / "bad.py"
    path.write_text(body)
    with pytest.raises(ConfigError) as e:
        load_config({"n_layer": 4, "batch_size": 1}, [str(path)])
    msg = str(e.value)
    assert str(path) in msg and needle in msg and "\n" not in msg


def test_smoke_env_caps_the_counts_and_says_so(monkeypatch, capsys):
    """NANODEPTH_SMOKE=1 (tests/test_docs.py runs the docs under it): counts above a cap come down,
    a value below it (0: 'from the checkpoint') stays, keys a script lacks are not added; unset,
    nothing changes."""
    from configurator import SMOKE_CAPS, load_config
    defaults = dict(max_iters=600, eval_iters=0, batch_size=16, learning_rate=1e-3,
                    prefill_shapes='8x512')
    assert load_config(defaults, ['--max_iters=5000']) == dict(defaults, max_iters=5000)
    monkeypatch.setenv('NANODEPTH_SMOKE', '1')
    cfg = load_config(defaults, ['--max_iters=5000'])
    assert cfg == dict(defaults, max_iters=SMOKE_CAPS['max_iters'],
                       batch_size=SMOKE_CAPS['batch_size'], prefill_shapes='1x32')
    assert 'NANODEPTH_SMOKE is set' in capsys.readouterr().err
    monkeypatch.setenv('NANODEPTH_SMOKE', '0')
    assert load_config(defaults, [])['max_iters'] == 600


def test_smoke_env_caps_a_limit_whose_zero_means_all(monkeypatch):
    """arith.py's and eval_harness.py's limit (0: every problem) is capped under smoke, 0 too; a
    smaller limit stays."""
    from configurator import SMOKE_CAPS, load_config
    monkeypatch.setenv('NANODEPTH_SMOKE', '1')
    for limit, want in ((0, SMOKE_CAPS['limit']), (1000, SMOKE_CAPS['limit']), (5, 5)):
        assert load_config(dict(limit=0, split='test'), [f"--limit={limit}"])["limit"] == want
    assert SMOKE_CAPS['limit'] == 32


def test_smoke_env_keeps_the_capped_width_divisible_into_heads(monkeypatch):
    """A width capped below a config's (GPT-2's 768 with 12 heads) still splits into heads: the
    most heads <= n_head that divide the capped width; a width that already divides is untouched."""
    from configurator import SMOKE_CAPS, load_config
    monkeypatch.setenv('NANODEPTH_SMOKE', '1')
    cfg = load_config(dict(n_embd=64, n_head=4), ['--n_embd=768', '--n_head=12'])
    assert cfg['n_embd'] == SMOKE_CAPS['n_embd'] == 128 and cfg['n_head'] == 8
    assert load_config(dict(n_embd=64, n_head=4), ['--n_embd=512', '--n_head=8'])['n_head'] == 8
    assert load_config(dict(n_embd=64, n_head=6), []) == dict(n_embd=64, n_head=6)


# --------------------------------------------------------------------------------------------------
# --help: descriptions read from the comments where the defaults are declared

DECLARED = '''
# I/O
out_dir = 'out/x'          # the run's folder
steps = 10                 # optimizer steps: a long comment that
                           # goes on here
# data
batch_size = 16
OTHER = dict(
    ckpt='',               # the checkpoint file
    n=0,
)


class Options:
    budget: float = 0.5    # fraction on the full path
    # a block above the field
    # in two lines
    readout: str = 'u'
    plain: int = 1
'''


def test_option_descriptions_read_the_comments_where_defaults_live(tmp_path):
    """The trailing comment with its continuation lines (not the next section's title); a class
    field's comment block above; a dict(...)'s keywords; '' for an option with none (a section
    title above a global is not its description)."""
    from configurator import option_descriptions
    path = write(tmp_path, DECLARED, 'declared.py')
    got = option_descriptions(path)
    assert got['out_dir'] == "the run's folder"
    assert got['steps'] == 'optimizer steps: a long comment that goes on here'
    assert got['batch_size'] == ''
    assert option_descriptions(path, 'OTHER') == {'ckpt': 'the checkpoint file', 'n': ''}
    assert option_descriptions(path, 'Options') == {
        'budget': 'fraction on the full path', 'readout': 'a block above the field in two lines',
        'plain': ''}


def test_help_text_lists_defaults_descriptions_groups_and_flags_undocumented_ones(tmp_path):
    """Each option as --key=default (a str as typed, '' and odd strings quoted) with its
    description, under its group's title; an option without one reads UNDOCUMENTED, which the
    scripts' tests refuse."""
    from configurator import asks_help, help_text, source_group
    path = write(tmp_path, DECLARED, 'declared.py')
    text = help_text('Do a thing.\n\nMore detail.\n\n    python x.py --steps=3\n', 'python x.py',
                     [source_group('x options', dict(out_dir='out/x', steps=10, batch_size=16),
                                   path),
                      source_group('other', dict(ckpt='', start='\n'), (path, 'OTHER'))],
                     flags={'--json': 'one JSON object'})
    lines = text.splitlines()
    assert lines[0] == 'Do a thing.' and 'More detail.' not in text
    assert '  python x.py --steps=3' in lines
    assert re.search(r"^  --out_dir=out/x +the run's folder$", text, re.M)
    assert re.search(r"^  --steps=10 +optimizer steps: a long comment that goes on here$", text,
                     re.M)
    assert re.search(r"^  --batch_size=16 +UNDOCUMENTED$", text, re.M)
    assert re.search(r"^  --ckpt='' +the checkpoint file$", text, re.M)
    assert re.search(r"^  --start='\\n' +UNDOCUMENTED$", text, re.M)
    assert re.search(r"^  --json +one JSON object$", text, re.M)
    assert lines.index('x options:') < lines.index('other:')
    assert all(len(line) <= 100 for line in lines)
    assert asks_help(['--a=1', '-h']) and asks_help(['--help']) and not asks_help(['--helper=1'])


def test_help_text_takes_a_docstring_with_an_indented_blank_line():
    """A line of spaces alone in an indented example block is no example, and no crash."""
    from configurator import help_text
    text = help_text('Do a thing.\n\n    python x.py --a=1\n    \n    python x.py --a=2\n',
                     'python x.py', [])
    assert text.splitlines()[-2:] == ['  python x.py --a=1', '  python x.py --a=2']


@pytest.mark.parametrize('where', ['argv', 'file'])
def test_an_int_too_large_for_a_float_key_is_one_config_error(tmp_path, where):
    """A whole number past float's range for a float key was an OverflowError (a traceback): it is
    refused as any non-finite number is, naming the key."""
    huge = '1' + '0' * 400
    if where == 'file':
        path = tmp_path / 'c.py'
        path.write_text(f'learning_rate = {huge}\n')
        argv = [str(path)]
    else:
        argv = [f'--learning_rate={huge}']
    with pytest.raises(ConfigError, match=r"config key 'learning_rate' from .* must be a finite "
                                          r"number, got a whole number of about 401 digits"):
        load_config(DEFAULTS, argv)
    assert load_config(DEFAULTS, ['--learning_rate=3'])['learning_rate'] == 3.0


def test_an_int_too_large_to_print_is_one_config_error(tmp_path):
    """str() refuses a whole number of more than 4300 digits: the error names it by its length."""
    path = tmp_path / 'c.py'
    path.write_text('n_layer = 10 ** 5000\n')
    with pytest.raises(ConfigError, match=r"config key 'n_layer' from .* is too large: a whole "
                                          r"number of about 5001 digits does not fit in 64 bits"):
        load_config(DEFAULTS, [str(path)])
    with pytest.raises(ConfigError, match=r"is too large: 9223372036854775808 does not fit"):
        load_config(DEFAULTS, ['--n_layer=9223372036854775808'])
