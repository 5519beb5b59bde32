"""ScienceWorld's start-up check: a missing or too old Java, or no loopback for py4j, is one line
before anything is built (`envs_bridge.scienceworld_env.check_java_runtime`)."""
import os
import shutil
import stat
import subprocess
import sys

import pytest

from envs_bridge.base import EnvError
from envs_bridge.scienceworld_env import MIN_JAVA, check_java_runtime, java_major_version
from tests.fixtures.paths import REPO_ROOT

ROOT = REPO_ROOT


def test_java_major_version_reads_both_numbering_schemes():
    assert java_major_version('openjdk version "17.0.15" 2025-04-15') == 17
    assert java_major_version('java version "1.8.0_392"\nJava(TM) SE Runtime') == 8
    assert java_major_version('openjdk version "21" 2023-09-19') == 21
    assert java_major_version('java version "1.7.0_80"') == 7
    assert java_major_version("command not found") is None


def _fake_java(tmp_path, version_line, code=0):
    exe = tmp_path / "java"
    exe.write_text(f"#!/bin/sh\necho '{version_line}' >&2\nexit {code}\n")
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return str(exe)


def test_no_java_on_path_is_one_line_saying_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))   # an empty folder: no java
    with pytest.raises(EnvError, match=r"`java` was not found: install Java 17") as e:
        check_java_runtime()
    assert "\n" not in str(e.value)


def test_a_too_old_or_broken_java_is_refused(tmp_path):
    old = _fake_java(tmp_path, 'java version "1.7.0_80"')
    with pytest.raises(EnvError, match=rf"needs Java {MIN_JAVA} or newer .* is Java 7"):
        check_java_runtime(old)
    (tmp_path / "b").mkdir()
    broken = _fake_java(tmp_path / "b", "Error: could not open lib/jvm.cfg", code=1)
    with pytest.raises(EnvError, match=r"said 'Error: could not open lib/jvm.cfg'"):
        check_java_runtime(broken)


@pytest.mark.skipif(shutil.which("java") is None, reason="no Java on this machine")
def test_the_installed_java_passes():
    check_java_runtime()   # raises on this machine's Java 17 if the check were wrong


def _no_loopback_available() -> bool:
    try:
        return subprocess.run(["unshare", "-n", "true"], capture_output=True,
                              timeout=10).returncode != 0
    except (OSError, subprocess.SubprocessError):
        return True


@pytest.mark.skipif(shutil.which("java") is None or _no_loopback_available(),
                    reason="needs Java and `unshare -n` (a network namespace, loopback down)")
def test_no_loopback_is_one_line_naming_it():
    """In a fresh network namespace the loopback interface is down: py4j could not connect."""
    code = ("from envs_bridge.scienceworld_env import check_java_runtime\n"
            "from envs_bridge.base import EnvError\n"
            "try:\n    check_java_runtime()\nexcept EnvError as e:\n    print(e)\n")
    out = subprocess.run(["unshare", "-n", sys.executable, "-c", code], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "connects over loopback and 127.0.0.1 cannot be reached" in out.stdout


@pytest.mark.parametrize("script, extra", [("train.py", []),
                                           ("eval.py", ["--no_checkpoint", "--split=dev"]),
                                           ("sft.py", ["--force"])])
def test_entry_points_refuse_a_missing_java_in_one_line_before_writing(tmp_path, script, extra):
    empty = tmp_path / "bin"
    empty.mkdir()
    workdir = tmp_path / "run"
    out = subprocess.run([sys.executable, script, "--config=configs/sciworld.py:tiny",
                          f"--config.workdir={workdir}", *extra], cwd=ROOT,
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PATH": str(empty)})
    assert out.returncode == 2, out.stderr
    err = [ln for ln in out.stderr.strip().splitlines()
           if " strata_jax" not in ln and " envs_bridge" not in ln]
    assert len(err) == 1 and "`java` was not found" in err[0], out.stderr
    assert "Traceback" not in out.stderr
    assert not workdir.exists()
