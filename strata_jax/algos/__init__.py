"""RL math as pure functions of arrays: the batch contract, advantage estimators, losses, and
the algorithm table (`table.ALGORITHMS`: what each ``c.algo`` name means).

See docs/method.md §1-§8 for the pinned conventions.
"""
from strata_jax.algos.batch import (ID_FIELDS, KIND_ACTION, KIND_STRATEGY, PAD_ID, SampleBatch,
                                   make_sample_batch, pad_batch, pad_rows)
from strata_jax.algos.config import EstimatorConfig, LossConfig
from strata_jax.algos.dapo_filter import keep_informative_groups
from strata_jax.algos.estimators import (
    ESTIMATORS,
    compute_advantages,
    get_estimator,
    register_estimator,
    strategy_rewards,
)
from strata_jax.algos.losses import (
    aggregate,
    kl_penalty,
    loss_mask,
    loss_normalizers,
    policy_loss_per_token,
    ppo_loss,
    value_loss,
)
from strata_jax.algos.stapo import stapo_eta, stapo_weights
from strata_jax.algos.table import ALGORITHMS, Algorithm, get_algorithm

__all__ = [
    "ID_FIELDS", "KIND_ACTION", "KIND_STRATEGY", "PAD_ID", "SampleBatch", "make_sample_batch",
    "pad_batch", "pad_rows",
    "EstimatorConfig", "LossConfig", "keep_informative_groups",
    "ESTIMATORS", "compute_advantages", "get_estimator", "register_estimator", "strategy_rewards",
    "aggregate", "kl_penalty", "loss_mask", "loss_normalizers", "policy_loss_per_token",
    "ppo_loss", "value_loss", "stapo_eta", "stapo_weights",
    "ALGORITHMS", "Algorithm", "get_algorithm",
]
