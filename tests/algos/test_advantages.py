"""Advantage estimators against hand-computed numbers; each test is named after the pitfall it guards.

Sources: docs/method.md §4-§7. Hand numbers are worked out in the comments.
"""
import math

import jax
import numpy as np
import pytest

from strata_jax.algos import (
    ESTIMATORS,
    EstimatorConfig,
    compute_advantages,
    get_algorithm,
    get_estimator,
    keep_informative_groups,
    make_sample_batch,
    stapo_weights,
)
from strata_jax.algos.batch import KIND_ACTION, KIND_STRATEGY

EPS = 1e-6
TOL = dict(rtol=1e-5, atol=1e-6)


def act(task, traj, step=0, score=0.0, **kw):
    return dict(prompt_ids=[1, 2], response_ids=[3, 4], task_id=task, trajectory_id=traj,
                step_index=step, kind=KIND_ACTION, score=score, **kw)


def strat(task, sid, **kw):
    return dict(prompt_ids=[1], response_ids=[5, 6, 7], task_id=task, trajectory_id=-1,
                strategy_id=sid, kind=KIND_STRATEGY, **kw)


def run(name, records, step=0, **cfg):
    b = make_sample_batch(records)
    adv, w, m = compute_advantages(name, b, EstimatorConfig(**cfg), step)
    return np.asarray(adv)[: len(records)], np.asarray(w)[: len(records)], m


# ----------------------------------------------------------------------------- GRPO / RLOO


def test_all_equal_group_gives_exact_zero_despite_fp32_mean_residue():
    # 0.1 is not exact in fp32: a one-pass mean leaves a residue that /(std + eps) would blow up.
    adv, w, m = run("grpo", [act(0, i, score=0.1) for i in range(7)])
    assert np.all(adv == 0.0)
    np.testing.assert_array_equal(w, np.ones(7))
    assert float(m["adv/zero_var_group_frac"]) == 1.0


def test_size1_group_uses_mean0_std1_for_grpo_and_zero_for_rloo():
    adv, _, _ = run("grpo", [act(0, 0, score=0.7), act(1, 0, score=0.0), act(1, 1, score=1.0)])
    np.testing.assert_allclose(adv[0], 0.7 / (1 + EPS), **TOL)
    adv, _, _ = run("rloo", [act(0, 0, score=0.7)])
    assert adv[0] == 0.0


@pytest.mark.parametrize("ddof,std", [(0, 0.5), (1, math.sqrt(0.5))])
def test_ddof_0_vs_1(ddof, std):
    adv, _, _ = run("grpo", [act(0, 0, score=0.0), act(0, 1, score=1.0)], std_ddof=ddof)
    np.testing.assert_allclose(adv, [-0.5 / (std + EPS), 0.5 / (std + EPS)], **TOL)


def test_grpo_default_ddof_is_1_and_strata_default_is_0():
    assert EstimatorConfig().ddof(1) == 1 and EstimatorConfig().ddof(0) == 0
    assert EstimatorConfig(std_ddof=0).ddof(1) == 0


def test_rows_of_a_group_interleaved_with_other_groups_group_by_id_not_position():
    # task 0 rows 0,2,4 scores 1,2,6: mean 3, dev -2,-1,3, ddof1 var 7.
    # task 1 rows 1,3,5 scores 10,0,20: mean 10, dev 0,-10,10, ddof1 var 100.
    recs = [act(t, i, score=s) for i, (t, s) in enumerate(
        [(0, 1.0), (1, 10.0), (0, 2.0), (1, 0.0), (0, 6.0), (1, 20.0)])]
    adv, _, _ = run("grpo", recs)
    s7 = math.sqrt(7) + EPS
    np.testing.assert_allclose(adv, [-2 / s7, 0.0, -1 / s7, -10 / (10 + EPS), 3 / s7, 10 / (10 + EPS)],
                               **TOL)


def test_per_group_not_whole_batch_normalisation():
    # Per group: +-0.5 / std(ddof1 = sqrt .5) = +-0.7071 in both groups. Whole-batch would give
    # (0 - 5.5)/std(0,1,10,11) = -1.04 etc.
    adv, _, _ = run("grpo", [act(0, 0, score=0.0), act(0, 1, score=1.0),
                             act(1, 0, score=10.0), act(1, 1, score=11.0)])
    a = 0.5 / (math.sqrt(0.5) + EPS)
    np.testing.assert_allclose(adv, [-a, a, -a, a], **TOL)


