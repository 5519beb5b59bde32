"""Evaluation: per-family summaries by the env's family, flat baselines' metrics, and
test-time strategy scaling (strata_jax/evaluation/scaling.py) with a scripted policy on memory_key."""
from __future__ import annotations

import re

import jax
import numpy as np
import pytest

from configs import builtin
from envs_bridge import EnvPool, Task
from strata_jax.evaluation import (eval_rollout_config, evaluate, format_metrics, summarize,
                                   task_family)
from strata_jax.models import load_tokenizer
from strata_jax.rollout import PromptBuilder, ScriptedPolicy, collect_rollout, rollout_stats
from strata_jax.rollout.records import EpisodeSpec, LoopStats, StepRecord, Trajectory
from strata_jax.evaluation.scaling import (TestTimeConfig, choose, critic_scorer, evaluate_scaled,
                                  first_action_votes)

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


def test_per_family_eval_lists_count_alfworld_games_by_task_type():
    from strata_jax.evaluation import per_family
    cool = [Task("alfworld", GAME.replace("Fridge-7", f"Fridge-{i}")) for i in range(3)]
    pick = [Task("alfworld", GAME.replace("pick_cool_then_place_in_recep-Apple",
                                          f"pick_and_place_simple-Mug{i}")) for i in range(2)]
    got = per_family(cool + pick, 2)   # 2 per family, not 2 per game file
    assert got == [cool[0], pick[0], cool[1], pick[1]]


def test_format_metrics_omits_strategy_failures_of_a_flat_baseline():
    base = {"eval/success": 0.5, "eval/score": 50.0, "eval/episodes": 2.0, "step": 3,
            "eval/invalid_step_frac": 0.25, "eval/env_rejected_frac": 0.0}
    assert "strategy format failures" not in format_metrics(base)
    strata = format_metrics({**base, "eval/strategy_format_fail_frac": 0.5})
    assert "strategy format failures 0.500" in strata


# ----------------------------------------------------------------------------- test-time scaling

KEY = jax.random.key(5)
VARIATIONS = (3, 8)
MAX_STEPS = 8


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def _corridor(variation: int) -> int:
    from envs_bridge.builtin import MemoryKeyEnv
    env = MemoryKeyEnv()
    env.reset(Task("memory_key", "memory_key", variation))
    return env.corridor


class PlanScript:
    """memory_key replies where exactly candidate `right` of each task's S strategies carries
    the right code (the others carry the code + 1 per digit, mod 10). Candidates in
    `look_first` open with `look`, the others with `go north`; then north to the vault and
    enter the plan's code. The judge flags step 1 when the plan's code differs from the note
    in step 1's observation. Every reply is logged (token cost)."""

    def __init__(self, s: int, right: int, look_first=(0,)) -> None:
        self.s, self.right, self.look_first = s, right, set(look_first)
        self.calls, self.replies = 0, []

    def __call__(self, prompt: str, key: np.ndarray) -> str:
        self.replies.append(self._reply(prompt))
        return self.replies[-1]

    def _reply(self, prompt: str) -> str:
        if "<strategy></strategy>" in prompt:
            code = "".join(re.search(r"vault code (\d)-(\d)-(\d)", prompt).groups())
            i = self.calls % self.s
            self.calls += 1
            if i != self.right:
                code = "".join(str((int(d) + 1) % 10) for d in code)
            lead = "look first" if i in self.look_first else "north first"
            return f"<strategy>plan {i}: code {code}; {lead}, then enter it.</strategy>"
        plan = re.search(r"code (\d{3});", prompt).group(1)
        if "<bad_steps>" in prompt:
            note = "".join(re.search(r"vault code (\d)-(\d)-(\d)", prompt).groups())
            return "<bad_steps>1</bad_steps>" if plan != note else "<bad_steps>none</bad_steps>"
        if "You are at step" not in prompt and "look first" in prompt:   # step 1
            return "<think>look</think><action>look</action>"
        if "keypad waits" in prompt.split("urrent observation:")[-1]:
            return f"<think>vault</think><action>enter {plan}</action>"
        return "<think>walk</think><action>go north</action>"


def _config(s: int, choice: str, probe: int = 0, algo: str = "strata"):
    c = builtin.get_config(algo)
    c.rollout.diverse_sampling = False   # the S candidates in sampling order: hand-checkable
    c.eval.strategy_samples, c.eval.strategy_choice, c.eval.probe_steps = s, choice, probe
    return c


