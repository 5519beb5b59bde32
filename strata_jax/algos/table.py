"""The algorithm table: what each ``c.algo`` name means, read by every part of a run.

An algorithm is an advantage estimator (a name in `strata_jax.algos.estimators.ESTIMATORS`)
plus the few facts about the run around it that differ between algorithms. Every consumer
looks them up here (`get_algorithm`) instead of comparing names:

=================================  =========================================================
consumer                           reads
=================================  =========================================================
``configs/base.py``                the names (``--config=x.py:grpo`` variants)
``experiment.validate``            the names (an unknown ``c.algo`` is a ConfigError)
``experiment.resolve``             ``cumulative_prompts``, ``clip_eps_high``
``RolloutConfig.from_config``      ``rollout`` (rollout mode), ``refill``
``TrainConfig``                    ``estimator`` (the update's advantages), ``critic``
                                   (``train.critic="auto"``), ``levels`` (Dr.GRPO norm_len)
``distributed.check_config``       ``refill`` (single process only)
=================================  =========================================================

Adding an algorithm is one `ALGORITHMS` entry plus, when no registered estimator fits, its
estimator (``@register_estimator``); docs/design.md §13.1 has the recipe. Sources for each entry:
docs/method.md §5 (StraTA; §5.11 its trajectory-level ablation), §6 (baselines), §7 (STAPO).
"""
from __future__ import annotations

import dataclasses

from strata_jax.config import ConfigError

ROLLOUT_MODES = ("strata", "flat")
CRITICS = ("none", "separate", "head")


@dataclasses.dataclass(frozen=True)
class Algorithm:
    """One algorithm's entry (frozen, hashable).

    Attributes:
      estimator: registry name of its advantage estimator (`estimators.ESTIMATORS`).
      rollout: "strata" = strategy stage, then M episodes per strategy of N (docs/method.md
        §5.1-§5.4); "flat" = ``rollout.group_size`` episodes per task, no strategy.
      critic: what ``train.critic="auto"`` resolves to: "none", "separate" (a critic model of
        its own, PPO, docs/method.md §6.4) or "head" (a value head on the policy trunk, STAPO,
        §7.1).
      refill: DAPO's dynamic sampling: tasks whose episodes all score the same are replaced
        and re-rolled, up to ``rollout.dapo_max_tries`` rounds (docs/method.md §6.5); single
        process only.
      cumulative_prompts: the algorithm needs whole-trajectory prompts; `experiment.resolve`
        turns ``rollout.cumulative_prompts`` on (STAPO's trajectory-aware critic, §7.1).
      clip_eps_high: when set, `experiment.resolve` raises ``loss.clip_eps_high`` to it if the
        config leaves the clip symmetric (DAPO's clip-higher 0.28, §6.5); None = the config's.
    Raises ConfigError for an unknown rollout mode or critic.
    """

    estimator: str
    rollout: str = "flat"
    critic: str = "none"
    refill: bool = False
    cumulative_prompts: bool = False
    clip_eps_high: float | None = None

    def __post_init__(self) -> None:
        if self.rollout not in ROLLOUT_MODES:
            raise ConfigError(f"Algorithm.rollout must be one of {ROLLOUT_MODES}, "
                              f"got {self.rollout!r}")
        if self.critic not in CRITICS:
            raise ConfigError(f"Algorithm.critic must be one of {CRITICS}, got {self.critic!r}")

    @property
    def levels(self) -> tuple[str, ...]:
        """The sample levels the loss trains: ("action", "strategy") for the strata rollout
        (L_act + lambda * L_strat, docs/method.md §5.7), else ("action",)."""
        return ("action", "strategy") if self.rollout == "strata" else ("action",)


ALGORITHMS: dict[str, Algorithm] = {
    "strata": Algorithm(estimator="strata", rollout="strata"),
    # the ablation: StraTA's rollout and prompts, a trajectory-level advantage (§5.11)
    "strata_traj": Algorithm(estimator="strata_traj", rollout="strata"),
    "grpo": Algorithm(estimator="grpo"),
    "rloo": Algorithm(estimator="rloo"),
    "gigpo": Algorithm(estimator="gigpo"),
    "ppo": Algorithm(estimator="gae", critic="separate"),
    "dapo": Algorithm(estimator="grpo", refill=True, clip_eps_high=0.28),
    "stapo": Algorithm(estimator="stapo", critic="head", cumulative_prompts=True),
}


def get_algorithm(name: str) -> Algorithm:
    """The `ALGORITHMS` entry of `name`. Raises ConfigError listing the names."""
    try:
        return ALGORITHMS[name]
    except (KeyError, TypeError):
        raise ConfigError(f"unknown algo {name!r}; use one of {tuple(ALGORITHMS)} "
                          "(--config.algo=...)") from None


__all__ = ["Algorithm", "ALGORITHMS", "CRITICS", "ROLLOUT_MODES", "get_algorithm"]
