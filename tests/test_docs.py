"""Every command the docs give works, in the order written: each ```bash block of README.md, then of
docs/*.md (sorted), line by line, in one fresh copy of the repository (its tracked files; ../shared
beside it is a link to this checkout's), as a new user would run them; and, in another fresh copy,
the commands in the config files' headers, file by file.

How the commands are shortened (one mechanism): each runs exactly as written, with
NANODEPTH_SMOKE=1 in its environment. Every script reads its options through
configurator.load_config, which then caps the counts of iterations, steps, batches and tokens and
the model's width and vocabulary (configurator.SMOKE_CAPS and SMOKE_VALUES), so a training run is 2
iterations and a benchmark one step on a small model; sweep.py's train.py runs inherit it, and a
study runs its first seed only. The commands' numbers mean nothing here: this checks that they
run.

How they are started: `python SCRIPT ...` runs in a fork of tests/warm_python.py, a process that
has imported torch (and torch._dynamo, which torch's optimizers load), as a fresh `python SCRIPT
...` would run it otherwise (its own session, argv, sys.path, __main__, exit status; the project's
modules imported by the script): importing torch is 3-4 s of each such command on a 2-core machine,
most of its time under smoke. tests/test_warm_python.py checks the fork against a real process.
Other commands (bash, the processes a script starts) start as they are.

Not run (SKIP, each with its reason): `pip install` (the environment is given), the test suite
itself, `torchrun` (DDP over 8 GPUs on FineWeb-Edu), Tiny Shakespeare when its text is not in
../shared/data (preparing it downloads it), and the lm-evaluation-harness example where lm_eval is
not installed. A skipped command is printed, never silently dropped.
"""
import importlib.util
import json
import os
import re
import select
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import GROUP_VAR, start, stop, tagged_processes

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / 'shared'
HAVE_SHAKESPEARE = (SHARED / 'data' / 'tinyshakespeare.txt').is_file()
HAVE_LM_EVAL = importlib.util.find_spec('lm_eval') is not None
NO_LM_EVAL = 'needs lm_eval (pip install lm_eval), which CI does not install'
SKIP = {      # command prefix -> why it is not run here (None: run it)
    'pip install': 'installs packages: the environment is given',
    'python -m pytest': 'the test suite, which this test is part of',
    'torchrun': 'DDP over 8 processes (GPUs) on FineWeb-Edu, which is downloaded',
    'python data/prepare.py shakespeare_char': None if HAVE_SHAKESPEARE else
        'downloads Tiny Shakespeare (../shared/data/tinyshakespeare.txt is absent)',
    'python train.py config/shakespeare_char.py': None if HAVE_SHAKESPEARE else
        'needs data/shakespeare_char, prepared by the download above',
    'python data/prepare.py arith --vocab_from=data/shakespeare_char': None if HAVE_SHAKESPEARE
        else 'needs data/shakespeare_char, prepared by the download above',
    'python arith.py --ckpt=out/arith_lora': None if HAVE_SHAKESPEARE else
        'scores the Shakespeare backbone tuned above',
    # the harness's offline example: its data and training serve only it
    'python data/prepare.py arith --out_dir=data/arith': None if HAVE_LM_EVAL else NO_LM_EVAL,
    'python train.py --dataset=arith': None if HAVE_LM_EVAL else NO_LM_EVAL,
    'python eval_harness.py': None if HAVE_LM_EVAL else NO_LM_EVAL,
}
# a command that does under NANODEPTH_SMOKE=1 what another documented command does (the same
# script, config file and code paths; other sizes or counts): that one runs, and this one's options
# are checked to be options its script has (REPEAT_OPTIONS_KNOWN)
SAME_UNDER_SMOKE = {
    'python bench.py --suite=gpu': 'python bench.py --suite=gpu --smoke=True',
    'python bench.py config/bench_decode_vs_hf_cpu.py --out=results/cpu_2026-11-25/'
    'decode_vs_hf_floor.json --json':
        'python bench.py config/bench_decode_vs_hf_cpu.py --quick=True --json',
    'python bench.py config/bench_cpu.py --budgets=1.0,0.75,0.5,0.25,0.125 --profile=True --json':
        'python bench.py config/bench_cpu.py --budgets=1.0,0.75,0.5,0.25,0.125 --profile=True '
        '--quick=True --out=results/bench_ffn.json',
    'python bench.py config/bench_cpu.py --budgets=1.0,0.5 --decode_batches=1 --json':
        'python bench.py config/bench_cpu.py --budgets=1.0,0.75,0.5,0.25,0.125 --profile=True '
        '--quick=True --out=results/bench_ffn.json',
    'python bench.py config/bench_cpu.py --route=mod --budgets=1.0,0.5 --decode_batches=1 --json':
        'python bench.py config/bench_cpu.py --route=mod --budgets=1.0,0.75,0.5,0.25,0.125 '
        '--decode_batches=1,8 --profile=True --json',
    # the study's runs, all finished by the same study run with --jobs=2
    'python sweep.py config/study_a3.py': 'python sweep.py config/study_a3.py --jobs=2',
}
TIMEOUT_S = 300             # one command


