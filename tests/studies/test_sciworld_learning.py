"""The ScienceWorld learning study's queue (studies/sciworld_learning/run.py): the registered
jobs in order, the warm start as LoRA adapters written under --results, each arm's config as
the write-up registers it, the family rule on hand-made screens, and the chosen families filled
into every later job."""
from __future__ import annotations

import json
import os
import re

import pytest

from studies.sciworld_learning import run as sw
from tests.fixtures.study_jobs import job_config


@pytest.fixture()
def queue(tmp_path):
    a = sw.registered_args(["--out", str(tmp_path / "runs"), "--results", str(tmp_path / "res")])
    return a, sw.jobs(a)


def test_the_registered_jobs_in_order(queue):
    a, q = queue
    assert [j["name"] for j in q] == [
        "warm_start", "screen", "start_strata", "start_flat",
        "run_grpo_s0", "final_grpo_s0", "run_strata_s0", "final_strata_s0",
        "run_grpo_s1", "final_grpo_s1", "run_strata_s1", "final_strata_s1"]


def test_the_warm_start_is_lora_cloning_of_the_screen_families_kept_under_results(queue):
    a, q = queue
    ws = q[0]
    c = job_config(ws)
    assert ws["argv"][-1] == "--out=" + sw.export_dir(a)
    assert sw.export_dir(a).startswith(os.path.abspath(a.results))
    assert ws["done"] == os.path.join(sw.export_dir(a), "sft_meta.json")
    assert (c.sft.lora_rank, c.sft.lora_alpha, c.sft.episodes, c.sft.steps, c.sft.lr) == (
        16, 64, 28, 30, 1e-4)
    assert tuple(c.env.tasks) == sw.SCREEN_FAMILIES and c.env.max_steps == 15
    assert c.model.path == "qwen2.5-coder-0.5b-instruct" and c.model.dtype == "float32"
    # every later job loads that export by its folder, never a cache lookup
    for job in q[1:]:
        assert job_config(job).model.warm_start == sw.export_dir(a), job["name"]


def test_each_arms_config_is_the_registered_one(queue):
    a, q = queue
    by = {j["name"]: j for j in q}
    g, s = job_config(by["run_grpo_s1"]), job_config(by["run_strata_s0"])
    assert (g.algo, s.algo, g.seed, s.seed) == ("grpo", "strata", 1, 0)
    assert g.rollout.group_size == 8 == s.rollout.num_strategies * s.rollout.episodes_per_strategy
    for c in (g, s):
        assert (c.iterations, c.lora.rank, c.optim.lr, c.rollout.temperature, c.loss.kl_coef,
                c.loss.entropy_coef, c.rollout.tasks_per_batch, c.env.max_steps) == (
            15, 16, 2e-5, 0.6, 0, 0, 1, 15)
    ev = job_config(by["final_strata_s0"])
    assert ev.seed == 0 == job_config(by["start_strata"]).seed
    assert by["final_strata_s0"]["argv"][-1] == "--adapter=" + os.path.join(
        os.path.abspath(a.out), "run_strata_s0", "adapters", "step15")
    assert "--split=dev" in by["screen"]["argv"] and "--split=test" in by["final_grpo_s0"]["argv"]


def _screen(values):
    out = {}
    for f, (succ, score) in zip(sw.SCREEN_FAMILIES, values):
        out[f"eval/family/{f}/success"], out[f"eval/family/{f}/score"] = succ, score
    return out


def test_the_family_rule_on_hand_made_screens():
    f = sw.SCREEN_FAMILIES
    # success in [0.10, 0.60] or score in [20, 70]; nearest 0.35 first, at most 3
    screen = _screen([(0.0, 5.0), (0.375, 50.0), (0.125, 30.0), (0.8, 90.0), (0.0, 25.0),
                      (0.3125, 40.0), (1.0, 100.0)])
    # qualifying: f[1] (|.375-.35|=.025), f[2] (.225), f[4] by score (.35), f[5] (.0375)
    assert sw.choose_families(screen) == [f[1], f[5], f[2]]
    # one qualifies: too few, the queue stops
    assert sw.choose_families(_screen([(0.0, 0.0)] * 6 + [(0.5, 60.0)])) == []
    assert sw.choose_families(_screen([(0.0, 0.0)] * 5 + [(0.6, 10.0), (0.1, 10.0)])) == [
        f[5], f[6]]


