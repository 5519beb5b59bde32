"""Same seed, same commit, same machine: same numbers; a resume on another task list is refused.

The smallest built-in job (tests/fixtures/small_job.py: memory_key, the tiny model, an 80-step
behaviour-cloning warm start that already writes some valid actions and strategies, 2
iterations) runs twice as `python train.py` in two processes. The first starts from the
session's warm start (`small_warm_start`, trained by `python sft.py`); the second trains its own
(another cache dir) through train.py's warm-start hook and loads the compiled programs the first
one wrote (the same compilation cache), so the test covers the warm start by both entry points,
the compilation cache, the env pool's threads and the sampler's batching. Every metric that is
not a wall time, a throughput, a memory figure or a compile / cache count must be equal, bit for
bit; so must the episodes written, the two warm starts' weights and the final checkpoint. Then
resuming the second run on its train task list reversed (same size) must be refused.
"""
import glob
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from strata_jax.metrics import read_jsonl
from tests.fixtures.paths import REPO_ROOT
from tests.fixtures.small_job import ONE_DEVICE, restore_run_state
from tests.fixtures.small_job import SMALL as JOB

pytestmark = pytest.mark.slow
ROOT = REPO_ROOT
SMALL = JOB + ["--config.iterations=2", "--config.ckpt.every=1"]
# Wall times, throughputs, memory and compile / cache counts differ between the runs by design.
NOT_REPLAYED = ("time/", "perf/", "compile/", "mem/")


def _run(tmp_path, name, cache_dir):
    workdir = tmp_path / name
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), *SMALL,
           f"--config.workdir={workdir}", f"--config.sft.cache_dir={cache_dir}",
           f"--config.compilation_cache_dir={tmp_path / 'jax_cache'}"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800,
                         env=ONE_DEVICE)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return workdir, out


def _replayed(row):
    return {k: v for k, v in row.items()
            if k not in ("step", "time") and not k.startswith(NOT_REPLAYED)}


def _load_safetensors(path):
    from safetensors.numpy import load_file
    return load_file(path)


def test_same_command_twice_gives_the_same_numbers(tmp_path, monkeypatch, small_warm_start):
    shared, export = small_warm_start
    a, out_a = _run(tmp_path, "a", shared)
    b, out_b = _run(tmp_path, "b", tmp_path / "b_ws")
    assert "loading cached behaviour-cloning export " + export in out_a.stderr   # a trained none
    assert "behaviour cloning into" in out_b.stderr
    rows_a, rows_b = read_jsonl(str(a / "metrics.jsonl")), read_jsonl(str(b / "metrics.jsonl"))
    assert [r["step"] for r in rows_a] == [r["step"] for r in rows_b] == [1, 2]
    # the second process really loaded programs the first one compiled
    assert rows_b[-1]["compile/cache_hits"] > rows_a[-1]["compile/cache_hits"]
    for ra, rb in zip(rows_a, rows_b):
        da, db = _replayed(ra), _replayed(rb)
        assert da.keys() == db.keys()
        assert {"rollout/invalid_step_frac", "rollout/mean_return", "train/loss",
                "train/entropy", "train/grad_norm", "adv/action_mean", "train/tokens",
                "mismatch/sampler_abs"} <= da.keys()
        diff = {k: (da[k], db[k]) for k in da if da[k] != db[k]}
        assert not diff, diff
    # the warm start writes some valid actions and strategies, so the parser, the env steps
    # and uneven episodes are part of what is replayed
    assert rows_a[0]["rollout/invalid_step_frac"] < 1.0
    assert rows_a[0]["rollout/strategy_format_fail_frac"] < 1.0
    # the episodes: every prompt, generated token, action, observation and reward
    eps_a = (a / "trajectories.jsonl").read_text()
    assert eps_a == (b / "trajectories.jsonl").read_text() and eps_a.count("\n") >= 2
    # the warm start each process trained, and the checkpointed params after iteration 2
    ws_a = os.path.join(export, "model.safetensors")
    (ws_b,) = glob.glob(str(tmp_path / "b_ws" / "*" / "model.safetensors"))
    assert os.path.basename(os.path.dirname(ws_b)) == os.path.basename(export)   # one key
    wa, wb = _load_safetensors(ws_a), _load_safetensors(ws_b)
    assert wa.keys() == wb.keys() and all(np.array_equal(wa[k], wb[k]) for k in wa)
    meta_a, meta_b = (json.loads(open(os.path.join(os.path.dirname(p), "sft_meta.json")).read())
                      for p in (ws_a, ws_b))
    assert meta_a["losses"] == meta_b["losses"]
    # the whole checkpointed state after iteration 2: params, optimizer moments, PRNG key, step
    state_a, meta_a = _restore(a)
    state_b, meta_b = _restore(b)
    leaves_a, leaves_b = jax.tree.leaves(state_a), jax.tree.leaves(state_b)
    assert len(leaves_a) == len(leaves_b) > 0
    assert all(np.array_equal(x, y) for x, y in zip(leaves_a, leaves_b))
    assert meta_a["sampler_state"] == meta_b["sampler_state"]

    # Resuming run b on the same number of train tasks in another order is refused: the saved
    # position would continue with other tasks (the task-list fingerprint).
    from strata_jax.jobs import train
    from strata_jax import experiment as ex
    c = _small_config(b)
    c.iterations, c.sft.cache_dir = 3, str(tmp_path / "b_ws")
    c.compilation_cache_dir = ""   # in-process: no process-wide cache setting
    real = ex.task_list
    monkeypatch.setattr(ex, "task_list", lambda c, split=None: real(c, split)[::-1])
    with pytest.raises(ex.ConfigError, match=f"cannot resume {b}: sampler state is for another "
                                             "list of 1000 tasks"):
        train.run(c)
    assert [r["step"] for r in read_jsonl(str(b / "metrics.jsonl"))] == [1, 2]   # untouched


def _small_config(workdir):
    """The config `python train.py` built from the SMALL flags, on `workdir`."""
    from configs import builtin
    from strata_jax.config import set_override
    c = builtin.get_config("tiny")
    for flag in SMALL[1:]:   # after the --config= file
        key, value = flag[len("--config."):].split("=", 1)
        set_override(c, key, value)
    c.workdir = str(workdir)
    return c


def _restore(workdir):
    """The TrainState of checkpoint 2 of a run with the SMALL flags (host numpy leaves)."""
    return restore_run_state(_small_config(workdir), 2)
