"""The Qwen2 decoder layer in plain JAX: RMSNorm, RoPE, the projections (plain, LoRA-adapted
or pre-transposed), q/k/v, the SwiGLU MLP, and the layer's rematerialisation (per layer, or a
scan over stacked layers) under a remat policy.

Source: transformers ``modeling_qwen2.py`` (Qwen2DecoderLayer, Qwen2RMSNorm, rotate-half RoPE);
the params layout in qwen2.py's module docstring; the remat policies in
`strata_jax.config.REMAT_CHECKPOINT_POLICIES`.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from strata_jax.config import REMAT_CHECKPOINT_POLICIES
from strata_jax.models.attention import TreeMask, attention
from strata_jax.models.config import Qwen2Config
from strata_jax.sharding import constrain

Params = dict[str, Any]


def checkpoint_policy(remat: str) -> Any:
    """The ``jax.checkpoint`` policy of a remat name other than "none"
    (`strata_jax.config.REMAT_CHECKPOINT_POLICIES`). Raises KeyError on another name."""
    return getattr(jax.checkpoint_policies, REMAT_CHECKPOINT_POLICIES[remat])


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """HF Qwen2RMSNorm: normalise in fp32, cast back to x.dtype, then scale by weight."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * x32.astype(x.dtype)


def rope_cos_sin(positions: jax.Array, head_dim: int,
                 theta: float) -> tuple[jax.Array, jax.Array]:
    """cos, sin [B, T, head_dim] fp32 of HF's default RoPE (frequencies repeated twice)."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE on x [B, T, N, Dh] with cos/sin [B, T, Dh] (HF apply_rotary_pos_emb)."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos = cos[:, :, None, :].astype(x.dtype)
    sin = sin[:, :, None, :].astype(x.dtype)
    return x * cos + rotated * sin


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LoraWeight:
    """A projection with a low-rank adapter, applied without merging (strata_jax/models/lora.py).

    ``x @ W'.T`` with ``W' = W + scale * B @ A`` is computed as
    ``x @ W.T + scale * (x @ A.T) @ B.T``: the merged [out, in] matrix never exists, so a
    LoRA forward/backward holds no second copy of the targeted weights (and the gradient of A,
    B needs only the [.., rank] activations). Attributes: w [out, in] (frozen base), a
    [rank, in], b [out, rank] (any float dtypes; the matmuls run in x's dtype via the caller's
    cast), scale = alpha / rank (static). Source: Hu et al. 2021 "LoRA" eq. 3 (h = W0 x + B A x).
    """

    w: jax.Array
    a: jax.Array
    b: jax.Array
    scale: float = dataclasses.field(metadata=dict(static=True), default=1.0)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class InOutWeight:
    """A projection stored pre-transposed, ``w`` [in, out], so the matmul is ``x @ w``.

    Only in an inference copy made by `prepare_sampler_params` (the trainer's params keep HF's
    [out, in], which LoRA, loading, export and sharding rely on); `linear` and the LM head
    dispatch on the type, so the same `forward` runs either copy.
    """

    w: jax.Array


def linear(x: jax.Array, w: jax.Array | LoraWeight | InOutWeight,
           b: jax.Array | None = None) -> jax.Array:
    """x [B, T, in] times a projection, ``x @ W.T`` (+ bias b [out]): a plain [out, in] matrix,
    a `LoraWeight` (the adapter unmerged) or an `InOutWeight` ([in, out]). Returns [B, T, out]
    in the matmul's dtype."""
    if isinstance(w, InOutWeight):
        y = jnp.einsum("btd,df->btf", x, w.w)
    elif isinstance(w, LoraWeight):
        y = jnp.einsum("btd,fd->btf", x, w.w)
        low = jnp.einsum("btd,rd->btr", x, w.a.astype(x.dtype))
        y = y + (w.scale * jnp.einsum("btr,fr->btf", low, w.b.astype(x.dtype))).astype(y.dtype)
    else:
        y = jnp.einsum("btd,fd->btf", x, w)
    return y if b is None else y + b