def documented_commands():
    """(file, command line) for each command of each ```bash block, in reading order; a line's
    trailing comment is dropped, and `a && b` gives two commands."""
    out = []
    for doc in [REPO / 'README.md', *sorted((REPO / 'docs').glob('*.md'))]:
        for block in re.findall(r'^```bash\n(.*?)^```', doc.read_text(), re.S | re.M):
            for line in block.splitlines():
                out += [(doc.relative_to(REPO).as_posix(), c) for c in split_commands(line)]
    return out


def split_commands(line):
    """The commands of a shell line: its comment dropped, `a && b` split."""
    words, out = shlex.split(line, comments=True), []
    while words:
        cut = words.index('&&') if '&&' in words else len(words)
        out.append(shlex.join(words[:cut]))
        words = words[cut + 1:]
    return out


def skip_reason(command):
    return next((why for prefix, why in SKIP.items() if command.startswith(prefix) and why), None)


def fresh_copy(dest):
    """The repository's tracked files (as they are in the working tree) under dest/repo, and
    dest/shared linking to the shared folder beside this checkout."""
    files = subprocess.run(['git', 'ls-files', '-z'], cwd=REPO, capture_output=True,
                           check=True).stdout
    for name in filter(None, files.decode().split('\0')):
        src, dst = REPO / name, dest / 'repo' / name
        if src.is_file():
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)
    if SHARED.exists():
        (dest / 'shared').symlink_to(SHARED)
    return dest / 'repo'


def run_command(command, cwd, env, warm=None):
    """The command in its own process group, ended as a whole (SIGTERM, then SIGKILL) if it
    overruns: `python SCRIPT ...` in a fork of `warm` (a WarmPython) where one is given, anything
    else as a process of its own. (exit status, its output)."""
    argv = shlex.split(command)
    if warm is not None and argv[0] == 'python' and argv[1:2] and argv[1].endswith('.py'):
        return warm.run(argv[1:], cwd, command)
    if argv[0] == 'python':
        argv[0] = sys.executable
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        end_group(proc.pid)
        out, _ = proc.communicate()
        pytest.fail(f"{command} ran past {TIMEOUT_S} s:\n{out[-3000:]}")
    return proc.returncode, out


