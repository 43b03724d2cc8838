"""
Config files and typed --key=value overrides, nanoGPT-style but strict.

    python train.py config/shakespeare_char.py --batch_size=32 --compile=False

The defaults are a dict (train.py's module-level values). Arguments are applied left to right: a
path ending in .py is executed and every top-level name it assigns must be a known key;
`--key=value` is parsed with ast.literal_eval (a bare word is taken as a string) and must have the
default's type (an int is accepted for a float key; None-valued defaults accept anything). An
unknown key or a wrong type raises ConfigError naming the key and the closest valid one, before any
work is done.

An option's name from before the routing families' options took their prefix (budget, gate, ...)
is refused with a ConfigError naming today's (RENAMED); config files and results were migrated.

Smoke runs: with the environment variable NANODEPTH_SMOKE=1 every script that reads its options
here (train.py, and through it sweep.py's runs; eval.py, sample.py, bench.py, flops.py) caps each
count of iterations, steps, batches, tokens and scored problems it has, and the model's width and
vocabulary (SMOKE_CAPS, SMOKE_VALUES), after the config files and the command line, and says so on
stderr (sweep.py also runs a study's first seed only): any documented command then runs in
seconds. Its numbers mean nothing (config.json records the capped values); tests/test_docs.py runs
the docs this way.
"""
import ast
import difflib
import functools
import json
import math
import os


class UserError(Exception):
    """A problem with the user's input (config, command line, data or checkpoint files): every
    script prints it as one line 'error: ...' and exits with code 2, before any work is done."""


class ConfigError(UserError, ValueError):
    """A bad config file, key or value."""


def run_cli(main):
    """The scripts' entry point: sys.exit(main(sys.argv[1:])), a UserError as one line and exit
    2; running out of memory (the host's or a GPU's) as one line and exit 1."""
    import sys
    try:
        sys.exit(main(sys.argv[1:]))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except (MemoryError, RuntimeError) as e:
        if not out_of_memory(e):
            raise
        print(f"error: out of memory ({type(e).__name__}: {out_of_memory(e)}); ask for less at "
              "once: a smaller batch, fewer samples or tokens", file=sys.stderr)
        sys.exit(1)


def out_of_memory(e):
    """The line of an exception that says an allocation failed ('' where none does): torch's
    (CPU: 'DefaultCPUAllocator: can't allocate memory', CUDA: 'CUDA out of memory') or Python's
    own MemoryError."""
    if isinstance(e, MemoryError):
        return str(e) or 'MemoryError'
    lines = str(e).splitlines()
    said = next((line for line in lines if "can't allocate memory" in line
                 or 'out of memory' in line.lower()), '')
    return said.split('DefaultCPUAllocator: ')[-1][:160]


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
    if os.path.islink(path) and not os.path.exists(path):
        raise ConfigError(f"{label} is a link to {os.readlink(path)}, which does not exist; "
                          "create that folder or choose another")
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


def replaceable_result(path, key, script, is_result):
    """Refuse (ConfigError naming --key) an existing file at path that is not an earlier result of
    `script` (is_result(its JSON) false, or no JSON object at all): --key names where a result
    goes, and a run's config.json or a dataset's meta.json given there by mistake is not this
    script's to replace."""
    if not os.path.isfile(path):
        return
    try:
        with open(path, encoding='utf-8') as f:
            obj = json.load(f)
        ours = isinstance(obj, dict) and is_result(obj)
    except (OSError, UnicodeDecodeError, ValueError):
        ours = False
    if not ours:
        raise ConfigError(f"--{key}={path} holds a file that is not a result of {script}, which "
                          "this run would replace; name a new file, or move that one away")


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


# The routing options' names from before each family's options took its prefix, and today's: an old
# name is refused, naming the new one (under route=mod, MoD's learned router was gate='mlp').
RENAMED = {
    'budget': 'ffn_budget, or mod_capacity under route=mod',
    'controlled_layers': 'ffn_layers, or mod_layers under route=mod',
    'gate': "ffn_gate, or mod_router under route=mod (where gate='mlp' is mod_router='learned')",
    'gate_hidden': 'ffn_gate_hidden, or mod_predictor_hidden under route=mod',
    'infer_rule': 'ffn_infer_rule, or mod_infer_rule under route=mod',
    'predictor_weight': 'ffn_predictor_weight, or mod_predictor_weight under route=mod',
    'router_bce_weight': 'mod_bce_weight',
    **{old: 'ffn_' + old for old in (
        'cheap_rank', 'gate_grad', 'jepa_latent', 'jepa_outcome', 'jepa_readout', 'jepa_weight',
        'mimic_weight', 'oracle_layers_per_step', 'oracle_policy', 'rank_kind', 'rank_margin',
        'rank_pairs', 'rank_weight', 'util_weight')},
}


