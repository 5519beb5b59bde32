"""The package installs: pyproject.toml and the requirements files agree, and a wheel built from
the repo, installed without dependencies into a fresh venv, imports and validates a config from
outside the checkout (offline: no package index is contacted)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from tests.fixtures.paths import REPO_ROOT

ROOT = REPO_ROOT


def _pyproject() -> dict:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def _requirements(name: str) -> dict[str, Requirement]:
    """The requirements a requirements file names itself (``-r`` includes are not followed)."""
    out = {}
    with open(os.path.join(ROOT, name)) as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if line and not line.startswith("-"):
                req = Requirement(line)
                out[canonicalize_name(req.name)] = req
    return out


def _by_name(reqs: list[str]) -> dict[str, Requirement]:
    return {canonicalize_name(Requirement(r).name): Requirement(r) for r in reqs}


def _within(pinned: SpecifierSet, declared: SpecifierSet) -> bool:
    """Whether every version `pinned` allows is one `declared` allows: equal specifiers, or
    `pinned` is an exact pin inside `declared`, or `declared` is open."""
    if not str(declared) or str(pinned) == str(declared):
        return True
    exact = [s for s in pinned if s.operator == "=="]
    return bool(exact) and all(declared.contains(s.version) for s in exact)


def _check_agree(pinned: dict[str, Requirement], declared: dict[str, Requirement]) -> None:
    assert sorted(pinned) == sorted(declared)
    for name, req in pinned.items():
        assert _within(req.specifier, declared[name].specifier), (
            f"{name}: requirements pin {req.specifier} outside pyproject's "
            f"{declared[name].specifier}")


def test_runtime_dependencies_agree_with_requirements_txt():
    _check_agree(_requirements("requirements.txt"), _by_name(_pyproject()["project"]["dependencies"]))


def test_test_extra_agrees_with_requirements_test_txt():
    _check_agree(_requirements("requirements-test.txt"),
                 _by_name(_pyproject()["project"]["optional-dependencies"]["test"]))


def test_agreement_check_catches_a_drift():
    """The check above can fail: a dropped package and an out-of-range pin are both caught."""
    declared = _by_name(["jax>=0.10.2,<0.13", "numpy>=2.0"])
    with pytest.raises(AssertionError):
        _check_agree(_by_name(["jax>=0.10.2,<0.13"]), declared)
    with pytest.raises(AssertionError):
        _check_agree(_by_name(["jax==0.13.1", "numpy>=2.0"]), declared)
    _check_agree(_by_name(["jax==0.12.0", "numpy==2.1.0"]), declared)


def test_gpu_and_tpu_extras_keep_the_jax_range():
    deps = _by_name(_pyproject()["project"]["dependencies"])
    extras = _pyproject()["project"]["optional-dependencies"]
    for extra in ("gpu", "tpu"):
        (req,) = [Requirement(r) for r in extras[extra]]
        assert canonicalize_name(req.name) == "jax"
        assert req.specifier == deps["jax"].specifier


def test_license_and_citation_exist():
    with open(os.path.join(ROOT, "LICENSE")) as f:
        assert "Apache License" in f.read(200)
    with open(os.path.join(ROOT, "CITATION.cff")) as f:
        cff = f.read()
    assert "cff-version:" in cff and "license: Apache-2.0" in cff
    assert _pyproject()["project"]["license"] == "Apache-2.0"   # SPDX (setuptools >= 77)
    assert _pyproject()["project"]["license-files"] == ["LICENSE"]


def test_wheel_installs_and_validates_a_config_outside_the_checkout(tmp_path):
    """Build the wheel from a copy of the sources (no build isolation, no index), install it with
    --no-deps into a venv that sees this environment's packages, and from another directory load
    `configs.builtin:tiny` and run the library's config validation on it."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(os.path.join(ROOT, name), src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for pkg in ("strata_jax", "envs_bridge", "configs"):
        shutil.copytree(os.path.join(ROOT, pkg), src / pkg, ignore=ignore)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    env["PIP_NO_INDEX"] = "1"
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(wheels), str(src)], check=True, env=env, cwd=tmp_path)
    (wheel,) = list(wheels.glob("strata_jax-*.whl"))

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = str(venv / "bin" / "python")
    site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    # The fresh venv sees this environment's packages (jax, flax, ...) after its own.
    ours = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    with open(os.path.join(site, "_test_env.pth"), "w") as f:
        f.write("\n".join(sorted(ours)) + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", py, "install", "--no-deps", "-q",
                    str(wheel)], check=True, env=env, cwd=tmp_path)

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    probe = (
        "import strata_jax, configs, envs_bridge\n"
        "from configs import builtin\n"
        "from strata_jax.validation import validate\n"
        "c = builtin.get_config('tiny')\n"
        "validate(c)\n"
        "print(strata_jax.__file__); print(configs.__file__); print(c.env.name)\n")
    out = subprocess.run([py, "-c", probe], check=True, capture_output=True, text=True,
                         env=env, cwd=elsewhere).stdout.split()
    assert all(p.startswith(site) for p in out[:2]), out
    assert out[2] == "memory_key"
