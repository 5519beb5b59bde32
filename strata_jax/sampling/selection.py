"""Next-token selection from full-vocabulary logits: greedy, temperature, top-k, top-p.

Everything here is jit-friendly and works on ``logits [B, V] float32`` with one PRNG key per
row. It avoids sorting the vocabulary: on a CPU, sorting or ``lax.top_k`` over V = 151936 per
row and step costs more than the model's whole decode step. Instead

- the top-k / top-p thresholds are found by bisection over the float's bit pattern (32 passes
  of a count or masked sum, each as cheap as a max over the vocabulary), which gives exactly
  the threshold a sort would give;
- sampling draws a block of 128 ids by its total mass, then an id inside the block: exact
  categorical sampling with two uniforms per row, instead of V Gumbel draws;
- argmax takes the max per block of 128, then inside the winning block (XLA's variadic
  argmax reduce is slow on CPU).

Ordering follows transformers' logits processors: temperature, then top-k, then top-p (mass
measured after the top-k cut). Reported logprobs are ``log_softmax(logits / T)`` of the chosen
id over the FULL vocabulary (before the cuts), T = 1 for greedy (docs/method.md §9.1).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

BLOCK = 128  # ids per sampling / argmax block


def _sortable_int(x: jax.Array) -> jax.Array:
    """Map float32 to int32 so that integer order equals float order (``-0 < +0``)."""
    bits = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
    return jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)


def _floor_mid(lo: jax.Array, hi: jax.Array) -> jax.Array:
    """floor((lo + hi) / 2) for int32 without overflow."""
    return (lo >> 1) + (hi >> 1) + (lo & hi & 1)


def _bisect_threshold(keys: jax.Array, ok, lo: jax.Array, hi: jax.Array) -> jax.Array:
    """Largest int32 ``t`` in ``[lo, hi)`` with ``ok(t)`` true, for a monotone predicate.

    Invariant: ``ok(lo)`` holds, ``ok(hi)`` does not. 32 halvings cover the int32 range.
    keys: unused here except for documentation of the per-row shape; lo, hi: [B] int32.
    """
    del keys

    def body(_, carry):
        lo, hi = carry
        mid = _floor_mid(lo, hi)
        # mid == lo once converged; then neither bound moves.
        good = ok(mid)
        return jnp.where(good, mid, lo), jnp.where(good, hi, mid)

    lo, _ = lax.fori_loop(0, 32, body, (lo, hi))
    return lo


def top_k_mask(scaled: jax.Array, top_k: jax.Array) -> jax.Array:
    """Mask of the ``top_k`` largest entries per row (ties at the k-th value all kept).

    Args:
      scaled: [B, V] float32 (finite or -inf) logits.
      top_k: int32 scalar or [B], 1 <= top_k; values >= V keep everything.
    Returns:
      [B, V] bool.
    """
    v = scaled.shape[-1]
    k = jnp.clip(jnp.broadcast_to(jnp.asarray(top_k, jnp.int32), scaled.shape[:1]), 1, v)
    key = _sortable_int(scaled)
    lo = jnp.min(key, axis=-1)  # count(key >= lo) == V >= k
    hi = jnp.max(key, axis=-1)
    # ok(hi) holds too when k == 1 or at ties; search [lo, hi + 1) then (hi + 1 never ok since
    # no entry exceeds hi). hi < int32 max because the largest logit is a finite float.

    def ok(t):
        return jnp.sum(key >= t[:, None], axis=-1) >= k

    thr = _bisect_threshold(key, ok, lo, hi + 1)
    return key >= thr[:, None]


def top_p_mask(weights: jax.Array, top_p: jax.Array) -> jax.Array:
    """Mask of the nucleus: the smallest set of heaviest entries whose mass reaches ``top_p``.

    Equivalent to sorting descending and keeping each id whose exclusive cumulative mass is
    below ``top_p`` (transformers' TopPLogitsWarper up to the boundary tie rule: all ids tied
    with the last kept one are kept).

    Args:
      weights: [B, V] float32 non-negative unnormalised probabilities (0 = excluded).
      top_p: float32 scalar or [B] in (0, 1].
    Returns:
      [B, V] bool (at least the heaviest id of each row).
    """
    p = jnp.broadcast_to(jnp.asarray(top_p, jnp.float32), weights.shape[:1])
    key = _sortable_int(weights)  # weights >= 0, so plain bit order
    target = p * jnp.sum(weights, axis=-1)
    lo = jnp.zeros(weights.shape[:1], jnp.int32)  # mass(w >= 0) = total >= target
    hi = jnp.max(key, axis=-1) + 1  # mass 0 < target

    def ok(t):
        return jnp.sum(jnp.where(key >= t[:, None], weights, 0.0), axis=-1) >= target

    thr = _bisect_threshold(key, ok, lo, hi)
    # Guard the degenerate all-zero row: keep its max.
    thr = jnp.minimum(thr, hi - 1)
    return key >= thr[:, None]


def _blocked(x: jax.Array, fill) -> jax.Array:
    """[B, V] -> [B, V / BLOCK, BLOCK], padding V up with ``fill``."""
    b, v = x.shape
    pad = (-v) % BLOCK
    if pad:
        x = jnp.pad(x, ((0, 0), (0, pad)), constant_values=fill)
    return x.reshape(b, (v + pad) // BLOCK, BLOCK)


def _first_index(flags: jax.Array) -> jax.Array:
    """Index of the first True along the last axis (size if none), int32."""
    n = flags.shape[-1]
    return jnp.min(jnp.where(flags, jnp.arange(n, dtype=jnp.int32), n), axis=-1)


def greedy_argmax(logits: jax.Array) -> jax.Array:
    """First index of the row maximum, like ``jnp.argmax`` / torch.argmax.

    logits: [B, V] float32 -> [B] int32 in [0, V). Two-level: max per block of 128, then inside
    the first block holding the row max.

    NaN counts as +inf (the first NaN / +inf entry wins; jnp.argmax would prefer the first NaN
    over an earlier +inf). Without this a NaN row max matches no entry (NaN != NaN), the
    first-index search returns its "none" value and the id lands past V (e.g. 512 for
    V = 300), out of the vocabulary. The final clamp keeps the id in range whatever the input.
    """
    v = logits.shape[-1]
    logits = jnp.where(jnp.isnan(logits), jnp.inf, logits)
    blocks = _blocked(logits, -jnp.inf)
    block_max = jnp.max(blocks, axis=-1)  # [B, nb]
    row_max = jnp.max(block_max, axis=-1, keepdims=True)
    blk = _first_index(block_max == row_max)  # [B]
    inside = jnp.take_along_axis(blocks, blk[:, None, None], axis=1)[:, 0]  # [B, BLOCK]
    idx = _first_index(inside == row_max)
    return jnp.minimum(blk * BLOCK + idx, v - 1)


def _last_positive(w: jax.Array) -> jax.Array:
    n = w.shape[-1]
    return jnp.max(jnp.where(w > 0, jnp.arange(n, dtype=jnp.int32), 0), axis=-1)


def sample_categorical(keys: jax.Array, weights: jax.Array) -> jax.Array:
    """One draw per row from the categorical distribution proportional to ``weights``.

    Args:
      keys: [B] PRNG keys (typed keys or raw uint32 [B, 2]).
      weights: [B, V] float32 non-negative, each row with positive total.
    Returns:
      [B] int32 ids; an id with weight 0 is never drawn.
    """
    blocks = _blocked(weights, 0.0)  # [B, nb, BLOCK]
    block_mass = jnp.sum(blocks, axis=-1)  # [B, nb]
    u = jax.vmap(lambda k: jax.random.uniform(k, (2,), jnp.float32))(keys)  # [B, 2] in [0, 1)

    def draw(w, uu):  # w: [B, n] -> index in [0, n) with w > 0
        c = jnp.cumsum(w, axis=-1)
        idx = jnp.sum(c <= (uu * c[:, -1])[:, None], axis=-1).astype(jnp.int32)
        # u * total can round up to total: fall back to the last id with positive weight.
        return jnp.minimum(idx, _last_positive(w))

    blk = draw(block_mass, u[:, 0])
    inside = jnp.take_along_axis(blocks, blk[:, None, None], axis=1)[:, 0]
    return blk * BLOCK + draw(inside, u[:, 1])


def select_next_tokens(
    logits: jax.Array,
    keys: jax.Array,
    temperature: jax.Array,
    top_p: jax.Array,
    top_k: jax.Array,
    *,
    greedy: bool,
    use_top_k: bool,
    use_top_p: bool,
) -> tuple[jax.Array, jax.Array]:
    """Choose one token per row and report its logprob.

    Args:
      logits: [B, V] float32 next-token logits (from ``models.heads.logits_from_hidden``).
      keys: [B] PRNG keys, already specific to this step (unused when greedy).
      temperature: float32 scalar > 0 (ignored when greedy).
      top_p: float32 scalar in (0, 1] (used when ``use_top_p``).
      top_k: int32 scalar >= 1 (used when ``use_top_k``).
      greedy, use_top_k, use_top_p: static switches (they change the compiled program; the
        values above do not).
    Returns:
      tokens [B] int32, logprobs [B] float32 = log_softmax(logits / T)[token] over the full
      vocabulary, T = 1 when greedy.
    """
    logits = logits.astype(jnp.float32)
    row_max = jnp.max(logits, axis=-1, keepdims=True)
    if greedy:
        tokens = greedy_argmax(logits)
        shifted = logits - row_max
    else:
        shifted = (logits - row_max) / temperature
    e = jnp.exp(shifted)  # in (0, 1], max entry exactly 1: no overflow, no empty row
    log_z = jnp.log(jnp.sum(e, axis=-1))
    if not greedy:
        w = e
        if use_top_k:
            w = jnp.where(top_k_mask(shifted, top_k), w, 0.0)
        if use_top_p:
            w = jnp.where(top_p_mask(w, top_p), w, 0.0)
        tokens = sample_categorical(keys, w)
    chosen = jnp.take_along_axis(shifted, tokens[:, None], axis=-1)[:, 0]
    return tokens.astype(jnp.int32), chosen - log_z
