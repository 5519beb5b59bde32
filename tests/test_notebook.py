"""notebooks/quickstart.ipynb: stored without outputs, install cell tagged, and executed end to
end on CPU (nbclient + ipykernel) with the tiny ScienceWorld config for 2 iterations, skipping
the install cell; the values it computed are checked against the run's files."""
from __future__ import annotations

import json
import os

import pytest

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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
    assert "pip" in installs[0].source and "jax[tpu]" in installs[0].source


def test_notebook_runs_tiny_config_on_cpu(tmp_path, monkeypatch):
    import nbformat
    from nbclient import NotebookClient

    from strata_jax.metrics import read_jsonl

    nb = nbformat.read(NOTEBOOK, as_version=4)
    nb.cells = [c for c in nb.cells if not (c.cell_type == "code" and _is_install(c))]
    nb.cells.append(nbformat.v4.new_code_cell(_PROBE))
    workdir = tmp_path / "quickstart"
    # The kernel inherits this environment: the notebook's config cell reads these three (no
    # warm start here: its minutes of SFT are tested in test_sft.py / test_train_e2e.py), and a
    # single CPU device is what a CPU Colab runtime has (the tests' 8 fake devices only slow it).
    monkeypatch.setenv("QUICKSTART_WORKDIR", str(workdir))
    monkeypatch.setenv("QUICKSTART_ITERATIONS", "2")
    monkeypatch.setenv("QUICKSTART_WARM_START", "")
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    client = NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": os.path.join(ROOT, "notebooks")}})
    client.execute()

    text = "".join(o.get("text", "") for o in nb.cells[-1].outputs if o.output_type == "stream")
    probe = json.loads(text.split("PROBE ", 1)[1])
    assert probe["workdir"] == str(workdir) and probe["iterations"] == 2
    assert probe["summary_status"] == "done" and probe["summary_step"] == 2
    # The rows the notebook plotted are the run's metrics file, one per iteration.
    rows = read_jsonl(str(workdir / "metrics.jsonl"))
    assert probe["row_steps"] == [r["step"] for r in rows] == [1, 2]
    assert {"rollout/mean_return", "rollout/success_rate", "train/loss"} <= set(probe["panels"])
    assert probe["lines"] == len(probe["panels"])
    with open(probe["curves_png"], "rb") as f:
        png = f.read()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    # The figure was also displayed inline (a PNG in the curves cell's outputs).
    assert any("image/png" in o.get("data", {}) for cell in nb.cells if cell.cell_type == "code"
               for o in cell.outputs)
    # The trajectory shown is one the run dumped at its last iteration, with strategy + verdict.
    shown = probe["shown"]
    trajs = read_jsonl(str(workdir / "trajectories.jsonl"))
    match = [t for t in trajs if t["step"] == shown["step"] and t["task_uid"] == shown["task_uid"]
             and t["trajectory_id"] == shown["trajectory_id"]]
    assert shown["step"] == 2 and len(match) == 1
    assert match[0]["strategy"] == shown["strategy"] and match[0]["verdict"] == shown["verdict"]
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    printed = "".join(o.get("text", "") for o in code[-2].outputs if o.output_type == "stream")
    assert "STRATEGY:" in printed and f"JUDGE VERDICT: {shown['verdict']!r}" in printed
    assert os.path.isdir(workdir / "ckpt" / "2")