def end_group(pid):
    """SIGTERM to the process group, a second, then SIGKILL."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            pass
        time.sleep(1)


class WarmPython:
    """tests/warm_python.py started with the commands' environment: `python SCRIPT ...` run in a
    fork of a process that has imported torch and torch._dynamo, sparing each command the 3-4 s
    of those imports (most of a smoke-sized command's time). The script runs as a fresh `python
    SCRIPT ...` would (its own session, sys.argv, sys.path[0], __main__, exit status), with only
    those imported before it. End it with close()."""

    def __init__(self, folder, env):
        self.folder, self.buffer, self.count = folder, b'', 0
        self.proc = start([sys.executable, str(Path(__file__).with_name('warm_python.py'))],
                          env=env, cwd=folder, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          stderr=None, text=False)

    def line(self, timeout):
        """The next line the process writes, or None after `timeout` seconds without one."""
        deadline = time.time() + timeout
        while b'\n' not in self.buffer:
            left = deadline - time.time()
            if left <= 0 or not select.select([self.proc.stdout], [], [], left)[0]:
                return None
            chunk = os.read(self.proc.stdout.fileno(), 4096)
            assert chunk, f'tests/warm_python.py exited ({self.proc.wait()})'
            self.buffer += chunk
        line, _, self.buffer = self.buffer.partition(b'\n')
        return line.decode()

    def run(self, argv, cwd, command):
        self.count += 1
        out = Path(self.folder) / f'command{self.count}.log'
        request = dict(argv=argv, cwd=str(cwd), out=str(out))
        self.proc.stdin.write((json.dumps(request) + '\n').encode())
        self.proc.stdin.flush()
        pid = self.line(120)            # (the first one waits for the imports)
        assert pid is not None, f'tests/warm_python.py did not start {command}'
        pid = int(pid)
        status = self.line(TIMEOUT_S)
        if status is None:
            end_group(pid)
            self.line(60)
            pytest.fail(f"{command} ran past {TIMEOUT_S} s:\n{out.read_text()[-3000:]}")
        # a command that exits leaves nothing running (a fresh process's pipe would stay open)
        left, deadline = self.left_running(), time.time() + 5
        while left and time.time() < deadline:
            time.sleep(0.1)
            left = self.left_running()
        if left:
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            pytest.fail(f"{command} exited ({status}) but left {left} running (killed)")
        return int(status), out.read_text()

    def left_running(self):
        """The live processes the commands started (they carry this process's tag), not it."""
        return [p for p in tagged_processes(GROUP_VAR, self.proc.group_tag) if p != self.proc.pid]

    def close(self):
        stop(self.proc)


def test_the_commands_are_found():
    """The extraction itself: the quickstart first, `&&` split, comments dropped, and every skip
    names a command the docs still give (a skip list entry that matches nothing is stale)."""
    commands = [c for _, c in documented_commands()]
    assert commands[:2] == ['pip install -r requirements.txt', 'python train.py']
    assert not any('#' in c for c in commands) and len(commands) >= 15
    assert all(any(c.startswith(prefix) for c in commands) for prefix in SKIP)
    assert all(a in commands and b in commands for a, b in SAME_UNDER_SMOKE.items())


def test_a_command_not_run_for_its_twin_gives_options_its_script_has():
    """A command skipped as the same under smoke as another: the same script and config file,
    and each option it gives is one the twin gives or its script defines (a typo would otherwise
    go unnoticed)."""
    for skipped, twin in SAME_UNDER_SMOKE.items():
        a, b = shlex.split(skipped), shlex.split(twin)
        assert a[:2] == b[:2], (skipped, twin)
        plain = lambda words: [w for w in words if not w.startswith('--')]
        assert plain(a) == plain(b), (skipped, twin)
        keys = lambda words: {w[2:].partition('=')[0] for w in words if w.startswith('--')}
        source = (REPO / a[1]).read_text()
        for key in keys(a) - keys(b):
            assert re.search(rf"^\s+{key}=|'--{key}'", source, re.M), (skipped, key)


@pytest.mark.slow
def test_every_documented_command_runs_in_order(tmp_path):
    """torch.compile runs eagerly here (TORCHDYNAMO_DISABLE), as in the config files' chain: a
    --compile=True command would spend most of its time compiling a 2-step run, and compiled
    execution has tests of its own (tests/test_compile.py)."""
    twin = lambda command: (f'under smoke the same as `{SAME_UNDER_SMOKE[command]}`'
                            if command in SAME_UNDER_SMOKE else None)
    ran = run_in_order(tmp_path, documented_commands(),
                       lambda command: skip_reason(command) or twin(command),
                       TORCHDYNAMO_DISABLE='1')
    assert len(ran) >= 12


def run_in_order(tmp_path, commands, why_not, **env):
    """(source, command) pairs run one after another in one fresh copy under NANODEPTH_SMOKE, each
    required to exit 0; skipped where why_not(command) gives a reason, or where it was given
    above (a command given again redoes the same work on the same files). Prints what ran, with
    times, and what was skipped, with why; returns the lines of what ran."""
    repo = fresh_copy(tmp_path)
    env = {**os.environ, 'NANODEPTH_SMOKE': '1', 'OMP_NUM_THREADS': '1',
           'PYTHONDONTWRITEBYTECODE': '1', **env}
    (tmp_path / 'logs').mkdir()
    warm = WarmPython(tmp_path / 'logs', env)
    t0, ran, skipped, seen = time.time(), [], [], set()
    try:
        for source, command in commands:
            why = why_not(command) or ('given above, ran there' if command in seen else None)
            seen.add(command)
            if why:
                skipped.append(f"{source}: {command} ({why})")
                continue
            began = time.time()
            code, out = run_command(command, repo, env, warm)
            assert code == 0, f"{source}: `{command}` exited {code}:\n{out[-3000:]}"
            ran.append(f"{time.time() - began:5.1f} s  {source}: {command}")
    finally:
        warm.close()
    print('\n'.join(['ran:', *ran, 'skipped:', *skipped, f'total {time.time() - t0:.0f} s']))
    return ran


def config_commands():
    """(config file, command line) for each command in each config file's header (its leading `#`
    lines; a command is indented by two spaces or more), files in name order: `\\` continuations
    joined, `[...]` optional parts, a trailing `(...)` remark and comments dropped, `a && b`
    split."""
    out = []
    for path in sorted((REPO / 'config').glob('*.py')):
        lines = path.read_text().splitlines()
        header = '\n'.join(line[1:] for line in lines[:next(
            (i for i, line in enumerate(lines) if not line.startswith('#')), len(lines))])
        for line in header.replace('\\\n', ' ').splitlines():
            if not re.match(r'\s{2,}(python|torchrun|bash) ', line):
                continue
            line = re.sub(r'\s\(.*\)\s*$', '', re.sub(r'\[[^]]*\]', '', line))
            out += [(f'config/{path.name}', c) for c in split_commands(line)]
    return out


def config_skip_reason(command):
    """Why a config file's command is not run here (None: it is)."""
    if command.startswith('python sweep.py') and '--dry_run' not in command:
        return ("a study: hours of runs; each arm's config is checked by tests/test_configs.py and "
                "a study runs from the README above")
    if 'fineweb' in command or command.startswith('torchrun'):
        return 'FineWeb-Edu, downloaded, and (torchrun) 8 GPUs'
    if 'config/ffn_paper_157m.py' in command:
        return 'trains on FineWeb-Edu, downloaded above'
    if 'gpt2' in command:
        return "GPT-2's weights, downloaded"
    if 'shakespeare' in command and not HAVE_SHAKESPEARE:
        return SKIP['python data/prepare.py shakespeare_char']
    return skip_reason(command)


