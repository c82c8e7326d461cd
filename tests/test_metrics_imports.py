"""``visattn.metrics`` imports itself without circles: its intra-package imports form a DAG.

Every import statement counts, wherever it stands (module level, inside a function, under
``if TYPE_CHECKING``): an import deferred into a function still closes a circle, it only moves the
moment it bites. Relative imports are resolved against the importing module's package.
"""

import ast
from pathlib import Path

import visattn.metrics

PACKAGE = "visattn.metrics"
PACKAGE_DIR = Path(visattn.metrics.__file__).parent


def module_files(package: str, root: Path) -> dict[str, Path]:
    """Module name -> file, for every ``.py`` file below ``root`` (``__init__`` names its package)."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join((package, *parts))] = path
    return modules


def _with_packages(name: str) -> list[str]:
    """``a.b.c`` -> ``[a, a.b, a.b.c]``: importing a module runs its packages first."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def imported_modules(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of ``modules`` that ``module`` (source at ``path``) imports, anywhere in its source."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    own_packages = set(_with_packages(package))  # already initialising when ``module`` runs
    needed: set[str] = set()  # to run (with their packages) before the import completes
    names_from: set[str] = set()  # modules whose namespace a name is read from (may be own packages)
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            needed.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                source = ".".join([*base, node.module] if node.module else base)
            else:
                source = node.module or ""
            needed.add(source)
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                if submodule in modules:  # ``from pkg import sub``
                    needed.add(submodule)
                else:  # ``from pkg import name``: read from pkg's (maybe half-run) namespace
                    names_from.add(source)
    targets = {name for target in needed for name in _with_packages(target)} - own_packages
    return {t for t in targets | names_from if t in modules and t != module}


def import_graph(package: str, root: Path) -> dict[str, set[str]]:
    modules = module_files(package, root)
    return {name: imported_modules(name, path, modules) for name, path in modules.items()}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per back edge of a depth-first search (none iff the graph is a DAG), each as
    ``[m0, m1, ..., m0]``."""
    cycles: list[list[str]] = []
    state: dict[str, str] = {}  # "open" while on the stack, then "done"
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = "open"
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == "open":
                cycles.append([*stack[stack.index(target) :], target])
            elif target not in state:
                visit(target)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return cycles


def test_metrics_imports_form_a_dag():
    graph = import_graph(PACKAGE, PACKAGE_DIR)
    assert len(graph) > 5 and f"{PACKAGE}.scorer" in graph[PACKAGE]  # the graph was really read
    cycles = import_cycles(graph)
    assert not cycles, "import circles in visattn.metrics:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_check_finds_circles_of_every_import_form(tmp_path):
    """The checker itself, on a made-up package: relative, absolute, deferred and package imports."""
    files = {
        "__init__.py": "from .a import A\n",
        "a.py": "def f():\n    from .b import B\n",  # a -> b, deferred into a function
        "b.py": "import pkg.sub.c\n",  # b -> pkg.sub (its package runs first) -> pkg.sub.c
        "sub/__init__.py": "",
        "sub/c.py": "from .. import a\n",  # c -> a: the circle a -> b -> sub.c -> a
        "d.py": "from . import A\n",  # d reads a name from the package: d -> pkg -> a ...
        "e.py": "from pkg.sub import c\nfrom . import d\n",  # ... but nothing imports d or e
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = import_graph("pkg", tmp_path)
    assert graph["pkg.a"] == {"pkg.b"}
    assert graph["pkg.b"] == {"pkg.sub", "pkg.sub.c"}
    assert graph["pkg.sub.c"] == {"pkg.a"}
    assert graph["pkg.d"] == {"pkg"}
    assert graph["pkg.e"] == {"pkg.sub", "pkg.sub.c", "pkg.d"}
    assert import_cycles(graph) == [["pkg.a", "pkg.b", "pkg.sub.c", "pkg.a"]]
    graph["pkg.a"] = set()
    assert import_cycles(graph) == []
