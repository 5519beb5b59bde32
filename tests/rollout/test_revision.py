"""Strategy revision (rollout option, docs/method.md §5.9): the triggers, the revision prompts,
the plan later step prompts carry, the revision rows of the batch, and row keys that do not
depend on placement. Advantages of the revision level: tests/algos/test_advantages.py."""
from __future__ import annotations

import re

import jax
import numpy as np
import pytest

from envs_bridge import EnvPool, Task
from strata_jax.algos.batch import KIND_STRATEGY
from strata_jax.models import load_tokenizer
from strata_jax.rollout import (EpisodeSpec, PromptBuilder, RolloutConfig, ScriptedPolicy,
                                StepRecord, Trajectory, collect_rollout)
from strata_jax.rollout.records import Revision
from strata_jax.rollout.prompts import REVISION_INSTRUCTION, STEP_INSTRUCTION
from strata_jax.rollout.revision import RevisionConfig, revision_trigger

KEY = jax.random.key(5)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


# ----------------------------------------------------------------------------- triggers


def _traj(steps, revised_at=()):
    """A Trajectory with steps given as (action | None, reward, env_rejected) tuples."""
    tr = Trajectory(EpisodeSpec(Task("memory_key", "memory_key", 0), 0, 0, 0, "z"))
    for a, r, rej in steps:
        tr.steps.append(StepRecord(None, None, "", a, a is None, "obs", r, {"invalid": rej}))
    for i, t in enumerate(revised_at, 1):
        tr.revisions.append(Revision(t, i, "stuck", None, None, "", f"z{i}", 1, False))
    return tr


def test_every_k_fires_at_multiples_of_k_never_at_step_0():
    cfg = RevisionConfig(every=2)
    fired = [revision_trigger(_traj([("go", 1.0, False)] * t), cfg) for t in range(7)]
    assert fired == [None, None, "every", None, "every", None, "every"]
    # not twice at one step: a revision already written at t = 4
    assert revision_trigger(_traj([("go", 1.0, False)] * 4, revised_at=[4]), cfg) is None


@pytest.mark.parametrize("window,stuck", [
    ([(None, 0.0, False)] * 3, True),                                  # format-invalid
    ([("a", 0.5, True), (None, 0.5, False), ("b", 0.5, True)], True),  # invalid / env-rejected
    ([("go", 0.2, False)] * 3, True),                                  # one repeated action
    ([("a", 0.0, False), ("b", 0.0, False), ("c", 0.0, False)], True),  # score did not move
    ([("a", 0.0, False), ("b", 0.1, False), ("c", 0.0, False)], False),
    ([("go", 0.0, False), ("go", 0.1, False), ("look", 0.0, False)], False),
])
def test_stuck_trigger_cases(window, stuck):
    cfg = RevisionConfig(on="stuck", stuck_steps=3)
    tr = _traj([("x", 1.0, False)] + window)
    assert revision_trigger(tr, cfg) == ("stuck" if stuck else None)


def test_stuck_needs_k_steps_since_the_last_revision_and_every_wins():
    stuck = [(None, 0.0, False)] * 5
    cfg = RevisionConfig(on="stuck", stuck_steps=3)
    assert revision_trigger(_traj(stuck[:2]), cfg) is None               # fewer than k steps
    assert revision_trigger(_traj(stuck, revised_at=[3]), cfg) is None   # 2 steps since
    assert revision_trigger(_traj(stuck, revised_at=[2]), cfg) == "stuck"
    both = RevisionConfig(every=5, on="stuck", stuck_steps=3)
    assert revision_trigger(_traj(stuck), both) == "every"


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="revise_on"):
        RevisionConfig(on="sometimes")
    with pytest.raises(ValueError, match="revise_every"):
        RevisionConfig(every=-1)
    with pytest.raises(ValueError, match="revise_stuck_steps"):
        RevisionConfig(on="stuck", stuck_steps=0)
    with pytest.raises(ValueError, match="algo=strata"):
        RolloutConfig(mode="flat", revise_every=2)
    assert not RolloutConfig().revision.enabled   # the paper setting: off


# ----------------------------------------------------------------------------- rollout


