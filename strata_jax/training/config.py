"""Static (hashable, jit-static) trainer options read from the experiment config.

`TrainConfig.from_config(c)` reads every field from its one key of the experiment ConfigDict
(`TrainConfig.config_sources`): ``c.algo``, ``c.optim.*``, ``c.train.*``, ``c.model.remat``,
``c.rollout.temperature``, ``c.adv.stapo_dropout(_passes)``, and the ``c.loss`` / ``c.adv`` /
``c.lora`` sections through their own dataclasses; a missing key, or a key of ``c.optim`` /
``c.train`` that no field reads, is a ConfigError. The defaults below equal configs/base.py
(tests/test_config_schema.py checks it field by field); they serve library calls and tests.
Source: docs/method.md §8-§9 (objective, optimiser), §6.4 (PPO critic), §7.1 (STAPO critic).
"""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from strata_jax.algos.config import EstimatorConfig, LossConfig
from strata_jax.algos.table import get_algorithm
from strata_jax.config import REMAT_POLICIES, read_fields
from strata_jax.models.lora import LoraConfig
from strata_jax.training.replay import ReplayConfig

CRITIC_KINDS = ("auto", "none", "separate", "head")
LR_SCHEDULES = ("constant", "cosine")

# TrainConfig fields read from c.optim / c.train (every key of those sections is one of these).
_OPTIM_FIELDS = ("lr", "critic_lr", "weight_decay", "grad_clip", "warmup_steps", "ppo_epochs",
                 "mini_batch_size", "micro_batch_rows", "micro_batch_tokens", "skip_empty_steps")
_TRAIN_FIELDS = ("adam_eps", "lr_schedule", "decay_steps", "compute_dtype", "logprob_chunk",
                 "score_rows", "recompute_old", "trim_padding", "response_floor",
                 "pack_width", "donate_state",
                 "scan_layers",
                 "critic", "value_trunk_coef", "value_head_init_std")


def remat_policy(remat: Any) -> str:
    """``model.remat`` as a policy name: True -> "dots", False -> "none", a name unchanged."""
    return "dots" if remat is True else ("none" if remat is False else str(remat))


