"""MetricsWriter writes the same scalars to tensorboardX and JSONL."""
import glob
import math
import os

import numpy as np
import pytest

from strata_jax.metrics import MetricsWriter, Progress, memory_metrics, read_jsonl
from tests.fixtures.paths import REPO_ROOT


def test_scalars_and_trajectories_round_trip(tmp_path):
    w = MetricsWriter(str(tmp_path))
    w.scalars(1, {"success": np.float32(0.25), "loss": 1.5, "text": "skip me", "bad": float("nan")})
    w.scalars(2, {"success": 0.5})
    w.trajectories(2, [{"strategy": "go to kitchen", "actions": ["look around"]}])
    w.close()
    rows = read_jsonl(str(tmp_path / "metrics.jsonl"))
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["success"] == 0.25 and rows[0]["loss"] == 1.5
    assert "text" not in rows[0] and rows[0]["bad"] is None
    assert rows[1]["success"] == 0.5
    trajs = read_jsonl(str(tmp_path / "trajectories.jsonl"))
    assert trajs == [{"step": 2, "strategy": "go to kitchen", "actions": ["look around"]}]
    # The tensorboard event file holds the same values.
    tb = read_tb_scalars(glob.glob(str(tmp_path / "tb" / "events.*"))[0])
    assert tb[("success", 1)] == 0.25 and tb[("success", 2)] == 0.5 and tb[("loss", 1)] == 1.5


def read_tb_scalars(path):
    """Parse a TFRecord event file with tensorboardX's own protos: {(tag, step): value}."""
    import struct
    from tensorboardX.proto import event_pb2
    out = {}
    with open(path, "rb") as f:
        data = f.read()
    i = 0
    while i < len(data):
        (n,) = struct.unpack("<Q", data[i:i + 8])
        ev = event_pb2.Event.FromString(data[i + 12:i + 12 + n])
        i += 12 + n + 4
        for v in ev.summary.value:
            out[(v.tag, ev.step)] = v.simple_value
    return out


def test_disabled_writer_writes_nothing(tmp_path):
    w = MetricsWriter(str(tmp_path / "run"), enabled=False)
    assert w.scalars(0, {"a": 1}) == {"a": 1.0}
    w.close()
    assert not (tmp_path / "run").exists()


def test_eta_follows_the_steps_after_the_first():
    from strata_jax.metrics import eta_seconds, format_eta
    # step 1 ended at t=100 (compiling); steps 2-4 took 30 s: 10 s a step, 6 left -> 60 s
    assert eta_seconds(4, 10, 1, 100.0, 130.0) == 60.0
    assert eta_seconds(1, 10, 1, 100.0, 100.0) is None           # only the compiling step
    assert eta_seconds(3, 10, 1, 100.0, 120.0, settle=3) is None  # 2 < 3 settled steps
    assert eta_seconds(4, 10, 1, 100.0, 130.0, settle=3) == 60.0
    assert eta_seconds(6, 8, 5, 50.0, 80.0) == 60.0               # a resume from step 4
    assert eta_seconds(10, 10, 1, 100.0, 500.0) == 0.0
    assert [format_eta(x) for x in (None, 59.6, 119.0, 246.0)] == [
        "eta after compile", "eta 60 s", "eta 119 s", "eta 4.1 min"]


def test_progress_eta():
    import io
    s = io.StringIO()
    p = Progress(total=4, start=0, stream=s)
    p.t0 -= 50.0  # the first iteration took 50 s (compiling): no ETA from it
    assert "1/4" in p.update(1) and "eta after compile" in s.getvalue()
    p.first = (1, p.first[1] - 10.0)   # iteration 2 took 10 s -> 20 s left for 2 more
    line = p.update(2)
    assert "2/4" in line and "eta 20 s" in line


def test_resume_drops_rows_of_lost_iterations(tmp_path):
    # pitfall: a run killed after logging step 2 but before checkpointing it resumes from step 1
    # and logs step 2 again; the log must hold each step once
    w = MetricsWriter(str(tmp_path), tensorboard=False)
    for step in (1, 2):
        w.scalars(step, {"loss": float(step)})
        w.trajectories(step, [{"a": step}])
    w.close()
    w = MetricsWriter(str(tmp_path), tensorboard=False, resume_step=1)
    w.scalars(2, {"loss": 20.0})
    w.close()
    rows = read_jsonl(str(tmp_path / "metrics.jsonl"))
    assert [(r["step"], r["loss"]) for r in rows] == [(1, 1.0), (2, 20.0)]
    assert [t["step"] for t in read_jsonl(str(tmp_path / "trajectories.jsonl"))] == [1]


