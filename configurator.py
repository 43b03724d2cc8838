"""
Config files and typed --key=value overrides, nanoGPT-style but strict.

    python train.py config/shakespeare_char.py --batch_size=32 --compile=False

The defaults are a dict (train.py's module-level values). Arguments are applied left to right: a path
ending in .py is executed and every top-level name it assigns must be a known key; `--key=value` is
parsed with ast.literal_eval (a bare word is taken as a string) and must have the default's type
(an int is accepted for a float key; None-valued defaults accept anything). An unknown key or a wrong
type raises ConfigError naming the key and the closest valid one, before any work is done.

Options renamed since (e.g. budget -> ffn_budget) keep working under their old names, with a note on
stderr once per name: `aliases` (an `Aliases` over the routing families: model.ALIASES) resolves an old
name by the route the arguments end with, whatever their order, and an old and a new spelling of one
field still apply left to right.

Smoke runs: with the environment variable NANODEPTH_SMOKE=1 every script that reads its options
here (train.py, and through it sweep.py's runs; eval.py, sample.py, bench.py, flops.py) caps each
count of iterations, steps, batches and tokens it has, and the model's width and vocabulary
(SMOKE_CAPS, SMOKE_VALUES), after the config files and the command line, and says so on stderr: any
documented command then runs in seconds. Its numbers mean nothing (config.json records the capped
values); tests/test_docs.py runs the docs this way.
"""
import ast
import difflib
import os


class UserError(Exception):
    """A problem with the user's input (config, command line, data or checkpoint files): every script
    prints it as one line 'error: ...' and exits with code 2, before any work is done."""


class ConfigError(UserError, ValueError):
    """A bad config file, key or value."""


def run_cli(main):
    """The scripts' entry point: sys.exit(main(sys.argv[1:])), a UserError as one line and exit 2."""
    import sys
    try:
        sys.exit(main(sys.argv[1:]))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


class Aliases:
    """The old option names of a registry of routing families {route: family}, each listing its own
    (family.aliases: {old: new} or {old: (new, {old value: new value})}). One old name can mean different
    options under different routes (budget: ffn_budget under one, mod_capacity under another), so it
    resolves by the route: the route's own family first, then the first family in registry order that
    had it, so that the refusal of another family's option names the option."""

    def __init__(self, families):
        self.families = families        # held, not copied: a family registered later is seen

    def names(self):
        return {key for family in self.families.values() for key in family.aliases}

    def resolve(self, key, value, route):
        """(new key, new value) for an old name `key`, or None if it is not one."""
        mine = self.families.get(route)
        for family in ([mine] if mine is not None else []) + list(self.families.values()):
            if key in family.aliases:
                new = family.aliases[key]
                if isinstance(new, tuple):             # (new name, {old value: new value})
                    new, values = new
                    value = values.get(value, value) if isinstance(value, str) else value
                return new, value
        return None

    def resolve_dict(self, d):
        """A copy of the stored dict d (model_args, config.json) with old option names read as today's,
        by d's own route, in d's order; where d holds both spellings of one field, the later one wins.
        Options d's route added since d was written, whose default now differs from what its code did,
        get that behaviour (the family's stored_before), so a resumed or evaluated run means what it did."""
        route = d.get('route')
        out = {}
        for key, value in d.items():
            key, value = self.resolve(key, value, route) or (key, value)
            out.pop(key, None)
            out[key] = value
        for key, value in getattr(self.families.get(route), 'stored_before', {}).items():
            out.setdefault(key, value)
        return out


SMOKE_ENV = 'NANODEPTH_SMOKE'
SMOKE_CAPS = dict(max_iters=2, eval_interval=2, warmup_iters=1, log_interval=1, eval_iters=1,
                  batch_size=2, block_size=128, n_embd=128, vocab_size=512, bench_steps=1,
                  bench_warmup=0, decode_tokens=2, max_new_tokens=8)
SMOKE_VALUES = dict(decode_batches='1', prefill_shapes='1x32')


def smoke_caps(config):
    """NANODEPTH_SMOKE=1: the counts config has capped (a value already below a cap is kept; 0 often
    means 'from the checkpoint'), with one note on stderr."""
    if os.environ.get(SMOKE_ENV, '') in ('', '0'):
        return config
    changed = {k: min(config[k], cap) for k, cap in SMOKE_CAPS.items()
               if k in config and config[k] > cap}
    changed.update({k: v for k, v in SMOKE_VALUES.items() if k in config and config[k] != v})
    if changed:
        import sys
        print(f"note: {SMOKE_ENV} is set: a smoke run with "
              + ', '.join(f'{k}={v}' for k, v in changed.items()), file=sys.stderr)
    return {**config, **changed}


