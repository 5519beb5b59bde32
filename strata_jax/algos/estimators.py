"""Advantage estimators as pure jittable functions, registered by name.

Every estimator has ONE signature:

    estimator(batch: SampleBatch, config: EstimatorConfig, step) -> (advantages, sample_weights, metrics)

    advantages:     [R] f32 per sample (the loss broadcasts it over the sample's tokens); 0 on
                    rows outside the estimator's statistics (padding, crashed episodes).
    sample_weights: [R] f32; 1 on valid rows and 0 on padding / crashed rows, except under STAPO
                    weighting (then the selective weights, mean 1 per level over the rows the
                    estimator trains; the rows it gives 0 stay 0).
    metrics:        dict of scalar f32 arrays for logging, plus per-row [R] arrays under keys that
                    start with "row/" (e.g. "row/value_targets" for the critic, "row/strategy_reward").

`config` is static (a hashable frozen dataclass, jit it with `static_argnums` or a closure);
`step` is the training step (may be traced; only STAPO's quantile annealing reads it).
Use `compute_advantages(name, batch, config, step)`: it looks the estimator up and applies the
`stapo_weighting` modifier when the config asks for it.

Names: grpo, rloo, gigpo, gae, strata, strata_traj, stapo. Which estimator an algorithm (``c.algo``) uses is
its entry in `strata_jax.algos.table.ALGORITHMS` (ppo -> gae, dapo -> grpo). Source:
docs/method.md §4-§7.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from strata_jax.algos.batch import KIND_ACTION, KIND_STRATEGY, SampleBatch
from strata_jax.algos.config import EstimatorConfig
from strata_jax.algos.segments import (
    dense_group_ids,
    group_normalize,
    per_trajectory_reverse,
    reverse_linear_recurrence,
    trajectory_order,
)
from strata_jax.algos.stapo import stapo_weights

Estimator = Callable[[SampleBatch, EstimatorConfig, object], tuple]
ESTIMATORS: dict[str, Estimator] = {}


def register_estimator(*names: str):
    """Decorator: register an estimator under one or more names. A new algorithm is its
    estimator (this, unless a registered one fits) plus one `table.ALGORITHMS` entry."""
    def deco(fn):
        for n in names:
            ESTIMATORS[n] = fn
        return fn
    return deco


def get_estimator(name: str) -> Estimator:
    """Look an estimator up by name; raises KeyError listing the registered names."""
    if name not in ESTIMATORS:
        raise KeyError(f"unknown estimator {name!r}; registered: {sorted(ESTIMATORS)}")
    return ESTIMATORS[name]


def compute_advantages(name: str, batch: SampleBatch, config: EstimatorConfig, step=0):
    """Run estimator `name`, then STAPO's weighting modifier if `config.stapo_weighting`.

    The modifier uses c_u = 0 (no critic on GRPO, RLOO, ...); `stapo` already weights itself.
    It selects, floors and normalises over the rows the estimator trains (valid rows with a
    non-zero estimator weight); the others keep weight 0 (docs/method.md §7.3).
    Returns (advantages [R] f32, sample_weights [R] f32, metrics dict).
    """
    adv, w, metrics = get_estimator(name)(batch, config, step)
    if config.stapo_weighting and name != "stapo":
        # Over the rows the estimator trains only: a valid row it gives weight 0 (StraTA's
        # strategy without a valid episode, a row outside every group) has no advantage to
        # select on; it must stay at 0 and stay out of eta's quantile and the mean-1 count.
        w, m = stapo_weights(adv, batch.valid & (w > 0), batch.kind, batch.value_std, config,
                             step, uncertainty_coef=0.0)
        metrics = {**metrics, **m}
    return adv, w, metrics


# ----------------------------------------------------------------------------- helpers


def _action_mask(b: SampleBatch) -> jax.Array:
    return b.valid & (b.kind == KIND_ACTION)


def _strategy_mask(b: SampleBatch) -> jax.Array:
    return b.valid & (b.kind == KIND_STRATEGY)


def _revision_mask(b: SampleBatch) -> jax.Array:
    """Strategy rows of a revision (level anchor_id = ordinal >= 1; docs/method.md §5.9)."""
    return _strategy_mask(b) & (b.anchor_id > 0)


def _masked_mean_std(x: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    m = mask.astype(jnp.float32)
    n = jnp.maximum(jnp.sum(m), 1.0)
    mean = jnp.sum(x * m) / n
    var = jnp.sum(((x - mean) * m) ** 2) / n
    return mean, jnp.sqrt(var)


def advantage_metrics(adv: jax.Array, b: SampleBatch, groups: list[dict]) -> dict:
    """adv mean/std per level over valid rows and the fraction of zero-variance groups.

    `groups` holds `segment_stats` dicts of the group statistics the estimator used.
    """
    am, asd = _masked_mean_std(adv, _action_mask(b))
    sm, ssd = _masked_mean_std(adv, _strategy_mask(b))
    ng = sum((g["num_groups"] for g in groups), jnp.zeros((), jnp.int32))
    nz = sum((g["num_constant_groups"] for g in groups), jnp.zeros((), jnp.int32))
    return {
        "adv/action_mean": am, "adv/action_std": asd,
        "adv/strategy_mean": sm, "adv/strategy_std": ssd,
        "adv/zero_var_group_frac": nz.astype(jnp.float32) / jnp.maximum(ng, 1).astype(jnp.float32),
    }


def _step_scores(b: SampleBatch, c: EstimatorConfig) -> jax.Array:
    """Per step-sample score: the episode return minus the invalid-format penalty on that step."""
    return b.score - c.invalid_penalty * b.invalid.astype(jnp.float32)


def _whiten(x: jax.Array, mask: jax.Array) -> jax.Array:
    """(x - mean) / sqrt(var_unbiased + 1e-8) over masked rows (verl's masked_whiten)."""
    m = mask.astype(jnp.float32)
    n = jnp.sum(m)
    mean = jnp.sum(x * m) / jnp.maximum(n, 1.0)
    var = jnp.sum(((x - mean) * m) ** 2) / jnp.maximum(n - 1.0, 1.0)
    return jnp.where(mask, (x - mean) * jax.lax.rsqrt(var + 1e-8), 0.0)


# ----------------------------------------------------------------------------- estimators


@register_estimator("grpo")
def grpo(b: SampleBatch, c: EstimatorConfig, step=0):
    """GRPO over all step samples of a task group (each step counts once; ddof pinned 1).

    A = (S - mean_g) / (std_g + eps), S = episode return - 0.1 * invalid; size-1 group:
    mean 0, std 1; zero-variance group: 0. Source: docs/method.md §6.1 (verl-agent GRPO).
    DAPO's advantages are these too: its clip-higher is in the loss (``loss.clip_eps_high``
    0.28) and its dynamic sampling in `dapo_filter.keep_informative_groups` (docs/method.md §6.5).
    """
    mask = _action_mask(b)
    seg = dense_group_ids([b.task_id], mask)
    adv, st = group_normalize(_step_scores(b, c), seg, mask, norm_by_std=c.norm_by_std,
                              ddof=c.ddof(1), eps=c.eps, singleton="grpo")
    return adv, mask.astype(jnp.float32), advantage_metrics(adv, b, [st])


@register_estimator("rloo")
def rloo(b: SampleBatch, c: EstimatorConfig, step=0):
    """RLOO: A = n/(n-1) * (S - mean_g) over the step samples of a task group; size-1 group: 0.

    Source: docs/method.md §6.2 (equals S minus the mean of the other n-1 samples).
    """
    mask = _action_mask(b)
    seg = dense_group_ids([b.task_id], mask)
    s = _step_scores(b, c)
    adv, st = group_normalize(s, seg, mask, norm_by_std=False, ddof=0, eps=c.eps, singleton="zero")
    n = st["count"]
    adv = jnp.where(n > 1, adv * n / jnp.maximum(n - 1.0, 1.0), 0.0)
    return adv, mask.astype(jnp.float32), advantage_metrics(adv, b, [st])


@register_estimator("gigpo")
def gigpo(b: SampleBatch, c: EstimatorConfig, step=0):
    """GiGPO: A = A_episode + omega * A_step (docs/method.md §6.3; verl-agent compute_gigpo_outcome_advantage).

    Episode term: group-relative over the step samples of the task group (GRPO conventions,
    ddof 1, size-1 group mean 0 std 1), S = return - 0.1 * invalid.
    Step term: discounted step returns G_t = r_t + gamma * G_{t+1} within the trajectory
    (gamma 0.95), grouped by (task_id, anchor_id); singleton step group gives 0.
    Both terms use `gigpo_step_norm`: mean_norm (subtract the mean) or mean_std_norm.
    Extra metric: row/step_returns.
    """
    mask = _action_mask(b)
    by_std = c.gigpo_step_norm == "mean_std_norm"
    task_seg = dense_group_ids([b.task_id], mask)
    ep, st_ep = group_normalize(_step_scores(b, c), task_seg, mask, norm_by_std=by_std,
                                ddof=c.ddof(1), eps=c.eps, singleton="grpo")
    traj_seg = dense_group_ids([b.task_id, b.trajectory_id], mask)
    g = per_trajectory_reverse(b.step_reward, c.gigpo_gamma, traj_seg, b.step_index, mask)
    anchor_seg = dense_group_ids([b.task_id, b.anchor_id], mask)
    st_adv, st_step = group_normalize(g, anchor_seg, mask, norm_by_std=by_std, ddof=c.ddof(1),
                                      eps=c.eps, singleton="zero")
    adv = ep + c.gigpo_omega * st_adv
    m = advantage_metrics(adv, b, [st_ep])
    m["gigpo/step_group_count"] = st_step["num_groups"].astype(jnp.float32)
    m["row/step_returns"] = g
    return adv, mask.astype(jnp.float32), m


def _gae(b: SampleBatch, c: EstimatorConfig, lam: float, whiten: bool):
    """GAE over each trajectory's step samples: (advantages, value targets = raw A + V).

    The step reward of a format-invalid step carries the invalid-format penalty (as every other
    estimator's step score does: docs/method.md §2), so PPO and STAPO see it too.
    """
    mask = _action_mask(b)
    traj_seg = dense_group_ids([b.task_id, b.trajectory_id], mask)
    order, has_next = trajectory_order(traj_seg, b.step_index, mask)
    v = jnp.where(mask, b.values, 0.0)[order]
    reward = b.step_reward - c.invalid_penalty * b.invalid.astype(jnp.float32)
    r = jnp.where(mask, reward, 0.0)[order]
    v_next = jnp.where(has_next, jnp.concatenate([v[1:], jnp.zeros((1,), v.dtype)]), 0.0)
    delta = r + c.gae_gamma * v_next - v
    a_sorted = reverse_linear_recurrence(delta, jnp.where(has_next, c.gae_gamma * lam, 0.0))
    adv = jnp.where(mask, jnp.zeros_like(a_sorted).at[order].set(a_sorted), 0.0)
    targets = jnp.where(mask, adv + b.values, 0.0)
    if whiten:
        adv = _whiten(adv, mask)
    return adv, targets, mask


@register_estimator("gae")
def gae(b: SampleBatch, c: EstimatorConfig, step=0):
    """GAE for PPO per step sample (gamma = lambda = 1 pinned), whitened over valid samples.

    delta_t = r_t + gamma * V_{t+1} - V_t with V after the last step of a trajectory = 0;
    A_t = delta_t + gamma * lambda * A_{t+1}. Metric row/value_targets = A_raw + V (critic).
    Source: docs/method.md §6.4 (verl compute_gae_advantage_return, per step sample instead of per token).
    """
    adv, targets, mask = _gae(b, c, c.gae_lambda, c.gae_whiten)
    m = advantage_metrics(adv, b, [])
    m["row/value_targets"] = targets
    return adv, mask.astype(jnp.float32), m


@register_estimator("stapo")
def stapo(b: SampleBatch, c: EstimatorConfig, step=0):
    """STAPO: GAE (gamma 1, lambda 0.95) over the trajectory-aware critic's values, whitened,
    then selective weights with the dropout-uncertainty bonus c_u * std(V) (docs/method.md §7.2-§7.3).
    Metric row/value_targets = A_raw + V for the weighted value loss. Only step samples carry
    a value, so strategy rows (if any) get advantage and weight 0. Out of scope (docs/method.md §7.5):
    the source's prioritised replay pool and weight-stratified batch sampling.
    """
    adv, targets, mask = _gae(b, c, c.stapo_gae_lambda, c.stapo_whiten)
    w, sm = stapo_weights(adv, mask, b.kind, b.value_std, c, step,
                          uncertainty_coef=c.stapo_uncertainty_coef)
    m = {**advantage_metrics(adv, b, []), **sm, "row/value_targets": targets}
    return adv, w, m


def strategy_rewards(b: SampleBatch, c: EstimatorConfig):
    """StraTA's strategy reward R(z) per row, from the episode returns of the strategy's episodes.

    R(z_i) = clip(TopMean_delta({R_ij}_j) - P_len(z_i) - P_fmt(z_i), -1, 1), TopMean_delta = mean
    of the k = ceil(delta * M) largest returns (ties: any choice gives the same mean), M = the
    strategy's valid episodes; P_len = beta_len * max(0, |z| - L_max) / L_max; P_fmt = format_fail.
    An episode is counted once (its first valid step row carries its return).
    Returns (R(z) [R] f32 on strategy rows (0 elsewhere), has_episodes [R] bool on strategy rows).
    Only the task-level strategies (anchor_id 0) count here; revision rows get 0 / False.
    Source: docs/method.md §5.5.
    """
    R = b.num_rows
    act = _action_mask(b)
    strat = _strategy_mask(b) & (b.anchor_id == 0)
    rows = jnp.arange(R, dtype=jnp.int32)
    traj_seg = dense_group_ids([b.task_id, b.trajectory_id], act)
    first_row = jax.ops.segment_min(jnp.where(act, rows, R), traj_seg, num_segments=R + 1)
    rep = act & (rows == first_row[traj_seg])           # one row per episode
    # (task, strategy) groups shared by the strategy row and its episodes.
    ts = dense_group_ids([b.task_id, b.strategy_id], act | strat)
    ts_rep = jnp.where(rep, ts, R)
    m_count = jax.ops.segment_sum(rep.astype(jnp.float32), ts_rep, num_segments=R + 1)
    k = jnp.clip(jnp.ceil(c.top_delta * m_count - 1e-4), 1.0, jnp.maximum(m_count, 1.0))
    # Rank of each episode's return inside its strategy, largest first.
    order = jnp.lexsort((-b.score, ts_rep, ~rep))
    pos = jnp.arange(R)
    ts_sorted = ts_rep[order]
    start = jax.ops.segment_min(pos, ts_sorted, num_segments=R + 1)
    rank_sorted = pos - start[ts_sorted]
    rank = jnp.zeros((R,), jnp.int32).at[order].set(rank_sorted.astype(jnp.int32))
    top = rep & (rank < k[ts_rep])
    top_sum = jax.ops.segment_sum(jnp.where(top, b.score, 0.0), ts_rep, num_segments=R + 1)
    top_mean = top_sum / k
    p_len = c.len_penalty * jnp.maximum(0.0, b.strategy_len.astype(jnp.float32) - c.len_max) / c.len_max
    p_fmt = b.format_fail.astype(jnp.float32)
    rz = jnp.clip(top_mean[ts] - p_len - p_fmt, -1.0, 1.0)
    has_eps = strat & (m_count[ts] > 0)
    return jnp.where(has_eps, rz, 0.0), has_eps


def revision_advantages(b: SampleBatch, c: EstimatorConfig):
    """The revision level of StraTA with strategy revision (docs/method.md §5.9).

    Revision row (kind STRATEGY, anchor_id = ordinal r >= 1, score = G, the episode's return
    from the revision point): R(z') = clip(G - P_len(z') - P_fmt(z'), -1, 1), P_len / P_fmt as
    for z. Group: the r-th revisions of the episodes of one original strategy, key
    (task_id, strategy_id, r); A = (R - mean_g) / (std_g + eps), ddof pinned 0 (as StraTA's
    other levels); zero-variance group: 0; a revision alone in its group: 0 (nothing to
    compare it with). Returns (A [R] f32, R(z') [R] f32, mask [R] bool; 0 / False off the
    revision rows, the group stats).
    """
    rev = _revision_mask(b)
    p_len = c.len_penalty * jnp.maximum(0.0, b.strategy_len.astype(jnp.float32) - c.len_max) / c.len_max
    r_rev = jnp.where(rev, jnp.clip(b.score - p_len - b.format_fail.astype(jnp.float32),
                                    -1.0, 1.0), 0.0)
    seg = dense_group_ids([b.task_id, b.strategy_id, b.anchor_id], rev)
    a_rev, st = group_normalize(r_rev, seg, rev, norm_by_std=c.norm_by_std, ddof=c.ddof(0),
                                eps=c.eps, singleton="zero")
    return a_rev, r_rev, rev, st


@register_estimator("strata")
def strata(b: SampleBatch, c: EstimatorConfig, step=0):
    """StraTA's two-level advantages (docs/method.md §5.5-§5.6), ddof pinned 0, eps 1e-6.

    Strategy level: GRPO over the N strategy rewards R(z) of a task (`strategy_rewards`);
    a strategy with no valid episode gets 0 and stays out of the statistics.
    Action level, judge_mode "advantage": GRPO over the M episode returns of one strategy (one
    value per episode), broadcast to every step of the episode, then A -= kappa on judge-flagged
    steps and A -= invalid_penalty on format-invalid steps. judge_mode "reward": step scores
    S_t = R_ij - kappa * judge - invalid_penalty * invalid, group statistics over all step
    samples of the strategy's M episodes.
    Revision level (only when the rollout revised strategies): `revision_advantages`; an
    episode's action rows keep their action-level advantages.
    Metrics: row/strategy_reward (R(z) on strategy rows, R(z') on revision rows), strata/*
    (judge and invalid step fractions).
    """
    R = b.num_rows
    act = _action_mask(b)
    rz, has_eps = strategy_rewards(b, c)
    task_seg = dense_group_ids([b.task_id], has_eps)
    a_strat, st_s = group_normalize(rz, task_seg, has_eps, norm_by_std=c.norm_by_std,
                                    ddof=c.ddof(0), eps=c.eps, singleton="grpo")
    judge = b.judge_flag.astype(jnp.float32)
    inval = b.invalid.astype(jnp.float32)
    grp = dense_group_ids([b.task_id, b.strategy_id], act)
    if c.judge_mode == "advantage":
        rows = jnp.arange(R, dtype=jnp.int32)
        traj_seg = dense_group_ids([b.task_id, b.trajectory_id], act)
        first_row = jax.ops.segment_min(jnp.where(act, rows, R), traj_seg, num_segments=R + 1)
        rep = act & (rows == first_row[traj_seg])
        a_rep, st_a = group_normalize(b.score, jnp.where(rep, grp, R), rep,
                                      norm_by_std=c.norm_by_std, ddof=c.ddof(0), eps=c.eps,
                                      singleton="grpo")
        a_ep = jax.ops.segment_sum(a_rep, jnp.where(rep, traj_seg, R), num_segments=R + 1)[traj_seg]
        a_act = a_ep - c.judge_kappa * judge - c.invalid_penalty * inval
    else:
        s = b.score - c.judge_kappa * judge - c.invalid_penalty * inval
        a_act, st_a = group_normalize(s, grp, act, norm_by_std=c.norm_by_std, ddof=c.ddof(0),
                                      eps=c.eps, singleton="grpo")
    a_rev, r_rev, rev, st_r = revision_advantages(b, c)
    adv = jnp.where(act, a_act, jnp.where(has_eps, a_strat, a_rev)).astype(jnp.float32)
    weights = (act | has_eps | rev).astype(jnp.float32)
    m = advantage_metrics(adv, b, [st_s, st_a, st_r])
    na = jnp.maximum(jnp.sum(act.astype(jnp.float32)), 1.0)
    m["strata/judge_step_frac"] = jnp.sum(judge * act) / na
    m["strata/invalid_step_frac"] = jnp.sum(inval * act) / na
    m["strata/strategy_reward_mean"] = jnp.sum(rz) / jnp.maximum(jnp.sum(has_eps.astype(jnp.float32)), 1.0)
    m["row/strategy_reward"] = rz + r_rev
    return adv, weights, m


@register_estimator("strata_traj")
def strata_traj(b: SampleBatch, c: EstimatorConfig, step=0):
    """StraTA's prompts, a trajectory-level estimator: the ablation without the two-level
    advantage (docs/method.md §5.11).

    Action level: GRPO over the episodes of the whole task (its N x M episodes across every
    strategy, one value per episode, ddof pinned 0 and eps as StraTA's), broadcast to every
    step, then A -= kappa on judge-flagged steps and A -= invalid_penalty on format-invalid
    steps (judge_mode "reward": step scores with those penalties, group statistics over the
    task's step samples). Strategy rows: the mean of their episodes' advantages (before the
    step penalties), the credit a trajectory-level estimator gives tokens that M trajectories
    share; no strategy reward, no top-delta, no grouping over strategies; a strategy without a
    valid episode gets weight 0. Revisions (when the rollout revised strategies) keep StraTA's
    revision level. So StraTA and this estimator see the same rows and differ only in the
    advantage. Metrics: as `strata`, plus row/strategy_reward = the strategy's mean return.
    """
    R = b.num_rows
    act = _action_mask(b)
    strat = _strategy_mask(b) & (b.anchor_id == 0)
    judge = b.judge_flag.astype(jnp.float32)
    inval = b.invalid.astype(jnp.float32)
    rows = jnp.arange(R, dtype=jnp.int32)
    traj_seg = dense_group_ids([b.task_id, b.trajectory_id], act)
    first_row = jax.ops.segment_min(jnp.where(act, rows, R), traj_seg, num_segments=R + 1)
    rep = act & (rows == first_row[traj_seg])                 # one row per episode
    task_seg = dense_group_ids([b.task_id], act)
    a_rep, st_a = group_normalize(b.score, jnp.where(rep, task_seg, R), rep,
                                  norm_by_std=c.norm_by_std, ddof=c.ddof(0), eps=c.eps,
                                  singleton="grpo")
    a_ep = jax.ops.segment_sum(a_rep, jnp.where(rep, traj_seg, R), num_segments=R + 1)[traj_seg]
    if c.judge_mode == "advantage":
        a_act = a_ep - c.judge_kappa * judge - c.invalid_penalty * inval
    else:
        s = b.score - c.judge_kappa * judge - c.invalid_penalty * inval
        a_act, st_a = group_normalize(s, task_seg, act, norm_by_std=c.norm_by_std,
                                      ddof=c.ddof(0), eps=c.eps, singleton="grpo")
    # the strategy row's credit: the mean episode advantage of its (task, strategy) group
    ts = dense_group_ids([b.task_id, b.strategy_id], act | strat)
    ts_rep = jnp.where(rep, ts, R)
    n_eps = jax.ops.segment_sum(rep.astype(jnp.float32), ts_rep, num_segments=R + 1)
    a_sum = jax.ops.segment_sum(jnp.where(rep, a_rep, 0.0), ts_rep, num_segments=R + 1)
    r_sum = jax.ops.segment_sum(jnp.where(rep, b.score, 0.0), ts_rep, num_segments=R + 1)
    has_eps = strat & (n_eps[ts] > 0)
    a_strat = jnp.where(has_eps, a_sum[ts] / jnp.maximum(n_eps[ts], 1.0), 0.0)
    r_mean = jnp.where(has_eps, r_sum[ts] / jnp.maximum(n_eps[ts], 1.0), 0.0)
    a_rev, r_rev, rev, st_r = revision_advantages(b, c)
    adv = jnp.where(act, a_act, jnp.where(has_eps, a_strat, a_rev)).astype(jnp.float32)
    weights = (act | has_eps | rev).astype(jnp.float32)
    m = advantage_metrics(adv, b, [st_a, st_r])
    na = jnp.maximum(jnp.sum(act.astype(jnp.float32)), 1.0)
    m["strata/judge_step_frac"] = jnp.sum(judge * act) / na
    m["strata/invalid_step_frac"] = jnp.sum(inval * act) / na
    m["strata/strategy_reward_mean"] = (jnp.sum(r_mean)
                                        / jnp.maximum(jnp.sum(has_eps.astype(jnp.float32)), 1.0))
    m["row/strategy_reward"] = r_mean + r_rev
    return adv, weights, m
