"""notebooks/quickstart.ipynb: stored without outputs, install cell tagged and safe on Colab
(clone URL from a variable, re-runnable, Java checked, jax pinned), and executed end to end on
CPU (nbclient + ipykernel) with the tiny ScienceWorld config for 2 iterations, skipping the
install cell, TWICE in the same directory (a re-run after a restart resumes the finished run
instead of failing or retraining); the values it computed are checked against the run's files."""
from __future__ import annotations

import json
import os

import pytest
from tests.fixtures.paths import REPO_ROOT

pytestmark = pytest.mark.slow
ROOT = REPO_ROOT
NOTEBOOK = os.path.join(ROOT, "notebooks", "quickstart.ipynb")

# Appended by the test only: dumps what the notebook's own cells computed.
_PROBE = """import json as _json
print("PROBE " + _json.dumps({
    "workdir": c.workdir, "iterations": c.iterations, "summary_status": summary["status"],
    "summary_step": summary["step"], "row_steps": [r["step"] for r in rows],
    "panels": [k for k, _ in panels], "curves_png": curves_png,
    "shown": {k: shown[k] for k in ("step", "task_uid", "strategy_id", "trajectory_id",
                                      "strategy", "verdict")},
    "lines": len(fig.axes)}))"""


def _is_install(cell) -> bool:
    return "install" in cell.get("metadata", {}).get("tags", []) or \
        cell.source.lstrip().startswith("# INSTALL")


def test_notebook_is_stored_clean_and_valid():
    import nbformat
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    assert nb.nbformat == 4
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(not c.outputs and c.execution_count is None for c in code), "strip outputs"
    installs = [c for c in code if _is_install(c)]
    assert len(installs) == 1 and code.index(installs[0]) == 0
    src = installs[0].source
    assert "pip" in src and '"jax[tpu]>=0.10.2,<0.13"' in src and '"jax[cuda12]>=0.10.2,<0.13"' in src
    assert "-U" not in src                         # an upgrade could leave the jax<0.13 pin
    assert 'REPO_URL = os.environ.get("STRATA_JAX_REPO", "")' in src
    assert "check=False" not in src and 'subprocess.run("java -version", shell=True, check=True)' in src
    # the clone happens only when no checkout is found (here, one level up, or ./strata-jax)
    assert 'os.path.join(os.getcwd(), "strata-jax")' in src and "if _repo_root() is None:" in src
    # no cell deletes the run by default, and the closing eval loads the checkpoint only
    assert "FRESH = False" in nb.cells[3].source
    assert any("run_eval(ce" in c.source for c in code)


def _execute(nb_path, cwd):
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(nb_path, as_version=4)
    nb.cells = [c for c in nb.cells if not (c.cell_type == "code" and _is_install(c))]
    nb.cells.append(nbformat.v4.new_code_cell(_PROBE))
    client = NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": cwd}})
    client.execute()
    text = "".join(o.get("text", "") for o in nb.cells[-1].outputs if o.output_type == "stream")
    return nb, json.loads(text.split("PROBE ", 1)[1])


def test_notebook_runs_tiny_config_on_cpu_twice(tmp_path, monkeypatch):
    from strata_jax.metrics import read_jsonl

    workdir = tmp_path / "quickstart"
    # The kernel inherits this environment: the notebook's config cell reads these (no warm
    # start here: its minutes of SFT are tested in test_sft.py / test_train_e2e.py), and a
    # single CPU device is what a CPU Colab runtime has (the tests' 8 fake devices only slow it).
    monkeypatch.setenv("QUICKSTART_WORKDIR", str(workdir))
    monkeypatch.setenv("QUICKSTART_ITERATIONS", "2")
    monkeypatch.setenv("QUICKSTART_WARM_START", "")
    monkeypatch.setenv("QUICKSTART_EVAL_EPISODES", "1")
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    for run in (1, 2):   # the second run: a restarted runtime re-running every cell
        nb, probe = _execute(NOTEBOOK, os.path.join(ROOT, "notebooks"))
        assert probe["workdir"] == str(workdir) and probe["iterations"] == 2
        assert probe["summary_status"] == "done" and probe["summary_step"] == 2
        # The rows the notebook plotted are the run's metrics file, one per iteration.
        rows = read_jsonl(str(workdir / "metrics.jsonl"))
        assert probe["row_steps"] == [r["step"] for r in rows] == [1, 2], run
        assert {"rollout/mean_return", "rollout/success_rate", "train/loss"} <= set(probe["panels"])
        assert probe["lines"] == len(probe["panels"])
        with open(probe["curves_png"], "rb") as f:
            png = f.read()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
        # The figure was also displayed inline (a PNG in the curves cell's outputs).
        assert any("image/png" in o.get("data", {}) for cell in nb.cells
                   if cell.cell_type == "code" for o in cell.outputs)
        # The trajectory shown is one the run dumped at its last iteration.
        shown = probe["shown"]
        trajs = read_jsonl(str(workdir / "trajectories.jsonl"))
        match = [t for t in trajs if t["step"] == shown["step"]
                 and t["task_uid"] == shown["task_uid"]
                 and t["trajectory_id"] == shown["trajectory_id"]]
        assert shown["step"] == 2 and len(match) == 1
        assert match[0]["strategy"] == shown["strategy"] and match[0]["verdict"] == shown["verdict"]
        outs = {i: "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")
                for i, cell in enumerate(nb.cells) if cell.cell_type == "code"}
        printed = next(t for t in outs.values() if "JUDGE VERDICT" in t)
        assert printed.startswith("=== episode (iteration 2) ")
        assert f"JUDGE VERDICT: {shown['verdict']!r}" in printed
        # the closing eval loaded the step-2 checkpoint (no warm start, no training)
        evaluated = next(t for t in outs.values() if "evaluating checkpoint" in t)
        assert f"evaluating checkpoint step 2 of {workdir}" in evaluated
        assert "episodes 2  (step 2)" in evaluated
        assert os.path.isdir(workdir / "ckpt" / "2")
        assert json.loads((workdir / "eval_dev_step2.json").read_text())["eval/episodes"] == 2.0