def _default_norm_len(c: Any) -> dict:
    """``{"norm_len": n}`` when ``loss.norm_len`` is unset (0), else ``{}``.

    n is Dr.GRPO's constant: the longest response the rollout can generate, i.e.
    ``rollout.max_action_tokens``, or when the algorithm trains strategies too (its
    `ALGORITHMS` entry's levels) ``max(max_action_tokens, max_strategy_tokens)``.
    """
    if c.loss.norm_len not in (0, None):
        return {}  # set (a bad value is LossConfig.validate's to report)
    r = c.rollout
    n = int(r.max_action_tokens)
    if "strategy" in get_algorithm(c.algo).levels:
        n = max(n, int(r.max_strategy_tokens))
    return {"norm_len": n}


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything the update step needs besides arrays; hashable so jit can treat it as static.

    Optimiser (c.optim): lr, critic_lr, weight_decay, grad_clip, warmup_steps (linear warmup in
      optimizer steps), lr_schedule ("constant" | "cosine" to 0 at `decay_steps` optimizer steps),
      ppo_epochs, mini_batch_size (step samples per optimizer step; strategy samples are spread
      evenly over the mini-batches on top), micro_batch_rows (rows per gradient-accumulation
      unit on the per-row path; the mini-batch plan pads each mini-batch to a multiple of it),
      micro_batch_tokens (the packed update's token budget per micro-batch; 0 =
      micro_batch_rows rows at the batch's prompt + response columns), skip_empty_steps (a
      mini-batch none of whose rows can move the loss takes no optimizer step: see
      `Trainer.train_on_batch` and docs/method.md §9.3).
      adam_eps: AdamW epsilon (torch's default 1e-8).
    Model execution: remat ("none" | "full" | "dots": jax.checkpoint policy over the forward),
      compute_dtype ("float32" | "bfloat16": params are cast for the forward, the optimizer keeps
      the stored dtype), logprob_chunk (positions per LM-head chunk), temperature (train
      temperature of pi_old / pi_theta, docs/method.md §9.1), score_rows (rows per chunk of the
      no-grad scoring passes; 0 = the micro-batch's rows / budget), recompute_old (run the old-logprob pass
      even when the update is exactly on-policy, one epoch of one mini-batch, where pi_old is
      the step's own logprob under stop_gradient; same result, one forward more: a check),
      trim_padding (drop all-padding prompt / response columns before scoring and training,
      widths bucketed; same result), response_floor (the response columns of the batch and of
      each micro-batch are the smallest power of two >= max(longest response, response_floor);
      0 = two sizes per octave from 8 as the prompt columns: tighter, but a run's drifting
      response lengths keep compiling new (prompt, response) width pairs,
      `buckets.response_columns`). The update runs prefix-tree packed micro-batches
      (training/prefix_tree/: each shared prompt prefix once, the scores and gradient of the
      per-row forward up to float summation order) of P packed rows of W slots with
      P x W <= micro_batch_tokens (0: micro_batch_rows x the batch's prompt + response
      columns, the memory of a per-row micro-batch), and P a multiple of the mesh's batch
      shards so the packed rows shard over the data axes; score_rows likewise (rows at the
      batch's width; 0 = the update's budget). pack_width (W, the
      slots of one packed row; 0 = auto: the budget over the batch shards rounded down to a
      power of two, at most 2048, at least the batch's row width rounded up to one; a wider
      row shares more prefixes at a larger compiled program, `Trainer.pack_shape`),
      donate_state (the optimizer step reuses the buffers of the state passed to
      `Trainer.update` / `train_on_batch`: one copy of params + moments less at the peak, but
      the caller's state object is dead after the call; on by default, False for a caller
      that updates one state more than once), scan_layers (with remat, the decoder layers of
      the gradient pass as a ``lax.scan`` over stacked weights: compiles much faster on deep
      models, one stacked weight copy more per step; same values).
    Critic: critic ("auto": what the algorithm's `ALGORITHMS` entry says: a separate model for
      ppo, a value head on the policy trunk for stapo, none otherwise), value_trunk_coef
      (STAPO: gradient of the value loss into the shared trunk is scaled by this; 0 = head
      only), value_head_init_std (head weights ~ N(0, std^2 / D)),
      dropout_passes K and dropout p (value uncertainty, docs/method.md §7.3).
    Sub-configs: loss (LossConfig), estimator (EstimatorConfig), algo (a name of
      `algos.table.ALGORITHMS`: its entry gives the estimator and the "auto" critic), lora
      (LoraConfig; rank > 0: the trainable params are LoRA adapters over the frozen base, which
      is also the KL reference, and lr = lora.lr when that is > 0), replay (ReplayConfig:
      STAPO's replay pool, strata_jax/training/replay.py; off by default).
    Sources: `config_sources` (one config key per field). Defaults = configs/base.py.
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
    micro_batch_rows: int = 8
    micro_batch_tokens: int = 0
    skip_empty_steps: bool = True
    remat: str = "dots"
    compute_dtype: str = "bfloat16"
    logprob_chunk: int = 64
    temperature: float = 1.0
    score_rows: int = 0
    recompute_old: bool = False
    trim_padding: bool = True
    response_floor: int = 32
    pack_width: int = 0
    donate_state: bool = True
    scan_layers: bool = False
    critic: str = "auto"
    value_trunk_coef: float = 0.0
    value_head_init_std: float = 0.1
    dropout_passes: int = 4
    dropout: float = 0.1
    loss: LossConfig = LossConfig()
    estimator: EstimatorConfig = EstimatorConfig()
    lora: LoraConfig = LoraConfig()
    replay: ReplayConfig = ReplayConfig()

    # Fields read from another dataclass's section, and the conversion of model.remat.
    SUBSECTIONS: ClassVar[dict[str, type]] = {"loss": LossConfig, "estimator": EstimatorConfig,
                                              "lora": LoraConfig, "replay": ReplayConfig}
    CONVERT: ClassVar[dict[str, Any]] = {"remat": remat_policy}

    def __post_init__(self) -> None:
        import math
        get_algorithm(self.algo)   # an unknown name: ConfigError listing ALGORITHMS
        for name in ("lr", "critic_lr"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r} "
                                 f"(--config.optim.{name}=...)")
        from strata_jax.sampling.params import check_temperature
        # pi_old / pi_theta divide the logits by it in float32 (docs/method.md §9.1)
        check_temperature(self.temperature, "rollout.temperature (the train temperature)",
                          allow_greedy=False)
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
        if self.mini_batch_size < 1 or self.micro_batch_rows < 1 or self.ppo_epochs < 1:
            raise ValueError("mini_batch_size, micro_batch_rows and ppo_epochs must be >= 1")
        if self.micro_batch_tokens < 0:
            raise ValueError("micro_batch_tokens must be >= 0 (0 = micro_batch_rows rows at the "
                             f"batch's width), got {self.micro_batch_tokens}")
        if self.dropout_passes < 1 or not 0.0 <= self.dropout < 1.0:
            raise ValueError("dropout_passes must be >= 1 and dropout in [0, 1)")

    @property
    def critic_kind(self) -> str:
        """"separate", "head" or "none": `critic`, with "auto" resolved by the algorithm's
        `ALGORITHMS` entry (ppo: separate, stapo: head, the others: none)."""
        if self.critic != "auto":
            return self.critic
        return get_algorithm(self.algo).critic

    @property
    def estimator_name(self) -> str:
        """Registry name of the advantage estimator of `algo` (its `ALGORITHMS` entry)."""
        return get_algorithm(self.algo).estimator

    @classmethod
    def config_sources(cls) -> dict[str, str]:
        """{field: dotted config key}, one key per field: ``algo``; ``optim.<field>`` for the
        optimiser fields; ``train.<field>`` for the execution fields; ``model.remat``
        (converted: True = "dots", False = "none"); ``rollout.temperature`` (the sampling
        temperature is the train temperature, docs/method.md §9.1);
        ``adv.stapo_dropout_passes`` / ``adv.stapo_dropout`` (dropout_passes / dropout); and
        the sections ``loss``, ``adv``, ``lora``, ``replay`` of the LossConfig / EstimatorConfig /
        LoraConfig fields. Derived on top (`from_config`): loss.norm_len 0 = the rollout's
        longest response; lr = lora.lr when LoRA is on and lora.lr > 0."""
        src = {"algo": "algo"}
        src.update({k: f"optim.{k}" for k in _OPTIM_FIELDS})
        src.update({k: f"train.{k}" for k in _TRAIN_FIELDS})
        src.update(remat="model.remat", temperature="rollout.temperature",
                   dropout_passes="adv.stapo_dropout_passes", dropout="adv.stapo_dropout")
        src.update({f: sub.SECTION for f, sub in cls.SUBSECTIONS.items()})
        return src

    @classmethod
    def from_config(cls, c: Any, **overrides) -> "TrainConfig":
        """Build from the experiment ConfigDict of ``configs/base.py``, every field read from
        its key (`config_sources`); `overrides` replace fields.

        Derived: loss.norm_len 0 = the rollout's longest possible response (`_default_norm_len`);
        lr = lora.lr when LoRA is on (rank > 0) and lora.lr > 0. Raises ConfigError on a
        missing key or an unknown key in ``c.optim`` / ``c.train`` (naming the closest),
        ValueError on a bad value.
        """
        scalar = {k: v for k, v in cls.config_sources().items() if k not in cls.SUBSECTIONS}
        v = read_fields(cls, c, scalar, convert=cls.CONVERT, owned={"optim": (), "train": ()})
        v["loss"] = LossConfig.from_config(c.loss, **_default_norm_len(c))
        v["estimator"] = EstimatorConfig.from_config(c.adv)
        v["lora"] = LoraConfig.from_config(c)
        v["replay"] = ReplayConfig.from_config(c.replay)
        if v["lora"].enabled and v["lora"].lr > 0:
            v["lr"] = float(v["lora"].lr)
        v["temperature"] = float(v["temperature"])
        v["dropout_passes"] = int(v["dropout_passes"])
        v["dropout"] = float(v["dropout"])
        v.update(overrides)
        return cls(**v)