def qkv(x: jax.Array, layer: Params, cos: jax.Array, sin: jax.Array,
        config: Qwen2Config) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q [B,T,H,Dh], k, v [B,T,K,Dh] of one layer's input x (input RMSNorm, biases, RoPE on q/k)."""
    b, t, _ = x.shape
    nh, nk, dh = config.num_heads, config.num_kv_heads, config.head_dim
    h = rms_norm(x, layer["input_norm"], config.rms_norm_eps)
    if "qkv_proj" in layer:   # fused inference copy (prepare_sampler_params): one matmul
        fused = linear(h, layer["qkv_proj"], layer["qkv_bias"])
        q, k, v = jnp.split(fused, [nh * dh, (nh + nk) * dh], axis=-1)
        q, k, v = q.reshape(b, t, nh, dh), k.reshape(b, t, nk, dh), v.reshape(b, t, nk, dh)
    else:
        q = linear(h, layer["q_proj"], layer["q_bias"]).reshape(b, t, nh, dh)
        k = linear(h, layer["k_proj"], layer["k_bias"]).reshape(b, t, nk, dh)
        v = linear(h, layer["v_proj"], layer["v_bias"]).reshape(b, t, nk, dh)
    q = constrain(apply_rope(q, cos, sin), ("batch", "length", "heads", "head_dim"))
    k = constrain(apply_rope(k, cos, sin), ("batch", "length", "kv_heads", "head_dim"))
    v = constrain(v, ("batch", "length", "kv_heads", "head_dim"))
    return q, k, v


def post_attention(x: jax.Array, attn: jax.Array, layer: Params,
                   config: Qwen2Config) -> jax.Array:
    """The rest of a decoder layer: residual + o_proj(attn), then residual + SwiGLU MLP."""
    x = constrain(x + linear(attn, layer["o_proj"]), ("batch", "length", "embed"))
    h = rms_norm(x, layer["post_norm"], config.rms_norm_eps)
    if "gate_up_proj" in layer:   # fused inference copy (prepare_sampler_params)
        gate, up = jnp.split(linear(h, layer["gate_up_proj"]), 2, axis=-1)
    else:
        gate = linear(h, layer["gate_proj"])
        up = linear(h, layer["up_proj"])
    gate = constrain(gate, ("batch", "length", "mlp"))
    up = constrain(up, ("batch", "length", "mlp"))
    x = x + linear(jax.nn.silu(gate) * up, layer["down_proj"])
    return constrain(x, ("batch", "length", "embed"))


def decoder_layer(x: jax.Array, layer: Params, cos: jax.Array, sin: jax.Array,
                  allowed: jax.Array, config: Qwen2Config, query_chunk: int) -> jax.Array:
    """One decoder layer without a KV cache (the unit `forward` rematerialises)."""
    q, k, v = qkv(x, layer, cos, sin, config)
    attn = attention(q, k, v, allowed, config.num_kv_heads, query_chunk, first_slot=0)
    return post_attention(x, attn, layer, config)


def remat_layer(x: jax.Array, layer: Params, cos: jax.Array, sin: jax.Array,
                allowed: jax.Array, config: Qwen2Config, query_chunk: int,
                remat: str) -> jax.Array:
    """One decoder layer, rematerialised in the backward pass with the ``remat`` policy and
    recomputed only once the layer above has produced its cotangent (same values as
    `decoder_layer`).

    Args: x [B, T, D] layer input; layer: one layer's params (arrays or `LoraWeight`s); cos,
    sin [B, T, Dh] f32 RoPE tables; allowed [B, T, T] bool or a `TreeMask`; static config,
    query_chunk, remat ("full" | "dots", `checkpoint_policy`). Returns [B, T, D] in x's dtype.
    Differentiable in x and layer (the RoPE tables and the mask get no cotangent).

    ``jax.checkpoint`` alone is not enough on XLA's CPU backend: a recomputation reads only the
    saved layer input, so the scheduler is free to hoist every layer's recomputation to the
    start of the backward pass, and all layers' activations were live at once (per-layer remat
    saved nothing in XLA's memory analysis of the 0.5B step). An ``optimization_barrier`` does
    not survive the CPU pipeline, so the backward (`_remat_layer_bwd`) adds ``0 * ct[:, :, :1]``
    to the saved activations instead: a real data dependency on the cotangent. A ``lax.scan``
    over stacked layers orders the recomputation too, but stacking copies every layer weight
    on each call (1.4 GB for the fp32 0.5B; a frozen LoRA base included).
    """
    return decoder_layer(x, layer, cos, sin, allowed, config, query_chunk)


