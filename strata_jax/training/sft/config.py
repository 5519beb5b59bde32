"""Behaviour-cloning settings: `SFTConfig` (``c.sft`` of configs/base.py)."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar

from strata_jax.config import read_fields, section_sources
from strata_jax.models.lora import ALL_LINEAR, LoraConfig

STRATEGY_MODES = ("both", "strata", "flat")
PLAN_CODES = ("keep", "mask")
PROMPT_HISTORIES = ("run", "window", "full")


@dataclasses.dataclass(frozen=True)
class SFTConfig:
    """Behaviour-cloning settings (``c.sft`` of configs/base.py; `from_config`).

    Attributes:
      episodes: expert episodes collected (tasks drawn without repeats from ``split``).
      split: task split the experts play.
      noise: probability that a step is a random action (see experts.py), in [0, 1).
      strategy_mode: "both" renders every episode with z (StraTA rows: strategy + step prompts
        with z + judge) AND without (flat baseline rows), so one warm start serves StraTA and the
        baselines; "strata" or "flat" renders one form only.
      judge: add judge examples (StraTA form only).
      think: the text inside <think></think> of every action response.
      max_plan_items: the plan (z) keeps at most this many numbered items.
      plan_code: "keep" renders the plan from the expert's actions as they are (memory_key's
        ends with ``enter <code>``: the cloned strategies carry the code); "mask" writes every
        ``enter <code>`` item as ``enter the vault code``, so the warm start teaches the moves
        and the keypad but leaves carrying the code in the strategy for RL to discover.
      plan_code_keep: with ``plan_code="mask"``, the fraction of expert episodes (a seeded
        draw per episode, `keeps_code`) whose plan keeps its code: a start whose strategies
        carry the code sometimes, so the strategy-level reward has something to raise (with
        none carrying it, no group's strategies differ in what they carry). In [0, 1].
      train_strategies: train the strategy examples (StraTA form). False keeps the model's own
        way of writing strategies (the action rows still see the rendered plan as z): with
        ``plan_code="mask"`` the warm start then neither teaches nor unlearns putting the code
        in the plan.
      clone_guesses: False leaves out the StraTA-form action rows that type a code their prompt
        cannot show (a masked plan as z, the note out of the history window; `render_episode`),
        so that form's code rows all teach reading the code from z or the history, none
        guessing it. The flat form keeps its guesses.
      strata_prompts, flat_prompts: the history each form's rows are rendered with: "run" (the
        run's own prompts: the whole trajectory under ``rollout.cumulative_prompts``, else the
        ``env.history_length`` window), "window" (that window) or "full" (the whole
        trajectory). One warm start can so serve a StraTA arm with windowed prompts and a flat
        arm whose prompts keep the whole trajectory (``rollout.cumulative_prompts``): both
        arms' configs name the same two renderings and share its fingerprint
        (`strata_jax.jobs.warm_start.fingerprint`).
      max_gold_steps: ScienceWorld gold paths longer than this are skipped.
      steps, batch_size, lr, weight_decay, grad_clip, warmup_steps: optimisation (AdamW, linear
        warmup then cosine decay to 0 at ``steps``).
      logprob_chunk: response positions per LM-head chunk.
      max_shapes: the batch shapes a run compiles at most: (prompt, response) widths
        planned over every step's batch before the first step, split between the two axes by
        the model's work per column (`strata_jax.training.sft.batch_shapes`); 0 pads each
        batch to its own buckets (power-of-two prompt, response rounded to 8: one program per
        distinct pair met, the rule before the option).
      seed: data and batch order seed. log_every: steps between loss log lines.
      cache_dir: where `strata_jax.jobs.warm_start` keeps exports, one sub-folder per fingerprint
        (configs/base.py: ``runs/warm_start``; "" = ``<workdir>/warm_start``).
      lora_rank: 0 (default) fine-tunes every param and exports an HF checkpoint; > 0 trains
        rank-``lora_rank`` adapters (`strata_jax.models.lora`, the RL trainer's LoRA) over the
        frozen initial params at ``lr`` and exports only the adapters (PEFT's files,
        `strata_jax.models.adapter_files`), a folder small enough to keep in git; the warm
        start is then the initial params with the adapters merged.
      lora_alpha, lora_targets: the adapters' scale numerator (scale alpha / rank) and the
        projections they adapt (regexes over ``layers.<i>.<proj>``, as ``lora.targets``; the
        default adapts every projection). Separate from ``lora.*``: those are the RL run's own
        adapters, which ride on the merged warm start.
    Raises ValueError for an out-of-range field (a LoRA field as `LoraConfig` would).
    """

    episodes: int = 32
    split: str = "train"
    noise: float = 0.1
    strategy_mode: str = "both"
    judge: bool = True
    think: str = "I follow the plan."
    max_plan_items: int = 12
    plan_code: str = "keep"
    plan_code_keep: float = 0.0
    train_strategies: bool = True
    clone_guesses: bool = True
    strata_prompts: str = "run"
    flat_prompts: str = "run"
    max_gold_steps: int = 30
    steps: int = 300
    batch_size: int = 16
    lr: float = 1e-5
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    warmup_steps: int = 20
    logprob_chunk: int = 64
    max_shapes: int = 4
    seed: int = 0
    log_every: int = 50
    cache_dir: str = "runs/warm_start"
    lora_rank: int = 0
    lora_alpha: float = 64.0
    lora_targets: tuple[str, ...] = (ALL_LINEAR,)

    # a ``--config.sft.lora_targets=<regex>`` string is one target, as ``lora.targets``
    CONVERT: ClassVar[dict[str, Callable[[Any], Any]]] = {
        "lora_targets": lambda t: (t,) if isinstance(t, str) else tuple(t), "lora_rank": int}

    def __post_init__(self) -> None:
        if self.strategy_mode not in STRATEGY_MODES:
            raise ValueError(f"sft.strategy_mode must be one of {STRATEGY_MODES}, "
                             f"got {self.strategy_mode!r}")
        if self.plan_code not in PLAN_CODES:
            raise ValueError(f"sft.plan_code must be one of {PLAN_CODES}, got {self.plan_code!r}")
        for name in ("strata_prompts", "flat_prompts"):
            if getattr(self, name) not in PROMPT_HISTORIES:
                raise ValueError(f"sft.{name} must be one of {PROMPT_HISTORIES}, "
                                 f"got {getattr(self, name)!r}")
        if not 0.0 <= self.plan_code_keep <= 1.0:
            raise ValueError(f"sft.plan_code_keep must be in [0, 1], got {self.plan_code_keep}")
        if not 0.0 <= self.noise < 1.0:
            raise ValueError(f"sft.noise must be in [0, 1), got {self.noise}")
        if int(self.max_shapes) < 0:
            raise ValueError(f"sft.max_shapes must be >= 0 (0 = per-batch buckets), "
                             f"got {self.max_shapes}")
        for name in ("episodes", "steps", "batch_size", "max_plan_items"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"sft.{name} must be >= 1, got {getattr(self, name)}")
        if isinstance(self.lora_targets, str):
            object.__setattr__(self, "lora_targets", (self.lora_targets,))
        try:
            self.lora   # LoraConfig's own checks (alpha > 0, targets non-empty and valid regexes)
        except ValueError as e:
            # the message names LoraConfig's key (lora.alpha): name this section's instead
            raise ValueError(str(e).replace("lora.", "sft.lora_", 1)) from None

    @property
    def lora(self) -> LoraConfig | None:
        """The adapters' `LoraConfig` (rank, alpha, targets; its lr is unused: ``lr`` trains
        them), or None when ``lora_rank`` is 0 (full fine-tuning).
        Raises ValueError for a negative rank, a non-positive alpha or bad targets."""
        if self.lora_rank < 0:
            raise ValueError(f"lora.rank must be >= 0 (0 = full fine-tuning), got {self.lora_rank}")
        if self.lora_rank == 0:
            return None
        return LoraConfig(rank=int(self.lora_rank), alpha=float(self.lora_alpha),
                          targets=tuple(self.lora_targets))

    @classmethod
    def config_sources(cls) -> dict[str, str]:
        """{field: dotted config key}: every field is ``sft.<field>``."""
        return section_sources(cls, "sft")

    @classmethod
    def from_config(cls, c: Any, **overrides: Any) -> "SFTConfig":
        """From ``c.sft``, every field read; a missing or unknown key is a ConfigError."""
        v = read_fields(cls, c, cls.config_sources(), convert=cls.CONVERT, owned={"sft": ()})
        v.update(overrides)
        return cls(**v)


def renders_full(cfg: SFTConfig, form: str, run_cumulative: bool) -> bool:
    """Whether the rows of `form` ("strata" or "flat") are rendered with the whole trajectory
    (`SFTConfig` strata_prompts / flat_prompts; "run" follows `run_cumulative`, the run's
    ``rollout.cumulative_prompts``)."""
    v = cfg.strata_prompts if form == "strata" else cfg.flat_prompts
    return run_cumulative if v == "run" else v == "full"


__all__ = ["SFTConfig", "STRATEGY_MODES", "PLAN_CODES", "PROMPT_HISTORIES", "renders_full"]
