"""docs/design.md is true of the tree: every path it names exists, and its module map (§4) names
every module of the packages."""
import os
import re

from tests.fixtures.paths import REPO_ROOT

ROOT = REPO_ROOT
DESIGN = os.path.join(ROOT, "docs", "design.md")
PACKAGES = ("strata_jax", "envs_bridge", "configs")


def _text() -> str:
    with open(DESIGN, encoding="utf-8") as f:
        return f.read()


def _module_map() -> list[tuple[str, str]]:
    """(path cell, job cell) of each row of §4's table, backticks removed from the path."""
    section = _text().split("## 4. Module map", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 2 and cells[0].startswith("`"):
            rows.append((cells[0], cells[1]))
    return rows


def _named_files(path_cell: str, job_cell: str) -> set[str]:
    """Repo-relative files a map row names: its path cell's paths, and for a folder row the
    ``name.py`` / ``sub/`` entries its job cell lists, found in that folder or a subfolder
    (a missing one is returned as if directly in the folder)."""
    out = set()
    for p in re.findall(r"`([^`]+)`", path_cell):
        out.add(p.rstrip("/"))
        if not p.endswith("/"):
            continue
        under = [os.path.relpath(os.path.join(d, x), ROOT)
                 for d, dirs, files in os.walk(os.path.join(ROOT, p)) for x in dirs + files]
        for name in re.findall(r"`([A-Za-z_][\w/]*(?:\.py|/))`", job_cell):
            name = name.rstrip("/")
            hits = [u for u in under if u == os.path.join(p, name) or u.endswith("/" + name)]
            out |= set(hits) or {os.path.join(p, name)}
    return out


def test_every_path_in_the_module_map_exists():
    rows = _module_map()
    assert len(rows) > 10
    missing = sorted(p for path, job in rows for p in _named_files(path, job)
                     if not os.path.exists(os.path.join(ROOT, p)))
    assert missing == [], f"docs/design.md §4 names paths that do not exist: {missing}"


def test_the_module_map_names_every_module():
    named = set()
    for path, job in _module_map():
        named |= _named_files(path, job)
    unnamed = []
    for pkg in PACKAGES:
        for dirpath, dirs, files in os.walk(os.path.join(ROOT, pkg)):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            rel = os.path.relpath(dirpath, ROOT)
            if rel in named:   # a folder row or entry covers what is inside it
                continue
            for f in files:
                p = os.path.join(rel, f)
                if f.endswith(".py") and f != "__init__.py" and p not in named \
                        and not any(p.startswith(n + "/") for n in named if n != pkg):
                    unnamed.append(p)
    assert unnamed == [], f"modules missing from docs/design.md §4: {sorted(unnamed)}"


def test_every_repo_path_design_md_names_exists():
    """Backticked tokens that look like repo paths (a known top folder, or ``x/y.py``)."""
    tops = {d for d in os.listdir(ROOT) if os.path.isdir(os.path.join(ROOT, d))}
    missing = []
    for token in set(re.findall(r"`([A-Za-z_][\w./-]*)`", _text())):
        head = token.split("/", 1)[0]
        if "/" in token and head in tops | set(PACKAGES):
            if not os.path.exists(os.path.join(ROOT, token.rstrip("/"))):
                missing.append(token)
    assert missing == [], f"docs/design.md names paths that do not exist: {sorted(missing)}"


def test_tests_mirror_the_package():
    """Each test folder is named for a package folder it tests (strata_jax/<x>/, envs_bridge/,
    studies/, benchmarks/, docs/) or holds the shared fixtures; test modules at the top of
    tests/ test top-level modules of strata_jax."""
    tests = os.path.join(ROOT, "tests")
    homes = {d for d in os.listdir(os.path.join(ROOT, "strata_jax"))
             if os.path.isdir(os.path.join(ROOT, "strata_jax", d)) and d != "__pycache__"}
    homes |= {"envs_bridge", "studies", "benchmarks", "docs", "fixtures"}
    folders = {d for d in os.listdir(tests)
               if os.path.isdir(os.path.join(tests, d)) and d != "__pycache__"}
    assert folders - homes == set(), f"test folders with no package folder: {folders - homes}"
    for d in folders - {"fixtures"}:
        assert os.path.exists(os.path.join(tests, d, "__init__.py")), d
        assert any(f.startswith("test_") for f in os.listdir(os.path.join(tests, d))), d
    loose = [f for f in os.listdir(tests) if f.endswith(".py") and not f.startswith("test_")]
    assert sorted(loose) == ["__init__.py", "conftest.py"], loose


def _modules(tops=(*PACKAGES, "benchmarks", "studies")):
    for top in tops:
        for dirpath, dirs, files in os.walk(os.path.join(ROOT, top)):
            dirs[:] = [d for d in dirs if d not in ("__pycache__", "results")]
            for f in files:
                if f.endswith(".py"):
                    yield os.path.join(dirpath, f)


def test_every_module_is_at_most_500_lines():
    long = {}
    for path in _modules():
        with open(path, encoding="utf-8") as f:
            n = sum(1 for _ in f)
        if n > 500:
            long[os.path.relpath(path, ROOT)] = n
    assert long == {}, f"split these along their seams: {long}"


def test_no_module_imports_another_modules_private_names():
    """``from <our module> import _name`` reaches into another module's internals: such a
    name gets a public name (or moves to where it is used). The tests are held to it too."""
    import ast
    ours = (*PACKAGES, "benchmarks", "studies")
    found = []
    for path in _modules((*ours, "tests")):
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and \
                    node.module.split(".")[0] in ours:
                found += [f"{os.path.relpath(path, ROOT)}: {node.module}.{a.name}"
                          for a in node.names if a.name.startswith("_")]
    assert found == []