SMOKE_ENV = 'NANODEPTH_SMOKE'
SMOKE_CAPS = dict(max_iters=2, eval_interval=2, warmup_iters=1, log_interval=1, eval_iters=1,
                  batch_size=2, block_size=128, n_embd=128, vocab_size=512, bench_steps=1,
                  bench_warmup=0, decode_tokens=2, max_new_tokens=8, limit=32)
SMOKE_ZERO_IS_ALL = ('limit',)       # arith.py's and eval_harness.py's 0: every problem
SMOKE_VALUES = dict(decode_batches='1', prefill_shapes='1x32')


def hf_hub_cache():
    """Where transformers keeps downloaded models: HF_HUB_CACHE, else HF_HOME/hub, else
    ~/.cache/huggingface/hub."""
    return os.environ.get('HF_HUB_CACHE') or os.path.join(
        os.environ.get('HF_HOME') or os.path.expanduser('~/.cache/huggingface'), 'hub')


def smoke_caps(config):
    """NANODEPTH_SMOKE=1: the counts config has capped (a value already below a cap is kept; 0 often
    means 'from the checkpoint'), with one note on stderr."""
    if os.environ.get(SMOKE_ENV, '') in ('', '0'):
        return config
    changed = {k: min(config[k], cap) or cap for k, cap in SMOKE_CAPS.items()
               if k in config and (config[k] > cap or k in SMOKE_ZERO_IS_ALL and config[k] == 0)}
    changed.update({k: v for k, v in SMOKE_VALUES.items() if k in config and config[k] != v})
    if 'n_embd' in changed and 'n_head' in config and changed['n_embd'] % config['n_head']:
        # the capped width must still split into heads: the most heads <= n_head that divide it
        changed['n_head'] = max(h for h in range(1, config['n_head'] + 1)
                                if changed['n_embd'] % h == 0)
    if changed:
        import sys
        print(f"note: {SMOKE_ENV} is set: a smoke run with "
              + ', '.join(f'{k}={v}' for k, v in changed.items()), file=sys.stderr)
    return {**config, **changed}


def _unknown(key, defaults, where):
    if key in RENAMED and RENAMED[key].split(',')[0] in defaults:    # a script taking today's name
        return ConfigError(f"config key '{key}' from {where} was renamed: use {RENAMED[key]}")
    close = difflib.get_close_matches(key, list(defaults), n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ''
    return ConfigError(f"unknown config key '{key}'{hint}")


def _check_type(key, value, default, where):
    if default is None:
        return value
    if isinstance(default, bool) or isinstance(value, bool):
        ok = isinstance(default, bool) and isinstance(value, bool)
    elif isinstance(default, float):
        ok = isinstance(value, (int, float))
        if ok and isinstance(value, int) and abs(value) >= 2**1024:    # float() would overflow
            raise ConfigError(f"config key '{key}' from {where} must be a finite number, got "
                              f"{_whole(value)}")
        value = float(value) if ok else value
    else:
        ok = isinstance(value, type(default))
    if not ok:
        raise ConfigError(f"config key '{key}' from {where} must be {type(default).__name__}, "
                          f"got {type(value).__name__} {value!r}")
    # torch and numpy take 64-bit numbers: a larger int or a non-finite float can only fail later
    if isinstance(value, int) and not isinstance(value, bool) and not -2**63 <= value < 2**63:
        raise ConfigError(f"config key '{key}' from {where} is too large: {_whole(value)} does not "
                          "fit in 64 bits")
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"config key '{key}' from {where} must be a finite number, got {value!r}")
    return value


def _whole(value):
    """A whole number as an error names it: its digits, or their count where they are too many to
    print (str() refuses past 4300 digits)."""
    if value.bit_length() < 1000:
        return str(value)
    return f"a whole number of about {int(value.bit_length() * 0.30103) + 1} digits"


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
        if not (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
        ):
            continue
        key = node.targets[0].id
        try:
            value = ast.literal_eval(node.value)
        except ValueError:           # computed, not declared
            continue
        if not key.startswith('_') and key.islower() and isinstance(value, (int, float, bool, str)):
            out[key] = value
    return out


