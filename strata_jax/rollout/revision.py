"""Strategy revision during an episode: when to revise, the revision call, the revision rows
(docs/method.md §5.9). An option of the StraTA rollout, off by default (the paper's z is
fixed for the whole episode).

Triggers, checked for each live episode before each of its steps (t = steps taken, t >= 1):
  * ``every = K`` (> 0): at t = K, 2K, 3K, ...
  * ``on = "stuck"``: at least ``stuck_steps`` = k steps since the last revision (or the
    start), and over the last k steps the episode is stuck: every step was invalid
    (format-invalid or refused by the env, `env_rejected`), or the k sent actions are all the
    same text, or no step changed the score (every step reward 0).
At a trigger the policy writes a new plan from the revision prompt
(`PromptBuilder.revision_prompt`: the plan in force, the history window, the current
observation); a plan that passes the strategy format check replaces the one in force for the
later step prompts, a failed one leaves it (and is trained with its P_fmt penalty).

Rows: each revision is a strategy sample of its own level (kind KIND_STRATEGY, anchor_id = its
ordinal r >= 1, step_index = t, trajectory_id = its episode's, score = the episode's return
from step t on); `strata_jax.algos.estimators.strata` gives it its advantage.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from strata_jax.algos.batch import KIND_STRATEGY
from strata_jax.rollout.episodes import decode_generation, generate_timed
from strata_jax.rollout.records import LoopStats, Revision, Trajectory, env_rejected
from strata_jax.rollout.keys import PURPOSE_REVISION, row_keys
from strata_jax.rollout.policy import Policy
from strata_jax.rollout.prompts import PromptBuilder
from strata_jax.rollout.strategy import check_strategy
from strata_jax.sampling import FINISH_LENGTH, SamplingParams

REVISE_ON = ("", "stuck")
"""Values of ``rollout.revise_on``: "" (no stuck trigger) or "stuck"."""


@dataclasses.dataclass(frozen=True)
class RevisionConfig:
    """When episodes revise their strategy (config: rollout.revise_every / revise_on /
    revise_stuck_steps).

    Attributes:
      every: K, revise after every K steps (0 = off).
      on: "" or "stuck" (see the module docstring).
      stuck_steps: k, the window of the stuck test and the least steps between two stuck
        revisions (>= 1).
    Raises:
      ValueError on a negative `every`, an unknown `on` or `stuck_steps` < 1.
    """

    every: int = 0
    on: str = ""
    stuck_steps: int = 3

    def __post_init__(self) -> None:
        if self.every < 0:
            raise ValueError(f"rollout.revise_every must be >= 0 (0 = off), got {self.every}")
        if self.on not in REVISE_ON:
            raise ValueError(f"rollout.revise_on must be one of {REVISE_ON}, got {self.on!r}")
        if self.stuck_steps < 1:
            raise ValueError(f"rollout.revise_stuck_steps must be >= 1, got {self.stuck_steps}")

    @property
    def enabled(self) -> bool:
        """Whether any trigger is on."""
        return self.every > 0 or self.on == "stuck"


def is_stuck(tr: Trajectory, k: int) -> bool:
    """Whether the last k steps of `tr` are stuck: all invalid (format or env-rejected), or k
    identical sent actions, or no reward on any of them. False with fewer than k steps."""
    window = tr.steps[-k:]
    if len(window) < k:
        return False
    if all(s.invalid or env_rejected(s) for s in window):
        return True
    if window[0].action is not None and all(s.action == window[0].action for s in window):
        return True
    return all(s.reward == 0.0 for s in window)


def revision_trigger(tr: Trajectory, config: RevisionConfig) -> str | None:
    """The trigger that fires for `tr` before its next step: "every", "stuck" or None.

    Never at step 0 (the episode's z is fresh) nor twice at one step; "every" wins when both
    fire. The stuck test only looks at steps after the last revision."""
    t = len(tr.steps)
    last = tr.revisions[-1].step if tr.revisions else 0
    if t == 0 or t == last:
        return None
    if config.every and t % config.every == 0:
        return "every"
    if config.on == "stuck" and t - last >= config.stuck_steps and is_stuck(tr, config.stuck_steps):
        return "stuck"
    return None


class StrategyReviser:
    """The step loop's revision hook (`episodes.Reviser`): one batched policy call per cohort
    turn over the episodes whose trigger fires.

    Args:
      builder: the rollout's `PromptBuilder`.
      key: the iteration's base key; a revision samples with ``row_keys(key,
        (PURPOSE_REVISION, task_uid, strategy_id, trajectory_id, t))``, independent of cohort
        and batch row.
      config: `RevisionConfig`.
      sampling: the strategy sampling params (temperature, ``max_strategy_tokens``, stop text
        ``</strategy>``): a revision is a strategy sample.
    """

    def __init__(self, builder: PromptBuilder, key: Any, config: RevisionConfig,
                 sampling: SamplingParams) -> None:
        self.builder, self.key, self.config, self.sampling = builder, key, config, sampling

    def __call__(self, policy: Policy, trajs: Sequence[Trajectory], stats: LoopStats,
                 cohort: int) -> None:
        todo = [(tr, trig) for tr in trajs
                if (trig := revision_trigger(tr, self.config)) is not None]
        if not todo:
            return
        prompts = [self.builder.revision_prompt(tr.current_pieces, tr.observations[-1],
                                                tr.history, tr.strategy) for tr, _ in todo]
        keys = row_keys(self.key, [(PURPOSE_REVISION, tr.spec.task_uid, tr.spec.strategy_id,
                                    tr.spec.trajectory_id, len(tr.steps)) for tr, _ in todo])
        gens = generate_timed(policy, prompts, keys, self.sampling, stats, cohort)
        for b, (tr, trig) in enumerate(todo):
            gen = gens[b]
            text = decode_generation(self.builder.tokenizer, gen)
            check = check_strategy(text, gen.finish_reason == FINISH_LENGTH,
                                   self.builder.count_tokens)
            tr.revisions.append(Revision(
                len(tr.steps), len(tr.revisions) + 1, trig, prompts[b], gen, text,
                tr.strategy if check.format_fail else check.text, check.token_len,
                check.format_fail, check.reason))


def revision_records(trajs: Sequence[Trajectory]) -> list[dict]:
    """The revision rows of the batch (docs/method.md §5.9), one per revision: kind
    KIND_STRATEGY, task_id, strategy_id (the episode's original strategy), trajectory_id (the
    episode's), step_index = t, anchor_id = the ordinal r (>= 1; the original strategies' rows
    hold 0), score = the return from step t on (sum of the rewards of steps t..T-1),
    strategy_len = |z'|, format_fail = P_fmt(z'), valid = the episode did not crash."""
    recs = []
    for tr in trajs:
        for rv in tr.revisions:
            recs.append(dict(
                prompt_ids=rv.prompt.ids, response_ids=rv.generation.token_ids,
                sampler_logprobs=rv.generation.logprobs, task_id=tr.spec.task_uid,
                strategy_id=tr.spec.strategy_id, trajectory_id=tr.spec.trajectory_id,
                step_index=rv.step, kind=KIND_STRATEGY, anchor_id=rv.ordinal,
                score=float(sum(s.reward for s in tr.steps[rv.step:])), step_reward=0.0,
                valid=not tr.crashed, strategy_len=rv.token_len, format_fail=rv.format_fail))
    return recs


def revision_stats(trajs: Sequence[Trajectory]) -> dict[str, float]:
    """Rollout metrics of the revision option: rollout/revisions (count),
    rollout/revised_episode_frac, rollout/revision_format_fail_frac,
    rollout/revision_stuck_frac (revisions the stuck trigger fired)."""
    revs = [rv for tr in trajs for rv in tr.revisions]
    n = max(len(revs), 1)
    return {
        "rollout/revisions": float(len(revs)),
        "rollout/revised_episode_frac": (sum(bool(tr.revisions) for tr in trajs)
                                         / max(len(trajs), 1)),
        "rollout/revision_format_fail_frac": sum(rv.format_fail for rv in revs) / n,
        "rollout/revision_stuck_frac": sum(rv.trigger == "stuck" for rv in revs) / n,
    }