def _remat_layer_fwd(x, layer, cos, sin, allowed, config, query_chunk, remat):
    """Forward: the layer linearised under ``jax.checkpoint(policy)``; the residual is its
    pullback (what the policy saved) and x's leading [B, T]."""
    body = jax.checkpoint(decoder_layer, policy=checkpoint_policy(remat), static_argnums=(5, 6))
    y, pullback = jax.vjp(lambda h, w: body(h, w, cos, sin, allowed, config, query_chunk),
                          x, layer)
    # the pullback's leaves: what the policy saved (the inputs, and for "dots" the weight-matmul
    # outputs) and the weights; the activations are those that start with x's [B, T]
    return y, (pullback, x.shape[:2])


def _remat_layer_bwd(config, query_chunk, remat, res, ct):
    """Backward: every saved activation (a float leaf starting with [B, T]) gets + 0 * ct, then
    the pullback recomputes the layer. Adding zero changes no value (a non-finite ct already
    makes the gradient non-finite); a weight that happens to start with [B, T] is only copied."""
    pullback, bt = res
    # [B, T, 1] zeros that exist only once ct does; per row, so a batch-sharded ct needs no
    # communication (activations keep "embed" whole, sharding.LOGICAL_RULES)
    zero = ct[:, :, :1] * 0

    def after_ct(r):
        if jnp.issubdtype(r.dtype, jnp.floating) and r.ndim >= 2 and r.shape[:2] == bt:
            return r + zero.reshape(bt + (1,) * (r.ndim - 2)).astype(r.dtype)
        return r

    dx, dlayer = jax.tree.map(after_ct, pullback)(ct)
    return dx, dlayer, None, None, None


remat_layer = jax.custom_vjp(remat_layer, nondiff_argnums=(5, 6, 7))
remat_layer.defvjp(_remat_layer_fwd, _remat_layer_bwd)


def same_structure(layers: list[Params]) -> bool:
    """True when every layer dict has the same pytree structure and leaf shapes (stackable)."""
    first = jax.tree.structure(layers[0])
    shapes = [x.shape for x in jax.tree.leaves(layers[0])]
    return all(jax.tree.structure(layer) == first
               and [x.shape for x in jax.tree.leaves(layer)] == shapes for layer in layers[1:])


def remat_layers(x: jax.Array, layers: list[Params], cos: jax.Array, sin: jax.Array,
                 allowed: jax.Array, config: Qwen2Config, query_chunk: int,
                 remat: str) -> jax.Array:
    """The decoder layers as a ``lax.scan`` over stacked weights with a checkpointed body
    (``forward(scan_layers=True)``; same values as `remat_layer` per layer).

    The scan's backward loop recomputes one layer per iteration (layer inputs [L, B, T, D] plus
    one layer's activations), and the body compiles once, so deep models compile much faster
    than the unrolled layers; the price is a stacked copy of every layer weight on each call
    (all of the layer weights, a frozen LoRA base included).
    """
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *layers)
    body = jax.checkpoint(decoder_layer, policy=checkpoint_policy(remat), static_argnums=(5, 6))

    def step(h, layer):
        return body(h, layer, cos, sin, allowed, config, query_chunk), None

    x, _ = jax.lax.scan(step, x, stacked)
    return x


__all__ = ["LoraWeight", "InOutWeight", "rms_norm", "rope_cos_sin", "apply_rope", "linear",
           "checkpoint_policy", "qkv", "post_attention", "decoder_layer", "remat_layer",
           "remat_layers", "same_structure"]
