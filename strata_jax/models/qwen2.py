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

KV cache: `KVCache` (k, v: [L, B, S, K, Dh]; valid: [B, S] bool). Slots are indexed by write
order, not position: RoPE positions are explicit per token, so left padding, gaps and shared
prefixes work by marking slots invalid.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from strata_jax.models.config import Qwen2Config
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
    [out, in], which LoRA, loading, export and sharding rely on); `_linear` and the LM head
    dispatch on the type, so the same `forward` runs either copy.
    """

    w: jax.Array


def _linear(x: jax.Array, w: jax.Array | LoraWeight | InOutWeight,
            b: jax.Array | None = None) -> jax.Array:
    if isinstance(w, InOutWeight):
        y = jnp.einsum("btd,df->btf", x, w.w)
    elif isinstance(w, LoraWeight):
        y = jnp.einsum("btd,fd->btf", x, w.w)
        low = jnp.einsum("btd,rd->btr", x, w.a.astype(x.dtype))
        y = y + (w.scale * jnp.einsum("btr,fr->btf", low, w.b.astype(x.dtype))).astype(y.dtype)
    else:
        y = jnp.einsum("btd,fd->btf", x, w)
    return y if b is None else y + b


def _attention_block(q: jax.Array, k: jax.Array, v: jax.Array,
                     allowed: jax.Array) -> jax.Array:
    """Grouped-query attention of q [B,K,G,T,Dh] over k, v [B,S,K,Dh] with allowed [B,T,S].

    Returns [B,K,G,T,Dh] in q.dtype. q is head-major (the scores' layout, so neither einsum
    transposes its output); k, v stay in the KV cache's layout (transposing them would copy the
    cache every decode step).
    """
    dh = q.shape[-1]
    scores = jnp.einsum("bkgth,bskh->bkgts", q, k.astype(q.dtype),
                        preferred_element_type=jnp.float32) * (dh ** -0.5)
    scores = jnp.where(allowed[:, None, None, :, :], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    return jnp.einsum("bkgts,bskh->bkgth", probs, v.astype(q.dtype))


# Queries per attention block (`forward`'s query_chunk default, and the block a packed layout's
# host key index is built for, training/prefix_tree.py): the two must agree, so both read this.
QUERY_CHUNK = 128


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TreeMask:
    """The prefix-tree attention rule of a packed layout (training/prefix_tree.py), kept as
    two per-key vectors instead of a [B, T, S] mask, optionally with a per-block key index.

    Attributes: valid [B, S] bool (real key), end [B, S] int32 (exclusive end slot of the
    key's segment subtree in pre-order). Key slot k is visible to query slot q iff
    valid[k] and k <= q < end[k]: a query sees its own segment causally and every token of
    its ancestor segments. `_attention` builds the block of the rule inside each
    (rematerialised) query block, so no [B, T, S] array exists.

    index: optional [B, nblocks, A] int32 (`prefix_tree.block_key_index`): for query block j
    (slots [j * block, (j + 1) * block)), the key slots before the block that its queries may
    see, i.e. {k < j * block : valid[k] and end[k] > j * block} (the segments still open at
    the block's start: its ancestor chain), ascending, -1 padding. With it a block attends
    to those A keys plus its own slots instead of every key up to its end, the same values
    (every other key's probability is exactly 0 under the rule). block: static, the query
    block the index was built for; `_attention` raises ValueError unless it equals its
    query_chunk (another block size would read another block's ancestors).
    """

    valid: jax.Array
    end: jax.Array
    index: jax.Array | None = None
    block: int = dataclasses.field(metadata=dict(static=True), default=0)


def _block_mask(allowed: jax.Array | TreeMask, q0: int, q1: int, s: int) -> jax.Array:
    """allowed[:, q0:q1, :s] of a dense mask, or that block of a `TreeMask`'s rule (query
    slots q0..q1-1 are the block's, slots counted from 0: no cache)."""
    if not isinstance(allowed, TreeMask):
        return allowed[:, q0:q1, :s]
    q_slot = jnp.arange(q0, q1)[None, :, None]
    k_slot = jnp.arange(s)[None, None, :]
    return (allowed.valid[:, None, :s] & (k_slot <= q_slot)
            & (q_slot < allowed.end[:, None, :s]))


def _mask_block_attention(q: jax.Array, k: jax.Array, v: jax.Array,
                          allowed: jax.Array | TreeMask, q0: int) -> jax.Array:
    """`_attention_block` of the queries q [B,K,G,Tq,Dh] in slots q0.. over k, v [B,S,K,Dh],
    the block's mask cut (dense) or built (`TreeMask`) here, inside the caller's
    checkpoint, so the backward pass keeps only the O(S) inputs of the rule."""
    return _attention_block(q, k, v, _block_mask(allowed, q0, q0 + q.shape[3], k.shape[1]))


def _sparse_block_attention(q: jax.Array, k: jax.Array, v: jax.Array, valid: jax.Array,
                            end: jax.Array, idx: jax.Array, q0: jax.Array) -> jax.Array:
    """`_attention_block` of the queries q [B,K,G,C,Dh] in slots q0..q0+C-1 (q0 int32, may be
    traced) over only the keys they can see under the tree rule: the A keys idx [B, A] int32
    (the block's row of ``TreeMask.index``, -1 padding; gathered from k, v [B,S,K,Dh]) and the
    block's own C slots; valid [B,S] bool and end [B,S] int32 are the `TreeMask`'s. Scores are
    [.., C, A + C] instead of [.., C, q0 + C]. The gather runs here, inside the caller's
    checkpoint, so the backward pass keeps only k, v and the O(S) rule (memory as the dense
    rule's); its gradient is autodiff's scatter-add of the gathered keys' cotangents. Same
    values as the dense rule: the same visible keys, whose scores and softmax are computed the
    same way; the keys left out would get probability exactly 0 (a padding query sees no key
    either way and gets a uniform, finite, never read distribution)."""
    c = q.shape[3]
    rows = jnp.arange(idx.shape[0])[:, None]
    safe = jnp.maximum(idx, 0)                                 # -1 padding: slot 0, masked
    own = q0 + jnp.arange(c)
    cut = lambda x: jax.lax.dynamic_slice_in_dim(x, q0, c, axis=1)  # noqa: E731  the own slots
    slot = jnp.concatenate([safe, jnp.broadcast_to(own, (idx.shape[0], c))], axis=1)
    ok = jnp.concatenate([valid[rows, safe] & (idx >= 0), cut(valid)], axis=1)
    ends = jnp.concatenate([end[rows, safe], cut(end)], axis=1)
    kk = jnp.concatenate([k[rows, safe], cut(k)], axis=1)
    vv = jnp.concatenate([v[rows, safe], cut(v)], axis=1)
    q_slot = own[None, :, None]
    allowed = ok[:, None, :] & (slot[:, None, :] <= q_slot) & (q_slot < ends[:, None, :])
    return _attention_block(q, kk, vv, allowed)


def _tree_attention(q: jax.Array, k: jax.Array, v: jax.Array, tree: TreeMask) -> jax.Array:
    """Block-sparse tree attention of q [B,K,G,T,Dh] over k, v [B,T,K,Dh] under a `TreeMask`
    with an index: every query block of tree.block slots attends its A indexed earlier keys
    and its own slots (`_sparse_block_attention`), the blocks as one ``lax.map`` over a
    checkpointed body. Returns [B,K,G,T,Dh] in q.dtype.

    Why a loop and not one unrolled block per query block: a packed row has W / block blocks
    (16 at W = 2048) in every layer, and unrolled they multiply the forward's and backward's
    program by that count, so XLA's compile time and the compiler's own memory (the process's
    peak on CPU) grew with the packed width. As a loop the program holds one block whatever W.
    Every block uses the index, the first ones too (whose causal slice would be at most as
    large): the same visible keys, so the same values up to float summation order. T is padded
    to whole blocks (padding queries see no key; their rows are cut off). tree.index must be
    [B, ceil(T / tree.block), A] (`_attention` checks it and raises ValueError). Source: the
    tree rule of design.md §12.1; the per-block gather as `_sparse_block_attention`."""
    b, kh, g, t, dh = q.shape
    c = tree.block
    nb = -(-t // c)
    pad = nb * c - t
    valid, end = tree.valid, tree.end
    if pad:
        q = jnp.pad(q, ((0, 0),) * 3 + ((0, pad), (0, 0)))
        k, v = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) for x in (k, v))
        valid, end = jnp.pad(valid, ((0, 0), (0, pad))), jnp.pad(end, ((0, 0), (0, pad)))
    blocks = q.reshape(b, kh, g, nb, c, dh).transpose(3, 0, 1, 2, 4, 5)   # [nb, B,K,G,C,Dh]
    index = tree.index.transpose(1, 0, 2)                                # [nb, B, A]
    starts = jnp.arange(nb, dtype=jnp.int32) * c

    @jax.checkpoint
    def one(xs):
        qj, idx, q0 = xs
        return _sparse_block_attention(qj, k, v, valid, end, idx, q0)

    out = jax.lax.map(one, (blocks, index, starts))                      # [nb, B,K,G,C,Dh]
    out = out.transpose(1, 2, 3, 0, 4, 5).reshape(b, kh, g, nb * c, dh)
    return out[:, :, :, :t]


def _attention(q: jax.Array, k: jax.Array, v: jax.Array, allowed: jax.Array | TreeMask,
               num_kv_heads: int, query_chunk: int, first_slot: int | None = None) -> jax.Array:
    """Grouped-query attention. q [B,T,H,Dh]; k, v [B,S,K,Dh]; allowed [B,T,S] bool, or a
    `TreeMask` (no cache: first_slot 0), whose rule is built per query block.

    Returns [B, T, H*Dh] in q.dtype. Scores and softmax in fp32; a row with no allowed key gets
    a uniform (finite) distribution instead of NaN. When T > query_chunk, queries are processed
    in blocks of query_chunk, each rematerialised in the backward pass (``jax.checkpoint``), so
    the fp32 scores held at once are B x H x query_chunk x S rather than B x H x T x S.

    first_slot: static slot of the first query when known (0 without a cache, the static
    cache_index of a prefill), None when traced (decode). The causal rule never lets query slot
    j see a key slot > j, so a block of queries ending at slot e attends keys [0, e] only: the
    causal half of the scores is never computed (the same values: a skipped key's probability
    underflows to exactly 0 when the query has any allowed key; a query with none, a padding
    slot, gets a uniform distribution over fewer keys, still finite and never read). Skipping
    the causal half roughly halves attention's forward + backward against blocks over every key
    (benchmarks/layer_step.py times it beside torch's fused attention).

    A `TreeMask` with an index (block-sparse tree attention) goes further: block j scores only
    its A indexed earlier keys and its own slots (`_sparse_block_attention`) whenever
    (`_tree_attention`: the blocks as one loop), so a packed row's attention grows as
    T x (A + query_chunk) instead of T^2 / 2 (the keys of unrelated subtrees are never
    scored). Raises ValueError when the index's block is not
    query_chunk or its shape is not [B, ceil(T / query_chunk), A].
    Source: HF transformers Qwen2 attention (repeat_kv + eager softmax attention), same values.
    """
    b, t, h, dh = q.shape
    g = h // num_kv_heads
    q = q.reshape(b, t, num_kv_heads, g, dh).transpose(0, 2, 3, 1, 4)   # [B, K, G, T, Dh]

    def keys(end: int) -> int:
        """Key slots a block of queries [.., end) may see: up to its causal end, else all."""
        return k.shape[1] if first_slot is None else min(k.shape[1], first_slot + end)

    tree = allowed if isinstance(allowed, TreeMask) else None
    if tree is not None and first_slot != 0:
        raise ValueError("a TreeMask is the rule of a packed forward without a cache")
    if tree is not None and tree.index is not None:
        nblocks = -(-t // query_chunk)
        if tree.block != query_chunk:
            raise ValueError(f"the tree key index was built for query blocks of {tree.block} "
                             f"slots but attention runs blocks of query_chunk={query_chunk}; "
                             "build it with block=query_chunk")
        if tree.index.shape[:2] != (b, nblocks):
            raise ValueError(f"tree key index must be [B, nblocks, A] = [{b}, {nblocks}, A] for "
                             f"T={t}, query_chunk={query_chunk}; got {tree.index.shape}")
    if t <= query_chunk:
        s = keys(t)
        out = _mask_block_attention(q, k[:, :s], v[:, :s], allowed, 0)
    elif tree is not None and tree.index is not None:
        out = _tree_attention(q, k, v, tree)
    else:
        block = jax.checkpoint(_mask_block_attention, static_argnums=(4,))
        outs = []
        for i in range(0, t, query_chunk):
            e = min(t, i + query_chunk)
            s = keys(e)
            part = allowed if tree is not None else allowed[:, i:e, :s]
            outs.append(block(q[:, :, :, i:e], k[:, :s], v[:, :s], part,
                              i if tree is not None else 0))
        out = jnp.concatenate(outs, axis=3)
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, h * dh)


# jax.checkpoint policy per TrainConfig.remat name ("none" = no checkpoint). "full" keeps only
# each decoder layer's input and recomputes the layer in the backward pass; "dots" also keeps the
# weight-matmul outputs (no batch dims: q/k/v/o, gate/up/down, LoRA's x @ A) and recomputes the
# cheap elementwise work (maxtext's usual policy).
REMAT_POLICIES = {"full": jax.checkpoint_policies.nothing_saveable,
                  "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}


def _qkv(x: jax.Array, layer: Params, cos: jax.Array, sin: jax.Array,
         config: Qwen2Config) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q [B,T,H,Dh], k, v [B,T,K,Dh] of one layer's input x (input RMSNorm, biases, RoPE on q/k)."""
    b, t, _ = x.shape
    nh, nk, dh = config.num_heads, config.num_kv_heads, config.head_dim
    h = rms_norm(x, layer["input_norm"], config.rms_norm_eps)
    if "qkv_proj" in layer:   # fused inference copy (prepare_sampler_params): one matmul
        qkv = _linear(h, layer["qkv_proj"], layer["qkv_bias"])
        q, k, v = jnp.split(qkv, [nh * dh, (nh + nk) * dh], axis=-1)
        q, k, v = q.reshape(b, t, nh, dh), k.reshape(b, t, nk, dh), v.reshape(b, t, nk, dh)
    else:
        q = _linear(h, layer["q_proj"], layer["q_bias"]).reshape(b, t, nh, dh)
        k = _linear(h, layer["k_proj"], layer["k_bias"]).reshape(b, t, nk, dh)
        v = _linear(h, layer["v_proj"], layer["v_bias"]).reshape(b, t, nk, dh)
    q = constrain(apply_rope(q, cos, sin), ("batch", "length", "heads", "head_dim"))
    k = constrain(apply_rope(k, cos, sin), ("batch", "length", "kv_heads", "head_dim"))
    v = constrain(v, ("batch", "length", "kv_heads", "head_dim"))
    return q, k, v


def _post_attention(x: jax.Array, attn: jax.Array, layer: Params,
                    config: Qwen2Config) -> jax.Array:
    """The rest of a decoder layer: residual + o_proj(attn), then residual + SwiGLU MLP."""
    x = constrain(x + _linear(attn, layer["o_proj"]), ("batch", "length", "embed"))
    h = rms_norm(x, layer["post_norm"], config.rms_norm_eps)
    if "gate_up_proj" in layer:   # fused inference copy (prepare_sampler_params)
        gate, up = jnp.split(_linear(h, layer["gate_up_proj"]), 2, axis=-1)
    else:
        gate = _linear(h, layer["gate_proj"])
        up = _linear(h, layer["up_proj"])
    gate = constrain(gate, ("batch", "length", "mlp"))
    up = constrain(up, ("batch", "length", "mlp"))
    x = x + _linear(jax.nn.silu(gate) * up, layer["down_proj"])
    return constrain(x, ("batch", "length", "embed"))


def _decoder_layer(x: jax.Array, layer: Params, cos: jax.Array, sin: jax.Array,
                   allowed: jax.Array, config: Qwen2Config, query_chunk: int) -> jax.Array:
    """One decoder layer without a KV cache (the unit `forward` rematerialises)."""
    q, k, v = _qkv(x, layer, cos, sin, config)
    attn = _attention(q, k, v, allowed, config.num_kv_heads, query_chunk, first_slot=0)
    return _post_attention(x, attn, layer, config)


def _remat_layer(x: jax.Array, layer: Params, cos: jax.Array, sin: jax.Array,
                 allowed: jax.Array, config: Qwen2Config, query_chunk: int,
                 remat: str) -> jax.Array:
    """One decoder layer, rematerialised in the backward pass with the ``remat`` policy and
    recomputed only once the layer above has produced its cotangent (same values as
    `_decoder_layer`).

    Args: x [B, T, D] layer input; layer: one layer's params (arrays or `LoraWeight`s); cos,
    sin [B, T, Dh] f32 RoPE tables; allowed [B, T, T] bool or a `TreeMask`; static config,
    query_chunk, remat ("full" | "dots", `REMAT_POLICIES`). Returns [B, T, D] in x's dtype. Differentiable in x and
    layer (the RoPE tables and the mask get no cotangent).

    ``jax.checkpoint`` alone is not enough on XLA's CPU backend: a recomputation reads only the
    saved layer input, so the scheduler is free to hoist every layer's recomputation to the
    start of the backward pass, and all layers' activations were live at once (per-layer remat
    saved nothing in XLA's memory analysis of the 0.5B step). An ``optimization_barrier`` does
    not survive the CPU pipeline, so the backward (`_remat_layer_bwd`) adds ``0 * ct[:, :, :1]``
    to the saved activations instead: a real data dependency on the cotangent. A ``lax.scan``
    over stacked layers orders the recomputation too, but stacking copies every layer weight
    on each call (1.4 GB for the fp32 0.5B; a frozen LoRA base included).
    """
    return _decoder_layer(x, layer, cos, sin, allowed, config, query_chunk)


def _remat_layer_fwd(x, layer, cos, sin, allowed, config, query_chunk, remat):
    """Forward: the layer linearised under ``jax.checkpoint(policy)``; the residual is its
    pullback (what the policy saved) and x's leading [B, T]."""
    body = jax.checkpoint(_decoder_layer, policy=REMAT_POLICIES[remat], static_argnums=(5, 6))
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


_remat_layer = jax.custom_vjp(_remat_layer, nondiff_argnums=(5, 6, 7))
_remat_layer.defvjp(_remat_layer_fwd, _remat_layer_bwd)


def _same_structure(layers: list[Params]) -> bool:
    """True when every layer dict has the same pytree structure and leaf shapes (stackable)."""
    first = jax.tree.structure(layers[0])
    shapes = [x.shape for x in jax.tree.leaves(layers[0])]
    return all(jax.tree.structure(layer) == first
               and [x.shape for x in jax.tree.leaves(layer)] == shapes for layer in layers[1:])


def _remat_layers(x: jax.Array, layers: list[Params], cos: jax.Array, sin: jax.Array,
                  allowed: jax.Array, config: Qwen2Config, query_chunk: int,
                  remat: str) -> jax.Array:
    """The decoder layers as a ``lax.scan`` over stacked weights with a checkpointed body
    (``forward(scan_layers=True)``; same values as `_remat_layer` per layer).

    The scan's backward loop recomputes one layer per iteration (layer inputs [L, B, T, D] plus
    one layer's activations), and the body compiles once, so deep models compile much faster
    than the unrolled layers; the price is a stacked copy of every layer weight on each call
    (all of the layer weights, a frozen LoRA base included).
    """
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *layers)
    body = jax.checkpoint(_decoder_layer, policy=REMAT_POLICIES[remat], static_argnums=(5, 6))

    def step(h, layer):
        return body(h, layer, cos, sin, allowed, config, query_chunk), None

    x, _ = jax.lax.scan(step, x, stacked)
    return x


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
      remat: static; "none" | "full" | "dots" (`REMAT_POLICIES`): each decoder layer is
        rematerialised with that policy and recomputed only when its output cotangent exists
        (`_remat_layer`), so a backward pass holds one layer's activations plus the layer
        inputs instead of every layer's, and no copy of the weights (same values). Ignored
        with a cache.
      scan_layers: static; with remat, run the layers as a ``lax.scan`` over stacked weights
        instead (`_remat_layers`: compiles once per body, much faster on deep models, but
        copies the layer weights on each call). Same values. Layers of different structure
        (LoRA on some layers only) cannot be stacked: they run unrolled as without it.
      key_end: optional [B, T] int32, a packed prefix-tree layout's attention rule
        (training/prefix_tree.py, pre-order segments): key k is visible to query q iff
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
        key_block other than query_chunk (`_attention`).
    """
    if remat != "none" and remat not in REMAT_POLICIES:
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

    if cache is None and remat != "none" and scan_layers and _same_structure(params["layers"]):
        x = _remat_layers(x, params["layers"], cos, sin, allowed, config, query_chunk, remat)
    elif cache is None and remat != "none":
        for layer in params["layers"]:
            x = _remat_layer(x, layer, cos, sin, allowed, config, query_chunk, remat)
    elif cache is None:
        for layer in params["layers"]:
            x = _decoder_layer(x, layer, cos, sin, allowed, config, query_chunk)
    else:
        for i, layer in enumerate(params["layers"]):
            q, k, v = _qkv(x, layer, cos, sin, config)
            idx = (jnp.int32(i), zero, cache_index, zero, zero)
            cache_k = jax.lax.dynamic_update_slice(cache_k, k[None].astype(cache_k.dtype), idx)
            cache_v = jax.lax.dynamic_update_slice(cache_v, v[None].astype(cache_v.dtype), idx)
            attn = _attention(q, cache_k[i], cache_v[i], allowed, nk, query_chunk, first_slot)
            x = _post_attention(x, attn, layer, config)

    hidden = rms_norm(x, params["final_norm"], config.rms_norm_eps)
    new_cache = None
    if cache is not None:
        new_cache = KVCache(k=cache_k, v=cache_v, valid=key_valid)
    return hidden, new_cache
