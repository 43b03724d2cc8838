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
"""
import ast
import difflib
import math
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


def writable_folder(path, key, label=None):
    """Refuse (ConfigError naming --key) a folder this process could not write files into: path must
    be a folder or creatable as one (no file on the way), and a file must really be creatable where
    it is or would be (a probe created and removed at once: the root user ignores mode bits, so the
    mode bits alone say nothing). Creates nothing that stays. Call it before any work."""
    label = label or f"--{key}={path}"         # how the user gave it
    if not path:
        raise ConfigError(f"{label}: empty; name a folder, e.g. --{key}=out/myrun")
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"{label} is a file, not a folder; choose a folder")
    _check_folder(path, label)


def _check_folder(path, what):
    probe_dir = os.path.abspath(path)
    while not os.path.exists(probe_dir):          # the nearest existing folder would hold it
        probe_dir = os.path.dirname(probe_dir)
    if not os.path.isdir(probe_dir):
        raise ConfigError(f"{what} cannot be created: {probe_dir} is a file; choose another path")
    _probe_write(probe_dir, what)


def writable_file(path, key, suffix=''):
    """Refuse (ConfigError naming --key) a file path this process could not write: not a folder,
    ending in `suffix` if given, its folder existing or creatable and writable (as writable_folder
    checks)."""
    if not path:
        raise ConfigError(f"--{key} is empty; name a file, e.g. "
                          f"--{key}=results/x{suffix or '.json'}")
    if os.path.isdir(path):
        raise ConfigError(f"--{key}={path} is a folder; name a file in it, e.g. "
                          f"--{key}={os.path.join(path, 'out' + (suffix or '.json'))}")
    if suffix and not path.endswith(suffix):
        raise ConfigError(f"--{key}={path} must end in {suffix}, e.g. --{key}={path}{suffix}")
    _check_folder(os.path.dirname(os.path.abspath(path)), f"--{key}={path}")
    if os.path.exists(path) and not (os.access(path, os.W_OK) and _can_open_for_append(path)):
        raise ConfigError(f"--{key}={path} exists and is not writable; choose another file")


def _can_open_for_append(path):
    try:
        with open(path, 'a'):            # changes nothing; fails where a write would
            return True
    except OSError:
        return False


def _probe_write(folder, what):
    import tempfile
    why = None
    if not os.access(folder, os.W_OK | os.X_OK):     # what a non-root user's write would meet
        why = 'permission denied'
    else:
        try:
            fd, probe = tempfile.mkstemp(prefix='.write-probe-', dir=folder)
            os.close(fd)
            os.remove(probe)
        except OSError as e:
            why = e.strerror or type(e).__name__
    if why:
        raise ConfigError(f"{what}: cannot write in {folder} ({why}); choose a folder you can "
                          "write to")


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
    # torch and numpy take 64-bit numbers: a larger int or a non-finite float can only fail later
    if isinstance(value, int) and not isinstance(value, bool) and not -2**63 <= value < 2**63:
        raise ConfigError(f"config key '{key}' from {where} is too large: {value} does not fit in "
                          "64 bits")
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"config key '{key}' from {where} must be a finite number, got {value!r}")
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
            except SystemExit as e:      # exit() in a config file would end the run silently
                line = next((fr.lineno for fr in _traceback_frames(e) if fr.filename == arg), '?')
                raise ConfigError(f"config file {arg}, line {line}: it exits (SystemExit "
                                  f"{e.code!r}); "
                                  f"a config file only assigns values: remove the exit") from None
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
    return config
