"""Qwen2 / Qwen2.5 decoder in plain JAX: embeddings, RMSNorm, grouped-query attention with q/k/v
bias (no o_proj bias), HF rotate-half RoPE, SwiGLU MLP, tied or untied LM head.

Source: transformers ``modeling_qwen2.py`` (Qwen2ForCausalLM), the parity reference in tests;
the conventions and the interface in docs/design.md §11.1.

Params layout (plain nested dict of jnp arrays; matrices keep the HF ``[out, in]`` layout so that
loading needs no transpose and every projection is ``x @ W.T``):

    {"embed":      [V, D],
     "layers":     list of num_layers dicts, each
                     {"input_norm": [D], "q_proj": [H*Dh, D], "q_bias": [H*Dh],
                      "k_proj": [K*Dh, D], "k_bias": [K*Dh], "v_proj": [K*Dh, D], "v_bias": [K*Dh],
                      "o_proj": [D, H*Dh], "post_norm": [D],
                      "gate_proj": [F, D], "up_proj": [F, D], "down_proj": [D, F]},
     "final_norm": [D],
     "lm_head":    [V, D]   (absent when config.tie_word_embeddings)}

Layers are a Python list walked by an unrolled loop: on CPU this was faster than ``lax.scan``
over stacked weights (docs/design.md §12), and slicing a stacked weight per layer would
copy it. Code outside this package must not depend on the per-layer layout; use
`param_logical_axes`, `init_params` and the loading functions instead.

This module holds the params layout, the KV cache and `forward`; the decoder layer (RMSNorm,
RoPE, projections, LoRA's unmerged adapter, rematerialisation) is layers.py, and attention (the
causal / cache rule, the packed prefix-tree rule `TreeMask`) is attention.py.

KV cache: `KVCache` (k, v: [L, B, S, K, Dh]; valid: [B, S] bool). Slots are indexed by write
order, not position: RoPE positions are explicit per token, so left padding, gaps and shared
prefixes work by marking slots invalid.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from strata_jax.config import REMAT_POLICIES
from strata_jax.models.attention import QUERY_CHUNK, TreeMask, attention
from strata_jax.models.config import Qwen2Config
from strata_jax.models.layers import (decoder_layer, post_attention, qkv, remat_layer,
                                      remat_layers, rms_norm, rope_cos_sin, same_structure)
from strata_jax.sharding import constrain, tree_shardings

Params = dict[str, Any]

# Per-layer weights: name -> logical axes (shapes: `layer_shapes`). The model's sharding
# annotation; `sharding.LOGICAL_RULES` maps the names to mesh axes (`param_shardings`).
_LAYER_AXES: dict[str, tuple[str | None, ...]] = {
    "input_norm": ("norm",),
    "q_proj": ("heads", "embed"),
    "q_bias": ("heads",),
    "k_proj": ("kv_heads", "embed"),
    "k_bias": ("kv_heads",),
    "v_proj": ("kv_heads", "embed"),
    "v_bias": ("kv_heads",),
    "o_proj": ("embed", "heads"),
    "post_norm": ("norm",),
    "gate_proj": ("mlp", "embed"),
    "up_proj": ("mlp", "embed"),
    "down_proj": ("embed", "mlp"),
}
# The decoder layer's linear projections (the weights LoRA may adapt and the sampler may
# re-lay out), in the table's order.
LINEAR_PROJECTIONS: tuple[str, ...] = tuple(n for n in _LAYER_AXES if n.endswith("_proj"))


def layer_shapes(config: Qwen2Config) -> dict[str, tuple[int, ...]]:
    """Shape of every per-layer weight (see the module docstring for names)."""
    d, f = config.hidden_size, config.intermediate_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    return {
        "input_norm": (d,), "q_proj": (q, d), "q_bias": (q,), "k_proj": (kv, d),
        "k_bias": (kv,), "v_proj": (kv, d), "v_bias": (kv,), "o_proj": (d, q),
        "post_norm": (d,), "gate_proj": (f, d), "up_proj": (f, d), "down_proj": (d, f),
    }


def param_shapes(config: Qwen2Config) -> Params:
    """The params pytree with shape tuples at the leaves (no arrays allocated)."""
    shapes: Params = {
        "embed": (config.vocab_size, config.hidden_size),
        "layers": [layer_shapes(config) for _ in range(config.num_layers)],
        "final_norm": (config.hidden_size,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head"] = (config.vocab_size, config.hidden_size)
    return shapes


def param_logical_axes(config: Qwen2Config, params: Params | None = None) -> Params:
    """Tree of logical-axes tuples with the structure of the params pytree.

    Consumed by `param_shardings`. With `params`, the lm_head entry follows the params
    (present or not) rather than the config.
    """
    has_head = ("lm_head" in params) if params is not None else not config.tie_word_embeddings
    axes: Params = {
        "embed": ("vocab", "embed"),
        "layers": [dict(_LAYER_AXES) for _ in range(config.num_layers)],
        "final_norm": ("norm",),
    }
    if has_head:
        axes["lm_head"] = ("vocab", "embed")
    return axes


def param_shardings(params: Any, config: Qwen2Config, mesh: Any, rules: Any = None) -> Any:
    """NamedSharding for every leaf of a Qwen2 params pytree (same structure as `params`):
    `param_logical_axes` through `sharding.tree_shardings` (`rules`: override of
    `sharding.LOGICAL_RULES`).

    Args:
      params: the params pytree, or the same tree of ``jax.ShapeDtypeStruct``.
      config: the model's ``Qwen2Config``.
      mesh: the device mesh (`sharding.make_mesh`).
    """
    return tree_shardings(param_logical_axes(config, params), params, mesh, rules)


def shard_params(params: Params, config: Qwen2Config, mesh: Any) -> Params:
    """``jax.device_put`` every leaf with its `param_shardings` sharding."""
    return jax.device_put(params, param_shardings(params, config, mesh))


def init_params(config: Qwen2Config, key: jax.Array, dtype: Any = jnp.float32) -> Params:
    """Random params: N(0, 0.02) matrices, zero biases, unit norm weights (HF's initialiser).

    Args:
      config: model shape. key: PRNG key. dtype: param dtype (float32 or bfloat16).
    Returns: the params pytree described in the module docstring.
    """
    shapes = param_shapes(config)
    leaves, treedef = jax.tree.flatten(shapes, is_leaf=lambda x: isinstance(x, tuple))
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(
        shapes, is_leaf=lambda x: isinstance(x, tuple))[0]]
    keys = jax.random.split(key, len(leaves))
    out = []
    for path, shape, k in zip(paths, leaves, keys):
        if "norm" in path:
            out.append(jnp.ones(shape, dtype))
        elif "bias" in path:
            out.append(jnp.zeros(shape, dtype))
        else:
            out.append((0.02 * jax.random.normal(k, shape, jnp.float32)).astype(dtype))
    return jax.tree.unflatten(treedef, out)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """Key/value cache of every layer.

    Attributes:
      k, v: [num_layers, B, S, num_kv_heads, head_dim], cache dtype (default: param dtype);
        keys are stored after RoPE.
      valid: [B, S] bool; slot s of row b holds a real token written by some forward call.
    Slots are indexed by write order: `forward` writes its T tokens into slots
    [cache_index, cache_index + T) of every row.
    """

    k: jax.Array
    v: jax.Array
    valid: jax.Array

    @property
    def max_len(self) -> int:
        """Number of slots S."""
        return self.valid.shape[1]


def init_cache(config: Qwen2Config, batch: int, max_len: int,
               dtype: Any = jnp.float32) -> KVCache:
    """An empty `KVCache` (zeros, valid all False) for `batch` rows and `max_len` slots."""
    shape = (config.num_layers, batch, max_len, config.num_kv_heads, config.head_dim)
    return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
                   valid=jnp.zeros((batch, max_len), bool))


def forward(params: Params, config: Qwen2Config, tokens: jax.Array, positions: jax.Array,
            mask: jax.Array, cache: KVCache | None = None,
            cache_index: jax.Array | int = 0,
            query_chunk: int = QUERY_CHUNK, remat: str = "none",
            scan_layers: bool = False,
            key_end: jax.Array | None = None, key_index: jax.Array | None = None,
            key_block: int | None = None) -> tuple[jax.Array, KVCache | None]:
    """Run the decoder and return final hidden states (after the final RMSNorm).

    Args:
      params: params pytree (module docstring); float32 or bfloat16.
      config: static, hashable model config.
      tokens: [B, T] int32 token ids.
      positions: [B, T] int32 RoPE position of each token (e.g. cumsum(mask) - 1 for left pad).
      mask: [B, T] bool, True for real tokens.
      cache: optional `KVCache` with S slots. The T new tokens are written into slots
        [cache_index, cache_index + T) of every row, valid[:, those slots] = mask, and the query
        in slot j attends key slots i <= j with valid[b, i]. Without a cache the same rule
        applies over the T tokens themselves.
      cache_index: int32 scalar, may be traced. cache_index + T must be <= S (not checkable
        when traced: ``lax.dynamic_update_slice`` would clamp the start).
      query_chunk: static; attention runs over blocks of this many queries when T is longer,
        each block over the keys up to its causal end (bounds the fp32 score memory of long
        prefills / training sequences and skips the masked half of the scores; same result).
        The default (`QUERY_CHUNK`) is the block size benchmarks/layer_step.py found fastest
        on CPU for the 0.5B shape.
      remat: static; "none" | "full" | "dots" (`strata_jax.config.REMAT_POLICIES`): each
        decoder layer is rematerialised with that policy and recomputed only when its output
        cotangent exists (`layers.remat_layer`), so a backward pass holds one layer's activations plus the layer
        inputs instead of every layer's, and no copy of the weights (same values). Ignored
        with a cache.
      scan_layers: static; with remat, run the layers as a ``lax.scan`` over stacked weights
        instead (`layers.remat_layers`: compiles once per body, much faster on deep models, but
        copies the layer weights on each call). Same values. Layers of different structure
        (LoRA on some layers only) cannot be stacked: they run unrolled as without it.
      key_end: optional [B, T] int32, a packed prefix-tree layout's attention rule
        (training/prefix_tree/, pre-order segments): key k is visible to query q iff
        mask[k] and k <= q < key_end[b, k], i.e. a token sees its own segment causally and all
        of its ancestor segments (`TreeMask`, built per query block: memory as the plain causal
        forward's). positions must then be the layout's (a segment's continue its parent's),
        and every hidden state equals the per-row forward's. Only without a cache.
      key_index: optional [B, ceil(T / query_chunk), A] int32 with key_end, the layout's
        per-query-block visible earlier keys (`TreeMask.index`,
        `prefix_tree.block_key_index`): each block then scores only those A keys and its own
        slots (same values; attention work ~T x (A + query_chunk) instead of ~T^2 / 2).
        key_block: the block size the index was built for; must equal query_chunk.
    Returns:
      hidden [B, T, D] in the param dtype; the updated cache (None without one).
    Raises:
      ValueError: shape mismatches, a static cache_index with cache_index + T > S, an
        unknown remat name, key_end with a cache, key_index without key_end, or a
        key_block other than query_chunk (`attention`).
    """
    if remat not in REMAT_POLICIES:
        raise ValueError(f"remat must be 'none', 'full' or 'dots', got {remat!r}")
    if tokens.ndim != 2 or positions.shape != tokens.shape or mask.shape != tokens.shape:
        raise ValueError(f"tokens, positions, mask must all be [B, T]; got {tokens.shape}, "
                         f"{positions.shape}, {mask.shape}")
    b, t = tokens.shape
    nk, dh = config.num_kv_heads, config.head_dim
    mask = mask.astype(bool)
    x = jnp.take(params["embed"], tokens, axis=0)
    x = constrain(x, ("batch", "length", "embed"))
    cos, sin = rope_cos_sin(positions, dh, config.rope_theta)

    if key_end is not None and (cache is not None or key_end.shape != tokens.shape):
        raise ValueError(f"key_end must be [B, T] = {tokens.shape} and needs cache=None; got "
                         f"{key_end.shape}, cache {'set' if cache is not None else 'None'}")
    if cache is None:
        q_slot = jnp.arange(t)
        key_valid = mask
        key_slot = jnp.arange(t)
    else:
        s = cache.max_len
        if cache.k.shape[:3] != (config.num_layers, b, s):
            raise ValueError(f"cache k {cache.k.shape} does not match L={config.num_layers}, "
                             f"B={b}, S={s}")
        if isinstance(cache_index, int) and cache_index + t > s:
            raise ValueError(f"cache_index {cache_index} + T {t} exceeds cache length {s}")
        # a static index bounds every query's keys (causal), a traced one (decode) does not
        first_slot = cache_index if isinstance(cache_index, int) else None
        cache_index = jnp.asarray(cache_index, jnp.int32)
        zero = jnp.zeros((), jnp.int32)
        key_valid = jax.lax.dynamic_update_slice(cache.valid, mask, (zero, cache_index))
        q_slot = cache_index + jnp.arange(t)
        key_slot = jnp.arange(s)
        cache_k, cache_v = cache.k, cache.v
    if key_index is not None and key_end is None:
        raise ValueError("key_index needs key_end (it indexes the tree rule's keys)")
    if key_end is not None:
        allowed = TreeMask(valid=mask, end=key_end.astype(jnp.int32),
                           index=None if key_index is None else key_index.astype(jnp.int32),
                           block=0 if key_block is None else int(key_block))
    else:
        allowed = key_valid[:, None, :] & (key_slot[None, :] <= q_slot[:, None])[None]

    if cache is None and remat != "none" and scan_layers and same_structure(params["layers"]):
        x = remat_layers(x, params["layers"], cos, sin, allowed, config, query_chunk, remat)
    elif cache is None and remat != "none":
        for layer in params["layers"]:
            x = remat_layer(x, layer, cos, sin, allowed, config, query_chunk, remat)
    elif cache is None:
        for layer in params["layers"]:
            x = decoder_layer(x, layer, cos, sin, allowed, config, query_chunk)
    else:
        for i, layer in enumerate(params["layers"]):
            q, k, v = qkv(x, layer, cos, sin, config)
            idx = (jnp.int32(i), zero, cache_index, zero, zero)
            cache_k = jax.lax.dynamic_update_slice(cache_k, k[None].astype(cache_k.dtype), idx)
            cache_v = jax.lax.dynamic_update_slice(cache_v, v[None].astype(cache_v.dtype), idx)
            attn = attention(q, cache_k[i], cache_v[i], allowed, nk, query_chunk, first_slot)
            x = post_attention(x, attn, layer, config)

    hidden = rms_norm(x, params["final_norm"], config.rms_norm_eps)
    new_cache = None
    if cache is not None:
        new_cache = KVCache(k=cache_k, v=cache_v, valid=key_valid)
    return hidden, new_cache