def test_invalid_format_penalty_on_that_steps_score_only():
    # scores 1, 1 - 0.1 = 0.9: mean .95, ddof1 std sqrt(.005) = .070711
    adv, _, _ = run("grpo", [act(0, 0, score=1.0), act(0, 0, 1, score=1.0, invalid=True)])
    s = math.sqrt(0.005) + EPS
    np.testing.assert_allclose(adv, [0.05 / s, -0.05 / s], rtol=1e-4)


def test_dr_grpo_no_std():
    adv, _, _ = run("grpo", [act(0, 0, score=0.0), act(0, 1, score=1.0)], norm_by_std=False)
    np.testing.assert_allclose(adv, [-0.5, 0.5], **TOL)


def test_rloo_k8_leave_one_out():
    # 3 successes of 8: A = 8/7 (S - 3/8): successes 5/7, failures -3/7 (= S - mean of the others).
    scores = [1, 0, 0, 1, 1, 0, 0, 0]
    adv, _, _ = run("rloo", [act(0, i, score=float(s)) for i, s in enumerate(scores)])
    np.testing.assert_allclose(adv, [5 / 7 if s else -3 / 7 for s in scores], **TOL)


def test_rloo_leaves_one_step_out_of_the_step_samples_siblings_included():
    # Episode A (return 1) has 3 steps, B (return 0) one: n = 4 step samples, mean 3/4.
    # A step: 4/3 * (1 - 3/4) = 1/3 = 1 - mean(1, 1, 0) (its two siblings and B's step);
    # B's step: 4/3 * (0 - 3/4) = -1 = 0 - mean(1, 1, 1). (Over episodes it would be +-1.)
    recs = [act(0, 0, s, 1.0) for s in range(3)] + [act(0, 1, 0, 0.0)]
    adv, _, _ = run("rloo", recs)
    np.testing.assert_allclose(adv, [1 / 3, 1 / 3, 1 / 3, -1.0], **TOL)


def test_padding_and_crashed_rows_are_out_of_the_statistics_and_weights():
    # crashed row (score 100) must not shift the group's mean.
    adv, w, _ = run("grpo", [act(0, 0, score=0.0), act(0, 1, score=1.0), act(0, 2, score=100.0, valid=False)])
    a = 0.5 / (math.sqrt(0.5) + EPS)
    np.testing.assert_allclose(adv, [-a, a, 0.0], **TOL)
    np.testing.assert_array_equal(w, [1, 1, 0])


# ----------------------------------------------------------------------------- GiGPO


def test_gigpo_repeated_anchor_singleton_step_group_and_discounting():
    # Task 0: trajectory A (return 1) visits anchors a, b, a with step rewards 0, 0, 1;
    # trajectory B (return 0) visits a, d with rewards 0, 0. gamma .95:
    #   G_A = [.9025, .95, 1], G_B = [0, 0].
    # anchor a = {.9025, 1, 0}: mean .634167 -> step terms .268333, .365833, -.634167;
    # anchors b and d are singletons -> 0.
    # Episode term (mean_norm, over the 5 step samples): mean .6 -> A rows +.4, B rows -.6.
    # Task 1: one row with the same anchor hash: its own groups (singleton episode: S - 0 = .5).
    recs = [act(0, 0, 0, 1.0, anchor_id=11), act(0, 0, 1, 1.0, anchor_id=22),
            act(0, 0, 2, 1.0, anchor_id=11, step_reward=1.0),
            act(0, 1, 0, 0.0, anchor_id=11), act(0, 1, 1, 0.0, anchor_id=44),
            act(1, 0, 0, 0.5, anchor_id=11)]
    recs = [recs[i] for i in (3, 0, 5, 2, 4, 1)]  # shuffle rows: grouping and step order by id
    adv, _, m = run("gigpo", recs)
    m_a = (0.9025 + 1.0) / 3
    want = {(0, 0, 0): 0.4 + 0.9025 - m_a, (0, 0, 1): 0.4, (0, 0, 2): 0.4 + 1.0 - m_a,
            (0, 1, 0): -0.6 - m_a, (0, 1, 1): -0.6, (1, 0, 0): 0.5}
    got = {(r["task_id"], r["trajectory_id"], r["step_index"]): a for r, a in zip(recs, adv)}
    for k, v in want.items():
        np.testing.assert_allclose(got[k], v, rtol=1e-5, err_msg=str(k))
    g = np.asarray(m["row/step_returns"])[: len(recs)]
    got_g = {(r["task_id"], r["trajectory_id"], r["step_index"]): x for r, x in zip(recs, g)}
    np.testing.assert_allclose([got_g[(0, 0, s)] for s in range(3)], [0.9025, 0.95, 1.0], **TOL)


