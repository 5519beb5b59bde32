"""ALFWorld adapter: clear error without data, family from path, legacy `put` mapping, and
small games built offline from the package's PDDL domain + grammar (expert plan wins)."""
import re

import pytest

from envs_bridge import Task
from envs_bridge.alfworld_env import ALFWorldDataError, ALFWorldEnv, family_from_game_path, map_legacy_put

ADM = ["go to fridge 1", "move apple 1 to fridge 1", "move apple 1 to countertop 1", "examine apple 1", "help"]


def test_missing_data_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.delenv("ALFWORLD_DATA", raising=False)
    with pytest.raises(ALFWorldDataError, match="alfworld-download"):
        ALFWorldEnv.task_list("train")
    monkeypatch.setenv("ALFWORLD_DATA", str(tmp_path / "nope"))
    with pytest.raises(ALFWorldDataError, match="not a directory"):
        ALFWorldEnv.task_list("train")
    monkeypatch.setenv("ALFWORLD_DATA", str(tmp_path))
    with pytest.raises(ALFWorldDataError, match="no solvable"):
        ALFWorldEnv.task_list("test")


def test_family_from_game_path():
    assert family_from_game_path(
        "/d/json_2.1.1/valid_seen/pick_cool_then_place_in_recep-Apple-None-Fridge-7/trial_T1/game.tw-pddl"
    ) == "pick_cool_then_place_in_recep"
    assert family_from_game_path("train/pick_two_obj_and_place-Book-None-Desk-1/t/game.tw-pddl") == "pick_two_obj_and_place"
    assert family_from_game_path("x/pick_and_place_simple-Pen-None-Desk-2/game.tw-pddl") == "pick_and_place_simple"
    with pytest.raises(ValueError, match="family"):
        family_from_game_path("/tmp/game.tw-pddl")


@pytest.mark.parametrize("action,expected", [
    ("put apple 1 in fridge 1", "move apple 1 to fridge 1"),
    ("put apple 1 on countertop 1", "move apple 1 to countertop 1"),
    ("put apple 1 in/on fridge 1", "move apple 1 to fridge 1"),
    ("move apple 1 to fridge 1", "move apple 1 to fridge 1"),  # already admissible
    ("put apple 1 in drawer 3", "put apple 1 in drawer 3"),  # no admissible match: unchanged
    ("go to fridge 1", "go to fridge 1"),
])
def test_map_legacy_put(action, expected):
    assert map_legacy_put(action, ADM) == expected


def test_map_legacy_put_ambiguous_is_unchanged():
    adm = ["move pot in box 1 to shelf 1", "move pot to box 1 on shelf 1"]
    assert map_legacy_put("put pot in box 1 on shelf 1", adm) == "put pot in box 1 on shelf 1"
    assert map_legacy_put("put pot in box 1 on shelf 1", adm[:1]) == "move pot in box 1 to shelf 1"


@pytest.fixture(scope="module")
def games(tmp_path_factory):
    pytest.importorskip("alfworld")
    pytest.importorskip("fast_downward")
    from tests.fixtures.envs import build_alfworld_games

    root = tmp_path_factory.mktemp("alfworld_data")
    return str(root), build_alfworld_games(str(root))


def test_task_list_skips_unsolvable(games):
    root, paths = games
    tasks = ALFWorldEnv.task_list("train", data_dir=root)
    assert sorted(t.task_id for t in tasks) == sorted(paths.values())


def test_expert_plan_wins_with_reward_one(games):
    root, paths = games
    env = ALFWorldEnv(data_dir=root, expert_plan=True)
    for name, path in paths.items():
        obs, info = env.reset(Task("alfworld", path, 0, "train"))
        assert "Your task is to:" in obs and info["family"] == name.split("-")[0]
        assert "go to fridge 1" in info["admissible_actions"] and "help" in info["admissible_actions"]
        assert "help" not in env.prompt_pieces().admissible_actions
        plan = info["expert_plan"]
        rewards = []
        for a in plan:
            obs, r, done, info = env.step(a)
            rewards.append(r)
        assert done and info["won"] and info["success"] and rewards == [0.0] * (len(plan) - 1) + [1.0]
    env.close()


def test_expert_plans_and_legacy_put_in_game(games):
    root, paths = games
    env = ALFWorldEnv(data_dir=root)
    path = paths["pick_and_place_simple-Apple-None-Fridge-1"]
    obs, info = env.reset(Task("alfworld", path, 0, "train"))
    # alfworld's templated goal text picks its wording at random when the game is built
    assert re.fullmatch(r"put (a|an|some) apple (in|on|in/on) fridge\.", env.prompt_pieces().task_description)
    for a in ["go to countertop 1", "take apple 1 from countertop 1", "go to fridge 1", "open fridge 1"]:
        obs, r, done, info = env.step(a)
    assert "move apple 1 to fridge 1" in info["admissible_actions"]
    obs, r, done, info = env.step("put apple 1 in fridge 1")
    assert info["mapped_action"] == "move apple 1 to fridge 1" and r == 1.0 and done and info["won"]
    env.reset(Task("alfworld", path, 0, "train"))
    obs, r, done, info = env.step("fly to the moon")
    assert obs == "Nothing happens." and info["invalid"] and r == 0.0 and not done
    env.close()
