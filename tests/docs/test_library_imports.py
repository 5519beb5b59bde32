"""The library stands alone: no module of strata_jax or envs_bridge imports the repo's
``configs/`` (not part of the installed package), at module level or inside a function, and
every module imports from a directory that holds only the two packages."""
from __future__ import annotations

import ast
import os
import pathlib
import shutil
import subprocess
import sys
from tests.fixtures.paths import REPO_ROOT

ROOT = pathlib.Path(REPO_ROOT)
PACKAGES = ("strata_jax", "envs_bridge")


def _imported_modules(path: pathlib.Path) -> set[str]:
    """Every module name an `import` / `from ... import` statement of the file names."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def test_no_library_module_imports_configs():
    offenders = {}
    files = [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")]
    assert len(files) > 50
    for p in files:
        bad = sorted(m for m in _imported_modules(p) if m == "configs" or m.startswith("configs."))
        if bad:
            offenders[str(p.relative_to(ROOT))] = bad
    assert offenders == {}


def test_every_module_imports_outside_the_repo(tmp_path):
    """`import strata_jax.experiment` (and every other module) with only the packages on
    sys.path and the working directory elsewhere, as an installed copy runs."""
    site = tmp_path / "site"
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, site / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    code = (
        "import importlib, pkgutil, sys\n"
        "import strata_jax.experiment\n"
        "names = []\n"
        f"for pkg in {PACKAGES!r}:\n"
        "    mod = importlib.import_module(pkg)\n"
        "    names.append(pkg)\n"
        "    for info in pkgutil.walk_packages(mod.__path__, pkg + '.'):\n"
        "        importlib.import_module(info.name)\n"
        "        names.append(info.name)\n"
        "assert 'configs' not in sys.modules, 'a library module imported configs'\n"
        "assert strata_jax.experiment.__file__.startswith(sys.argv[1]), "
        "strata_jax.experiment.__file__\n"
        "print(len(names))\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=str(site), JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", code, str(site)], cwd=elsewhere, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert int(out.stdout.strip().splitlines()[-1]) > 50
