"""The sampler's copy of a model's params: the one path from params to what a `Sampler` reads.

Training (after every update), evaluation (a checkpoint or the config's model) and the separate
judge (`strata_jax.rollout.build_judge_model`) all hand their params through a `SamplerCopy`:

    params (LoRA: `Trainer.policy_params` merges the adapters into the base first: `of_state`)
      -> cast to ``rollout.sampler_dtype`` (bf16 halves the bytes a decode step streams; the
         trainer keeps fp32 masters and recomputes pi_old itself, so the cast only shows up in
         the logged sampler-trainer mismatch)
      -> multi-host: gathered onto this host's devices (`strata_jax.distributed.to_local`)
      -> the layout of ``rollout.sampler_layout`` (`strata_jax.models.sampler_layout`)

The trainer's params are never touched. Source: docs/design.md §2 and §12.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from strata_jax.config import ConfigError
from strata_jax.models import Qwen2Config


@dataclasses.dataclass(frozen=True)
class SamplerCopy:
    """Turns params into the copy a `Sampler` reads (module docstring).

    Attributes:
      model: the model's `Qwen2Config`.
      dtype: the sampler's dtype (``rollout.sampler_dtype``, "" = ``model.dtype``).
      layout: `strata_jax.models.sampler_layout.prepare_sampler_params` keyword arguments
        (empty: the stored HF [out, in] layout, no copy).
      gather_to: the sampler's host-local mesh (`distributed.local_mesh`) when the params live
        on a mesh that spans several processes (training); None when they are already where the
        sampler reads them (evaluation, the judge). A pass-through for one process either way.
    """

    model: Qwen2Config
    dtype: Any
    layout: dict = dataclasses.field(default_factory=dict)
    gather_to: Mesh | None = None

    @classmethod
    def from_config(cls, c: Any, model: Qwen2Config, gather_to: Mesh | None = None
                    ) -> "SamplerCopy":
        """The copy of experiment config `c`: ``rollout.sampler_dtype`` (or ``model.dtype``) and
        ``rollout.sampler_layout`` ("" keeps the stored layout; otherwise a comma list of
        ``fuse_qkv``, ``fuse_gate_up`` and projection names stored pre-transposed, or "in_out":
        `parse_sampler_layout`). Raises ConfigError for an unknown layout name."""
        from strata_jax.models.sampler_layout import parse_sampler_layout
        spec = str(c.rollout.get("sampler_layout", "") or "")
        try:
            layout = parse_sampler_layout(spec)
        except ValueError as e:
            raise ConfigError(f"rollout.sampler_layout={spec!r}: {e}") from None
        dtype = jnp.dtype(c.rollout.get("sampler_dtype", "") or c.model.dtype)
        return cls(model, dtype, layout, gather_to)

    def __call__(self, params: Any) -> Any:
        """The sampler's copy of plain (merged) `params`: cast, gathered, laid out. Returns
        `params` itself when nothing changes (same dtype, one process, stored layout). When the
        sampler dtype equals the params' (no cast copy), a layout costs one more copy of the
        transformed weights. Every process must call it in a multi-host run (the gather is a
        collective)."""
        from strata_jax import distributed
        from strata_jax.models.sampler_layout import prepare_sampler_params
        params = cast(params, self.dtype)
        if self.gather_to is not None:
            params = distributed.to_local(params, self.model, self.gather_to)
        return prepare_sampler_params(params, self.model, **self.layout) if self.layout else params

    def of_state(self, trainer: Any, state: Any, base: Any = None) -> Any:
        """The sampler's copy of a `Trainer`'s current policy: `Trainer.policy_params` (with
        LoRA the adapters merged into the frozen `base`), then `__call__`."""
        return self(trainer.policy_params(state, base))


@jax.jit
def _cast_bf16(params: Any) -> Any:
    return jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)


def cast(params: Any, dtype: Any) -> Any:
    """Every leaf of `params` in `dtype` (`params` itself when they already are; bf16 in one
    jitted program)."""
    dtype = jnp.dtype(dtype)
    if all(x.dtype == dtype for x in jax.tree.leaves(params)):
        return params
    if dtype == jnp.bfloat16:
        return _cast_bf16(params)
    return jax.tree.map(lambda x: x.astype(dtype), params)


__all__ = ["SamplerCopy", "cast"]