def refuse_spaced_values(argv, defaults):
    """One syntax in every script: `--key VALUE` (a known key, its value after a space) is refused,
    naming the --key=VALUE spelling."""
    for i, arg in enumerate(argv):
        if arg.startswith('--') and arg[2:] in defaults:
            value = argv[i + 1] if i + 1 < len(argv) else 'VALUE'
            raise ConfigError(f"{arg} takes its value after '=': {arg}={value}")


def require_checkpoint_file(path):
    """--ckpt must name a file, checked before any work."""
    if not path or not os.path.isfile(path):
        raise ConfigError(f"--ckpt={path} is not a checkpoint file; name one, e.g. "
                          f"--ckpt=out/arith/ckpt.pt")


def load_config(defaults, argv):
    """Return a new dict: `defaults` updated by the config files and --key=value items of argv."""
    items = []                  # (key, value, where, text of a --key=value or None), left to right
    for arg in argv:
        if not arg.startswith('--'):
            if not arg.endswith('.py'):
                raise ConfigError(
                    f"expected a config file ending in .py or --key=value, got '{arg}'"
                )
            if os.path.isdir(arg):
                raise ConfigError(f"config file {arg} is a folder; name a config file in it, "
                                  f"e.g. config/shakespeare_char.py")
            if not os.path.isfile(arg):
                raise ConfigError(f"config file not found: {arg}")
            namespace = {}
            try:
                with open(arg) as f:
                    exec(compile(f.read(), arg, 'exec'), namespace)
            except SyntaxError as e:
                raise ConfigError(f"config file {arg}, line {e.lineno}: {e.msg}; fix the "
                                  "file") from None
            except SystemExit as e:      # exit() in a config file would end the run silently
                line = next((fr.lineno for fr in _traceback_frames(e) if fr.filename == arg), '?')
                raise ConfigError(f"config file {arg}, line {line}: it exits (SystemExit "
                                  f"{e.code!r}); "
                                  f"a config file only assigns values: remove the exit") from None
            except Exception as e:       # a runtime error while executing the file
                line = next((fr.lineno for fr in _traceback_frames(e) if fr.filename == arg), '?')
                raise ConfigError(f"config file {arg}, line {line}: {type(e).__name__}: {e}; fix "
                                  "the file") from None
            for key, value in namespace.items():
                if (
                    key.startswith('_')
                    or key == '__builtins__'
                    or callable(value)
                    or type(value).__name__ == 'module'
                ):
                    continue
                items.append((key, value, arg, None))
        else:
            key, eq, text = arg[2:].partition('=')
            if not eq:
                raise ConfigError(f"expected --key=value, got '{arg}'")
            items.append((key, parse_value(text), f"'{arg}'", text))
    config = dict(defaults)
    for key, value, where, text in items:
        if key not in defaults:
            raise _unknown(key, defaults, where)
        if text is not None and isinstance(defaults[key], str) and not isinstance(value, str):
            value = text       # a str key takes the text as written: --ffn_layers=0,2,5,
                               # --out_dir=2024
        config[key] = _check_type(key, value, defaults[key], where)
    return smoke_caps(config)


# --------------------------------------------------------------------------------------------------
# --help: each script's options, defaults and descriptions, read from where the defaults live

HELP_FLAGS = ('--help', '-h')


def given_keys(argv):
    """The keys argv sets on the command line (--key=value; a config file's are not among them)."""
    return {a[2:].partition('=')[0] for a in argv if a.startswith('--')}


def asks_help(argv):
    return any(a in HELP_FLAGS for a in argv)


def option_descriptions(path, within=None):
    """{name: description} of the options declared in the Python file at path: its module-level
    assignments (`batch_size = 16   # sequences per micro-batch`), or, with `within`, the fields of
    the class of that name or the keywords of the module-level `within = dict(...)`. A description
    is the comment ending the option's line(s) with the comment lines that continue it (indented
    past the name), else, for a class's field, the comment lines just above it (elsewhere those are
    section titles); '' where there is none."""
    return dict(_descriptions(os.path.abspath(path), within))