def test_the_config_files_commands_are_found():
    """The extraction from config headers: continuations joined, options kept whole, optional
    parts and remarks dropped; every config file that documents a chain gives it whole."""
    found = config_commands()
    commands = [c for _, c in found]
    distilled = [c for f, c in found if f == 'config/ffn_distilled_drafter_shakespeare.py']
    assert distilled == [
        'python data/prepare.py shakespeare_char',
        'python train.py config/exit_drafter_shakespeare.py --route=ffn --ffn_gate=mlp '
        '--ffn_budget=0.5 --ffn_layers=all --layer_dropout=0.0 --out_dir=out/ffn_shakespeare',
        'python train.py config/ffn_distilled_drafter_shakespeare.py',
        'python bench.py --init_from=out/ffn_distilled_drafter_shakespeare --speculate=1,2,3,4 '
        '--decode_batches=1']
    assert 'python train.py config/ffn_stage2_lookup.py' in commands
    assert 'python sweep.py config/study_families.py --jobs=2' in commands
    assert not any('#' in c or '[' in c or '(' in c for c in commands) and len(commands) >= 50
    ran = [c for c in commands if not config_skip_reason(c)]
    assert len(ran) >= (25 if HAVE_SHAKESPEARE else 10)


@pytest.mark.slow
def test_every_config_files_commands_run_in_order(tmp_path):
    """The commands config files' headers give (config_commands), in one fresh copy, as
    test_every_documented_command_runs_in_order runs the docs': a chain (a model trained, then
    distilled, tuned or benchmarked from its checkpoint) must run as written. torch.compile
    runs eagerly here (TORCHDYNAMO_DISABLE): a config's compile=True would spend a minute compiling
    a 2-iteration run, and compiled execution has tests of its own."""
    run_in_order(tmp_path, config_commands(), config_skip_reason, TORCHDYNAMO_DISABLE='1')


def test_every_optional_import_is_listed_with_its_feature():
    """Each third-party package the code or tests import is in requirements.txt or in
    requirements-extra.txt, the extras each with the feature that needs it (a `# comment`), and
    the README's install section gives their `pip install` lines, matplotlib's first."""
    listed = set()
    for name in ('requirements.txt', 'requirements-extra.txt'):
        for line in (REPO / name).read_text().splitlines():
            package = re.match(r'([A-Za-z0-9_.-]+)', line)
            if package:
                listed.add(package.group(1).lower())
                if name == 'requirements-extra.txt':
                    assert '#' in line, f"{name}: say which feature needs {package.group(1)}"
            listed.update(re.findall(r'pip install ([A-Za-z0-9_.-]+)', line))
    sources = [REPO / name for name in subprocess.run(
        ['git', 'ls-files', '*.py'], cwd=REPO, capture_output=True, text=True,
        check=True).stdout.split()]
    local = {p.stem for p in sources} | {p.name for p in REPO.iterdir() if p.is_dir()}
    imported = set()            # `from x.y import z` and `import x.y as w, v`: x and v
    for path in sources:
        for source, names in re.findall(r'^[ \t]*(?:from[ \t]+(\w+)[\w.]*[ \t]+import\b'
                                         r'|import[ \t]+([\w., \t]+))', path.read_text(), re.M):
            imported.update([source] if source else
                            [n.split()[0].split('.')[0] for n in names.split(',') if n.strip()])
    third_party = imported - set(sys.stdlib_module_names) - local
    assert third_party and not third_party - listed, sorted(third_party - listed)
    install = REPO.joinpath('README.md').read_text().split('\n## ')[1]
    assert install.startswith('Install') and 'pip install -r requirements-extra.txt' in install
    assert 'pip install matplotlib' in install and 'pip install lm_eval' in install
