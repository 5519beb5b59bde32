"""The STAPO sample-efficiency study's queue (studies/stapo_efficiency/run.py): the registered
jobs in order, the LoRA warm start kept under --results, each arm's config as the write-up
registers it (the same task, prompts, critic, episodes and optimizer; only the weighting and
the replay pool differ), the warm-start rule on hand-made dev checks, and the chosen warm
start filled into every later job."""
from __future__ import annotations

import json
import os
import re

import pytest

from studies.memory_key import queue as mq
from studies.stapo_efficiency import run as st
from tests.fixtures.study_jobs import job_config


@pytest.fixture()
def queue(tmp_path):
    a = st.registered_args(["--out", str(tmp_path / "runs"), "--results", str(tmp_path / "res")])
    return a, st.jobs(a)


def _finish(a, job, success):
    """Write `job`'s eval file with `success` and its argv marker: a finished job."""
    os.makedirs(os.path.dirname(job["done"]), exist_ok=True)
    with open(job["done"], "w") as f:
        json.dump({"eval/success": success}, f)
    with open(mq.marker(job), "w") as f:
        json.dump(mq.job_key(job), f)


def test_the_registered_jobs_in_order(queue):
    a, q = queue
    runs = [f"run_{arm}_s{s}" for s in (0, 1, 2) for arm in ("ppo", "stapo", "stapo_replay")]
    assert [j["name"] for j in q] == ["bc_export", "dev_check", "start"] + runs


def test_the_arms_differ_only_in_weighting_and_replay(queue):
    a, q = queue
    by = {j["name"]: j for j in q}
    # the warm start is only known after its dev check: fill it in by hand here
    cfgs = {arm: job_config(mq.fill_placeholder(by[f"run_{arm}_s1"], st.WARM, "/ws"))
            for arm in st.ARMS}
    p, s, r = cfgs["ppo"], cfgs["stapo"], cfgs["stapo_replay"]
    assert (p.algo, s.algo, r.algo) == ("ppo", "stapo", "stapo")
    assert (p.replay.enabled, s.replay.enabled, r.replay.enabled) == (False, False, True)
    for c in (p, s, r):
        assert c.seed == 1 and c.model.warm_start == "/ws"
        assert (c.env.name, c.env.max_steps, c.rollout.cumulative_prompts, c.train.critic) == (
            "guess_number", 7, True, "head")
        assert (c.rollout.tasks_per_batch * c.rollout.group_size, c.iterations,
                c.optim.mini_batch_size, c.lora.rank, c.optim.lr, c.optim.critic_lr) == (
            16, 12, 56, 16, 2e-5, 1e-5)
        assert (c.loss.kl_coef, c.loss.entropy_coef, c.eval.every, c.eval.max_tasks,
                c.eval.split) == (0, 0, 4, 48, "test")


def test_the_warm_start_is_lora_cloning_kept_under_results(queue):
    a, q = queue
    ws = job_config(q[0])
    assert q[0]["argv"][-1] == "--out=" + st.export_dir(a)
    assert st.export_dir(a).startswith(os.path.abspath(a.results))
    assert (ws.model.warm_start, ws.sft.lora_rank, ws.sft.episodes, ws.sft.steps, ws.sft.noise,
            ws.sft.strategy_mode) == ("sft", 16, 32, 30, 0.3, "flat")
    check = job_config(q[1])
    assert check.model.warm_start == st.export_dir(a) and "--split=dev" in q[1]["argv"]


def test_the_warm_start_rule_on_hand_made_dev_checks(queue):
    a, q = queue
    by = {j["name"]: j for j in q}
    assert st.chosen_warm_start(a) is None and st.resolve(a, by["start"]) is None
    assert st.resolve(a, by["bc_export"]) is by["bc_export"]
    # a file no finished job wrote (no argv marker) decides nothing
    os.makedirs(os.path.dirname(by["dev_check"]["done"]))
    with open(by["dev_check"]["done"], "w") as f:
        json.dump({"eval/success": 0.4}, f)
    assert st.chosen_warm_start(a) is None
    _finish(a, by["dev_check"], 0.40)   # inside [0.15, 0.70]: the first build
    assert st.chosen_warm_start(a) == st.export_dir(a)
    assert [j["name"] for j in st.jobs(a)][:3] == ["bc_export", "dev_check", "start"]
    assert job_config(st.resolve(a, by["start"])).model.warm_start == st.export_dir(a)
    for success, tokens in ((0.9, ["sft.noise=0.6"]), (0.05, ["sft.steps=60"])):
        _finish(a, by["dev_check"], success)
        q2 = st.jobs(a)
        names = [j["name"] for j in q2]
        assert names[:5] == ["bc_export", "dev_check", "bc_rebuild", "dev_check_rebuild",
                             "start"]
        assert st.rebuild_tokens(success) == tokens
        rebuilt = job_config(q2[2])
        assert (rebuilt.sft.noise, rebuilt.sft.steps) == ((0.6, 30) if success > 0.7
                                                          else (0.3, 60))
        assert st.chosen_warm_start(a) is None   # the rebuild's check has not run
    _finish(a, st.jobs(a)[3], 0.95)   # the rebuild is used whatever its check says
    assert st.chosen_warm_start(a) == st.export_dir(a, "bc_rebuild")


def test_a_damaged_eval_file_is_refused_with_what_to_do(tmp_path):
    path = tmp_path / "eval.json"
    for bad, message in (("{oops", "is not an eval file"), ("[1]", "holds a list"), ("{}", "eval/success is None"),
                         ('{"eval/success": 1.5}', "is 1.5, not a number in [0, 1]"),
                         ('{"eval/success": NaN}', "is nan"),
                         ('{"eval/success": true}', "is True")):
        path.write_text(bad)
        with pytest.raises(ValueError, match=re.escape(message)):
            st.read_success(str(path))
    path.write_text('{"eval/success": 0.25}')
    assert st.read_success(str(path)) == 0.25
