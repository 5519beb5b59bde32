"""LoRA: low-rank adapters on the attention and MLP projections of the Qwen2 params tree.

An adapted projection is ``W' = W + (alpha / rank) * B @ A`` with the HF ``[out, in]`` layout of
``W`` kept (so the forward is still ``x @ W'.T``): ``A`` is ``[rank, in]`` (PEFT's
``lora_A.weight``), ``B`` is ``[out, rank]`` (``lora_B.weight``). At init ``A`` is drawn like
PEFT's kaiming-uniform default (U(-1/sqrt(in), 1/sqrt(in))) and ``B = 0``, so the adapted model
starts exactly equal to the base model; the base stays frozen, which makes it the KL reference
model for free (no second copy of the weights).

Adapters pytree (plain nested dict; only targeted projections appear, every node non-empty so
orbax and optax see a regular tree):

    {"layers": {"<i>": {"<proj>": {"a": [rank, in] f32, "b": [out, rank] f32}, ...}, ...}}

with ``<i>`` the layer index as a string and ``<proj>`` one of `PROJECTIONS`. Targets are
regular expressions searched (``re.search``) in names ``"layers.<i>.<proj>"``, e.g. the default
``(q|k|v|o|gate|up|down)_proj$`` (every projection, verl-agent's / PEFT's "all-linear"),
``(q|v)_proj$`` (the original LoRA paper), ``layers\\.(2[0-7])\\.`` (the last 8 layers).

`lora_params(base, adapters, cfg)` is what training and scoring run: every targeted weight
becomes a `LoraWeight` (W, A, B, scale) and the forward computes ``x @ W.T + scale * (x @ A.T)
@ B.T``, so no merged copy of the weights exists in a step (merging inside the step held the
targeted weights a second time at the promoted dtype, plus their gradient-path copies).
`apply_lora(base, adapters, cfg)` merges (W + scale * B @ A, same structure and layout as the
base): the sampler's and the export's copy. `export_merged` writes the merged model as an HF
checkpoint via ``export_params``; `strata_jax.models.adapter_files` writes the adapters alone
(PEFT's files).
Source: Hu et al. 2021 "LoRA" (arXiv:2106.09685) sections 4.1-4.2 (W + BA, B = 0 init,
alpha / r scaling); PEFT ``LoraLayer`` (A/B layout, kaiming-uniform A); verl-agent 7B recipe
(rank 64, alpha 64, lr 3e-6, all linear layers).
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from strata_jax.config import read_fields, section_sources
from strata_jax.models.config import Qwen2Config
from strata_jax.models.layers import LoraWeight
from strata_jax.models.qwen2 import LINEAR_PROJECTIONS, Params, layer_shapes, param_logical_axes

# The projections LoRA may adapt (biases and norms never are).
PROJECTIONS: tuple[str, ...] = LINEAR_PROJECTIONS
ALL_LINEAR = r"(q|k|v|o|gate|up|down)_proj$"

Adapters = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """LoRA hyper-parameters (hashable: a static argument of jitted functions).

    Attributes:
      rank: r, the adapter rank; 0 = LoRA off (full fine-tuning).
      alpha: scaling numerator; the update is (alpha / rank) * B @ A.
      targets: regexes searched in "layers.<i>.<proj>" names; a projection is adapted when any
        matches.
      lr: learning rate of the adapters (replaces optim.lr when LoRA is on); 0 = keep optim.lr.
    Defaults: configs/base.py's ``c.lora`` (verl-agent's 7B recipe: alpha 64, lr 3e-6; rank 0 =
    off), kept equal by tests/test_config_schema.py.
    Raises ValueError for a negative rank, a non-positive alpha with rank > 0, an empty targets
    tuple or an invalid regex.
    """

    rank: int = 0
    alpha: float = 64.0
    targets: tuple[str, ...] = (ALL_LINEAR,)
    lr: float = 3e-6

    SECTION: ClassVar[str] = "lora"

    def __post_init__(self) -> None:
        if self.rank < 0:
            raise ValueError(f"lora.rank must be >= 0 (0 = off), got {self.rank}")
        if self.rank > 0 and not (math.isfinite(self.alpha) and self.alpha > 0):
            raise ValueError(f"lora.alpha must be a finite number > 0, got {self.alpha}")
        if isinstance(self.targets, str):
            object.__setattr__(self, "targets", (self.targets,))
        if self.rank > 0 and not self.targets:
            raise ValueError("lora.targets is empty: give at least one regex, e.g. "
                             f"{ALL_LINEAR!r}")
        for t in self.targets:
            try:
                re.compile(t)
            except re.error as e:
                raise ValueError(f"lora.targets entry {t!r} is not a valid regex: {e}") from e

    @property
    def enabled(self) -> bool:
        """True when rank > 0."""
        return self.rank > 0

    @property
    def scale(self) -> float:
        """alpha / rank (the LoRA paper's scaling of B @ A)."""
        return self.alpha / self.rank

    @classmethod
    def config_sources(cls) -> dict[str, str]:
        """{field: dotted config key}: every field is ``lora.<field>``."""
        return section_sources(cls, cls.SECTION)

    @classmethod
    def from_config(cls, c: Any) -> "LoraConfig":
        """From the experiment config's ``c.lora`` section, every field read (a ``targets``
        string becomes a 1-tuple). Raises ConfigError on a missing or unknown key."""
        kw = read_fields(cls, c, cls.config_sources(), owned={cls.SECTION: ()},
                         convert={"targets": lambda t: (t,) if isinstance(t, str) else tuple(t),
                                  "rank": int})
        return cls(**kw)


def target_names(config: Qwen2Config, cfg: LoraConfig) -> list[str]:
    """Names "layers.<i>.<proj>" of the projections `cfg.targets` select, in layer order.

    Raises ValueError when no projection matches (the message lists example names).
    """
    names = [f"layers.{i}.{p}" for i in range(config.num_layers) for p in PROJECTIONS]
    pats = [re.compile(t) for t in cfg.targets]
    picked = [n for n in names if any(p.search(n) for p in pats)]
    if not picked:
        raise ValueError(f"lora.targets {cfg.targets} match no projection; names look like "
                         f"{names[:3]} ... {names[-1]}")
    return picked


def _split(name: str) -> tuple[str, str]:
    _, i, proj = name.split(".")
    return i, proj


def num_adapter_params(config: Qwen2Config, cfg: LoraConfig) -> int:
    """rank * (in + out) summed over the targeted projections (the adapter parameter count)."""
    shapes = layer_shapes(config)
    return sum(cfg.rank * sum(shapes[_split(n)[1]]) for n in target_names(config, cfg))


def init_lora(config: Qwen2Config, cfg: LoraConfig, key: jax.Array,
              dtype: Any = jnp.float32) -> Adapters:
    """Fresh adapters: A ~ U(-1/sqrt(in), 1/sqrt(in)) (PEFT's kaiming_uniform(a=sqrt(5))), B = 0.

    Args: config: model shape; cfg: LoRA config with rank > 0; key: PRNG key (one fold per
      targeted projection, so adding a target does not change the others' A); dtype: adapter
      dtype (float32: the adapters are the optimised master weights).
    Returns the adapters pytree of the module docstring. Raises ValueError when rank == 0.
    """
    if not cfg.enabled:
        raise ValueError("init_lora needs lora.rank > 0")
    shapes = layer_shapes(config)
    out: Adapters = {"layers": {}}
    for name in target_names(config, cfg):
        i, proj = _split(name)
        n_out, n_in = shapes[proj]
        k = jax.random.fold_in(jax.random.fold_in(key, int(i)), PROJECTIONS.index(proj))
        bound = 1.0 / n_in ** 0.5
        a = jax.random.uniform(k, (cfg.rank, n_in), jnp.float32, -bound, bound).astype(dtype)
        out["layers"].setdefault(i, {})[proj] = {"a": a, "b": jnp.zeros((n_out, cfg.rank), dtype)}
    return out


def lora_logical_axes(config: Qwen2Config, adapters: Adapters) -> Adapters:
    """Logical axes per adapter leaf: A [rank, in] -> (None, in-axis of W), B [out, rank] ->
    (out-axis of W, None), so B @ A is sharded like W (consumed by sharding.tree_shardings)."""
    base_axes = param_logical_axes(config)["layers"]
    return {"layers": {i: {p: {"a": (None, base_axes[int(i)][p][1]),
                               "b": (base_axes[int(i)][p][0], None)}
                           for p in layer}
                       for i, layer in adapters["layers"].items()}}


def lora_shardings(adapters: Adapters, config: Qwen2Config, mesh: jax.sharding.Mesh) -> Adapters:
    """NamedSharding per adapter leaf (`lora_logical_axes` through the one rule table)."""
    from strata_jax.sharding import tree_shardings
    return tree_shardings(lora_logical_axes(config, adapters), adapters, mesh)


def apply_lora(base: Params, adapters: Adapters, cfg: LoraConfig,
               dtype: Any = None) -> Params:
    """Effective params: every targeted W replaced by W + (alpha / rank) * B @ A.

    Args:
      base: the frozen Qwen2 params tree (qwen2.py layout), any float dtype.
      adapters: `init_lora` tree (structure decides which weights change; `cfg` gives the scale).
      cfg: LoRA config (rank > 0).
      dtype: dtype of the merged weights; None = promote(W, A) (float32 for a bf16 base with
        f32 adapters, so an update below bf16 resolution still reaches the forward); untargeted
        leaves are returned as they are (no copy).
    Returns a params tree of the base's structure. Pure and differentiable in `adapters` (and
    `base`); call it inside jit so the product fuses into the add. With B = 0 the result equals
    the base bit for bit (W + 0 is exact).
    Raises KeyError when the adapters name a layer / projection the base lacks.
    """
    scale = cfg.scale
    layers = list(base["layers"])
    for i, mods in adapters["layers"].items():
        layer = dict(layers[int(i)])
        for proj, ab in mods.items():
            w = layer[proj]
            dt = dtype or jnp.promote_types(w.dtype, ab["a"].dtype)
            delta = jnp.einsum("or,ri->oi", ab["b"].astype(jnp.float32),
                               ab["a"].astype(jnp.float32))
            layer[proj] = (w.astype(jnp.float32) + scale * delta).astype(dt)
        layers[int(i)] = layer
    return {**base, "layers": layers}


def lora_params(base: Params, adapters: Adapters, cfg: LoraConfig) -> Params:
    """The params tree a LoRA forward runs: every targeted W replaced by ``LoraWeight(W, A, B,
    alpha / rank)`` (no merge; `qwen2.forward` computes x @ W.T + scale * (x @ A.T) @ B.T).

    Same values as `apply_lora` up to float rounding (the low-rank term is added to the
    activations instead of the weights; an update below the weights' resolution still reaches
    the output). Untargeted leaves are the base's arrays (no copy). Differentiable in adapters.
    Raises KeyError when the adapters name a layer / projection the base lacks.
    """
    layers = list(base["layers"])
    for i, mods in adapters["layers"].items():
        layer = dict(layers[int(i)])
        for proj, ab in mods.items():
            layer[proj] = LoraWeight(layer[proj], ab["a"], ab["b"], cfg.scale)
        layers[int(i)] = layer
    return {**base, "layers": layers}


def export_merged(base: Params, adapters: Adapters, cfg: LoraConfig, config: Qwen2Config,
                  out_dir: str, dtype: Any = None) -> str:
    """Merge the adapters into the base and write an HF checkpoint (``export_params``).

    Args: base, adapters, cfg: as `apply_lora`; config: model config; out_dir: created;
      dtype: stored dtype (default: the base embedding's dtype, so a bf16 base exports bf16).
    Returns out_dir (config.json + safetensors that transformers and vLLM load).
    """
    from strata_jax.models.loading import export_params
    merged = jax.jit(apply_lora, static_argnums=(2,))(base, adapters, cfg)
    return export_params(merged, config, out_dir, dtype=dtype or base["embed"].dtype)


__all__ = ["PROJECTIONS", "ALL_LINEAR", "LoraConfig", "target_names", "num_adapter_params",
           "init_lora", "lora_logical_axes", "lora_shardings", "apply_lora", "lora_params",
           "export_merged", "LoraWeight"]
