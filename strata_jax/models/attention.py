"""Grouped-query attention of the Qwen2 decoder (plain JAX): the dense causal / cache rule,
query blocks rematerialised one at a time, and the prefix-tree rule of a packed layout
(`TreeMask`, training/prefix_tree/) in its dense-per-block and block-sparse forms.

Source: HF transformers Qwen2 attention (repeat_kv + eager softmax attention), same values;
the tree rule of docs/design.md §12.1. Used by `layers.decoder_layer` and `qwen2.forward`.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


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
# host key index is built for, training/prefix_tree/): the two must agree, so both read this.
QUERY_CHUNK = 128


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TreeMask:
    """The prefix-tree attention rule of a packed layout (training/prefix_tree/), kept as
    two per-key vectors instead of a [B, T, S] mask, optionally with a per-block key index.

    Attributes: valid [B, S] bool (real key), end [B, S] int32 (exclusive end slot of the
    key's segment subtree in pre-order). Key slot k is visible to query slot q iff
    valid[k] and k <= q < end[k]: a query sees its own segment causally and every token of
    its ancestor segments. `attention` builds the block of the rule inside each
    (rematerialised) query block, so no [B, T, S] array exists.

    index: optional [B, nblocks, A] int32 (`prefix_tree.block_key_index`): for query block j
    (slots [j * block, (j + 1) * block)), the key slots before the block that its queries may
    see, i.e. {k < j * block : valid[k] and end[k] > j * block} (the segments still open at
    the block's start: its ancestor chain), ascending, -1 padding. With it a block attends
    to those A keys plus its own slots instead of every key up to its end, the same values
    (every other key's probability is exactly 0 under the rule). block: static, the query
    block the index was built for; `attention` raises ValueError unless it equals its
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
    [B, ceil(T / tree.block), A] (`attention` checks it and raises ValueError). Source: the
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


def attention(q: jax.Array, k: jax.Array, v: jax.Array, allowed: jax.Array | TreeMask,
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


__all__ = ["QUERY_CHUNK", "TreeMask", "attention"]
