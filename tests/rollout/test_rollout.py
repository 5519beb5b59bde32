"""Rollout orchestration with a scripted policy on built-in envs (exact batch contents), key
independence from placement, the flat / cumulative / DAPO modes, and env-decode overlap from
recorded intervals."""
from __future__ import annotations

import re

import jax
import numpy as np
import pytest

from envs_bridge import EnvPool, Task
from strata_jax.algos.batch import KIND_ACTION, KIND_STRATEGY, PAD_ROW_ID
from strata_jax.models import load_tokenizer
from strata_jax.rollout import (PromptBuilder, RolloutConfig, ScriptedPolicy, anchor_hash,
                                collect_rollout, dapo_rollout)
from strata_jax.rollout.keys import base_key_data
from strata_jax.rollout.prompts import INVALID_NOTICE
from strata_jax.rollout.scripted import SCRIPTED_LOGPROB
from tests.fixtures import rollout as fx

KEY = jax.random.key(11)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def _texts(tok, batch, i):
    m = batch.response_mask[i]
    return tok.decode(batch.prompt_ids[i][batch.prompt_mask[i]]), tok.decode(batch.response_ids[i][m])


def test_strata_scripted_exact_batch(tok):
    fx.SENT_ACTIONS.clear()
    n, m = 2, 2
    cfg = RolloutConfig(mode="strata", num_strategies=n, episodes_per_strategy=m, oversample=2,
                        cohorts=2)
    tasks = [Task("memory_key_logged", "memory_key", v) for v in (3, 8)]
    policy = ScriptedPolicy(tok, fx.MemoryKeyScript())
    with EnvPool("memory_key_logged", {"max_steps": 10}, max_live_envs=3) as pool:
        res = collect_rollout(policy, pool, PromptBuilder(tok, 2048), tasks, key=KEY, config=cfg,
                              task_uid_start=5)
    b = res.batch
    codes = {5: fx.memory_key_code(3), 6: fx.memory_key_code(8)}
    seed = [int(x) for x in base_key_data(KEY)]

    # ---- strategy stage: 4 candidates [A, fail, B, A]; FPS over {0, 2, 3}; first from the rng
    assert len(res.strategies) == 2
    for g in res.strategies:
        assert [c.format_fail for c in g.checks] == [False, True, False, False]
        first = [0, 2, 3][int(np.random.default_rng(seed + [g.task_uid]).integers(3))]
        assert g.kept == {0: [0, 2], 2: [2, 0], 3: [3, 2]}[first]
    strat_rows = np.flatnonzero(b.kind == KIND_STRATEGY)
    assert len(strat_rows) == 4  # only the N kept strategies of each task are trained
    for r in strat_rows:
        g = res.strategies[int(b.task_id[r]) - 5]
        c = g.kept[int(b.strategy_id[r])]
        prompt, resp = _texts(tok, b, r)
        assert resp == g.candidates[c]  # stopped by the stop string </strategy>, no <|im_end|>
        assert resp.endswith("</strategy>") and b.response_ids[r][b.response_mask[r]][-1] != 151645
        assert "<strategy></strategy>" in prompt and "vault code" in prompt
        assert b.strategy_len[r] == len(tok.encode(g.checks[c].text)) and not b.format_fail[r]
        assert b.trajectory_id[r] == n * m + b.strategy_id[r] and b.valid[r]
    assert res.stats["rollout/candidate_format_fail_frac"] == 0.25

    # ---- episodes: N x M per task, ids, rewards, invalid / judge flags
    assert len(res.trajectories) == 2 * n * m
    by_key = {}
    for tr in res.trajectories:
        s = tr.spec
        by_key[(s.task_uid, s.strategy_id, s.trajectory_id)] = tr
    assert sorted(by_key) == [(u, i, i * m + j) for u in (5, 6) for i in range(n) for j in range(m)]
    act = np.flatnonzero((b.kind == KIND_ACTION) & b.valid)
    assert len(act) == sum(len(t.steps) for t in res.trajectories) == len(res.records) - 4
    sent = 0
    for tr in res.trajectories:
        code = codes[tr.spec.task_uid]
        variant_b = "variant B" in tr.spec.strategy
        rows = [r for r in act if (b.task_id[r], b.trajectory_id[r]) ==
                (tr.spec.task_uid, tr.spec.trajectory_id)]
        steps = len(rows)
        assert [int(b.step_index[r]) for r in rows] == list(range(steps))
        assert tr.success and tr.episode_return == 1.0
        expected_actions = [None] * variant_b + ["go north"] * (steps - 1 - variant_b) + [f"enter {code}"]
        assert [s.action for s in tr.steps] == expected_actions
        sent += steps - variant_b
        for t, r in enumerate(rows):
            st = tr.steps[t]
            assert b.score[r] == 1.0 and b.step_reward[r] == (1.0 if t == steps - 1 else 0.0)
            assert b.invalid[r] == (variant_b and t == 0)
            assert b.judge_flag[r] == (t == 0)  # verdict "<bad_steps>1, 99</bad_steps>"
            assert b.strategy_id[r] == tr.spec.strategy_id
            assert b.anchor_id[r] == anchor_hash(st.observation)
            prompt, resp = _texts(tok, b, r)
            # ids are exactly the policy's: prompt = prefix + suffix, response = generation
            np.testing.assert_array_equal(b.prompt_ids[r][b.prompt_mask[r]], st.prompt.ids)
            np.testing.assert_array_equal(b.response_ids[r][b.response_mask[r]], st.generation.token_ids)
            np.testing.assert_array_equal(b.sampler_logprobs[r][b.response_mask[r]], SCRIPTED_LOGPROB)
            assert not b.sampler_logprobs[r][~b.response_mask[r]].any()
            # a complete action ends the response at </action> (stop string); the invalid
            # output without one runs to <|im_end|>, which is trained but not in the text
            assert resp == st.output_text + ("<|im_end|>" if st.action is None else "")
            assert resp.endswith("</action>") == (st.action is not None)
            # observation tokens are in the prompt, never in the response mask
            assert st.observation in prompt and st.observation not in resp
            assert ("Your strategy for this task:\n" + tr.spec.strategy) in prompt
        if variant_b:  # the invalid step is not sent; the next prompt shows the same obs + notice
            p1, _ = _texts(tok, b, rows[1])
            assert INVALID_NOTICE in p1 and tr.steps[1].observation == tr.steps[0].observation
            assert b.anchor_id[rows[0]] == b.anchor_id[rows[1]]
            assert 'your output ended with: "I am not sure what to do"' in p1
        assert tr.verdict == "<think>step 1 was wasted</think><bad_steps>1, 99</bad_steps>"
    # only format-valid actions reached the simulators
    assert len(fx.SENT_ACTIONS) == sent
    assert all(a == "go north" or a.startswith("enter ") for _, a in fx.SENT_ACTIONS)
    # padding rows
    pad = ~b.valid
    assert (b.task_id[pad] == PAD_ROW_ID).all() and not b.response_mask[pad].any()
    assert b.num_rows % 8 == 0 and b.num_rows >= len(res.records)
    # judge calls are greedy, one per trajectory
    greedy_calls = [c for c in policy.calls if c[3]]
    assert len(greedy_calls) == 1 and greedy_calls[0][2] == 2 * n * m
    assert res.dump()[0]["steps"][0]["judge_flag"] is True