def test_gigpo_mean_std_norm():
    # Two one-step episodes, same anchor: episode term +-.7071 (ddof1), step term +-.7071.
    recs = [act(0, 0, 0, 1.0, step_reward=1.0, anchor_id=1), act(0, 1, 0, 0.0, anchor_id=1)]
    adv, _, _ = run("gigpo", recs, gigpo_step_norm="mean_std_norm")
    a = 0.5 / (math.sqrt(0.5) + EPS)
    np.testing.assert_allclose(adv, [2 * a, -2 * a], **TOL)


# ----------------------------------------------------------------------------- GAE / PPO


def test_gae_per_step_sample_terminal_at_last_step():
    # rewards 0,0,1, V = .5,.6,.7, gamma = lambda = 1: A = returns - V = .5,.4,.3; targets 1,1,1.
    recs = [act(0, 0, s, 1.0, step_reward=r, values=v) for s, r, v in
            [(2, 1.0, 0.7), (0, 0.0, 0.5), (1, 0.0, 0.6)]]
    adv, _, m = run("gae", recs, gae_whiten=False)
    np.testing.assert_allclose(adv, [0.3, 0.5, 0.4], **TOL)
    np.testing.assert_allclose(np.asarray(m["row/value_targets"])[:3], [1, 1, 1], **TOL)
    # whitened: mean .4, unbiased std .1 -> -1, 1, 0
    adv, _, _ = run(get_algorithm("ppo").estimator, recs)   # ppo's estimator (the table's)
    np.testing.assert_allclose(adv, [-1.0, 1.0, 0.0], rtol=1e-4, atol=1e-5)


def test_gae_lambda_095():
    # delta = .1, .1, .3; A2 = .3, A1 = .1 + .95*.3 = .385, A0 = .1 + .95*.385 = .46575
    recs = [act(0, 0, s, 1.0, step_reward=r, values=v) for s, r, v in
            [(0, 0.0, 0.5), (1, 0.0, 0.6), (2, 1.0, 0.7)]]
    adv, _, _ = run("gae", recs, gae_whiten=False, gae_lambda=0.95)
    np.testing.assert_allclose(adv, [0.46575, 0.385, 0.3], **TOL)


def test_gae_invalid_step_reward_carries_the_penalty():
    # Step 1 format-invalid: its reward 0 becomes -0.1. gamma = lambda = 1, V = 0:
    # A = returns = (-0.1 + 1, -0.1 + 1, 1) = .9, .9, 1.
    recs = [act(0, 0, 0, 1.0, step_reward=0.0, values=0.0),
            act(0, 0, 1, 1.0, step_reward=0.0, values=0.0, invalid=True),
            act(0, 0, 2, 1.0, step_reward=1.0, values=0.0)]
    adv, _, m = run("gae", recs, gae_whiten=False)
    np.testing.assert_allclose(adv, [0.9, 0.9, 1.0], **TOL)
    np.testing.assert_allclose(np.asarray(m["row/value_targets"])[:3], [0.9, 0.9, 1.0], **TOL)


# ----------------------------------------------------------------------------- StraTA


def _strata_batch():
    # Task 0, three strategies.
    # s0: episodes e0 (2 steps), e1, e2 with returns 1, .5, .5; |z| = 384 -> P_len = .5*128/256 = .25.
    #     top-delta with M=3 (odd): k = ceil(1.5) = 2, ties among the .5s: (1 + .5)/2 = .75 -> R = .5
    # s1: returns -.5 x3, format fail: -.5 - 1 = -1.5 -> clipped to -1.
    # s2: returns 2, 2 (scaled returns): top mean 2 -> clipped to 1.
    return [
        strat(0, 0, strategy_len=384), strat(0, 1, format_fail=True), strat(0, 2),
        act(0, 0, 0, 1.0, strategy_id=0), act(0, 0, 1, 1.0, strategy_id=0, judge_flag=True),
        act(0, 1, 0, 0.5, strategy_id=0, invalid=True), act(0, 2, 0, 0.5, strategy_id=0),
        act(0, 3, 0, -0.5, strategy_id=1), act(0, 4, 0, -0.5, strategy_id=1),
        act(0, 5, 0, -0.5, strategy_id=1),
        act(0, 6, 0, 2.0, strategy_id=2), act(0, 7, 0, 2.0, strategy_id=2),
    ]