def _plan_script(prompt: str, key: np.ndarray) -> str:
    """memory_key replies. Strategy: "plan 0: code XYZ; ...". Revision: "plan n+1 (k..)" from
    the plan in force, or (one key in three) an output without a strategy block. Steps: go
    north until the keypad, then enter the code of the plan in force."""
    if REVISION_INSTRUCTION in prompt:
        n = int(re.search(r"plan (\d+)", prompt).group(1))
        code = re.search(r"code (\d{3});", prompt).group(1)
        if int(key[0]) % 3 == 0:
            return "I keep my plan."
        return f"<strategy>plan {n + 1} (k{int(key[1]) % 89}): code {code}; go on north.</strategy>"
    if "<strategy></strategy>" in prompt:
        code = "".join(re.search(r"vault code (\d)-(\d)-(\d)", prompt).groups())
        return f"<strategy>plan 0: code {code}; go north, then enter it.</strategy>"
    if "<bad_steps>" in prompt:
        return "<bad_steps>none</bad_steps>"
    code = re.search(r"code (\d{3});", prompt).group(1)
    if "keypad waits" in prompt.split("urrent observation:")[-1]:
        return f"<think>vault</think><action>enter {code}</action>"
    return "<think>walk</think><action>go north</action>"


def _run(tok, cohorts=2, slots=4, **kw):
    cfg = RolloutConfig(mode="strata", num_strategies=1, episodes_per_strategy=3, oversample=2,
                        cohorts=cohorts, **kw)
    tasks = [Task("memory_key", "memory_key", v) for v in (2, 7)]
    with EnvPool("memory_key", {"max_steps": 8}, max_live_envs=slots) as pool:
        return collect_rollout(ScriptedPolicy(tok, _plan_script), pool, PromptBuilder(tok, 4096),
                               tasks, key=KEY, config=cfg)


def test_revise_every_2_prompts_rows_and_the_plan_in_force(tok):
    res = _run(tok, revise_every=2)
    b, recs = res.batch, res.records
    revs = [(tr, rv) for tr in res.trajectories for rv in tr.revisions]
    assert len(revs) == res.stats["rollout/revisions"] > 0
    fails = [rv.format_fail for _, rv in revs]
    assert any(fails) and not all(fails)
    for tr in res.trajectories:
        assert tr.success
        # one revision before each step t = 2, 4, ... the episode reached
        assert [rv.step for rv in tr.revisions] == list(range(2, len(tr.steps), 2))
        assert [rv.ordinal for rv in tr.revisions] == list(range(1, len(tr.revisions) + 1))
        plan = tr.spec.strategy
        for rv in tr.revisions:
            text = rv.prompt.text
            # the prompt: the plan in force, the history window, the request (no step request)
            assert f"Your strategy for this task:\n{plan}\n" in text
            assert f"You have taken {rv.step} steps" in text and STEP_INSTRUCTION not in text
            assert text.count(REVISION_INSTRUCTION) == 1 and rv.trigger == "every"
            # a failed revision keeps the plan; a good one replaces it
            new = re.search(r"<strategy>(.*)</strategy>", rv.output_text)
            assert rv.format_fail == (new is None)
            plan_before = plan
            plan = plan if new is None else new.group(1)
            assert rv.strategy == plan
            # the revision prompt shares its prefix with the step prompt it replaces
            if plan == plan_before:
                assert rv.prompt.prefix_ids == tr.steps[rv.step].prompt.prefix_ids
        # every step prompt carries the plan in force at that step
        for t, st in enumerate(tr.steps):
            in_force = [rv.strategy for rv in tr.revisions if rv.step <= t]
            z = in_force[-1] if in_force else tr.spec.strategy
            assert f"Your strategy for this task:\n{z}\n" in st.prompt.text
    # revision rows: after the strategy and action rows, one per revision
    rows = [i for i, r in enumerate(recs) if r["kind"] == KIND_STRATEGY and r["anchor_id"] > 0]
    assert len(rows) == len(revs) and rows == list(range(len(recs) - len(revs), len(recs)))
    for i, (tr, rv) in zip(rows, revs):
        assert (b.task_id[i], b.strategy_id[i], b.trajectory_id[i]) == (
            tr.spec.task_uid, tr.spec.strategy_id, tr.spec.trajectory_id)
        assert (b.step_index[i], b.anchor_id[i], b.format_fail[i]) == (rv.step, rv.ordinal,
                                                                       rv.format_fail)
        # memory_key pays 1 on the last step: the return from any revision point is 1
        assert b.score[i] == sum(s.reward for s in tr.steps[rv.step:]) == 1.0
        np.testing.assert_array_equal(b.prompt_ids[i][b.prompt_mask[i]], rv.prompt.ids)
        np.testing.assert_array_equal(b.response_ids[i][b.response_mask[i]],
                                      rv.generation.token_ids)
        assert b.strategy_len[i] == rv.token_len and b.valid[i]
    # the task strategies keep anchor_id 0 and the dump lists the revisions
    strat = [i for i, r in enumerate(recs) if r["kind"] == KIND_STRATEGY and r["anchor_id"] == 0]
    assert len(strat) == 2
    dumped = res.dump()
    assert [len(d.get("revisions", [])) for d in dumped] == [len(t.revisions)
                                                             for t in res.trajectories]