def _random_walker(prompt: str, key: np.ndarray) -> str:
    """A key-driven policy: picks an admissible grid move from the row key (or an invalid reply)."""
    acts = re.findall(r"Admissible actions: \[(.*)\]", prompt)[-1].split(", ")
    r = int(key[0]) ^ int(key[1])
    if r % 7 == 0:
        return "no idea"
    return f"<think>r={r % 100}</think><action>{acts[r % len(acts)]}</action>"


@pytest.mark.parametrize("mode", ["flat", "strata"])
def test_rows_do_not_depend_on_placement(tok, mode):
    """Same key + ids -> identical batch, whatever the cohorts and the pool size."""
    tasks = [Task("grid_nav", "grid_nav", v) for v in (1, 2)]
    batches = []
    for cohorts, slots in ((1, 8), (2, 3), (3, 5)):
        cfg = RolloutConfig(mode=mode, group_size=3, num_strategies=1, episodes_per_strategy=3,
                            oversample=2, self_judgment=False, cohorts=cohorts)
        with EnvPool("grid_nav", {"max_steps": 5}, max_live_envs=slots) as pool:
            res = collect_rollout(ScriptedPolicy(tok, _random_walker), pool,
                                  PromptBuilder(tok, 2048), tasks, key=KEY, config=cfg)
        batches.append(res.batch)
    for other in batches[1:]:
        for f in ("prompt_ids", "response_ids", "task_id", "trajectory_id", "step_index",
                  "invalid", "score", "anchor_id", "kind"):
            np.testing.assert_array_equal(getattr(batches[0], f), getattr(other, f), err_msg=f)
    assert batches[0].invalid.any() and not batches[0].invalid.all()