def test_tensorboard_after_resume_matches_jsonl(tmp_path):
    # steps 1..5, then a resume from the step-3 checkpoint logs steps 4 and 5 again (10 * step):
    # TensorBoard must read one point per step, the resumed values, like metrics.jsonl
    from strata_jax.metrics import read_tensorboard
    w = MetricsWriter(str(tmp_path))
    for step in range(1, 6):
        w.scalars(step, {"v": float(step)})
    w.close()
    w = MetricsWriter(str(tmp_path), resume_step=3)
    for step in (4, 5):
        w.scalars(step, {"v": 10.0 * step})
    w.close()
    want = [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0), (5, 50.0)]
    assert read_tensorboard(str(tmp_path / "tb"))["v"] == want
    rows = read_jsonl(str(tmp_path / "metrics.jsonl"))
    assert [(r["step"], r["v"]) for r in rows] == want
    assert len(glob.glob(str(tmp_path / "tb" / "events.*"))) == 2   # the first file kept


def test_resumed_tags_name_what_was_logged_at_the_resume_step(tmp_path):
    w = MetricsWriter(str(tmp_path), tensorboard=False)
    w.scalars(1, {"loss": 1.0})
    w.scalars(2, {"loss": 2.0})
    w.scalars(2, {"eval/success": 0.5})
    w.scalars(3, {"loss": 3.0})
    w.close()
    w = MetricsWriter(str(tmp_path), tensorboard=False, resume_step=2)
    w.close()
    assert w.resumed_tags == {"loss", "eval/success"}
    w = MetricsWriter(str(tmp_path), tensorboard=False, resume_step=1)
    w.close()
    assert w.resumed_tags == {"loss"}


@pytest.mark.parametrize("name", ["metrics.jsonl", "trajectories.jsonl"])
def test_torn_last_line_is_dropped_with_a_warning(tmp_path, name):
    # what a full disk or a power cut leaves after the step-2 row
    w = MetricsWriter(str(tmp_path), tensorboard=False)
    for step in (1, 2):
        w.scalars(step, {"loss": float(step)})
        w.trajectories(step, [{"a": step}])
    w.close()
    path = tmp_path / name
    with open(path, "a") as f:
        f.write('{"step": 3, "time": 1796078')
    with pytest.warns(RuntimeWarning, match=f"{name}: dropping a torn last line"):
        rows = read_jsonl(str(path))
    assert [r["step"] for r in rows] == [1, 2]
    # a resume (or a fresh writer) repairs the file, and appended rows stay parseable
    with pytest.warns(RuntimeWarning, match=name):
        w = MetricsWriter(str(tmp_path), tensorboard=False, resume_step=2)
    w.scalars(3, {"loss": 30.0})
    w.trajectories(3, [{"a": 3}])
    w.close()
    assert [r["step"] for r in read_jsonl(str(tmp_path / "metrics.jsonl"))] == [1, 2, 3]
    assert [r["a"] for r in read_jsonl(str(tmp_path / "trajectories.jsonl"))] == [1, 2, 3]


def test_damaged_middle_line_names_file_and_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2, "ti\n{"step": 3}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl: line 2 is not JSON"):
        read_jsonl(str(path))
    # a resume meets it in MetricsWriter: a user error (one line from the entry point), and
    # the file is left as it was
    from strata_jax.metrics import DamagedLogError
    with pytest.raises(DamagedLogError, match=r"line 2 is not JSON .*repair or remove that line"):
        MetricsWriter(str(tmp_path), resume_step=1)
    assert path.read_text() == '{"step": 1}\n{"step": 2, "ti\n{"step": 3}\n'