def _run(tok, c, script, critic=None):
    tasks = [Task("memory_key", "memory_key", v) for v in VARIATIONS]
    with EnvPool("memory_key", {"max_steps": MAX_STEPS}, max_live_envs=4) as pool:
        return evaluate_scaled(c, ScriptedPolicy(tok, script), pool, PromptBuilder(tok, 2048),
                               tasks, key=KEY, critic=critic)


def _plan_values(tok, values):
    """A critic whose value of a row is set by the plan its prompt carries."""
    def critic(rows):
        return np.asarray([values[int(re.search(r"plan (\d)", tok.decode(list(p))).group(1))]
                           for p, _ in rows], np.float32)
    return critic


def _tokens(tok, replies):
    return sum(len(tok.encode(r, add_special_tokens=False)) for r in replies)


def test_judge_picks_the_one_right_strategy_from_full_episodes(tok):
    script = PlanScript(4, right=2)
    m, recs = _run(tok, _config(4, "judge"), script)
    assert m["eval/success"] == 1.0 and m["eval/episodes"] == 2.0
    assert m["eval/tts/oracle_success"] == 1.0 and m["eval/tts/probe_success"] == 0.25
    for rec, v in zip(recs, VARIATIONS):
        n = _corridor(v)
        tt = rec["test_time"]
        assert tt["chosen"] == 2 and rec["strategy_id"] == 2 and rec["success"]
        # wrong plans: flagged step 1 of an 8-step episode; the right one: not flagged
        assert tt["scores"] == [1 - 1 / MAX_STEPS] * 2 + [1.0] + [1 - 1 / MAX_STEPS]
        assert tt["probe_steps"] == [MAX_STEPS, MAX_STEPS, n + 1, MAX_STEPS]
        assert tt["probe_first_actions"] == ["look", "go north", "go north", "go north"]
    # cost: every generated token (4 strategies, 4 probes, 4 verdicts per task), every step
    assert m["eval/cost/sampled_tokens"] == _tokens(tok, script.replies) / 2
    steps = [3 * MAX_STEPS + _corridor(v) + 1 for v in VARIATIONS]
    assert m["eval/cost/env_steps"] == np.mean(steps)
    assert m["eval/family/memory_key/env_steps"] == np.mean(steps)


def test_first_action_majority_and_critic_picks_are_the_known_ones(tok):
    m, recs = _run(tok, _config(4, "first_action"), PlanScript(4, right=2))
    # first actions: look, north, north, north -> "go north", first taken by candidate 1
    assert [r["test_time"]["chosen"] for r in recs] == [1, 1]
    assert [r["test_time"]["scores"] for r in recs] == [[1.0, 3.0, 3.0, 3.0]] * 2
    assert m["eval/success"] == 0.0   # candidate 1 carries a wrong code
    for values, pick, ok in (([0.5, 0.1, 0.9, 0.3], 2, 1.0), ([0.5, 0.1, 0.2, 0.9], 3, 0.0)):
        m, recs = _run(tok, _config(4, "critic"), PlanScript(4, right=2),
                       critic=_plan_values(tok, values))
        assert [r["test_time"]["chosen"] for r in recs] == [pick, pick]
        assert recs[0]["test_time"]["scores"] == pytest.approx(values)
        assert m["eval/success"] == ok


def test_short_probes_then_the_chosen_episode_replays_the_probe(tok):
    probe = 2
    script = PlanScript(4, right=2)
    m, recs = _run(tok, _config(4, "judge", probe), script)
    assert m["eval/success"] == 1.0 and "eval/tts/oracle_success" not in m
    for rec, v in zip(recs, VARIATIONS):
        tt = rec["test_time"]
        assert tt["chosen"] == 2 and tt["probe_steps"] == [probe] * 4
        assert tt["scores"] == [0.5, 0.5, 1.0, 0.5]   # step 1 of 2 flagged on wrong plans
        assert [s["action"] for s in rec["steps"]][:probe] == ["go north", "go north"]
        assert len(rec["steps"]) == _corridor(v) + 1
    steps = [4 * probe + _corridor(v) + 1 for v in VARIATIONS]
    assert m["eval/cost/env_steps"] == np.mean(steps)
    assert m["eval/cost/sampled_tokens"] == _tokens(tok, script.replies) / 2


