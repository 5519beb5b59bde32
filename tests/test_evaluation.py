"""Evaluation: per-family summaries by the env's family, flat baselines' metrics, and
test-time strategy scaling (strata_jax/test_time.py) with a scripted policy on memory_key."""
from __future__ import annotations

import pytest

from envs_bridge import Task
from strata_jax.evaluation import format_metrics, summarize, task_family
from strata_jax.rollout.episodes import EpisodeSpec, StepRecord, Trajectory

GAME = ("/data/alfworld/json_2.1.1/valid_unseen/pick_cool_then_place_in_recep-Apple-None-"
        "Fridge-7/trial_T20190909_044715_250790/game.tw-pddl")


def _played(task: Task, family: str, reward: float, crashed: bool = False) -> Trajectory:
    tr = Trajectory(EpisodeSpec(task, 0, 0, 0), family=family, crashed=crashed)
    tr.steps.append(StepRecord(None, None, "", "look", False, "obs", reward=reward))
    tr.success = reward >= 1.0
    return tr


def test_summarize_groups_alfworld_by_its_task_type_not_the_game_path():
    other = GAME.replace("pick_cool_then_place_in_recep-Apple", "pick_and_place_simple-Mug")
    trs = [_played(Task("alfworld", GAME), "pick_cool_then_place_in_recep", 1.0),
           # a crashed reset has no info: the family comes from the path
           _played(Task("alfworld", GAME), "", 0.0, crashed=True),
           _played(Task("alfworld", other), "pick_and_place_simple", 0.0)]
    assert task_family(Task("alfworld", GAME)) == "pick_cool_then_place_in_recep"
    m = summarize(trs, "alfworld")
    fams = sorted(k.split("/")[2] for k in m if k.endswith("/success") and "/family/" in k)
    assert fams == ["pick_and_place_simple", "pick_cool_then_place_in_recep"]
    assert m["eval/family/pick_cool_then_place_in_recep/success"] == 0.5
    assert m["eval/family/pick_and_place_simple/success"] == 0.0
    assert m["eval/success"] == pytest.approx(1 / 3)


def test_format_metrics_omits_strategy_failures_of_a_flat_baseline():
    base = {"eval/success": 0.5, "eval/score": 50.0, "eval/episodes": 2.0, "step": 3,
            "eval/invalid_step_frac": 0.25, "eval/env_rejected_frac": 0.0}
    assert "strategy format failures" not in format_metrics(base)
    strata = format_metrics({**base, "eval/strategy_format_fail_frac": 0.5})
    assert "strategy format failures 0.500" in strata
