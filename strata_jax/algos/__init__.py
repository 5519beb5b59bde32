"""RL math as pure functions of arrays: the batch contract, advantage estimators, losses, and
the algorithm table (`table.ALGORITHMS`: what each ``c.algo`` name means).

See docs/method.md §1-§8 for the pinned conventions.
"""
import importlib
from typing import TYPE_CHECKING

# Names resolve on first use (PEP 562): configs/base.py reads only the algorithm table, and a
# config typo must be reported before jax and flax are imported (seconds on a loaded machine).
_EXPORTS = {
    "batch": ("ID_FIELDS", "KIND_ACTION", "KIND_STRATEGY", "PAD_ROW_ID", "SampleBatch",
              "make_sample_batch", "pad_batch", "pad_rows", "save_sample_batch",
              "load_sample_batch"),
    "config": ("EstimatorConfig", "LossConfig"),
    "dapo_filter": ("keep_informative_groups",),
    "estimators": ("ESTIMATORS", "compute_advantages", "get_estimator", "register_estimator",
                   "strategy_rewards"),
    "losses": ("aggregate", "kl_penalty", "loss_mask", "loss_normalizers", "mean_kl",
               "policy_loss_per_token", "ppo_loss", "value_loss"),
    "stapo": ("stapo_eta", "stapo_weights"),
    "table": ("ALGORITHMS", "Algorithm", "get_algorithm"),
}
_MODULE_OF = {name: mod for mod, names in _EXPORTS.items() for name in names}


def __getattr__(name: str):
    if name in _MODULE_OF:
        value = getattr(importlib.import_module(f"{__name__}.{_MODULE_OF[name]}"), name)
        globals()[name] = value
        return value
    if name in _EXPORTS or name == "segments":
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if TYPE_CHECKING:   # what static tools see: the eager form of the table above
    from strata_jax.algos.batch import (ID_FIELDS, KIND_ACTION, KIND_STRATEGY, PAD_ROW_ID,
                                       SampleBatch, load_sample_batch, make_sample_batch, pad_batch,
                                       pad_rows, save_sample_batch)
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
        mean_kl,
        policy_loss_per_token,
        ppo_loss,
        value_loss,
    )
    from strata_jax.algos.stapo import stapo_eta, stapo_weights
    from strata_jax.algos.table import ALGORITHMS, Algorithm, get_algorithm

__all__ = [
    "ID_FIELDS", "KIND_ACTION", "KIND_STRATEGY", "PAD_ROW_ID", "SampleBatch", "make_sample_batch",
    "pad_batch", "pad_rows", "save_sample_batch", "load_sample_batch",
    "EstimatorConfig", "LossConfig", "keep_informative_groups",
    "ESTIMATORS", "compute_advantages", "get_estimator", "register_estimator", "strategy_rewards",
    "aggregate", "kl_penalty", "loss_mask", "loss_normalizers", "mean_kl", "policy_loss_per_token",
    "ppo_loss", "value_loss", "stapo_eta", "stapo_weights",
    "ALGORITHMS", "Algorithm", "get_algorithm",
]