def test_flat_baseline_candidates_are_independent_episodes(tok):
    def respond(prompt, key):
        a = ["look", "go north", "go south"][int(key[0]) % 3]
        return f"<think>k</think><action>{a}</action>"

    c = _config(3, "first_action", algo="grpo")
    tasks = [Task("memory_key", "memory_key", v) for v in VARIATIONS]
    with EnvPool("memory_key", {"max_steps": 3}, max_live_envs=4) as pool:
        m, recs = evaluate_scaled(c, ScriptedPolicy(tok, respond), pool,
                                  PromptBuilder(tok, 2048), tasks, key=KEY)
    for rec in recs:
        tt = rec["test_time"]
        votes = first_action_votes_from(tt["probe_first_actions"])
        assert tt["scores"] == votes and tt["chosen"] == choose(votes)
        assert rec["strategy_id"] == 0 and rec["trajectory_id"] == tt["chosen"]
        assert rec["strategy"] is None
    assert "eval/strategy_format_fail_frac" not in m and m["eval/cost/env_steps"] == 9.0


def first_action_votes_from(actions):
    return [float(sum(b == a for b in actions)) if a is not None else 0.0 for a in actions]


def test_one_sample_is_the_one_strategy_protocol(tok):
    c = _config(1, "judge")
    assert not TestTimeConfig.from_config(c).enabled
    tasks = [Task("memory_key", "memory_key", v) for v in VARIATIONS]
    with EnvPool("memory_key", {"max_steps": MAX_STEPS}, max_live_envs=4) as pool:
        script = PlanScript(1, right=0, look_first=())
        m, recs = evaluate(c, ScriptedPolicy(tok, script), pool, PromptBuilder(tok, 2048),
                           tasks, key=KEY)
        # what the eval computed before test-time scaling existed: the rollout, summarized
        res = collect_rollout(ScriptedPolicy(tok, PlanScript(1, right=0, look_first=())),
                              pool, PromptBuilder(tok, 2048), tasks, key=KEY,
                              config=eval_rollout_config(c))
    old = dict(summarize(res.trajectories, "memory_key"))
    for k, v in rollout_stats(res.trajectories, res.strategies, LoopStats()).items():
        if k.startswith("rollout/") and k not in ("rollout/episodes", "rollout/success_rate",
                                                  "rollout/crashed_episodes"):
            old["eval/" + k.split("/", 1)[1]] = v
    added = {k for k in m if k not in old}
    assert added == {"eval/cost/sampled_tokens", "eval/cost/env_steps",
                     "eval/family/memory_key/sampled_tokens", "eval/family/memory_key/env_steps"}
    assert {k: m[k] for k in old} == old
    assert recs == res.dump()
    assert m["eval/success"] == 1.0 and "test_time" not in recs[0]
    # cost: one strategy and one episode per task
    steps = [_corridor(v) + 1 for v in VARIATIONS]
    assert m["eval/cost/env_steps"] == np.mean(steps)


def test_bad_settings_and_a_missing_critic_are_clear_errors(tok):
    with pytest.raises(ValueError, match="strategy_choice must be one of"):
        TestTimeConfig(2, "vote")
    with pytest.raises(ValueError, match="strategy_samples must be an integer >= 1"):
        TestTimeConfig(0)
    with pytest.raises(ValueError, match="probe_steps must be an integer >= 0"):
        TestTimeConfig(2, "judge", -1)
    with pytest.raises(ValueError, match="needs the checkpoint's critic"):
        _run(tok, _config(2, "critic"), PlanScript(2, right=0))


@pytest.mark.parametrize("algo,kind", [("stapo", "head"), ("ppo", "separate")])
def test_critic_scorer_gives_the_trainers_values(algo, kind):
    """The chooser's V(h_t) of a row = the value the trainer's scoring pass gives that row."""
    from strata_jax.algos import KIND_ACTION
    from strata_jax.models import init_params
    from strata_jax.training import Trainer
    from tests.fixtures.trainer import TINY, make_batch, train_config

    rng = np.random.default_rng(0)
    recs = [dict(prompt_ids=rng.integers(1, 256, n), response_ids=rng.integers(1, 256, r),
                 task_id=i, trajectory_id=0, step_index=0, kind=KIND_ACTION, score=0.0)
            for i, (n, r) in enumerate([(5, 3), (9, 1), (3, 6)])]
    params = init_params(TINY, jax.random.PRNGKey(0))
    trainer = Trainer(TINY, train_config(algo, value_head_init_std=3.0))
    state = trainer.init_state(params, jax.random.PRNGKey(1))
    assert set(state.critic_params) == ({"head"} if kind == "head" else {"trunk", "head"})
    want = np.asarray(trainer.score(state, make_batch(recs), ref_params=params,
                                    key=jax.random.PRNGKey(2), use_old=False).values)[:3]
    got = critic_scorer(trainer, state)([(r["prompt_ids"], r["response_ids"]) for r in recs])
    assert np.all(np.abs(want) > 1e-3)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # a head whose values are set by hand: w = 0, b = 0.7 -> V = 0.7 on every row
    head = {"w": np.zeros_like(state.critic_params["head"]["w"]), "b": np.float32(0.7)}
    state = state.replace(critic_params={**state.critic_params, "head": head})
    got = critic_scorer(trainer, state)([(r["prompt_ids"], r["response_ids"]) for r in recs])
    np.testing.assert_allclose(got, [0.7] * 3, rtol=0, atol=1e-7)