def test_strategy_reward_top_delta_ties_odd_m_and_both_clip_bounds_with_penalties():
    recs = _strata_batch()
    adv, w, m = run("strata", recs)
    np.testing.assert_allclose(np.asarray(m["row/strategy_reward"])[:3], [0.5, -1.0, 1.0], **TOL)
    # strategy level GRPO, ddof 0, over R = [.5, -1, 1]
    np.testing.assert_allclose(adv[:3], [0.39223181, -1.37281133, 0.98057952], rtol=1e-5)
    np.testing.assert_array_equal(w, np.ones(len(recs)))


def test_top_delta_even_m_and_plain_mean_ablation():
    recs = [strat(0, 0), strat(0, 1)] + [act(0, i, 0, s, strategy_id=0) for i, s in
                                         enumerate([0.0, 0.2, 0.6, 1.0])]
    recs += [act(0, 9, 0, 0.0, strategy_id=1)]
    _, _, m = run("strata", recs)
    assert np.isclose(float(m["row/strategy_reward"][0]), 0.8)       # k = 2: (1 + .6)/2
    _, _, m = run("strata", recs, top_delta=1.0)
    assert np.isclose(float(m["row/strategy_reward"][0]), 0.45)      # plain mean


def test_judge_penalty_lands_only_on_flagged_steps_in_advantage_mode():
    recs = _strata_batch()
    adv, _, _ = run("strata", recs)
    # s0 episodes counted once each (e0 has two steps): returns 1,.5,.5, ddof0 std sqrt(1/18).
    a_e0, a_e1 = 1.41420756, -0.70710378
    np.testing.assert_allclose(adv[3:7], [a_e0, a_e0 - 0.1, a_e1 - 0.1, a_e1], rtol=1e-5)
    # zero-variance action groups give exactly 0 and are kept.
    np.testing.assert_array_equal(adv[7:], np.zeros(5))


def test_judge_reward_mode_uses_step_scores_over_the_step_samples():
    # S = 1, 1-.1, .5-.1 (invalid), .5 over the 4 step samples of s0: mean .7, ddof0 std .254951
    adv, _, _ = run("strata", _strata_batch(), judge_mode="reward")
    np.testing.assert_allclose(adv[3:7], [1.1766922, 0.78446146, -1.1766922, -0.78446146], rtol=1e-5)


def test_strategy_without_valid_episodes_gets_zero_and_leaves_stats():
    recs = [strat(0, 0), strat(0, 1), strat(0, 2), act(0, 0, 0, 1.0, strategy_id=0),
            act(0, 1, 0, 0.0, strategy_id=1), act(0, 2, 0, 0.5, strategy_id=2, valid=False)]
    adv, w, _ = run("strata", recs)
    # R(z) = 1 and 0 (ddof 0: mean .5, std .5); the third strategy has no valid episode.
    np.testing.assert_allclose(adv[:3], [0.5 / (0.5 + EPS), -0.5 / (0.5 + EPS), 0.0], rtol=1e-5)
    np.testing.assert_array_equal(w, [1, 1, 0, 1, 1, 0])


def test_strata_traj_normalises_over_the_tasks_episodes_and_credits_a_strategy_its_mean():
    """The ablation (docs/method.md §5.11) on StraTA's batch: one GRPO group of the task's 8
    episodes (returns 1, .5, .5, -.5 x3, 2, 2: mean .5625, ddof-0 std .9822646), the judge and
    invalid penalties on their steps, and each strategy row the mean of its episodes'
    advantages: no top-delta, no length / format penalty, no grouping over strategies."""
    recs = _strata_batch()
    adv, w, m = run("strata_traj", recs)
    a = lambda r: (r - 0.5625) / (0.982264602843857 + EPS)   # noqa: E731
    np.testing.assert_allclose(adv[3:], [a(1), a(1) - 0.1, a(.5) - 0.1, a(.5), a(-.5), a(-.5),
                                         a(-.5), a(2), a(2)], rtol=1e-5)
    np.testing.assert_allclose(adv[:3], [0.10604735, -1.08168300, 1.46345346], rtol=1e-5)
    np.testing.assert_allclose(adv[:3], [(a(1) + 2 * a(.5)) / 3, a(-.5), a(2)], rtol=1e-5)
    np.testing.assert_allclose(np.asarray(m["row/strategy_reward"])[:3], [2 / 3, -0.5, 2.0],
                               rtol=1e-6)
    np.testing.assert_array_equal(w, np.ones(len(recs)))
    # the same rows under StraTA differ only in the advantages
    _, w_strata, _ = run("strata", recs)
    np.testing.assert_array_equal(w, w_strata)