def test_the_chosen_families_fill_every_later_job(queue, tmp_path):
    a, q = queue
    by = {j["name"]: j for j in q}
    assert sw.resolve(a, by["screen"]) is by["screen"]
    assert sw.resolve(a, by["run_strata_s0"]) is None   # no screen yet
    os.makedirs(os.path.join(a.out, "screen"))
    f = sw.SCREEN_FAMILIES
    with open(os.path.join(a.out, "screen", "eval_dev_step0.json"), "w") as fh:
        json.dump(_screen([(0.0, 0.0), (0.25, 30.0), (0.0, 0.0), (0.0, 0.0), (0.5, 60.0),
                           (0.0, 0.0), (0.0, 0.0)]), fh)
    # a screen file that no finished screen job wrote (no argv marker) chooses nothing
    assert sw.chosen_families(a) is None and sw.resolve(a, by["run_strata_s0"]) is None
    from studies.memory_key import queue as mq
    with open(mq.marker(by["screen"]), "w") as fh:
        json.dump(mq.job_key(by["screen"]), fh)
    job = sw.resolve(a, by["run_strata_s0"])
    assert tuple(job_config(job).env.tasks) == (f[1], f[4])   # in the screen's order
    assert sw.chosen_families(a) == [f[1], f[4]]


def test_paired_statistics_on_hand_values():
    import math
    from studies.memory_key import stats
    # five positive differences, no ties: exact one-sided p = 1 / 2^5
    assert math.isclose(stats.wilcoxon_greater([1.0, 2.0, 3.0, 4.0, 5.0]), 1 / 32)
    assert stats.wilcoxon_greater([0.0, 0.0]) == 1.0
    assert stats.bootstrap_mean_interval([7.0] * 5) == (7.0, 7.0, 7.0)
    # 400 alternating 0 / 1: mean 0.5, standard error 0.025 -> about 0.5 -+ 0.049
    m, lo, hi = stats.bootstrap_mean_interval([0.0, 1.0] * 200)
    assert m == 0.5 and abs(lo - 0.451) < 0.006 and abs(hi - 0.549) < 0.006
    assert stats.bootstrap_mean_interval([0.0, 1.0] * 200) == (m, lo, hi)   # seeded


def test_a_trained_policy_against_its_start_on_the_same_variations():
    from studies.sciworld_learning import report as rp

    def ep(fam, var, ok, ret):
        return dict(task_id=fam, variation=var, success=ok, episode_return=ret,
                    steps=[dict(invalid=False, env_rejected=False)] * 3)

    start = rp.episode_rows([ep("find-plant", 1, False, 0.25), ep("find-plant", 2, False, 0.0),
                             ep("find-plant", 3, True, 1.0), ep("find-animal", 4, False, 0.5)])
    after = rp.episode_rows([ep("find-plant", 1, True, 1.0), ep("find-plant", 2, False, 0.25),
                             ep("find-plant", 3, True, 1.0), ep("find-animal", 4, True, 1.0),
                             ep("find-animal", 9, True, 1.0)])   # no partner: left out
    t = rp.against_start(after, start)
    assert (t["pairs"], t["unpaired"], t["gained"], t["lost"]) == (4, 1, 2, 0)
    assert abs(t["mcnemar_p"] - 0.25) < 1e-12            # both discordant pairs gains: 0.5^2
    assert abs(t["fisher_p"] - 17 / 70) < 1e-12          # P(X >= 3), 4 of 8 successes, 4 drawn
    assert t["score_diff"] == (75 + 25 + 0 + 50) / 4     # scores 0-100
    s = rp.policy_summary(start)
    assert (s["n"], s["k"], s["score"]) == (4, 1, (25 + 0 + 100 + 50) / 4)


def test_a_damaged_screen_file_is_refused_with_what_to_do(tmp_path):
    good = _screen([(0.25, 30.0)] * 7)
    for bad, message in (("garbage{", "is not an eval file"), ("[1, 2]", "holds a list"),
                         ("{}", "eval/family/find-non-living-thing/success is None"),
                         (json.dumps({**good, "eval/family/find-plant/success": float("nan")}),
                          "find-plant/success is nan"),
                         (json.dumps({**good, "eval/family/find-plant/success": 35}),
                          "find-plant/success is 35, not a number in [0, 1]"),
                         (json.dumps({**good, "eval/family/find-plant/score": True}),
                          "find-plant/score is True")):
        path = tmp_path / "screen.json"
        path.write_text(bad)
        with pytest.raises(ValueError, match=re.escape(message)):
            sw.read_screen(str(path))
    path.write_text(json.dumps(good))
    assert sw.read_screen(str(path)) == good
