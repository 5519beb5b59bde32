"""The package's import structure: no import cycle, and an installed copy imports on its own.

1. The import graph of strata_jax/ and envs_bridge/, read with ``ast`` (imports at module level
   AND inside functions, i.e. the lazy ones too; ``if TYPE_CHECKING:`` blocks never run and are
   left out), has no cycle. Every cycle found is printed with the file and line of each edge.
   The graph builder is checked on a hand-made package first, so the test can fail.
2. ``pip install .`` (a ``--target`` copy, no dependencies, no build isolation: offline and
   fast) lets ``import strata_jax.experiment`` work from another directory, with neither the
   repo nor its ``configs/`` on the path.
"""
from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys

import pytest
from tests.fixtures.paths import REPO_ROOT

ROOT = REPO_ROOT
PACKAGES = ("strata_jax", "envs_bridge")


# ---------------------------------------------------------------------------------- the graph

def _modules(root: str, packages) -> dict[str, str]:
    """{dotted module name: file} of every .py file under `packages` (a package is its
    __init__)."""
    out = {}
    for pkg in packages:
        for d, _, files in os.walk(os.path.join(root, pkg)):
            for f in files:
                if not f.endswith(".py"):
                    continue
                rel = os.path.relpath(os.path.join(d, f), root)[:-3].split(os.sep)
                if rel[-1] == "__init__":
                    rel = rel[:-1]
                out[".".join(rel)] = os.path.join(d, f)
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST):
    """(node, is_from) of every import that can run: everywhere but ``if TYPE_CHECKING:``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def import_graph(root: str, packages=PACKAGES) -> dict[str, dict[str, str]]:
    """{module: {imported module: "file:line" of the first such import}} over `packages`.

    ``import a.b.c`` and ``from a.b import c`` point at the module they name (``a.b.c`` when it
    is a module, else the package ``a.b``), and at each enclosing package that is not already an
    ancestor of the importer (importing ``strata_jax.algos.batch`` from ``strata_jax.distributed``
    runs ``strata_jax/algos/__init__.py`` too; a sibling's parent package is already being
    imported, so it is no edge). Relative imports are resolved; outside modules are ignored.
    """
    mods = _modules(root, packages)
    graph: dict[str, dict[str, str]] = {m: {} for m in mods}
    for mod, path in mods.items():
        is_pkg = path.endswith("__init__.py")
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        for node in _imports(tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    parts = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    parts = parts[: len(parts) - (node.level - 1)]
                    base = ".".join(parts + ([base] if base else []))
                for a in node.names:
                    sub = f"{base}.{a.name}" if base else a.name
                    targets.append(sub if sub in mods else base)
            for t in targets:
                while t and t not in mods:   # ``import a.b.c`` of a name inside a.b.c
                    t = t.rpartition(".")[0]
                if not t:
                    continue
                chain = [t] + [t.rsplit(".", k)[0] for k in range(1, t.count(".") + 1)]
                for dep in chain:
                    ancestor = mod == dep or mod.startswith(dep + ".")
                    if dep in mods and (dep == t or not ancestor) and dep != mod:
                        graph[mod].setdefault(dep, f"{os.path.relpath(path, root)}:{node.lineno}")
    return graph


def find_cycles(graph: dict[str, dict[str, str]]) -> list[list[str]]:
    """One cycle [m0, m1, ..., m0] per strongly connected component of more than one module
    (Tarjan), each starting at its smallest module name; sorted."""
    index, low, on, stack, comps = {}, {}, set(), [], []

    def visit(v):   # recursion depth = longest import chain (a few dozen)
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(set(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    cycles = []
    for comp in comps:   # shortest way back to the start inside the component (BFS)
        start = min(comp)
        prev, frontier = {start: None}, [start]
        while frontier and start not in [w for v in frontier for w in graph[v]]:
            nxt = []
            for v in frontier:
                for w in sorted(graph[v]):
                    if w in comp and w not in prev:
                        prev[w] = v
                        nxt.append(w)
            frontier = nxt
        last = next(v for v in frontier if start in graph[v])
        path = [last]
        while prev[path[-1]] is not None:
            path.append(prev[path[-1]])
        cycles.append(path[::-1] + [start])
    return sorted(cycles)


def describe(graph, cycle) -> str:
    """``a -> b (file:line) -> ... -> a`` for a failure message."""
    return " -> ".join([cycle[0]] + [f"{b} ({graph[a][b]})" for a, b in zip(cycle, cycle[1:])])


# ---------------------------------------------------------------------------------- tests

def _write(root, files):
    for rel, text in files.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)


def test_the_graph_finds_lazy_relative_and_package_cycles(tmp_path):
    _write(str(tmp_path), {
        "pkg/__init__.py": "from pkg.a import A\n",
        "pkg/a.py": "A = 1\ndef f():\n    from pkg import b   # lazy\n",
        "pkg/b.py": "from .a import A\nfrom typing import TYPE_CHECKING\n"
                    "if TYPE_CHECKING:\n    from pkg.c import C\n",
        "pkg/c.py": "import pkg.b\nC = 1\n",
        "pkg/sub/__init__.py": "from pkg.sub.x import X\n",
        "pkg/sub/x.py": "X = 1\nfrom pkg.sub import y\n",   # sibling via the parent: no edge
        "pkg/sub/y.py": "import os\nfrom pkg.c import C\n",
        "other/__init__.py": "",
        "other/m.py": "from pkg.sub.y import *\n",          # runs pkg/sub/__init__.py too
    })
    g = import_graph(str(tmp_path), ("pkg", "other"))
    assert g["pkg.a"] == {"pkg.b": "pkg/a.py:3"}
    assert g["pkg.b"] == {"pkg.a": "pkg/b.py:1"}             # the TYPE_CHECKING import is not
    assert set(g["pkg.sub.x"]) == {"pkg.sub.y"}
    assert set(g["other.m"]) == {"pkg.sub.y", "pkg.sub", "pkg"}
    assert find_cycles(g) == [["pkg.a", "pkg.b", "pkg.a"]]
    assert describe(g, find_cycles(g)[0]) == \
        "pkg.a -> pkg.b (pkg/a.py:3) -> pkg.a (pkg/b.py:1)"
    g["pkg.c"]["pkg.sub.y"] = "x"
    g["pkg.sub.y"]["pkg.c"] = "y"
    assert find_cycles(g) == [["pkg.a", "pkg.b", "pkg.a"], ["pkg.c", "pkg.sub.y", "pkg.c"]]


def test_no_import_cycle_in_the_package():
    g = import_graph(ROOT)
    assert {"strata_jax.experiment", "strata_jax.training.trainer",
            "envs_bridge.registry"} <= set(g)
    assert "strata_jax.algos.batch" in g["strata_jax.distributed"]   # module-level edges
    assert "strata_jax.jobs.warm_start" in g["strata_jax.jobs.assemble"]   # lazy (in-function) edges
    cycles = find_cycles(g)
    assert not cycles, "import cycles (one per tangle of modules that import each other):\n" + \
        "\n".join(describe(g, c) for c in cycles)


def test_an_installed_copy_imports_outside_the_repo(tmp_path):
    # Built from a copy of the tracked sources, so the build leaves nothing in the checkout.
    src, target, elsewhere = tmp_path / "src", tmp_path / "site", tmp_path / "elsewhere"
    elsewhere.mkdir()
    files = subprocess.run(["git", "ls-files"], capture_output=True, text=True, cwd=ROOT,
                           check=True).stdout.split()
    for rel in files:
        if os.path.isfile(os.path.join(ROOT, rel)):
            os.makedirs(src / os.path.dirname(rel), exist_ok=True)
            shutil.copy(os.path.join(ROOT, rel), src / rel)
    pip = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--no-index", "--target", str(target), str(src)],
        capture_output=True, text=True, cwd=str(tmp_path))
    assert pip.returncode == 0, pip.stdout + pip.stderr
    assert {"strata_jax", "envs_bridge"} <= set(os.listdir(target))
    # configs/ ships (an installed copy loads experiment files); the library never imports it
    assert (target / "configs").exists() and not (target / "tests").exists()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(target)
    code = ("import strata_jax.experiment as ex, envs_bridge, sys; "
            "print(ex.__file__); print('configs' in sys.modules)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=str(elsewhere), env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    path, configs_loaded = run.stdout.split()
    assert path.startswith(str(target)) and configs_loaded == "False", run.stdout


if __name__ == "__main__":   # print the package's cycles
    graph = import_graph(ROOT)
    for cyc in find_cycles(graph):
        print(describe(graph, cyc))
    pytest.main([__file__, "-q"])