def test_strata_traj_strategy_without_episodes_and_reward_mode():
    recs = [strat(0, 0), strat(0, 1), strat(0, 2), act(0, 0, 0, 1.0, strategy_id=0),
            act(0, 1, 0, 0.0, strategy_id=1), act(0, 2, 0, 0.5, strategy_id=2, valid=False)]
    adv, w, _ = run("strata_traj", recs)
    # two valid episodes, returns 1 and 0: +-.5 / (.5 + eps); the third strategy: weight 0
    np.testing.assert_allclose(adv, [0.5 / (0.5 + EPS), -0.5 / (0.5 + EPS), 0, 0.5 / (0.5 + EPS),
                                     -0.5 / (0.5 + EPS), 0], rtol=1e-5)
    np.testing.assert_array_equal(w, [1, 1, 0, 1, 1, 0])
    # judge_mode "reward": step scores over the task's step samples (s = 1, .9, .4, .5,
    # -.5 x3, 2, 2), the strategy rows still the mean episode advantage
    adv, _, _ = run("strata_traj", _strata_batch(), judge_mode="reward")
    s = np.array([1, .9, .4, .5, -.5, -.5, -.5, 2, 2])
    np.testing.assert_allclose(adv[3:], (s - s.mean()) / (s.std() + EPS), rtol=1e-5)
    np.testing.assert_allclose(adv[:3], [0.10604735, -1.08168300, 1.46345346], rtol=1e-5)


def rev(task, sid, traj, step, ordinal, score, **kw):
    """A strategy-revision row: kind STRATEGY, anchor_id = ordinal, score = return from `step`."""
    return dict(prompt_ids=[1, 2, 3], response_ids=[5, 6], task_id=task, strategy_id=sid,
                trajectory_id=traj, step_index=step, kind=KIND_STRATEGY, anchor_id=ordinal,
                score=score, **kw)


def _revision_rows():
    # Strategy s0 of task 0 (episodes 0, 1, 2 of `_strata_batch`), first revisions (r = 1):
    #   e0: G = 1.0                      -> R = 1.0
    #   e1: G = 0.0, |z'| = 384          -> R = 0 - .5 * 128/256 = -0.25
    #   e2: G = 0.5, format failure      -> R = .5 - 1 = -0.5
    #   group (0, 0, 1): mean 1/12, ddof-0 std sqrt(((11/12)^2 + (1/3)^2 + (7/12)^2) / 3)
    #   = 0.65616732 -> A = 1.39699927, -0.50799973, -0.88899953
    # e0's second revision (r = 2) is alone in its group (0, 0, 2)   -> A = 0
    # s1's only revision, G = 2 (clipped to R = 1), alone            -> A = 0
    # s2's two first revisions with equal G = .4: zero variance      -> A = 0 (kept, weight 1)
    # a revision of a crashed episode (valid False): out of stats, weight 0
    return [rev(0, 0, 0, 1, 1, 1.0), rev(0, 0, 1, 1, 1, 0.0, strategy_len=384),
            rev(0, 0, 2, 1, 1, 0.5, format_fail=True), rev(0, 0, 0, 3, 2, 0.3),
            rev(0, 1, 3, 1, 1, 2.0), rev(0, 2, 6, 2, 1, 0.4), rev(0, 2, 7, 2, 1, 0.4),
            rev(0, 0, 2, 2, 1, 0.9, valid=False)]