def test_flat_and_cumulative_modes(tok):
    tasks = [Task("grid_nav", "grid_nav", v) for v in (4, 5)]
    cfg = RolloutConfig(mode="flat", group_size=3, cohorts=2)
    with EnvPool("grid_nav", {"max_steps": 4}, max_live_envs=4) as pool:
        res = collect_rollout(ScriptedPolicy(tok, _random_walker), pool,
                              PromptBuilder(tok, 4096, history_length=None), tasks, key=KEY,
                              config=cfg)
    b = res.batch
    assert not (b.kind == KIND_STRATEGY).any() and not res.strategies
    assert (b.strategy_id[b.valid] == 0).all() and not b.judge_flag.any()
    assert sorted({(int(t), int(j)) for t, j in zip(b.task_id[b.valid], b.trajectory_id[b.valid])}) \
        == [(t, j) for t in (0, 1) for j in range(3)]
    for tr in res.trajectories:
        assert tr.verdict is None and tr.spec.strategy is None
        last = tr.steps[-1].prompt.text
        # cumulative: every earlier step is in the last prompt; the response holds none of it
        for t, st in enumerate(tr.steps[:-1], start=1):
            assert f"[Step {t}] Observation: {st.observation}" in last
        assert "Your strategy" not in last
        for st in tr.steps:
            assert st.observation not in st.output_text


def test_dapo_refill(tok):
    """grid_nav tasks whose episodes all return the same are dropped and refilled."""
    # the expert move, except that a key-chosen third of the steps are wasted: some groups
    # end with unequal returns, others (all won / all lost) are dropped
    def respond(prompt: str, key: np.ndarray) -> str:
        pos = re.findall(r"You are at \((\d), (\d)\)\. The goal is at \((\d), (\d)\)", prompt)[-1]
        x, y, gx, gy = map(int, pos)
        a = "go east" if gx > x else "go west" if gx < x else "go north" if gy > y else "go south"
        if int(key[0]) % 3 == 0:  # sometimes waste the episode -> unequal returns
            return "<think>wait</think><action>look</action>"
        return f"<think>go</think><action>{a}</action>"

    counter = iter(range(100))

    def sample_tasks(k: int):
        return [Task("grid_nav", "grid_nav", next(counter)) for _ in range(k)]

    cfg = RolloutConfig(mode="flat", group_size=4, tasks_per_batch=3, dapo_max_tries=3)
    with EnvPool("grid_nav", {"max_steps": 3}, max_live_envs=4) as pool:
        res = dapo_rollout(ScriptedPolicy(tok, respond), pool, PromptBuilder(tok, 2048), sample_tasks,
                           key=KEY, config=cfg)
    groups = {}
    for tr in res.trajectories:
        groups.setdefault(tr.spec.task_uid, []).append(tr.episode_return)
    tries = int(res.stats["dapo/tries"])
    assert 1 <= tries <= 3 and res.stats["dapo/kept_groups"] == len(groups) <= 3
    informative = [max(r) > min(r) for r in groups.values()]
    if tries < 3:  # stopped early: 3 informative groups were found
        assert len(groups) == 3 and all(informative)
    assert res.stats["dapo/rolled_out_groups"] > len(groups) or all(informative)
    uids = sorted(groups)
    assert len(set(uids)) == len(uids)  # uids keep counting across tries
    assert set(np.unique(res.batch.task_id[res.batch.valid])) == set(uids)


def test_dapo_last_try_keeps_all(tok):
    """A policy that never wins: no group is informative, so the last try keeps every group."""
    counter = iter(range(100))
    cfg = RolloutConfig(mode="flat", group_size=2, tasks_per_batch=2, dapo_max_tries=2)
    with EnvPool("grid_nav", {"max_steps": 2}, max_live_envs=4) as pool:
        res = dapo_rollout(ScriptedPolicy(tok, lambda p, k: "<think>x</think><action>look</action>"),
                           pool, PromptBuilder(tok, 2048),
                           lambda k: [Task("grid_nav", "grid_nav", next(counter)) for _ in range(k)],
                           key=KEY, config=cfg)
    assert res.stats["dapo/tries"] == 2 and res.stats["dapo/rolled_out_groups"] == 4
    # the last try rolled out tasks uid 2, 3 and kept both
    assert sorted({tr.spec.task_uid for tr in res.trajectories}) == [2, 3]


