"""Static (hashable, jit-static) trainer options read from the experiment config.

`TrainConfig.from_config(c)` reads `c.optim`, `c.loss`, `c.adv`, `c.rollout.temperature`,
`c.model.remat`, `c.algo` and the optional `c.train` sub-dict of ``configs/base.py``; fields the
ConfigDict lacks keep the defaults below (docs/method.md §5.8, §6.4, §7 pinned values).
Source: docs/method.md §8-§9 (objective, optimiser), §6.4 (PPO critic), §7.1 (STAPO critic).
"""
from __future__ import annotations

import dataclasses
from typing import Any

from strata_jax.algos.config import EstimatorConfig, LossConfig
from strata_jax.models.lora import LoraConfig

CRITIC_KINDS = ("auto", "none", "separate", "head")
REMAT_POLICIES = ("none", "full", "dots")
LR_SCHEDULES = ("constant", "cosine")


def _default_norm_len(c: Any, loss: Any) -> dict:
    """``{"norm_len": n}`` when ``loss.norm_len`` is unset (0 / absent), else ``{}``.

    n is Dr.GRPO's constant: the longest response the rollout can generate, i.e.
    ``rollout.max_action_tokens``, or with StraTA ``max(max_action_tokens,
    max_strategy_tokens)`` (strategy rows are trained too). Without a rollout section nothing
    is filled (`LossConfig.validate` then asks for it when the mode needs it).
    """
    if loss is not None:
        cur = loss.get("norm_len", 0) if hasattr(loss, "get") else getattr(loss, "norm_len", 0)
        if cur not in (0, None):
            return {}  # set (a bad value is LossConfig.validate's to report)
    r = c.get("rollout", None)
    if r is None or "max_action_tokens" not in r:
        return {}
    n = int(r.max_action_tokens)
    if c.get("algo", None) == "strata" and "max_strategy_tokens" in r:
        n = max(n, int(r.max_strategy_tokens))
    return {"norm_len": n}


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything the update step needs besides arrays; hashable so jit can treat it as static.

    Optimiser (c.optim): lr, critic_lr, weight_decay, grad_clip, warmup_steps (linear warmup in
      optimizer steps), lr_schedule ("constant" | "cosine" to 0 at `decay_steps` optimizer steps),
      ppo_epochs, mini_batch_size (step samples per optimizer step; strategy samples are spread
      evenly over the mini-batches on top), micro_batch_size (rows per gradient-accumulation unit).
      adam_eps (c.train.adam_eps): AdamW epsilon (torch's default 1e-8).
    Model execution: remat ("none" | "full" | "dots": jax.checkpoint policy over the forward),
      compute_dtype ("float32" | "bfloat16": params are cast for the forward, the optimizer keeps
      the stored dtype), logprob_chunk (positions per LM-head chunk), temperature (train
      temperature of pi_old / pi_theta, docs/method.md §9.1), score_rows (rows per chunk of the
      no-grad scoring passes; 0 = micro_batch_size), recompute_old (run the old-logprob pass
      even when the update is exactly on-policy, one epoch of one mini-batch, where pi_old is
      the step's own logprob under stop_gradient; same result, one forward more: a check),
      trim_padding (drop all-padding prompt / response columns before scoring and training,
      widths bucketed; same result), donate_state (the optimizer step reuses the buffers of the
      state passed to `Trainer.update` / `train_on_batch`: one copy of params + moments less at
      the peak, but the caller's state object is dead after the call).
    Critic: critic ("auto": separate model for ppo/gae, value head on the policy trunk for stapo,
      none otherwise), value_trunk_coef (STAPO: gradient of the value loss into the shared trunk
      is scaled by this; 0 = head only), value_head_init_std (head weights ~ N(0, std^2 / D)),
      dropout_passes K and dropout p (value uncertainty, docs/method.md §7.3).
    Sub-configs: loss (LossConfig), estimator (EstimatorConfig), algo (estimator registry name),
      lora (LoraConfig; rank > 0: the trainable params are LoRA adapters over the frozen base,
      which is also the KL reference, and lr = lora.lr when that is > 0).
    """

    algo: str = "strata"
    lr: float = 1e-6
    critic_lr: float = 1e-5
    weight_decay: float = 0.01
    adam_eps: float = 1e-8
    grad_clip: float = 1.0
    warmup_steps: int = 0
    lr_schedule: str = "constant"
    decay_steps: int = 0
    ppo_epochs: int = 1
    mini_batch_size: int = 256
    micro_batch_size: int = 8
    remat: str = "none"
    compute_dtype: str = "float32"
    logprob_chunk: int = 64
    temperature: float = 1.0
    score_rows: int = 0
    recompute_old: bool = False
    trim_padding: bool = True
    donate_state: bool = False
    critic: str = "auto"
    value_trunk_coef: float = 0.0
    value_head_init_std: float = 0.1
    dropout_passes: int = 4
    dropout: float = 0.1
    loss: LossConfig = LossConfig()
    estimator: EstimatorConfig = EstimatorConfig()
    lora: LoraConfig = LoraConfig()

    def __post_init__(self) -> None:
        import math
        for name in ("lr", "critic_lr"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r} "
                                 f"(--config.optim.{name}=...)")
        if not self.adam_eps > 0:
            raise ValueError(f"train.adam_eps must be > 0 (Adam divides by sqrt(v) + eps), "
                             f"got {self.adam_eps!r}")
        if self.critic not in CRITIC_KINDS:
            raise ValueError(f"train.critic must be one of {CRITIC_KINDS}, got {self.critic!r}")
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"model.remat must be one of {REMAT_POLICIES}, got {self.remat!r} "
                             "(true = dots, false = none)")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"train.lr_schedule must be one of {LR_SCHEDULES}, "
                             f"got {self.lr_schedule!r}")
        if self.lr_schedule == "cosine" and self.decay_steps <= 0:
            raise ValueError("lr_schedule 'cosine' needs train.decay_steps > 0 (optimizer steps)")
        if self.compute_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"compute_dtype must be float32 or bfloat16, got {self.compute_dtype!r}")
        if self.mini_batch_size < 1 or self.micro_batch_size < 1 or self.ppo_epochs < 1:
            raise ValueError("mini_batch_size, micro_batch_size and ppo_epochs must be >= 1")
        if self.dropout_passes < 1 or not 0.0 <= self.dropout < 1.0:
            raise ValueError("dropout_passes must be >= 1 and dropout in [0, 1)")

    @property
    def critic_kind(self) -> str:
        """"separate" (PPO / GAE), "head" (STAPO) or "none", resolving "auto" from `algo`."""
        if self.critic != "auto":
            return self.critic
        if self.algo in ("ppo", "gae"):
            return "separate"
        if self.algo == "stapo":
            return "head"
        return "none"

    @classmethod
    def from_config(cls, c: Any, **overrides) -> "TrainConfig":
        """Build from the experiment ConfigDict of ``configs/base.py`` (unknown keys ignored).

        Reads c.algo, c.optim.*, c.loss.* (LossConfig; loss.norm_len 0 = the rollout's
        longest possible response, see `_default_norm_len`), c.adv.* (EstimatorConfig), c.lora.*
        (LoraConfig; lora.lr > 0 replaces optim.lr when rank > 0), c.rollout.temperature,
        c.model.remat (True -> "dots"), c.adv.stapo_dropout(_passes), and any field of this
        class under c.train (which wins).
        """
        names = {f.name for f in dataclasses.fields(cls)}
        v: dict[str, Any] = {"algo": c.algo}
        optim = c.get("optim", {}) or {}
        for k in ("lr", "critic_lr", "weight_decay", "grad_clip", "warmup_steps", "ppo_epochs",
                  "mini_batch_size", "micro_batch_size"):
            if k in optim:
                v[k] = optim[k]
        if "rollout" in c and "temperature" in c.rollout:
            v["temperature"] = float(c.rollout.temperature)
        if "model" in c and "remat" in c.model:
            v["remat"] = "dots" if c.model.remat is True else ("none" if c.model.remat is False
                                                                else str(c.model.remat))
        adv = c.get("adv", None)
        if adv is not None:
            if "stapo_dropout_passes" in adv:
                v["dropout_passes"] = int(adv.stapo_dropout_passes)
            if "stapo_dropout" in adv:
                v["dropout"] = float(adv.stapo_dropout)
        loss = c.get("loss", None)
        v["loss"] = LossConfig.from_config(loss, **_default_norm_len(c, loss))
        v["estimator"] = EstimatorConfig.from_config(adv)
        v["lora"] = LoraConfig.from_config(c)
        if v["lora"].enabled and v["lora"].lr > 0:
            v["lr"] = float(v["lora"].lr)
        for k, val in (c.get("train", None) or {}).items():
            if k in names:
                v[k] = val
        v.update(overrides)
        return cls(**v)
