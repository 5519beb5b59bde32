"""Run the decoder over prompt ++ response and score the response tokens.

A `SampleBatch` row holds a LEFT-padded prompt [Tp] and a RIGHT-padded response [Tr]; their
concatenation has pads only at both ends, so RoPE positions are ``cumsum(mask) - 1`` and the
state at concatenated column Tp - 1 + j predicts response token j. Logprobs / entropies are
computed by ``token_logprobs_and_entropy`` on the response span only, in chunks (never
B x T x V logits). Used by the old-logprob pass (pi_old is the trainer's own recomputation at the
train temperature, docs/method.md §9.1), the reference pass and the loss.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from strata_jax.models import QUERY_CHUNK, Qwen2Config, forward, token_logprobs_and_entropy

Params = dict[str, Any]


def sequence_inputs(prompt_ids: jax.Array, prompt_mask: jax.Array, response_ids: jax.Array,
                    response_mask: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """tokens, mask, positions [B, Tp + Tr] (int32, bool, int32) of prompt ++ response.

    Positions count real tokens only (cumsum(mask) - 1, clipped at 0), so left padding and the
    response's right padding take no RoPE positions (per-row positions, docs/design.md §11.1).
    """
    tokens = jnp.concatenate([prompt_ids, response_ids], axis=1).astype(jnp.int32)
    mask = jnp.concatenate([prompt_mask, response_mask], axis=1).astype(bool)
    positions = jnp.maximum(jnp.cumsum(mask.astype(jnp.int32), axis=1) - 1, 0)
    return tokens, mask, positions


def cast_params(params: Params, dtype: str) -> Params:
    """Floating leaves cast to `dtype` ("float32" | "bfloat16"); gradients flow through the cast."""
    dt = jnp.bfloat16 if dtype == "bfloat16" else jnp.float32
    return jax.tree.map(lambda p: p.astype(dt) if jnp.issubdtype(p.dtype, jnp.floating) else p,
                        params)


def response_states(params: Params, model: Qwen2Config, prompt_ids: jax.Array,
                    prompt_mask: jax.Array, response_ids: jax.Array, response_mask: jax.Array,
                    *, remat: str = "none", compute_dtype: str = "float32",
                    scan_layers: bool = False) -> tuple[jax.Array, jax.Array]:
    """Hidden states that score the response, and the state at the last response token.

    Args:
      params, model: the decoder. prompt_ids/prompt_mask [B, Tp] (left-padded),
      response_ids/response_mask [B, Tr] (right-padded); remat: "none" | "full" | "dots"
      (per decoder layer, `qwen2.forward`); scan_layers: those layers as a scan over stacked
      weights (`qwen2.forward`);
      compute_dtype: params are cast to it for the forward.
    Returns:
      hidden [B, Tr, D]: hidden[:, j] is the state whose next-token distribution scores
        response token j (concatenated column Tp - 1 + j).
      last [B, D] f32: h_t = final hidden state at the last response token (column
        Tp - 1 + n_b, n_b = response length of row b; the last prompt token when n_b = 0).
        This is where the value head reads (docs/method.md §7.1).
    """
    p = cast_params(params, compute_dtype)
    tokens, mask, positions = sequence_inputs(prompt_ids, prompt_mask, response_ids, response_mask)
    hidden, _ = forward(p, model, tokens, positions, mask, remat=remat,
                        scan_layers=scan_layers)
    tp, tr = prompt_ids.shape[1], response_ids.shape[1]
    resp = jax.lax.slice_in_dim(hidden, tp - 1, tp - 1 + tr, axis=1)
    n = jnp.sum(response_mask.astype(jnp.int32), axis=1)
    last = jnp.take_along_axis(hidden, (tp - 1 + n)[:, None, None], axis=1)[:, 0]
    return resp, last.astype(jnp.float32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PackedInputs:
    """One packed micro-batch of a prefix-tree layout, as device arrays
    (`prefix_tree.packed_micro_batches` builds them on the host).

    Attributes: tokens, positions [P, W] int32, mask [P, W] bool, key_end [P, W] int32 (the
    packed rows and their attention rule, `qwen2.forward`); score_index [m, Tr] int32 (flat
    packed index p * W + c of the state that scores response column j of micro-batch row i);
    last_index [m] int32 (flat packed index of row i's last real token); key_index
    optional [P, ceil(W / block), A] int32 (`prefix_tree.block_key_index`: each query block's
    visible earlier keys, for the block-sparse attention; None: the dense tree rule);
    response_slot optional [S, n] int32 (flat index i * Tr + j of each real response token,
    m * Tr for padding: `response_logprobs` runs the LM head on those positions only; None: on
    all m x Tr); old_slot optional [S, n] int32, response_slot without the rows whose pi_old
    comes from elsewhere (replayed rows: `prefix_tree.slots_without_rows`), the head's
    positions of the old-logprob pass (None: response_slot); block (static) the query block the
    key index was built for, the forward's query_chunk.
    """

    tokens: jax.Array
    positions: jax.Array
    mask: jax.Array
    key_end: jax.Array
    score_index: jax.Array
    last_index: jax.Array
    key_index: jax.Array | None = None
    response_slot: jax.Array | None = None
    old_slot: jax.Array | None = None
    block: int = dataclasses.field(metadata=dict(static=True), default=0)


def packed_response_states(params: Params, model: Qwen2Config, packed: PackedInputs, *,
                           remat: str = "none", compute_dtype: str = "float32",
                           scan_layers: bool = False,
                           query_chunk: int | None = None) -> tuple[jax.Array, jax.Array]:
    """`response_states` of the original rows, computed over a prefix-tree packed layout
    (`training.prefix_tree`): each shared prefix is run once.

    Args:
      params, model, remat, compute_dtype, scan_layers: as `response_states`; query_chunk:
        static queries per attention block (`qwen2.forward`; bounds the fp32 scores held at
        once to P x H x query_chunk x W); None: packed.block when it carries a key index
        (the block it was built for), else `QUERY_CHUNK`.
      packed: `PackedInputs` (the packed rows, `qwen2.forward` with key_end: a token sees
        its own segment causally and all of its ancestor segments; with key_index each
        query block scores only the keys it can see; the gather indices).
    Raises: ValueError (from `qwen2.forward`) when query_chunk is given and differs from the
      block packed.key_index was built for.
    Returns: (hidden [m, Tr, D] in the compute dtype, last [m, D] f32), the values
      `response_states` returns for the same rows (float round-off aside: different matmul
      shapes sum in a different order). Gradients flow through the gathers: a shared prefix
      state gets the sum of the cotangents of every row that reads it.
    """
    p = cast_params(params, compute_dtype)
    if query_chunk is None:
        query_chunk = packed.block if packed.key_index is not None else QUERY_CHUNK
    hidden, _ = forward(p, model, packed.tokens.astype(jnp.int32),
                        packed.positions.astype(jnp.int32), packed.mask.astype(bool),
                        remat=remat, scan_layers=scan_layers, key_end=packed.key_end,
                        key_index=packed.key_index, key_block=packed.block,
                        query_chunk=query_chunk)
    flat = hidden.reshape((-1, hidden.shape[-1]))
    resp = jnp.take(flat, packed.score_index, axis=0)
    last = jnp.take(flat, packed.last_index, axis=0)
    return resp, last.astype(jnp.float32)


def response_logprobs(params: Params, model: Qwen2Config, hidden: jax.Array,
                      response_ids: jax.Array, response_mask: jax.Array, *,
                      temperature: float = 1.0, chunk_size: int = 64,
                      compute_dtype: str = "float32",
                      slots: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Per-token logprob and entropy [B, Tr] f32 of the response tokens (0 off the mask).

    logprob = log_softmax(logits / temperature)[token] (no top-p / top-k renormalisation,
    docs/method.md §9.1); chunked over Tr by `token_logprobs_and_entropy` (chunk_size
    positions of each of the B rows per chunk).

    hidden [B, Tr, D] (`response_states`), response_ids / response_mask [B, Tr].
    slots: optional [S, n] int32 flat indices b * Tr + j of the positions to score (the real
    response tokens, `PackedInputs.response_slot`), B * Tr for padding entries: the LM head
    (a [D, V] matmul per position, V ~ 152k, the largest per-position cost of the update)
    then runs on S x n positions, chunked over n, instead of on all B x Tr, and the results
    are scattered back; positions not listed (all off the mask) are 0. Same values per
    position (each position's logits depend on its own state only). A chunk of padding
    entries only skips the head (`token_logprobs_and_entropy`'s live), so n may be padded to
    a fixed size for free.
    """
    p = cast_params(params, compute_dtype)
    ids = response_ids.astype(jnp.int32)
    m = response_mask.astype(bool)
    if slots is None:
        lp, ent = token_logprobs_and_entropy(p, model, hidden, ids, temperature=temperature,
                                             chunk_size=chunk_size)
        return jnp.where(m, lp, 0.0), jnp.where(m, ent, 0.0)
    b, t, d = hidden.shape
    safe = jnp.minimum(slots, b * t - 1)       # padding entries read a real slot, then drop
    h = jnp.take(hidden.reshape(b * t, d), safe, axis=0)
    lp, ent = token_logprobs_and_entropy(p, model, h, jnp.take(ids.reshape(-1), safe),
                                         temperature=temperature, chunk_size=chunk_size,
                                         live=slots < b * t)
    flat = slots.reshape(-1)

    def scatter(x):
        out = jnp.zeros((b * t,), jnp.float32).at[flat].set(x.reshape(-1), mode="drop")
        return out.reshape(b, t)

    return jnp.where(m, scatter(lp), 0.0), jnp.where(m, scatter(ent), 0.0)
