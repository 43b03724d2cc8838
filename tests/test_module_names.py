"""The repository's commands run from its root, which Python puts first on sys.path: a module here
named like one a dependency installs hides that one from every library importing it. (transformers
5 imports Hugging Face's `kernels` package, its own dependency, and a kernels.py here hid it: every
transformers import failed.) The names are checked against what the installed dependencies, those
of requirements.txt, requirements-extra.txt, torch and pytest with theirs in turn, install."""
import importlib.metadata as metadata
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def canonical(name):
    return re.sub(r'[-_.]+', '-', name).lower()


def requirement_names(path):
    """The distribution names a requirements file lists."""
    names = []
    for line in path.read_text().splitlines():
        m = re.match(r'\s*([A-Za-z0-9][A-Za-z0-9_.-]*)', line.split('#')[0])
        if m:
            names.append(m.group(1))
    return names


def installed_dependencies(names):
    """The canonical names of the installed distributions among `names` and what they require,
    transitively (optional extras left out)."""
    seen, todo = set(), list(names)
    while todo:
        name = canonical(todo.pop())
        if name in seen:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:     # not installed here: it can hide nothing
            continue
        seen.add(name)
        for requirement in dist.requires or []:
            if 'extra ==' not in requirement.replace('"', ' ').replace("'", ' '):
                todo.append(re.match(r'[A-Za-z0-9_.-]+', requirement).group())
    return seen


def our_modules():
    """The top-level names importable from the root (and from tests/, which pytest puts on the
    path): the .py files and the folders with an __init__.py."""
    names = set()
    for folder in (REPO, REPO / 'tests'):
        names |= {p.stem for p in folder.glob('*.py')}
        names |= {p.name for p in folder.iterdir() if (p / '__init__.py').is_file()}
    return names


def test_no_module_here_hides_one_that_a_dependency_installs():
    wanted = [*requirement_names(REPO / 'requirements.txt'),
              *requirement_names(REPO / 'requirements-extra.txt'), 'torch', 'pytest']
    dependencies = installed_dependencies(wanted)
    assert {'torch', 'numpy'} <= dependencies           # the walk found the installed ones
    provided = metadata.packages_distributions()        # import name -> its distributions
    clashes = {name: sorted(d for d in provided[name] if canonical(d) in dependencies)
               for name in our_modules() & set(provided)}
    assert not {name: dists for name, dists in clashes.items() if dists}, (
        'rename these modules: an installed dependency provides the same import name')