def _overlapping_calls(res):
    """(policy calls, the calls during which some env ticket of ANOTHER cohort was in flight,
    the calls during which any env ticket was in flight)."""
    sampler = [iv for iv in res.intervals if iv.kind == "sampler"]
    env = [iv for iv in res.intervals if iv.kind == "env"]
    during = lambda s, e: e.start < s.end and s.start < e.end  # noqa: E731
    return (sampler, [s for s in sampler if any(e.cohort != s.cohort and during(s, e) for e in env)],
            [s for s in sampler if any(during(s, e) for e in env)])


def test_env_steps_overlap_decoding(tok):
    """Two cohorts: one cohort's env steps are in flight during the other's policy calls;
    with one cohort they never are."""
    out = {}
    for cohorts in (1, 2):
        policy = ScriptedPolicy(tok, _random_walker, delay_s=0.03)
        cfg = RolloutConfig(mode="flat", group_size=4, cohorts=cohorts)
        with EnvPool("slow_grid", {"max_steps": 4, "delay_s": 0.06}, max_live_envs=4) as pool:
            out[cohorts] = collect_rollout(policy, pool, PromptBuilder(tok, 2048),
                                           [Task("slow_grid", "grid_nav", 7)], key=KEY, config=cfg)
    sampler, overlapped, _ = _overlapping_calls(out[2])
    assert {iv.cohort for iv in sampler} == {0, 1} and all(iv.rows <= 2 for iv in sampler)
    assert len(overlapped) >= len(sampler) // 2
    # one policy call per step per cohort
    assert out[2].stats["time/sampler_calls"] == len(sampler) == \
        sum(max(len(t.steps) for t in out[2].trajectories if t.spec.trajectory_id // 2 == c) for c in (0, 1))
    sampler1, _, any1 = _overlapping_calls(out[1])
    assert any1 == [] and sampler1[0].rows == 4
    for r in out.values():
        assert 0.0 < r.stats["time/env_wait_frac"] < 1.0


def test_auto_cohorts_follow_the_env_class_not_timing(tok):
    """cohorts=0: one decode call per step over every live episode for an instant env (the
    built-ins), two turn-taking cohorts for an env that declares slow steps."""
    from strata_jax.rollout.episodes import resolve_cohorts
    assert resolve_cohorts(0, "memory_key") == 1 and resolve_cohorts(0, "slow_grid") == 2
    assert resolve_cohorts(3, "memory_key") == 3
    with pytest.raises(ValueError, match="must be >= 0"):
        resolve_cohorts(-1, "memory_key")
    with pytest.raises(ValueError, match="cohorts must be >= 0"):
        RolloutConfig(cohorts=-1)
    cfg = RolloutConfig(mode="flat", group_size=4)
    assert cfg.cohorts == 0
    with EnvPool("grid_nav", {"max_steps": 4}, max_live_envs=4) as pool:
        res = collect_rollout(ScriptedPolicy(tok, _random_walker), pool, PromptBuilder(tok, 2048),
                              [Task("grid_nav", "grid_nav", 7)], key=KEY, config=cfg)
    sampler, _, _ = _overlapping_calls(res)
    # one call per step of the longest episode, the first one over all 4 episodes
    assert res.stats["time/sampler_calls"] == len(sampler) == \
        max(len(t.steps) for t in res.trajectories)
    assert sampler[0].rows == 4 and {iv.cohort for iv in sampler} == {0}
    with EnvPool("slow_grid", {"max_steps": 4, "delay_s": 0.01}, max_live_envs=4) as pool:
        slow = collect_rollout(ScriptedPolicy(tok, _random_walker), pool, PromptBuilder(tok, 2048),
                               [Task("slow_grid", "grid_nav", 7)], key=KEY, config=cfg)
    sampler2, _, _ = _overlapping_calls(slow)
    assert {iv.cohort for iv in sampler2} == {0, 1} and all(iv.rows <= 2 for iv in sampler2)


def test_config_from_base(tok):
    from configs.base import get_base_config
    c = get_base_config()
    rc = RolloutConfig.from_config(c)
    assert (rc.mode, rc.num_strategies, rc.episodes_per_strategy, rc.oversample, rc.cohorts) == \
        ("strata", 4, 8, 8, 0)
    assert rc.max_strategy_tokens == 512 and rc.max_judge_tokens == 256 and not rc.dapo_refill
    c.algo = "dapo"
    assert RolloutConfig.from_config(c).mode == "flat" and RolloutConfig.from_config(c).dapo_refill
    from strata_jax.rollout import make_prompt_builder
    assert make_prompt_builder(tok, c).history_length == 2
    c.rollout.cumulative_prompts = True
    b = make_prompt_builder(tok, c)
    assert b.history_length is None and b.max_prompt_tokens == 4096
    with pytest.raises(ValueError, match="mode"):
        RolloutConfig(mode="tree")


def test_crashed_episodes_are_masked(tok):
    def respond(prompt: str, key: np.ndarray) -> str:
        a = ["go north", "go west", "go east"][int(key[0]) % 3]
        return f"<think>k</think><action>{a}</action>"

    cfg = RolloutConfig(mode="flat", group_size=6, cohorts=2)
    with EnvPool("crashy_grid", {"max_steps": 3}, max_live_envs=6) as pool:
        res = collect_rollout(ScriptedPolicy(tok, respond), pool, PromptBuilder(tok, 2048),
                              [Task("crashy_grid", "grid_nav", 0)], key=KEY, config=cfg)
    b = res.batch
    crashed = [tr for tr in res.trajectories if tr.crashed]
    alive = [tr for tr in res.trajectories if not tr.crashed]
    assert crashed and alive and res.stats["rollout/crashed_episodes"] == len(crashed)
    for tr in res.trajectories:
        rows = np.flatnonzero(b.trajectory_id == tr.spec.trajectory_id)
        assert len(rows) == len(tr.steps)  # kept in the batch for logging...
        assert (b.valid[rows] == (not tr.crashed)).all()  # ...but masked out of the loss
        if tr.crashed:
            assert tr.steps[-1].action == "go west" and "simulated simulator crash" in tr.error


def test_generation_stops_at_the_first_complete_action_block(tok):
    """The issue's reply: a complete action, then a fabricated observation and a second action.
    With max_action_tokens=24 the whole reply (43 tokens) would be cut by the limit (an invalid
    step); the stop string ends it at the first </action>, so `go north` is sent, the step is
    valid and the trained response holds nothing after the action block."""
    reply = ("<think>walk on</think><action>go north</action>\nObservation: The vault swings "
             "open. You win.\n<think>done</think><action>enter 000</action>")
    assert len(tok.encode(reply, add_special_tokens=False)) > 24
    fx.SENT_ACTIONS.clear()
    cfg = RolloutConfig(mode="flat", group_size=1, max_action_tokens=24, cohorts=1)
    with EnvPool("memory_key_logged", {"max_steps": 2}, max_live_envs=1) as pool:
        res = collect_rollout(ScriptedPolicy(tok, lambda prompt, key: reply), pool,
                              PromptBuilder(tok, 2048), [Task("memory_key_logged", "memory_key", 3)],
                              key=KEY, config=cfg)
    (tr,) = res.trajectories
    assert [s.action for s in tr.steps] == ["go north", "go north"]
    assert [s.invalid for s in tr.steps] == [False, False]
    assert fx.SENT_ACTIONS == [(3, "go north"), (3, "go north")]
    b = res.batch
    for r in range(2):
        resp = tok.decode(b.response_ids[r][b.response_mask[r]])
        assert resp == "<think>walk on</think><action>go north</action>\n"  # 15 tokens
        assert int(b.response_mask[r].sum()) == 15 and not b.invalid[r]
    assert tr.steps[0].generation.finish_reason == "stop"
    # the history shows the parsed action, never the fabricated observation
    assert "You win" not in tr.steps[1].prompt.text


def _look_script(prompt: str, key: np.ndarray) -> str:
    """A plan, then "look around" at every step, then a verdict (any env)."""
    if "<strategy></strategy>" in prompt:
        return "<strategy>Look around first, then act on what is seen.</strategy>"
    if "<bad_steps>" in prompt:
        return "<bad_steps>none</bad_steps>"
    return "<think>look</think><action>look around</action>"


class _RecordingPolicy(ScriptedPolicy):
    """ScriptedPolicy that keeps every row's full prompt ids (prefix + suffix), call by call."""

    def __init__(self, tok, respond):
        super().__init__(tok, respond)
        self.prompts: list[list[int]] = []

    def generate(self, prefixes, prefix_index, suffixes, sampling, keys):
        self.prompts += [list(prefixes[int(i)]) + list(s) for i, s in zip(prefix_index, suffixes)]
        return super().generate(prefixes, prefix_index, suffixes, sampling, keys)


@pytest.mark.parametrize("env,task,script,marker", [
    ("memory_key", Task("memory_key", "memory_key", 3), fx.MemoryKeyScript, "Admissible actions: ["),
    pytest.param("scienceworld", Task("scienceworld", "find-non-living-thing", 0),
                 lambda: _look_script, "Valid action templates: [", marks=pytest.mark.slow),
])
def test_prompts_do_not_depend_on_the_pool_backend(tok, env, task, script, marker):
    """The same StraTA rollout on the thread and the process backend: every prompt the policy
    saw (strategy candidates, steps, judge) is identical token for token, and carries the
    env's own pieces (its role name, its action list / templates), which the process backend
    reads from the env in its worker."""
    cfg = RolloutConfig(mode="strata", num_strategies=1, episodes_per_strategy=2, oversample=2,
                        cohorts=1)
    seen, rows = {}, {}
    for backend in ("thread", "process"):
        policy = _RecordingPolicy(tok, script())
        with EnvPool(env, {"max_steps": 3}, max_live_envs=2, backend=backend,
                     step_timeout_s=120) as pool:
            res = collect_rollout(policy, pool, PromptBuilder(tok, 4096), [task], key=KEY,
                                  config=cfg)
        seen[backend], rows[backend] = policy.prompts, [list(r["prompt_ids"]) for r in res.records]
        pieces = res.trajectories[0].pieces
        assert pieces.environment != env and pieces.task_description  # the env's, not a fallback
        role = f"You are an expert agent in {pieces.environment}."
        assert all(role in tok.decode(p) for p in seen[backend])
        assert all(marker in tok.decode(p) for p in rows[backend])
        # 2 strategy candidates, >= 1 step per episode, 1 judge call over the 2 episodes
        assert len(seen[backend]) >= 2 + 2 + 2 and len(policy.calls) >= 3
    assert seen["thread"] == seen["process"]
    assert rows["thread"] == rows["process"]


def test_strategy_without_a_valid_episode_is_masked(tok):
    """Strategy 0 walks west on crashy_grid (every episode crashes at step 1), strategy 1
    walks east: strategy 0's row has no reward (docs/method.md §5.5) and is out of the loss."""
    calls = {"n": 0}

    def respond(prompt: str, key: np.ndarray) -> str:
        if "<strategy></strategy>" in prompt:
            calls["n"] += 1
            return ("<strategy>plan WESTWARD</strategy>" if calls["n"] % 2 == 1
                    else "<strategy>plan EASTWARD</strategy>")
        if "<bad_steps>" in prompt:
            return "<bad_steps>none</bad_steps>"
        a = "go west" if "WESTWARD" in prompt else "go east"
        return f"<think>k</think><action>{a}</action>"

    cfg = RolloutConfig(mode="strata", num_strategies=2, episodes_per_strategy=2, oversample=1,
                        diverse_sampling=False, cohorts=1)
    with EnvPool("crashy_grid", {"max_steps": 2}, max_live_envs=4) as pool:
        res = collect_rollout(ScriptedPolicy(tok, respond), pool, PromptBuilder(tok, 2048),
                              [Task("crashy_grid", "grid_nav", 0)], key=KEY, config=cfg)
    b = res.batch
    assert [tr.crashed for tr in res.trajectories] == [True, True, False, False]
    rows = np.flatnonzero(b.kind == KIND_STRATEGY)
    assert [int(b.strategy_id[r]) for r in rows] == [0, 1]
    assert [bool(b.valid[r]) for r in rows] == [False, True]


def test_flat_rollout_reports_no_strategy_metrics(tok):
    cfg = RolloutConfig(mode="flat", group_size=2, cohorts=1)
    with EnvPool("memory_key", {"max_steps": 2}, max_live_envs=2) as pool:
        res = collect_rollout(ScriptedPolicy(tok, _random_walker), pool, PromptBuilder(tok, 2048),
                              [Task("memory_key", "memory_key", 0)], key=KEY, config=cfg)
    for k in ("strategy_format_fail_frac", "candidate_format_fail_frac", "mean_strategy_len"):
        assert f"rollout/{k}" not in res.stats
    assert res.stats["rollout/episodes"] == 2.0
