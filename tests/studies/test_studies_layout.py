"""The layout of studies/ and benchmarks/: one folder per study with its entry point, write-up
and kept results; no benchmark or study depends on the test suite, and none is named like a
test; each runs as ``python -m`` from the repo root."""
from __future__ import annotations

import ast
import os
import subprocess
import sys
from tests.fixtures.paths import REPO_ROOT

ROOT = REPO_ROOT
STUDIES = sorted(d for d in os.listdir(os.path.join(ROOT, "studies"))
                 if os.path.isdir(os.path.join(ROOT, "studies", d)) and not d.startswith("_"))


def _py_files(top: str) -> list[str]:
    out = []
    for d, _, files in os.walk(os.path.join(ROOT, top)):
        out += [os.path.join(d, f) for f in sorted(files) if f.endswith(".py")]
    return out


def _imported(path: str) -> set[str]:
    """The top-level package of every module `path` imports (lazy imports included)."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
    return out


def test_every_study_has_its_entry_point_write_up_and_command():
    assert STUDIES == ["learning", "learning_real", "memory_key", "memory_key_fair", "options",
                       "sciworld_learning", "stapo_efficiency", "test_time_scaling", "zero_shot"]
    for name in STUDIES:
        folder = os.path.join(ROOT, "studies", name)
        assert os.path.exists(os.path.join(folder, "README.md")), name
        with open(os.path.join(folder, "run.py"), encoding="utf-8") as f:
            tree = ast.parse(f.read())
        assert f"python -m studies.{name}.run" in ast.get_docstring(tree), name
        assert "main" in {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}, name


def test_no_benchmark_or_study_imports_the_tests_or_looks_like_one():
    files = _py_files("benchmarks") + _py_files("studies")
    assert len(files) > 20
    assert [f for f in files if "tests" in _imported(f)] == []
    assert [f for f in files if os.path.basename(f).startswith("test_")] == []
    # the benchmarks measure speed and memory only; no study module is left among them
    assert [f for f in _py_files("benchmarks") if "studies" in _imported(f)] == []


def test_modules_stay_small():
    long = []
    for f in _py_files("studies") + _py_files("benchmarks"):
        with open(f, encoding="utf-8") as fh:
            n = len(fh.read().splitlines())
        if n > 500:
            long.append((os.path.relpath(f, ROOT), n))
    assert long == []


def test_a_study_runs_as_a_module_from_the_repo_root():
    out = subprocess.run([sys.executable, "-m", "studies.memory_key.run", "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "python -m studies.memory_key.run --report" in out.stdout
