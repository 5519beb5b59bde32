"""Built-in envs, the env registry, the step bookkeeping and the task sampler."""
import dataclasses
import json
import os
import re

import pytest

from envs_bridge import EnvPool, Task, TaskSampler, list_envs, make_env, register_env
from envs_bridge.base import Env, EnvError
from envs_bridge.builtin import GuessNumberEnv, builtin_task_list
from tests.fixtures.paths import REPO_ROOT

BUILTINS = ["memory_key", "guess_number", "grid_nav"]


def play_expert(env, task):
    obs, info = env.reset(task)
    actions, ret, done = [], 0.0, False
    while not done:
        a = env.expert_action()
        obs, r, done, info = env.step(a)
        actions.append(a)
        ret += r
    return actions, ret, info


def test_registry_lists_every_env():
    assert {"memory_key", "guess_number", "grid_nav", "scienceworld", "alfworld", "webshop"} <= set(list_envs())


def test_builtin_envs_are_entries_of_the_registry_table_imported_on_first_use():
    """The registry holds the built-ins itself (no registration as a side effect of importing
    envs_bridge.builtin): listing them imports nothing, building one imports its module."""
    import subprocess
    import sys
    code = ("import sys; from envs_bridge.registry import BUILTIN, get_env_factory, list_envs; "
            "names = list_envs(); assert 'envs_bridge.builtin' not in sys.modules; "
            "assert 'envs_bridge.scienceworld_env' not in sys.modules; "
            "f = get_env_factory('memory_key'); assert 'envs_bridge.builtin' in sys.modules; "
            "print(sorted(BUILTIN), f.__name__, names == sorted(BUILTIN))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=REPO_ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["['alfworld',", "'grid_nav',", "'guess_number',",
                                  "'memory_key',", "'scienceworld',", "'webshop']",
                                  "MemoryKeyEnv", "True"]
    with pytest.raises(ValueError, match="already registered"):
        register_env("grid_nav", GuessNumberEnv)
    with pytest.raises(KeyError, match="registered envs"):
        make_env("no_such_env")


@pytest.mark.parametrize("name", BUILTINS)
def test_expert_solves_every_dev_task(name):
    env = make_env(name)
    assert isinstance(env, Env)
    for task in builtin_task_list(name, "dev")[:30]:
        actions, ret, info = play_expert(env, task)
        assert ret == 1.0 and info["success"] and info["score"] == 1.0


def test_expert_optimal_lengths():
    env = make_env("memory_key")
    actions, _, _ = play_expert(env, Task("memory_key", "memory_key", 3))
    # seed 3: code 398, corridor of 3 rooms (random.Random(3)): 3 moves + 1 code entry
    assert actions == ["go north"] * 3 + ["enter 398"]
    env = make_env("guess_number")
    actions, _, _ = play_expert(env, Task("guess_number", "guess_number", 3))
    assert actions[0] == "guess 32" and len(actions) <= 7  # binary search over 64 values
    env = make_env("grid_nav")
    env.reset(Task("grid_nav", "grid_nav", 3))
    dist = abs(env.goal[0] - env.pos[0]) + abs(env.goal[1] - env.pos[1])
    actions, _, _ = play_expert(env, Task("grid_nav", "grid_nav", 3))
    assert len(actions) == dist


def test_memory_key_code_only_in_first_observation():
    env = make_env("memory_key")
    obs0, _ = env.reset(Task("memory_key", "memory_key", 3))
    assert "3-9-8" in obs0
    later = [env.step("go north")[0] for _ in range(3)]
    assert not any("398" in o or "3-9-8" in o for o in later)
    assert "398" not in env.prompt_pieces().task_description
    obs, r, done, info = env.step("enter 123")
    assert (r, done) == (0.0, False) and "wrong" in obs


def test_memory_key_one_digit_code_and_bad_length():
    # Seed 3 draws 3, 9, 8 (above): a 1-digit code is the first draw, and the corridor length
    # then comes from a different point of the seed's stream.
    env = make_env("memory_key", code_digits=1)
    obs0, _ = env.reset(Task("memory_key", "memory_key", 3))
    assert "'vault code 3'" in obs0
    while env.expert_action() == "go north":
        obs, *_ = env.step("go north")
    assert obs.endswith("waits for a 1-digit code.")
    assert env.step("enter 4")[1:3] == (0.0, False)
    assert env.step("enter 3")[1:3] == (1.0, True)
    with pytest.raises(ValueError, match="code_digits must be in 1..9"):
        make_env("memory_key", code_digits=0)


def _walk_to_vault(env):
    obs = None
    while env.expert_action() == "go north":
        obs, *_ = env.step("go north")
    return obs


def test_memory_key_one_attempt_locks_the_keypad_and_ends_the_episode():
    env = make_env("memory_key", code_digits=1, code_attempts=1, max_steps=10)
    env.reset(Task("memory_key", "memory_key", 3))   # code 3 (above)
    assert env.admissible_actions() == ["look", "go north"]
    obs = _walk_to_vault(env)
    assert obs.endswith("waits for a 1-digit code. It allows 1 more try.")
    # one digit: the vault lists every concrete code, in order, after the moves
    assert env.admissible_actions() == ["look", "go south"] + [f"enter {d}" for d in range(10)]
    obs, r, done, info = env.step("enter 4")
    assert (r, done, info["success"], info["invalid"]) == (0.0, True, False, False)
    assert obs == "The keypad buzzes: wrong code. The keypad locks for good."
    # the right code opens it at the first try
    env.reset(Task("memory_key", "memory_key", 3))
    _walk_to_vault(env)
    assert env.step("enter code 3")[1:3] == (1.0, True)


def test_memory_key_only_a_well_formed_code_at_the_keypad_is_a_try():
    """Before the vault there is no keypad, and a code of the wrong length is refused: neither
    uses an attempt; a wrong code of the right length does, down to the lock."""
    env = make_env("memory_key", code_digits=1, code_attempts=2, max_steps=20)
    env.reset(Task("memory_key", "memory_key", 3))               # code 3
    for early in ("enter 3", "enter 4", "enter"):
        obs, r, done, info = env.step(early)
        assert (obs, r, done, info["invalid"]) == ("Nothing happens.", 0.0, False, True)
    assert env.attempts_left == 2
    assert _walk_to_vault(env).endswith("It allows 2 more tries.")
    for malformed in ("enter", "enter code", "enter 33"):
        obs, r, done, info = env.step(malformed)
        assert (r, done, info["invalid"]) == (0.0, False, True), malformed
    assert obs == "The keypad beeps: it takes a 1-digit code." and env.attempts_left == 2
    obs, r, done, info = env.step("enter 5")
    assert (obs, r, done, info["invalid"]) == (
        "The keypad buzzes: wrong code. It allows 1 more try.", 0.0, False, False)
    obs, r, done, _ = env.step("enter 7")
    assert (r, done) == (0.0, True) and obs.endswith("The keypad locks for good.")


def test_memory_key_unlimited_attempts_keep_todays_rules():
    env = make_env("memory_key", code_digits=1, max_steps=20)   # code_attempts=0 by default
    env.reset(Task("memory_key", "memory_key", 3))
    obs, r, done, info = env.step("enter 3")                     # before the vault: rejected
    assert (obs, r, done, info["invalid"]) == ("Nothing happens.", 0.0, False, True)
    obs = _walk_to_vault(env)
    assert obs.endswith("waits for a 1-digit code.")            # no tries count shown
    for wrong in ("enter 0", "enter 1", "enter 2"):
        assert env.step(wrong)[1:3] == (0.0, False)
    assert env.step("enter")[0] == "Nothing happens."            # bare verb: rejected
    assert env.step("enter 3")[1:3] == (1.0, True)
    with pytest.raises(ValueError, match="code_attempts must be >= 0"):
        make_env("memory_key", code_attempts=-1)
    # three digits: 1000 codes, the template instead of a list
    env = make_env("memory_key", code_digits=3, code_attempts=1)
    env.reset(Task("memory_key", "memory_key", 3))
    _walk_to_vault(env)
    assert env.admissible_actions() == ["look", "go south", "enter <digits>"]


def test_deterministic_identical_copies():
    a, b = make_env("grid_nav"), make_env("grid_nav")
    t = Task("grid_nav", "grid_nav", 42)
    assert a.reset(t)[0] == b.reset(t)[0]


def test_invalid_format_step_counts_toward_limit_and_repeats_observation():
    env = make_env("guess_number", max_steps=3)
    obs0, _ = env.reset(Task("guess_number", "guess_number", 0))
    obs, r, done, info = env.step(None)
    assert (obs, r, done, info["invalid_format"], info["steps"]) == (obs0, 0.0, False, True, 1)
    obs, r, done, info = env.step("hello there")  # format-valid but rejected by the env
    assert info["invalid"] and not info["invalid_format"] and not done
    obs, r, done, info = env.step(None)
    assert done and info["truncated"] and info["steps"] == 3
    with pytest.raises(RuntimeError, match="reset"):
        env.step("guess 1")
    with pytest.raises(ValueError, match="for env"):
        env.reset(Task("grid_nav", "grid_nav", 0))


def test_splits_disjoint():
    seeds = {s: {t.variation for t in builtin_task_list("grid_nav", s)} for s in ("train", "dev", "test")}
    assert not (seeds["train"] & seeds["dev"]) and not (seeds["train"] & seeds["test"]) and not (seeds["dev"] & seeds["test"])


def test_sampler_same_seed_same_sequence_and_exact_resume():
    tasks = builtin_task_list("memory_key", "dev")  # 100 tasks
    s1, s2 = TaskSampler(tasks, seed=7), TaskSampler(tasks, seed=7)
    seq = s1.sample(150)  # crosses an epoch boundary
    assert seq == s2.sample(150)
    assert len(set(seq[:100])) == 100  # an epoch visits every task once
    assert seq != TaskSampler(tasks, seed=8).sample(150)
    s3 = TaskSampler(tasks, seed=7)
    s3.sample(37)
    state = json.loads(json.dumps(s3.get_state()))
    s4 = TaskSampler(tasks, seed=0)
    s4.set_state(state)
    assert s4.sample(113) == seq[37:150]
    with pytest.raises(ValueError, match="same env/split"):
        TaskSampler(tasks[:10], seed=7).set_state(state)
    with pytest.raises(ValueError):
        TaskSampler([], seed=0)


def test_sampler_refuses_a_state_of_another_task_list_of_the_same_size():
    # The same 100 dev tasks give the same fingerprint; other seeds (another split's 100
    # tasks relabelled "dev"), one task changed, or the same tasks reordered are refused: the
    # saved position would continue with other tasks.
    tasks = builtin_task_list("memory_key", "dev")
    s = TaskSampler(tasks, seed=7)
    s.sample(5)
    state = json.loads(json.dumps(s.get_state()))
    assert state["num_tasks"] == 100 and len(state["tasks_sha256"]) == 64
    TaskSampler(builtin_task_list("memory_key", "dev"), seed=0).set_state(state)   # accepted
    other_seeds = [dataclasses.replace(t, split="dev")
                   for t in builtin_task_list("memory_key", "test")]
    one_changed = tasks[:50] + [dataclasses.replace(tasks[50], variation=4242)] + tasks[51:]
    for other in (other_seeds, one_changed, tasks[::-1]):
        assert len(other) == 100
        with pytest.raises(ValueError, match="another list of 100 tasks"):
            TaskSampler(other, seed=7).set_state(state)
    # a state saved before the fingerprint was recorded is checked by size only
    old = {k: v for k, v in state.items() if k != "tasks_sha256"}
    resumed = TaskSampler(tasks, seed=0)
    resumed.set_state(old)
    assert resumed.sample(3) == TaskSampler(tasks, seed=7).sample(8)[5:]


@pytest.mark.parametrize("guess", ["²", "①", "٣", "-²", "1" * 5000, "--3", "4.0"])
def test_guess_number_non_ascii_or_huge_guess_is_invalid_not_crash(guess):
    """'²'.isdigit() is True but int('²') raises; a 5000-digit guess trips Python's int limit."""
    env = make_env("guess_number")
    obs0, _ = env.reset(Task("guess_number", "guess_number", 0))
    obs, r, done, info = env.step(f"guess {guess}")
    assert (r, done, info["invalid"]) == (0.0, False, True)
    assert obs.startswith("Nothing happens")
    assert (env.lo, env.hi) == (1, 64)  # the interval is untouched
    obs, r, done, info = env.step("guess 1")  # a plain ASCII guess still works
    assert not info["invalid"]


def test_memory_key_ignores_non_ascii_digits_in_code():
    env = make_env("memory_key")
    env.reset(Task("memory_key", "memory_key", 0))
    code = env.code
    while env.pos < env.corridor:
        env.step("go north")
    # Superscript / circled digits are not digits of the code: wrong code, not a crash.
    obs, r, done, info = env.step("enter " + code + "²①")
    assert (r, done) == (1.0, True)  # the ASCII code digits alone still match
    env.reset(Task("memory_key", "memory_key", 0))
    while env.pos < env.corridor:
        env.step("go north")
    obs, r, done, _ = env.step("enter ²③")
    assert (r, done) == (0.0, False) and "wrong" in obs


class _LyingEnv(GuessNumberEnv):
    """guess_number whose step result is replaced by `_LyingEnv.result` (an adapter bug)."""

    name = "lying_guess"
    result = None

    def _step(self, action):
        return _LyingEnv.result


register_env("lying_guess", _LyingEnv)


@pytest.mark.parametrize("result, match", [
    (("o", float("nan"), False, {}), "reward must be a finite real number, got nan"),
    (("o", float("inf"), False, {}), "reward must be a finite real number, got inf"),
    (("o", "1", False, {}), "reward must be a finite real number, got '1'"),
    (("o", 1.0, "no", {}), "done must be a bool, got str 'no'"),
    (("o", 1.0, None, {}), "done must be a bool, got NoneType"),
    ((12345, 1.0, False, {}), "observation must be str, got int"),
    (("o", 1.0, False, None), "info must be a dict, got NoneType"),
    (None, "_step must return (obs, reward, done, info), got None"),
])
def test_bad_step_result_is_env_error_naming_env_and_value(result, match):
    env = make_env("lying_guess")
    env.reset(Task("lying_guess", "lying_guess", 0))
    _LyingEnv.result = result
    with pytest.raises(EnvError, match=r"^lying_guess: " + re.escape(match)):
        env.step("guess 3")


def test_bad_step_result_through_pool_is_crashed_episode():
    with EnvPool("lying_guess", max_live_envs=1) as pool:
        (o,) = pool.reset([Task("lying_guess", "lying_guess", 0)])
        _LyingEnv.result = ("o", float("nan"), False, {})
        (s,) = pool.step([o.episode_id], ["guess 3"])
        assert (s.crashed, s.done, s.reward) == (True, True, 0.0)
        assert "lying_guess" in s.error and "nan" in s.error and pool.num_free == 1


def test_numpy_reward_and_done_are_accepted_as_plain_python():
    np = pytest.importorskip("numpy")
    env = make_env("lying_guess")
    env.reset(Task("lying_guess", "lying_guess", 0))
    _LyingEnv.result = ("o", np.float32(0.5), np.bool_(True), {})
    obs, r, done, info = env.step("guess 3")
    assert (r, done, type(r), type(done)) == (0.5, True, float, bool)


def test_memory_key_corridor_rooms_draws_unseen_lengths_and_keeps_the_default_worlds():
    """corridor_rooms "6-7": every world's corridor is 6 or 7 rooms (the expert walks it and
    the vault says so); unset, the worlds are the 3-5 ones, draw for draw (same code, same
    length for each seed); malformed specs are refused with the accepted forms."""
    import random as _random
    default, longer = make_env("memory_key", code_digits=1), make_env(
        "memory_key", code_digits=1, corridor_rooms="6-7", max_steps=12)
    lengths = set()
    for seed in range(40):
        t = Task("memory_key", "memory_key", seed)
        obs_d, _ = default.reset(t)
        rng = _random.Random(seed)
        code = str(rng.randrange(10))
        assert default.corridor == rng.randint(3, 5) and f"'vault code {code}'" in obs_d
        obs_l, _ = longer.reset(t)
        assert f"'vault code {code}'" in obs_l   # the code draw comes first: same code
        lengths.add(longer.corridor)
        moves = 0
        while longer.expert_action() == "go north":
            obs, *_ = longer.step("go north")
            moves += 1
        assert moves == longer.corridor and obs.startswith("You stand before the vault")
        assert longer.step(f"enter {code}")[1:3] == (1.0, True)
    assert lengths == {6, 7}
    assert make_env("memory_key", corridor_rooms="7").rooms == (7, 7)
    for bad in ("7-6", "0-3", "six", "1-2-3"):
        with pytest.raises(ValueError, match="corridor_rooms must be 'lo-hi'"):
            make_env("memory_key", corridor_rooms=bad)
