"""The sampler's copy of the params in another weight layout (docs/design.md §12).

The trainer keeps HF's [out, in] matrices (`strata_jax.models.qwen2`); the decode step may run
faster on some backends with projections stored [in, out] (`InOutWeight`, dispatched by the
decoder's linear layer) or with q|k|v and gate|up fused. `prepare_sampler_params` builds that
copy; ``rollout.sampler_layout`` picks it (`strata_jax.sampling.SamplerCopy`).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from strata_jax.models.config import Qwen2Config
from strata_jax.models.layers import InOutWeight, LoraWeight
from strata_jax.models.qwen2 import LINEAR_PROJECTIONS, Params

# Names `prepare_sampler_params` accepts in ``in_out`` (after fusion: q/k/v become qkv_proj,
# gate/up become gate_up_proj when fused).
SAMPLER_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj", "gate_proj",
                       "up_proj", "gate_up_proj", "down_proj", "lm_head")


def prepare_sampler_params(params: Params, config: Qwen2Config, *, fuse_qkv: bool = False,
                           fuse_gate_up: bool = False,
                           in_out: tuple[str, ...] = ()) -> Params:
    """An inference copy of the params in the layout the decode step runs fastest with.

    The trainer's params keep HF's [out, in] layout (module docstring); this returns a new
    pytree for `forward` / `logits_from_hidden` only (the sampler's copy), leaving `params`
    untouched. Per layer, ``fuse_qkv`` replaces q/k/v_proj and their biases by one
    ``qkv_proj`` [H*Dh + 2*K*Dh, D] and ``qkv_bias``; ``fuse_gate_up`` replaces gate/up_proj
    by ``gate_up_proj`` [2F, D] (gate rows first). Every name in ``in_out`` (from
    `SAMPLER_PROJECTIONS`, named after fusion) is stored pre-transposed as an `InOutWeight`
    [in, out]; "lm_head" adds a [D, V] output matrix (a second copy of the embedding when
    tied). Values are exactly the same numbers, so greedy decoding is unchanged up to the
    float summation order of the matmuls.

    Args:
      params: the params pytree (plain arrays, any float dtype; no LoRA adapters: merge them
        first, as the trainer's ``policy_params`` does).
      config: the model's config.
      fuse_qkv, fuse_gate_up, in_out: the layout (static; each combination is one program).
    Returns: the prepared pytree (new arrays; call it under ``jax.jit`` or let it run eagerly).
    Raises:
      ValueError: an unknown or not-applicable ``in_out`` name, or LoRA adapters in `params`.
    """
    in_out = tuple(in_out)
    names = set(SAMPLER_PROJECTIONS)
    names -= {"q_proj", "k_proj", "v_proj"} if fuse_qkv else {"qkv_proj"}
    names -= {"gate_proj", "up_proj"} if fuse_gate_up else {"gate_up_proj"}
    bad = [n for n in in_out if n not in names]
    if bad:
        raise ValueError(f"in_out names {bad} do not apply with fuse_qkv={fuse_qkv}, "
                         f"fuse_gate_up={fuse_gate_up}; choose from {sorted(names)}")
    if any(isinstance(x, (LoraWeight, InOutWeight)) for x in jax.tree.leaves(
            params, is_leaf=lambda x: isinstance(x, (LoraWeight, InOutWeight)))):
        raise ValueError("prepare_sampler_params needs plain [out, in] arrays: merge LoRA "
                         "adapters first and prepare the trainer's params only once")
    return _prepare(params, config=config, fuse_qkv=bool(fuse_qkv),
                    fuse_gate_up=bool(fuse_gate_up), in_out=in_out)


def _prepare_impl(params: Params, *, config: Qwen2Config, fuse_qkv: bool, fuse_gate_up: bool,
                  in_out: tuple[str, ...]) -> Params:
    def put(name, w):
        return InOutWeight(w.T) if name in in_out else w

    layers = []
    for layer in params["layers"]:
        new = {k: v for k, v in layer.items()}
        if fuse_qkv:
            new["qkv_proj"] = jnp.concatenate([new.pop("q_proj"), new.pop("k_proj"),
                                               new.pop("v_proj")], axis=0)
            new["qkv_bias"] = jnp.concatenate([new.pop("q_bias"), new.pop("k_bias"),
                                               new.pop("v_bias")], axis=0)
        if fuse_gate_up:
            new["gate_up_proj"] = jnp.concatenate([new.pop("gate_proj"), new.pop("up_proj")],
                                                  axis=0)
        layers.append({k: put(k, v) for k, v in new.items()})
    out = {k: v for k, v in params.items() if k != "layers"}
    out["layers"] = layers
    if "lm_head" in in_out:
        head = params["embed"] if config.tie_word_embeddings else params["lm_head"]
        out["lm_head"] = InOutWeight(head.T)
    return out


_prepare = jax.jit(_prepare_impl, static_argnames=("config", "fuse_qkv", "fuse_gate_up",
                                                   "in_out"))


def parse_sampler_layout(spec: str) -> dict:
    """A layout string -> `prepare_sampler_params` keyword arguments (fuse_qkv, fuse_gate_up,
    in_out), or {} for "" (the stored layout).

    `spec` is a comma list: ``fuse_qkv``, ``fuse_gate_up``, names of `SAMPLER_PROJECTIONS`
    stored [in, out], or ``in_out`` for every decoder projection [in, out]; an unfused q/k/v or
    gate/up name is mapped to its fused matrix when that fusion is on. Raises ValueError naming
    the valid items on an unknown one.
    """
    items = [t.strip() for t in spec.split(",") if t.strip()]
    if not items:
        return {}
    kw: dict = {"fuse_qkv": False, "fuse_gate_up": False}
    in_out: list[str] = []
    for tok in items:
        if tok in ("fuse_qkv", "fuse_gate_up"):
            kw[tok] = True
        elif tok == "in_out":
            in_out += list(LINEAR_PROJECTIONS)
        elif tok in SAMPLER_PROJECTIONS:
            in_out.append(tok)
        else:
            raise ValueError(f"unknown item {tok!r}; use in_out, fuse_qkv, "
                             f"fuse_gate_up or one of {', '.join(SAMPLER_PROJECTIONS)}")
    if kw["fuse_qkv"] and "q_proj" in in_out:
        in_out = [n for n in in_out if n not in ("q_proj", "k_proj", "v_proj")] + ["qkv_proj"]
    if kw["fuse_gate_up"] and "gate_proj" in in_out:
        in_out = [n for n in in_out if n not in ("gate_proj", "up_proj")] + ["gate_up_proj"]
    kw["in_out"] = tuple(dict.fromkeys(in_out))
    return kw
