"""Frozen (hashable, jit-static) option sets for the estimators and the loss.

Field names are the keys of `configs/base.py`'s ``c.adv`` and ``c.loss`` sections, one key per
field: ``EstimatorConfig.from_config(c.adv)`` and ``LossConfig.from_config(c.loss)`` read every
field from the section and refuse a missing or unknown key (`strata_jax.config.read_fields`).
The defaults below are the values of configs/base.py (the pinned values of docs/method.md), for
library calls and tests; tests/test_config_schema.py keeps the two equal field by field.
"""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Optional

from strata_jax.config import from_section, section_sources

@dataclasses.dataclass(frozen=True)
class EstimatorConfig:
    """Advantage-estimator options (docs/method.md §4-§7; defaults = the pinned values).

    Group normalisation:
        eps = 1e-6             added to the group std.
        std_ddof = None        None = the estimator's pin: 0 for strata, 1 for grpo / dapo / gigpo
                               (verl's torch.std); 0 or 1 overrides it for every estimator.
        norm_by_std = True     False + loss agg `seq-mean-token-sum-norm` = Dr.GRPO.
        invalid_penalty = 0.1  subtracted from a format-invalid step's score (strata: from its
                               advantage in judge_mode "advantage").
    StraTA (docs/method.md §5.5-§5.6):
        top_delta = 0.5        R(z) uses the mean of the ceil(delta*M) largest returns; 1.0 = plain mean.
        len_penalty = 0.5      beta_len;  len_max = 256  L_max (strategy tokens).
        judge_kappa = 0.1;     judge_mode = "advantage" | "reward".
    GiGPO (docs/method.md §6.3):
        gigpo_omega = 1.0;  gigpo_gamma = 0.95;  gigpo_step_norm = "mean_norm" | "mean_std_norm"
        (the episode term uses the same mode, as verl-agent does).
    GAE / PPO:
        gae_gamma = 1.0;  gae_lambda = 1.0;  gae_whiten = True  (whiten over valid step samples).
    STAPO (docs/method.md §7):
        stapo_weighting = False        the selective weights as a modifier on any estimator.
        stapo_eta = 0.5                fixed threshold on A.
        stapo_eta_quantile = -1.0      >= 0: eta = this quantile of |A| over the batch ...
        stapo_eta_quantile_end = -1.0  ... annealed linearly to this one (>= 0) over
        stapo_anneal_steps = 150       training steps (`step` argument).
        stapo_w_pos = "one"            weight of A > eta: "one" (w = 1) or "advantage" (w = A).
        stapo_w_neg = 0.3;  stapo_floor = 0.0 (the mediocre band |A| <= eta).
        stapo_uncertainty_coef = 0.5   c_u, applied by the `stapo` estimator (critic present);
                                       the modifier on critic-free estimators uses 0.
        stapo_gae_lambda = 0.95        STAPO's GAE lambda (gamma = gae_gamma = 1).
        stapo_whiten = True            whiten the GAE advantages before thresholding (PPO's
                                       whitening, so eta is in std units) [our pin].
        stapo_dropout_passes = 4; stapo_dropout = 0.1  (read by the trainer for value_std).
    """

    eps: float = 1e-6
    std_ddof: Optional[int] = None
    norm_by_std: bool = True
    invalid_penalty: float = 0.1
    top_delta: float = 0.5
    len_penalty: float = 0.5
    len_max: int = 256
    judge_kappa: float = 0.1
    judge_mode: str = "advantage"
    gigpo_omega: float = 1.0
    gigpo_gamma: float = 0.95
    gigpo_step_norm: str = "mean_norm"
    gae_gamma: float = 1.0
    gae_lambda: float = 1.0
    gae_whiten: bool = True
    stapo_weighting: bool = False
    stapo_eta: float = 0.5
    stapo_eta_quantile: float = -1.0
    stapo_eta_quantile_end: float = -1.0
    stapo_anneal_steps: int = 150
    stapo_w_pos: str = "one"
    stapo_w_neg: float = 0.3
    stapo_floor: float = 0.0
    stapo_uncertainty_coef: float = 0.5
    stapo_gae_lambda: float = 0.95
    stapo_whiten: bool = True
    stapo_dropout_passes: int = 4
    stapo_dropout: float = 0.1

    SECTION: ClassVar[str] = "adv"

    def validate(self) -> None:
        """Raise ValueError on an unknown mode or an out-of-range option."""
        if self.judge_mode not in ("advantage", "reward"):
            raise ValueError(f"judge_mode must be 'advantage' or 'reward', got {self.judge_mode!r}")
        if self.gigpo_step_norm not in ("mean_norm", "mean_std_norm"):
            raise ValueError(
                f"gigpo_step_norm must be 'mean_norm' or 'mean_std_norm', got {self.gigpo_step_norm!r}")
        if self.std_ddof not in (None, 0, 1):
            raise ValueError(f"std_ddof must be None, 0 or 1, got {self.std_ddof!r}")
        if not 0.0 < self.top_delta <= 1.0:
            raise ValueError(f"top_delta must be in (0, 1], got {self.top_delta}")
        if self.stapo_w_pos not in ("one", "advantage"):
            raise ValueError(f"stapo_w_pos must be 'one' or 'advantage', got {self.stapo_w_pos!r}")
        if self.stapo_eta_quantile > 1.0 or self.stapo_eta_quantile_end > 1.0:
            raise ValueError("stapo_eta_quantile(_end) must be <= 1 (negative = off)")

    def ddof(self, pinned: int) -> int:
        """std ddof to use: the explicit `std_ddof`, else the estimator's pinned value."""
        return pinned if self.std_ddof is None else int(self.std_ddof)

    @classmethod
    def config_sources(cls) -> dict[str, str]:
        """{field: dotted config key}: every field is ``adv.<field>``."""
        return section_sources(cls, cls.SECTION)

    @classmethod
    def from_config(cls, cfg: Any, **overrides) -> "EstimatorConfig":
        """Build from the ``c.adv`` section (a ConfigDict or mapping holding exactly the fields)
        or an EstimatorConfig; `overrides` replace fields. Raises ConfigError on a missing or
        unknown key, ValueError on a bad value (`validate`)."""
        return from_section(cls, cfg, **overrides)


AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
KL_ESTIMATORS = ("k1", "k2", "k3")


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """PPO-clip loss options (docs/method.md §8; verl's actor conventions).

        clip_eps_low = 0.2; clip_eps_high = 0.2 (DAPO clip-higher: 0.28).
        dual_clip = 3.0        c for negative advantages (<= 1 turns it off).
        agg_mode = "token-mean" | "seq-mean-token-mean" | "seq-mean-token-sum" |
                   "seq-mean-token-sum-norm".
        norm_len = 0           seq-mean-token-sum-norm divisor: a constant, the run's max
                               response length (Dr.GRPO), never the batch's padded width.
                               0 = unset: `TrainConfig.from_config` fills it from the rollout
                               limits; a LossConfig with seq-mean-token-sum-norm and norm_len 0
                               fails `validate`.
        strategy_coef = 0.5    lambda in L_act + lambda * L_strat.
        kl_coef = 0.01; kl_estimator = "k3" (k1 | k2 | k3); kl_clamp = 10.0 (k3 clamp).
        entropy_coef = 0.001.
        seq_level_ratio = False  ratio = exp(mean over the sequence of token log-ratios).
        value_coef = 0.5 (c1); value_clip = 0.5 (<= 0 turns it off).
    """

    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    dual_clip: float = 3.0
    agg_mode: str = "token-mean"
    norm_len: int = 0
    strategy_coef: float = 0.5
    kl_coef: float = 0.01
    kl_estimator: str = "k3"
    kl_clamp: float = 10.0
    entropy_coef: float = 0.001
    seq_level_ratio: bool = False
    value_coef: float = 0.5
    value_clip: float = 0.5

    SECTION: ClassVar[str] = "loss"

    def validate(self) -> None:
        """Raise ValueError on an unknown mode, or a missing / negative norm_len."""
        if self.agg_mode not in AGG_MODES:
            raise ValueError(f"agg_mode must be one of {AGG_MODES}, got {self.agg_mode!r}")
        if isinstance(self.norm_len, bool) or not isinstance(self.norm_len, int) \
                or self.norm_len < 0:
            raise ValueError(f"loss.norm_len must be an integer >= 0, got {self.norm_len!r}")
        if self.agg_mode == "seq-mean-token-sum-norm" and self.norm_len == 0:
            raise ValueError("agg_mode seq-mean-token-sum-norm divides by a constant: set "
                             "loss.norm_len to the run's max response length (tokens)")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {self.kl_estimator!r}")

    @classmethod
    def config_sources(cls) -> dict[str, str]:
        """{field: dotted config key}: every field is ``loss.<field>``."""
        return section_sources(cls, cls.SECTION)

    @classmethod
    def from_config(cls, cfg: Any, **overrides) -> "LossConfig":
        """Build from the ``c.loss`` section (a ConfigDict or mapping holding exactly the
        fields) or a LossConfig; `overrides` replace fields. Raises ConfigError on a missing or
        unknown key, ValueError on a bad value (`validate`)."""
        return from_section(cls, cfg, **overrides)