@functools.lru_cache(maxsize=None)          # a script's --help reads a file more than once
def _descriptions(path, within):
    import tokenize
    with open(path) as f:
        source = f.read()
    lines = source.splitlines()
    comments = {}                       # line number -> (column, text, alone on its line)
    for tok in tokenize.generate_tokens(iter(source.splitlines(True)).__next__):
        if tok.type == tokenize.COMMENT:
            (row, col), text = tok.start, tok.string.lstrip('#').strip()
            comments[row] = (col, text, not lines[row - 1][:col].strip())
    out = {}
    for name, node in _declarations(ast.parse(source, path), within):
        trailing = [comments[r][1] for r in range(node.lineno, node.end_lineno + 1)
                    if r in comments and not comments[r][2]]
        parts, row = trailing[-1:], node.end_lineno + 1
        while (trailing and row in comments and comments[row][2]
               and comments[row][0] > node.col_offset):
            parts.append(comments[row][1])         # a continuation, indented past the name
            row += 1
        row = node.lineno - 1
        while (not trailing and isinstance(node, ast.AnnAssign) and row in comments
               and comments[row][2] and comments[row][0] == node.col_offset):
            parts.insert(0, comments[row][1])      # the block just above, at the name's indent
            row -= 1
        out.setdefault(name, ' '.join(p for p in parts if p))
    return out


def _declarations(tree, within):
    """(name, node) of each option: module-level assignments, or those inside `within`."""
    for node in tree.body:
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, ast.AnnAssign) else [])
        names = [t.id for t in targets if isinstance(t, ast.Name)]
        if within is None:
            yield from ((n, node) for n in names)
        elif isinstance(node, ast.ClassDef) and node.name == within:
            yield from ((s.target.id, s) for s in node.body
                        if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name))
        elif within in names and isinstance(node.value, ast.Call):
            yield from ((k.arg, k) for k in node.value.keywords if k.arg)


def source_group(title, defaults, *sources):
    """A --help group: (title, defaults, descriptions), the descriptions read from `sources`, each a
    path or (path, within) as option_descriptions takes them."""
    described = {}
    for src in sources:
        path, within = (src, None) if isinstance(src, str) else src
        described = {**option_descriptions(path, within), **described}
    return title, defaults, described


def model_groups(config_class, families, shown=()):
    """--help groups of the model's fields: the dense model's own (config_class's class body), then
    each routing family's Options, titled by its route; keys in `shown` (a script's own, listed
    already) are left out."""
    import inspect
    from dataclasses import fields
    defaults = {f.name: f.default for f in fields(config_class)}
    groups = []
    for title, cls in [('model options', config_class),
                       *[(f'route={route} options', family.Options)
                         for route, family in families.items() if family.Options]]:
        path = inspect.getsourcefile(cls)
        described = option_descriptions(path, cls.__name__)
        own = {k: defaults[k] for k in described if k in defaults and k not in shown}
        groups.append((f'{title} ({os.path.basename(path)})', own, described))
    return groups


def _shown(value):
    """A default as it would be typed after --key=."""
    if isinstance(value, str) and value and value.strip() == value and ' ' not in value:
        return value
    return repr(value)


def help_text(doc, usage, groups, flags=None):
    """The text of --help: the script's purpose (its docstring's first paragraph), usage, its
    examples (the docstring's indented `python ...` lines), then each group's options as
    --key=default and the description, and the bare flags. An option with no description shows
    UNDOCUMENTED (tests refuse it)."""
    import textwrap
    paragraphs = doc.strip().split('\n\n')
    purpose = ' '.join(paragraphs[0].split())
    examples = [line.strip() for line in doc.splitlines()
                if line.startswith('    ') and line.split()[:1] in (['python'], ['torchrun'])]
    out = [textwrap.fill(purpose, 100), '', 'usage: ' + usage]
    if examples:
        out += ['', 'examples:', *('  ' + e for e in examples)]
    width = 36                          # where descriptions start

    def entry(left, description):
        text = description or 'UNDOCUMENTED'
        if len(left) > width - 4:
            out.append('  ' + left)
            left = ''
        out.append(textwrap.fill(text, 100, initial_indent=f"  {left:<{width - 2}}",
                                 subsequent_indent=' ' * width))
    if flags:
        out += ['', 'flags:']
        for flag, description in flags.items():
            entry(flag, description)
    for title, defaults, described in groups:
        if defaults:
            out += ['', title + ':']
            for key, value in defaults.items():
                entry(f"--{key}={_shown(value)}", described.get(key, ''))
    return '\n'.join(out)


def print_help(*args, **kwargs):
    """Print help_text(...) to stdout and return 0 (the scripts' exit code for --help)."""
    import sys
    try:
        print(help_text(*args, **kwargs), flush=True)
    except BrokenPipeError:             # `--help | head` closed the pipe: not an error
        sys.stdout = open(os.devnull, 'w')
    return 0
