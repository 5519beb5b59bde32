"""A broken experiment file is one line naming the file and line, exit 2, before anything is
written (`strata_jax.jobs.cli.load_config`)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from strata_jax.jobs.cli import load_config
from tests.fixtures.paths import REPO_ROOT

BROKEN = {
    "syntax": ("from configs import base\n\ndef get_config(arg=None)\n    return 1\n",
               "bad.py:3: syntax error"),
    "import": ("from configs import base\nimport math\nX = 1 / 0\n",
               "bad.py:3: importing it raised ZeroDivisionError: division by zero"),
    "raises": ("def get_config(arg=None):\n    return {}['nope']\n",
               "bad.py:2: get_config() raised KeyError: 'nope'"),
    "not_a_config": ("def get_config(arg=None):\n    return {'workdir': 'x'}\n",
                     "get_config() returned a dict, not an ml_collections.ConfigDict"),
    "no_get_config": ("X = 1\n", "defines no get_config()"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_load_config_refuses_a_broken_file_in_one_line(tmp_path, case):
    text, want = BROKEN[case]
    path = tmp_path / "bad.py"
    path.write_text(text)
    with pytest.raises(ValueError) as e:
        load_config(str(path))
    assert want in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_train_py_on_a_file_that_raises_at_import_is_one_line_exit_2(tmp_path):
    path = tmp_path / "bad.py"
    path.write_text(BROKEN["import"][0])
    workdir = tmp_path / "run"
    out = subprocess.run([sys.executable, "train.py", f"--config={path}",
                          f"--config.workdir={workdir}"], cwd=REPO_ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "bad.py:3: importing it raised ZeroDivisionError" in lines[0]
    assert not workdir.exists()


def test_an_unknown_split_is_refused_before_the_workdir_is_made(tmp_path):
    workdir = tmp_path / "run"
    out = subprocess.run([sys.executable, "train.py", "--config=configs/builtin.py:tiny",
                          "--config.env.split=nope", f"--config.workdir={workdir}"],
                         cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr
    err = [ln for ln in out.stderr.strip().splitlines()
           if " strata_jax" not in ln and " envs_bridge" not in ln]
    assert len(err) == 1 and "nope" in err[0] and "split" in err[0], out.stderr
    assert not workdir.exists()