def _unknown(key, defaults, aliases=None, route=None):
    old = aliases.names() if aliases is not None else set()
    close = difflib.get_close_matches(key, list(defaults) + sorted(old), n=1)
    if close and close[0] in old:          # suggest today's name of a close old one
        close = [aliases.resolve(close[0], None, route)[0]]
    hint = f" (did you mean '{close[0]}'?)" if close else ''
    return ConfigError(f"unknown config key '{key}'{hint}")


_noted = set()


def note_renamed(old, new, route):
    """One note per old name per process, on stderr."""
    if old not in _noted:
        _noted.add(old)
        import sys
        print(f"note: config key '{old}' is now '{new}' for route={route!r} (the old name still works)",
              file=sys.stderr)


def _check_type(key, value, default, where):
    if default is None:
        return value
    if isinstance(default, bool) or isinstance(value, bool):
        ok = isinstance(default, bool) and isinstance(value, bool)
    elif isinstance(default, float):
        ok = isinstance(value, (int, float))
        value = float(value) if ok else value
    else:
        ok = isinstance(value, type(default))
    if not ok:
        raise ConfigError(f"config key '{key}' from {where} must be {type(default).__name__}, "
                          f"got {type(value).__name__} {value!r}")
    return value


def _traceback_frames(e):
    import traceback
    return traceback.extract_tb(e.__traceback__)


def parse_value(text):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text        # a bare word such as --dataset=synthetic


def declared_defaults(path):
    """The config keys a script declares nanoGPT-style, as module-level literal assignments
    (`batch_size = 16`: lower-case names, int/float/bool/str values), read from its source without
    importing it, so that a module below train.py (flops.py, eval.py) can take train.py's keys."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    out = {}
    for node in tree.body:
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)):
            continue
        key = node.targets[0].id
        try:
            value = ast.literal_eval(node.value)
        except ValueError:           # computed, not declared
            continue
        if not key.startswith('_') and key.islower() and isinstance(value, (int, float, bool, str)):
            out[key] = value
    return out


def load_config(defaults, argv, aliases=None):
    """Return a new dict: `defaults` updated by the config files and --key=value items of argv. aliases
    (an Aliases, e.g. model.ALIASES): accept old option names, resolved by the final route."""
    items = []                  # (key, value, where, text of a --key=value or None), left to right
    for arg in argv:
        if not arg.startswith('--'):
            if not arg.endswith('.py'):
                raise ConfigError(f"expected a config file ending in .py or --key=value, got '{arg}'")
            if not os.path.isfile(arg):
                raise ConfigError(f"config file not found: {arg}")
            namespace = {}
            try:
                with open(arg) as f:
                    exec(compile(f.read(), arg, 'exec'), namespace)
            except SyntaxError as e:
                raise ConfigError(f"config file {arg}, line {e.lineno}: {e.msg}; fix the file") from None
            except Exception as e:       # a runtime error while executing the file
                line = next((fr.lineno for fr in _traceback_frames(e) if fr.filename == arg), '?')
                raise ConfigError(f"config file {arg}, line {line}: {type(e).__name__}: {e}; fix the file") from None
            for key, value in namespace.items():
                if key.startswith('_') or key == '__builtins__' or callable(value) or type(value).__name__ == 'module':
                    continue
                items.append((key, value, arg, None))
        else:
            key, eq, text = arg[2:].partition('=')
            if not eq:
                raise ConfigError(f"expected --key=value, got '{arg}'")
            items.append((key, parse_value(text), f"'{arg}'", text))
    # an old name means what it meant under the route these arguments end with
    route = next((v for k, v, _, _ in reversed(items) if k == 'route'), defaults.get('route'))
    config = dict(defaults)
    for key, value, where, text in items:
        hit = aliases.resolve(key, value, route) if key not in defaults and aliases is not None else None
        if hit is not None:
            if text is not None and isinstance(defaults.get(hit[0]), str):
                value = text   # as below: a str key takes the text as written
            note_renamed(key, hit[0], route)
            key, value = aliases.resolve(key, value, route)
        if key not in defaults:
            raise _unknown(key, defaults, aliases, route)
        if text is not None and isinstance(defaults[key], str) and not isinstance(value, str):
            value = text       # a str key takes the text as written: --ffn_layers=0,2,5, --out_dir=2024
        config[key] = _check_type(key, value, defaults[key], where)
    return smoke_caps(config)