def test_critic_choice_without_a_critic_is_a_clear_error(tmp_path):
    from strata_jax import experiment as ex
    from strata_jax.jobs.evaluate import run_eval
    from strata_jax.models import init_params
    from strata_jax.training import Trainer
    from tests.fixtures.trainer import TINY, train_config

    trainer = Trainer(TINY, train_config("grpo"))
    state = trainer.init_state(init_params(TINY, jax.random.PRNGKey(0)), jax.random.PRNGKey(1))
    with pytest.raises(ValueError, match="needs a critic, and this run has none"):
        critic_scorer(trainer, state)
    c = builtin.get_config("tiny")   # a strata run: no critic
    c.workdir = str(tmp_path)
    c.compilation_cache_dir = ""
    c.eval.strategy_samples, c.eval.strategy_choice = 2, "critic"
    with pytest.raises(ex.ConfigError, match="needs a critic and a strata run has none"):
        run_eval(c)
    with pytest.raises(ex.ConfigError, match="not --no_checkpoint"):
        run_eval(c, use_checkpoint=False)
    c.eval.strategy_choice = "vote"
    with pytest.raises(ex.ConfigError, match="strategy_choice must be one of"):
        run_eval(c)


def test_choosers_by_hand():
    def probe(first, steps=2, bad=(), crashed=False, verdict="v"):
        tr = Trajectory(EpisodeSpec(Task("memory_key", "memory_key"), 0, 0, 0), crashed=crashed,
                        verdict=verdict, bad_steps=bad)
        for t in range(steps):
            tr.steps.append(StepRecord(None, None, "", first if t == 0 else "look",
                                       first is None and t == 0, "obs"))
        return tr

    # first actions: invalid, a, b, a, b -> a and b tie at 2; a was taken first (candidate 1)
    votes = first_action_votes([probe(None), probe("a"), probe("b"), probe("a"), probe("b")])
    assert votes == [0.0, 2.0, 2.0, 2.0, 2.0] and choose(votes) == 1
    from strata_jax.evaluation.scaling import judge_scores
    scores = judge_scores([probe("a", 4, (1, 2)), probe("a", 4, (3,)), probe("a", 0),
                           probe("a", 4, crashed=True), probe("a", 4, verdict=None)])
    assert scores[:2] == [0.5, 0.75] and all(s == float("-inf") for s in scores[2:])
    assert choose(scores) == 1 and choose([float("-inf")] * 3) == 0


def test_run_eval_reports_the_prefill_work_with_and_without_the_prefix_cache(tmp_path):
    """eval.py's metrics count the prompt tokens of its decode calls and the tokens their
    prefill computed: the same prompts with the prefix cache and without, the cache computing
    fewer (each episode's prefix once, not at every step), and the metrics file keeps them.
    The tiny model as is (random weights, no warm start), greedy so that the two prefill paths'
    float rounding (the values agree to rounding, not bit for bit) cannot turn a sampled token
    into another: 2 memory_key episodes of 3 steps, the same prompts in both runs."""
    import json
    from strata_jax.jobs.evaluate import run_eval
    got = {}
    for mb in (0.0, 16.0):
        c = builtin.get_config("tiny")
        c.workdir = str(tmp_path / f"mb{mb:g}")
        c.compilation_cache_dir = str(tmp_path / "jax_cache")   # the second run loads it
        c.model.warm_start = ""
        c.env.max_steps = 3
        c.eval.episodes_per_family = 2
        c.eval.temperature = 0.0
        c.rollout.prefix_cache_mb = mb
        m = run_eval(c, split="dev", use_checkpoint=False)
        assert json.load(open(m["files"][0]))["eval/prefill_tokens"] == m["eval/prefill_tokens"]
        got[mb] = m
    a, b = got[0.0], got[16.0]
    assert "eval/prefix_computed_tokens" not in a
    assert a["eval/prompt_tokens"] == b["eval/prompt_tokens"] > b["eval/prefill_tokens"]
    # what the cache saved is exactly what it served from kept KV
    saved = a["eval/prefill_tokens"] - b["eval/prefill_tokens"]
    assert saved == b["eval/prefix_reused_tokens"] > 0
    assert a["eval/prompt_tokens"] > a["eval/prefill_tokens"]   # prefixes shared in a call
