"""STAPO's replay pool through a resume (strata_jax/training/replay.py, docs/method.md §7.5):
a run stopped after iteration 1 and resumed to 2 holds the same pool, and makes the same
update, as the run of 2 iterations in one go.

The loop runs in this process (`strata_jax.jobs.train.run`) on the built-in memory_key env
with the tiny random model, algo=stapo, replay on, no warm start, 1 task per iteration (it
compiles the sampler and the update, hence slow)."""
import os

import jax
import numpy as np
import pytest

from tests.fixtures.small_job import restore_run_state, smallest_config

pytestmark = pytest.mark.slow


def _config(workdir, iterations):
    return smallest_config(workdir, "tiny,stapo", iterations=str(iterations),
                           rollout__num_strategies="1", rollout__episodes_per_strategy="2",
                           ckpt__every="1", replay__enabled="true", replay__fraction="0.5",
                           adv__stapo_w_neg="1.0")


def _restore(c, step):
    state, meta = restore_run_state(c, step)
    return state, meta["trainer_state"]


def test_a_resumed_run_holds_the_same_pool_and_makes_the_same_update(tmp_path):
    from strata_jax.jobs import train
    from strata_jax.metrics import read_jsonl
    whole = _config(tmp_path / "whole", 2)
    assert train.run(whole)["status"] == "done"
    split = _config(tmp_path / "split", 1)
    assert train.run(split)["status"] == "done"
    assert train.run(_config(tmp_path / "split", 2))["step"] == 2   # resumes from step 1
    rows = read_jsonl(os.path.join(whole.workdir, "metrics.jsonl"))
    assert rows[1]["replay/rows"] > 0 and rows[1]["replay/mean_age"] == 1.0   # it replayed
    again = read_jsonl(os.path.join(split.workdir, "metrics.jsonl"))
    for k in ("replay/rows", "replay/pool_rows", "replay/fraction", "train/pg_loss"):
        assert again[1][k] == pytest.approx(rows[1][k], rel=1e-5), k
    for step in (1, 2):
        (s_a, h_a), (s_b, h_b) = _restore(whole, step), _restore(split, step)
        assert h_a["replay"] == h_b["replay"] and h_a["replay"]["rows"] > 0
        assert h_a["host_arrays"].keys() == h_b["host_arrays"].keys()
        for k, v in h_a["host_arrays"].items():
            np.testing.assert_array_equal(h_b["host_arrays"][k], v, err_msg=k)
        for a, b in zip(jax.tree.leaves(s_a), jax.tree.leaves(s_b)):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