def test_tensorboard_point_is_on_disk_when_scalars_returns(tmp_path):
    # kill -9 right after a row is logged: TensorBoard must already hold it, like metrics.jsonl
    # (tensorboardX's SummaryWriter queued it for a thread that writes within 120 s)
    from strata_jax.metrics import read_tensorboard
    w = MetricsWriter(str(tmp_path), resume_step=0)
    w.scalars(1, {"eval/success": 0.5})
    w.text(1, "episodes/0", "a sample episode")   # the text tab: not a scalar series
    assert read_tensorboard(str(tmp_path / "tb")) == {"eval/success": [(1, 0.5)]}
    assert [r["eval/success"] for r in read_jsonl(str(tmp_path / "metrics.jsonl"))] == [0.5]
    w.close()


def test_memory_metrics_host_peak_and_device_peak():
    import subprocess
    import sys

    # A process that touches 400 MiB, started by one that holds 800 MiB: its peak is at least
    # 400 MiB and at most that plus the interpreter and numpy (~100 MiB), not the parent's (Linux's
    # ru_maxrss carries the parent's resident set across fork + exec; pytest itself holds GBs).
    # Then it frees them (numpy maps an array that large, so the pages go back to the OS): the
    # resident set now is 400 MiB below the peak, which stays.
    child = ("import numpy as np; a = np.ones(400 * 2**20, np.uint8); "
             "from strata_jax.metrics import memory_metrics; "
             "m = memory_metrics(devices=[]); del a; n = memory_metrics(devices=[]); "
             "print(m['mem/host_peak_rss_gb'], m['mem/host_rss_gb'], n['mem/host_peak_rss_gb'], "
             "n['mem/host_rss_gb'])")
    parent = ("import subprocess, sys, numpy as np; big = np.ones(800 * 2**20, np.uint8); "
              f"print(subprocess.run([sys.executable, '-c', {child!r}], capture_output=True, "
              "text=True, check=True).stdout)")
    out = subprocess.run([sys.executable, "-c", parent], capture_output=True, text=True,
                         check=True, cwd=REPO_ROOT)
    peak, rss, peak_after, rss_after = map(float, out.stdout.strip().splitlines()[-1].split())
    assert 400 / 1024 <= peak < 600 / 1024, peak
    # (the kernel's per-thread RSS counters are synced lazily: equal to within a few pages)
    assert 400 / 1024 <= rss <= peak + 1e-3 and abs(peak_after - peak) < 1e-3, (rss, peak,
                                                                                 peak_after)
    assert 390 / 1024 <= rss - rss_after <= 410 / 1024, (rss, rss_after)

    class Device:   # a backend's memory_stats(): the largest peak wins, a missing one is skipped
        def __init__(self, stats):
            self.stats = stats

        def memory_stats(self):
            if isinstance(self.stats, Exception):
                raise self.stats
            return self.stats
    devices = [Device({"peak_bytes_in_use": 3 * 2**30, "bytes_in_use": 2**30}),
               Device({"bytes_in_use": 5 * 2**29}), Device(None), Device(RuntimeError("cpu"))]
    m = memory_metrics(devices)
    assert m["mem/device_peak_gb"] == 3.0
    assert "mem/device_peak_gb" not in memory_metrics([Device(None)])


def test_host_memory_parts_counts_live_arrays_and_their_bytes():
    import ctypes.util
    import gc

    import jax.numpy as jnp

    from strata_jax.metrics import host_memory_parts
    gc.collect()
    before = host_memory_parts()
    x = jnp.zeros((1024, 256), jnp.float32)   # 1 MiB
    x.block_until_ready()
    after = host_memory_parts()
    assert after["mem/live_arrays"] == before["mem/live_arrays"] + 1
    assert math.isclose(after["mem/live_array_gb"] - before["mem/live_array_gb"], 2**20 / 2**30)
    assert after["mem/gc_objects"] > 0
    # cyclic garbage made since is collected before the count: it does not show as growth
    for _ in range(1000):
        cycle = []
        cycle.append(cycle)
    del cycle
    assert host_memory_parts()["mem/gc_objects"] <= after["mem/gc_objects"] + 10
    if ctypes.util.find_library("c") and hasattr(ctypes.CDLL(ctypes.util.find_library("c")),
                                                 "mallinfo2"):
        assert after["mem/malloc_in_use_gb"] > 0 and after["mem/malloc_free_gb"] >= 0
    assert "mem/python_heap_gb" not in after   # tracemalloc is off
    del x
