"""MetricsWriter writes the same scalars to tensorboardX and JSONL (issue 8)."""
import glob
import math

import numpy as np

from strata_jax.metrics import MetricsWriter, Progress, read_jsonl


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


def test_progress_eta():
    import io
    s = io.StringIO()
    p = Progress(total=4, start=0, stream=s)
    p.t0 -= 10.0  # pretend 10 s went by for 2 iterations -> 10 s left for 2 more
    line = p.update(2)
    assert "2/4" in line and "eta   10.0s" in line


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
