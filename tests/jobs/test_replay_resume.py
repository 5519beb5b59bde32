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

pytestmark = pytest.mark.slow


def _config(workdir, iterations):
    from configs import builtin
    from strata_jax.config import set_override
    c = builtin.get_config("tiny,stapo")
    for key, value in (("iterations", str(iterations)), ("model.warm_start", ""),
                       ("rollout.tasks_per_batch", "1"), ("rollout.num_strategies", "1"),
                       ("rollout.episodes_per_strategy", "2"), ("rollout.group_size", "2"),
                       ("env.max_steps", "2"), ("env.num_workers", "2"),
                       ("rollout.max_action_tokens", "8"), ("rollout.max_strategy_tokens", "8"),
                       ("rollout.max_judge_tokens", "8"), ("eval.every", "0"),
                       ("ckpt.every", "1"), ("compilation_cache_dir", ""),
                       ("replay.enabled", "true"), ("replay.fraction", "0.5"),
                       ("adv.stapo_w_neg", "1.0")):
        set_override(c, key, value)
    c.workdir = str(workdir)
    return c


def _restore(c, step):
    from strata_jax import experiment as ex
    from strata_jax.training import Checkpointer, Trainer, TrainConfig
    tok = ex.build_tokenizer(c)
    model_cfg, params = ex.build_model(c, tok, None)
    trainer = Trainer(model_cfg, TrainConfig.from_config(c), None)
    ckpt = Checkpointer(os.path.join(c.workdir, "ckpt"))
    state, meta = ckpt.restore(trainer.abstract_state(params), step=step)
    ckpt.close()
    return jax.tree.map(np.asarray, jax.device_get(state)), meta["trainer_state"]


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