def test_revision_level_groups_the_rth_revisions_of_one_strategy_and_leaves_other_levels():
    base = _strata_batch()
    adv0, w0, m0 = run("strata", base)
    adv, w, m = run("strata", base + _revision_rows())
    n = len(base)
    # the strategy and action levels are those of the batch without revisions
    np.testing.assert_array_equal(adv[:n], adv0)
    np.testing.assert_array_equal(np.asarray(m["row/strategy_reward"])[:n],
                                  np.asarray(m0["row/strategy_reward"])[:n])
    np.testing.assert_allclose(np.asarray(m["row/strategy_reward"])[n:n + 8],
                               [1.0, -0.25, -0.5, 0.3, 1.0, 0.4, 0.4, 0.0], **TOL)
    np.testing.assert_allclose(adv[n:], [1.39699927, -0.50799973, -0.88899953, 0, 0, 0, 0, 0],
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(w, [1] * (n + 7) + [0])


def test_revision_level_without_std_normalisation():
    # norm_by_std=False: A = R - mean = 11/12, -1/3, -7/12 for the (0, 0, 1) group.
    adv, _, _ = run("strata", _strata_batch() + _revision_rows()[:3], norm_by_std=False)
    np.testing.assert_allclose(adv[-3:], [11 / 12, -1 / 3, -7 / 12], rtol=1e-5)


# ----------------------------------------------------------------------------- STAPO

ADV6 = np.array([1.0, 0.6, 0.2, -0.2, -0.7, -1.0], np.float32)


def _weights(adv, step=0, c_u=0.0, std=None, **cfg):
    n = len(adv)
    w, m = stapo_weights(adv, np.ones(n, bool), np.zeros(n, np.int32),
                         np.zeros(n, np.float32) if std is None else std,
                         EstimatorConfig(**cfg), step, uncertainty_coef=c_u)
    return np.asarray(w), m


def test_stapo_weights_eta_fixed():
    # raw 1,1,0,0,.3,.3 (sum 2.6) -> mean 1: x 6/2.6
    w, m = _weights(ADV6)
    np.testing.assert_allclose(w, np.array([1, 1, 0, 0, 0.3, 0.3]) * 6 / 2.6, rtol=1e-6)
    assert np.isclose(float(m["stapo/selected_frac"]), 4 / 6)
    assert np.isclose(float(m["stapo/selected_adv_mean"]), (1 + 0.6 - 0.7 - 1.0) / 4)
    w, _ = _weights(ADV6, stapo_w_pos="advantage")
    np.testing.assert_allclose(w, np.array([1, .6, 0, 0, .3, .3]) * 6 / 2.2, rtol=1e-6)


def test_stapo_weights_by_quantile_with_annealing():
    # |A| sorted .2,.2,.6,.7,1,1: q=.5 -> .65: raw 1,0,0,0,.3,.3
    w, m = _weights(ADV6, stapo_eta_quantile=0.5)
    assert np.isclose(float(m["stapo/eta"]), 0.65)
    np.testing.assert_allclose(w, np.array([1, 0, 0, 0, .3, .3]) * 6 / 1.6, rtol=1e-6)
    # annealed .5 -> 1.0 over 10 steps, step 5: q = .75 -> .7 + .75 * .3 = .925: raw 1,0,0,0,0,.3
    w, m = _weights(ADV6, step=5, stapo_eta_quantile=0.5, stapo_eta_quantile_end=1.0,
                    stapo_anneal_steps=10)
    assert np.isclose(float(m["stapo/eta"]), 0.925)
    np.testing.assert_allclose(w, np.array([1, 0, 0, 0, 0, .3]) * 6 / 1.3, rtol=1e-6)


def test_stapo_uncertainty_bonus_reaches_the_mediocre_band():
    std = np.array([0, 0, 0.4, 0, 0, 0], np.float32)
    w, _ = _weights(ADV6, c_u=0.5, std=std)   # raw 1,1,.2,0,.3,.3 (sum 2.8)
    np.testing.assert_allclose(w, np.array([1, 1, .2, 0, .3, .3]) * 6 / 2.8, rtol=1e-6)


def test_stapo_bonus_off_without_a_critic():
    # modifier on GRPO: value_std present in the batch but c_u = 0 (no critic).
    recs = [act(0, i, score=s, value_std=0.4) for i, s in enumerate([0.0, 0.0, 1.0, 1.0])]
    adv, w, m = run("grpo", recs, stapo_weighting=True)
    # GRPO: +-.5/std(ddof1 = .57735) = +-.866 > eta: all selected, w_pos 1, w_neg .3 -> mean 1
    np.testing.assert_allclose(w, np.array([.3, .3, 1, 1]) * 4 / 2.6, rtol=1e-6)
    assert float(m["stapo/selected_frac"]) == 1.0


def test_stapo_modifier_normalises_and_floors_over_the_rows_the_estimator_trains():
    # StraTA + the modifier (eta .5, floor .2). Strategy s2's only episode crashed: its row is
    # valid but the estimator gives it weight 0. Strategy level over s0, s1 only:
    # A = +-.5 / (.5 + 1e-6) -> w 1 and .3 (sum 1.3, n 2) -> 2/1.3, .6/1.3; s2 stays 0 (it got
    # the floor and a share of the mean before). Action level: s0's and s1's episodes are
    # one-row groups (GRPO singleton: A = R / (1 + 1e-6)): 1 and the floor .2 -> 2/1.2, .4/1.2.
    recs = [strat(0, 0), strat(0, 1), strat(0, 2), act(0, 0, 0, 1.0, strategy_id=0),
            act(0, 1, 0, 0.0, strategy_id=1), act(0, 2, 0, 0.5, strategy_id=2, valid=False)]
    adv, w, _ = run("strata", recs, stapo_weighting=True, stapo_floor=0.2)
    np.testing.assert_allclose(adv, [1, -1, 0, 1, 0, 0], atol=3e-6)
    np.testing.assert_allclose(w, [2 / 1.3, 0.6 / 1.3, 0, 2 / 1.2, 0.4 / 1.2, 0], rtol=1e-6)
    # eta's quantile is over the trained rows too: |A| sorted 0, 1, 1, 1 (s2's 0 left out)
    # at q .25 -> .75 (with s2: 0, 0, 1, 1, 1 -> 0)
    _, _, m = run("strata", recs, stapo_weighting=True, stapo_eta_quantile=0.25)
    assert float(m["stapo/eta"]) == pytest.approx(0.75, rel=1e-5)


def test_stapo_all_zero_weights_case():
    w, m = _weights(np.array([0.1, -0.2, 0.0, 0.4], np.float32))
    np.testing.assert_array_equal(w, np.zeros(4))
    assert float(m["stapo/empty"]) == 1.0 and np.isfinite(float(m["stapo/selected_adv_mean"]))


def test_stapo_estimator_gae_lambda_095_whitened_then_weighted():
    # raw GAE .46575, .385, .3 (see test_gae_lambda_095), whitened: mean .383583,
    # unbiased std .082918 -> 1.0, .0169, -1.0169: selected: first (w 1) and last (w .3);
    # bonus .5 * value_std .2 on every row -> raw 1.1, .1, .4 (sum 1.6) -> x 3/1.6
    recs = [act(0, 0, s, 1.0, step_reward=r, values=v, value_std=0.2) for s, r, v in
            [(0, 0.0, 0.5), (1, 0.0, 0.6), (2, 1.0, 0.7)]]
    adv, w, m = run("stapo", recs)
    raw = np.array([0.46575, 0.385, 0.3])
    np.testing.assert_allclose(adv, (raw - raw.mean()) / raw.std(ddof=1), rtol=1e-4)
    np.testing.assert_allclose(w, np.array([1.1, 0.1, 0.4]) * 3 / 1.6, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(m["row/value_targets"])[:3], [0.96575, 0.985, 1.0], rtol=1e-5)


# ----------------------------------------------------------------------------- DAPO, registry


def test_dapo_filter_drops_all_equal_groups():
    keep = keep_informative_groups([0, 0, 1, 1, 2, 2, 3], [1, 1, 0, 1, 0, 0.0, 1],
                                   valid=[1, 1, 1, 1, 1, 1, 1])
    np.testing.assert_array_equal(keep, [0, 0, 1, 1, 0, 0, 0])
    keep = keep_informative_groups([0, 0, 0], [1, 0, 5], valid=[1, 1, 0])
    np.testing.assert_array_equal(keep, [1, 1, 0])
    with pytest.raises(ValueError, match="same length"):
        keep_informative_groups([0], [1, 2])


def test_registry_names_and_unknown_name():
    assert sorted(ESTIMATORS) == ["gae", "gigpo", "grpo", "rloo", "stapo", "strata", "strata_traj"]
    for n in ESTIMATORS:
        assert callable(get_estimator(n))
    # algorithm names are the table's, not the registry's: ppo runs gae, dapo runs grpo
    assert (get_algorithm("ppo").estimator, get_algorithm("dapo").estimator) == ("gae", "grpo")
    with pytest.raises(KeyError, match="registered"):
        get_estimator("nope")
    with pytest.raises(ValueError, match="judge_mode"):
        EstimatorConfig(judge_mode="rewards").validate()


def test_config_reads_base_configdict():
    from configs.base import get_base_config
    from strata_jax.config import ConfigError
    c = get_base_config().adv
    c.std_ddof, c.judge_mode = 0, "reward"
    ec = EstimatorConfig.from_config(c)
    assert ec.std_ddof == 0 and ec.judge_mode == "reward" and ec.eps == 1e-6
    hash(ec)  # static under jit
    c.unknown_field = 3                         # a key no field reads is refused ...
    with pytest.raises(ConfigError, match="unknown config field 'adv.unknown_field'"):
        EstimatorConfig.from_config(c)
    del c["unknown_field"]
    del c["eps"]                                # ... and so is a missing one (no silent default)
    with pytest.raises(ConfigError, match="lacks 'adv.eps'"):
        EstimatorConfig.from_config(c)


# ----------------------------------------------------------------------------- constant groups


def _sum(deltas):
    """An episode return as the env bridge sums it: float64 sums of ScienceWorld's delta / 100."""
    total = 0.0
    for d in deltas:
        total += d / 100
    return total


def test_dapo_filter_and_grpo_share_one_constancy_rule():
    """Four 67s summed from different deltas are not bit-equal in float64, but GRPO sees the
    group as constant (advantages exactly 0); DAPO's filter must drop it too, and the four
    100s; it keeps the informative group."""
    r67 = [_sum([58, 9]), _sum([67]), _sum([60, 7]), _sum([30, 37])]
    r100 = [_sum([70, 20, 10]), _sum([100]), _sum([60, 30, 10]), _sum([1] * 100)]
    assert len(set(r67)) > 1 and len(set(r100)) > 1   # the float sums differ in the last bits
    informative = [0.1, 0.2, 0.67, 1.0]
    returns = r67 + r100 + informative
    tasks = [0] * 4 + [1] * 4 + [2] * 4
    keep = keep_informative_groups(tasks, returns)
    np.testing.assert_array_equal(keep, [0] * 8 + [1] * 4)
    adv, _, m = run("grpo", [act(t, i, score=s) for i, (t, s) in enumerate(zip(tasks, returns))])
    assert np.all(adv[:8] == 0.0) and np.all(adv[8:] != 0.0)
    assert float(m["adv/zero_var_group_frac"]) == pytest.approx(2 / 3)


SCIWORLD_REWARDS = [0.0, 0.08, 0.0, 0.25, 0.0, 0.0, 0.17, 0.0, 0.09, 0.0, 0.58, 0.0, 0.0]
ALFWORLD_REWARDS = [0.0] * 11 + [10.0]


@pytest.mark.parametrize("rewards", [SCIWORLD_REWARDS, ALFWORLD_REWARDS])
@pytest.mark.parametrize("norm", ["mean_norm", "mean_std_norm"])
def test_gigpo_four_identical_trajectories_get_exactly_zero(rewards, norm):
    """Four identical trajectories (same observations, so the same anchors, same rewards) at
    different offsets in the batch, behind another task's rows: both levels are constant
    groups, so every advantage is exactly 0 (as in verl-agent), whatever the rounding of the
    discounted returns at each offset."""
    ret = sum(rewards)
    recs = [act(9, j, s, 0.3 * j, step_reward=0.1 * s, anchor_id=500 + s)
            for j in range(3) for s in range(5)]   # shifts the offsets of task 0's rows
    recs += [act(0, i, s, ret, step_reward=r, anchor_id=100 + s)
             for i in range(4) for s, r in enumerate(rewards)]
    adv, _, m = run("gigpo", recs, gigpo_step_norm=norm)
    np.testing.assert_array_equal(adv[15:], np.zeros(4 * len(rewards)))
    g = np.asarray(m["row/step_returns"])[15:15 + len(rewards)]
    want = [sum(r * 0.95 ** k for k, r in enumerate(rewards[s:])) for s in range(len(rewards))]
    np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("ret", [0.05, _sum([58, 9])])
def test_strata_strategy_level_of_identical_strategies_is_exactly_zero(ret):
    """Four strategies whose episodes are identical trajectories (1, 7, 13 and 21 of them):
    their strategy rewards are one value, but the top-mean of each (k = 1, 4, 7, 11 of its
    returns, summed in row order, then / k) may round an ulp apart; the strategy level must
    give exactly 0, not that ulp over (std + eps)."""
    recs = [strat(0, sid) for sid in range(4)]
    e0 = 0
    for sid, m_eps in enumerate((1, 7, 13, 21)):
        recs += [act(0, e0 + e, s, ret, strategy_id=sid) for e in range(m_eps) for s in range(2)]
        e0 += m_eps
    adv, w, m = run("strata", recs)
    np.testing.assert_array_equal(adv[:4], np.zeros(4))
    np.testing.assert_allclose(np.asarray(m["row/strategy_reward"])[:4], [ret] * 4, rtol=1e-6)
    np.testing.assert_array_equal(w, np.ones(len(recs)))