def test_revision_rows_do_not_depend_on_placement(tok):
    a = _run(tok, cohorts=1, slots=8, revise_every=2).batch
    b = _run(tok, cohorts=3, slots=3, revise_every=2).batch
    for f in ("prompt_ids", "response_ids", "task_id", "trajectory_id", "step_index", "kind",
              "anchor_id", "score", "format_fail"):
        np.testing.assert_array_equal(getattr(a, f), getattr(b, f), err_msg=f)


def test_off_by_default_no_revision_rows(tok):
    res = _run(tok)
    assert all(not tr.revisions for tr in res.trajectories)
    assert not any(r["anchor_id"] for r in res.records if r["kind"] == KIND_STRATEGY)
    assert "rollout/revisions" not in res.stats
    assert all("revisions" not in d for d in res.dump())


def test_revise_on_stuck_in_a_rollout(tok):
    """memory_key's "go north" walk repeats one action: with k = 2 the stuck trigger fires after
    steps 2 and 4 (k steps since the last revision), never before step k."""
    res = _run(tok, revise_on="stuck", revise_stuck_steps=2)
    assert res.stats["rollout/revision_stuck_frac"] == 1.0
    for tr in res.trajectories:
        assert tr.success
        steps = [rv.step for rv in tr.revisions]
        assert steps and all(rv.trigger == "stuck" for rv in tr.revisions)
        assert steps[0] == 2 and all(b - a >= 2 for a, b in zip(steps, steps[1:]))
        for rv in tr.revisions:   # the window before each revision: one repeated action
            assert len({s.action for s in tr.steps[rv.step - 2:rv.step]}) == 1


def test_eval_reports_the_revision_figures_training_reports(tok):
    """eval.py's metrics carry the revision stats (eval/revisions, ...) when the config revises,
    the same numbers training's rollout gives for the same episodes; none when it does not."""
    from configs import builtin
    from strata_jax.evaluation import eval_rollout_config, evaluate
    c = builtin.get_config("strata")
    c.rollout.revise_every = 2
    tasks = [Task("memory_key", "memory_key", v) for v in (2, 7)]
    with EnvPool("memory_key", {"max_steps": 8}, max_live_envs=4) as pool:
        m, recs = evaluate(c, ScriptedPolicy(tok, _plan_script), pool, PromptBuilder(tok, 4096),
                           tasks, key=KEY)
        res = collect_rollout(ScriptedPolicy(tok, _plan_script), pool, PromptBuilder(tok, 4096),
                              tasks, key=KEY, config=eval_rollout_config(c))
    n_revisions = sum(len(r.get("revisions") or []) for r in recs)
    assert n_revisions > 0 and m["eval/revisions"] == n_revisions
    for k in ("revisions", "revised_episode_frac", "revision_format_fail_frac",
              "revision_stuck_frac"):
        assert m[f"eval/{k}"] == res.stats[f"rollout/{k}"], k
    c.rollout.revise_every = 0
    with EnvPool("memory_key", {"max_steps": 8}, max_live_envs=4) as pool:
        m, _ = evaluate(c, ScriptedPolicy(tok, _plan_script), pool, PromptBuilder(tok, 4096),
                        tasks, key=KEY)
    assert not any("revision" in k for k in m)
