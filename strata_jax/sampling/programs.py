"""The sampler's jitted device programs: prefill, prefix-shared prefill, the decode loop, scoring.

Source: docs/design.md §6 and §12. `strata_jax.sampling.sampler.Sampler` is the host side that
pads, buckets and places the rows these programs take.

* ``prefill`` allocates the ``KVCache`` (``T + N`` slots, N = bucketed max_new_tokens), runs
  the model over the left-padded prompts and keeps only the last column's hidden state: logits
  are computed for that position alone, never ``B x T x V``. ``prefill_prefixed`` runs the P
  shared prefixes once into their own cache, gathers them into the rows' caches, runs the
  suffixes on top with positions continuing each row's prefix, and packs each row's slots
  into a cache of ``R + N`` slots (R = the bucketed longest row, `compact_rows`), so decoding
  attends over the rows' bucket and not over the prefix bucket plus the suffix bucket;
  ``prefill_prefix_kv`` and ``prefill_on_prefixes`` are its two halves, for prefix KV kept
  across calls (`strata_jax.sampling.prefix_cache`).
* Every prefill runs a width longer than ``chunk`` as a loop over chunks of ``chunk`` columns
  that starts at the first chunk holding a real token (`prefill_chunks`): the all-padding
  chunks of a wide bucket are never computed, so a fixed, budget-wide prompt bucket (the
  bounded shapes of ``rollout.sampler_fixed_shapes``) costs the prompts' tokens rounded up to
  one chunk, not the bucket.
* ``decode`` (cache donated): token 0 is chosen from the prefill state; then a
  ``lax.while_loop`` feeds the previous token through the model (cache slot ``T + step - 1``,
  written in place by ``dynamic_update_slice``), computes the logits of that one position and
  chooses the next token. Rows stop at a stop id, on the token that completes the stop string
  (``SamplingParams.stop_text``: one ``table[state, token]`` gather per row and step, see
  `strata_jax.sampling.stops`) or at max_new_tokens; the loop exits when all rows are done.
* ``score``: logprobs of the response columns of prompt+response rows by one full forward.

Params are always arguments, never closed over (a closed-over 2 GB constant would be baked into
the executable). The cache's sharding hints follow ``strata_jax.sharding.LOGICAL_RULES``: rows
over (data, fsdp), kv heads over tensor.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from strata_jax import sharding as shd
from strata_jax.models import KVCache, Qwen2Config, forward, init_cache
from strata_jax.models.heads import logits_from_hidden, token_logprobs_and_entropy
from strata_jax.sampling.selection import select_next_tokens

Params = dict[str, Any]

_CACHE_AXES = ("layers", "batch", "length", "kv_heads", "head_dim")


class DecodeState(NamedTuple):
    """The carry of `decode`'s ``lax.while_loop`` (B rows, n_out new-token columns).

    Attributes:
      step: int32 scalar, the column the next token goes to (1 after the prefill's token).
      cache: the KVCache (donated into `decode`, updated in place).
      prev: [B] int32 token chosen last (fed through the model next).
      done: [B] bool, the row is finished (stopped, at max_new, or a filler row).
      lengths: [B] int32 tokens generated so far.
      stopped: [B] bool, the row ended on a stop id or stop string.
      tokens: [B, n_out] int32 generated tokens (0 past each row's length).
      logprobs: [B, n_out] float32 their logprobs (0 past each row's length).
      text_state: [B] int32 stop-string automaton state (0 when stop strings are off).
    """

    step: jax.Array
    cache: KVCache
    prev: jax.Array
    done: jax.Array
    lengths: jax.Array
    stopped: jax.Array
    tokens: jax.Array
    logprobs: jax.Array
    text_state: jax.Array


def _constrain_cache(cache: KVCache) -> KVCache:
    """Sharding hints for the cache: rows over (data, fsdp), kv heads over tensor."""
    return KVCache(k=shd.constrain(cache.k, _CACHE_AXES), v=shd.constrain(cache.v, _CACHE_AXES),
                   valid=shd.constrain(cache.valid, ("batch", "length")))


def _cache_dtype(params: Params, cache_dtype: str | None) -> Any:
    return jnp.dtype(cache_dtype) if cache_dtype else params["embed"].dtype


def prefill_chunks(params: Params, config: Qwen2Config, tokens: jax.Array,
                   positions: jax.Array, mask: jax.Array, cache: KVCache, base: int,
                   chunk: int) -> tuple[KVCache, jax.Array]:
    """`forward` of left-padded rows into ``cache`` slots ``[base, base + T)``, skipping the
    leading chunks that hold no real token of any row (traced inside jit).

    Args:
      tokens / positions / mask: [B, T] int32, int32, bool (`packing.pack_left`: each row's
        real tokens end at column T - 1).
      cache: the rows' `KVCache` (S >= base + T slots). base: static first slot.
      chunk: static column count per step; with T <= chunk, or T not a multiple of it, one
        `forward` over all T columns (the static causal bound of its attention kept).
    Returns:
      (the cache with the real columns' keys / values written and valid, the hidden state
      after column T - 1 [B, D] in the params' dtype). Same values as one `forward` over the
      T columns to float summation order: a skipped chunk's slots stay invalid, which is
      what its padding would have written, and a query attends the same valid keys.
    """
    b, t = tokens.shape
    if t <= chunk or t % chunk:
        hidden, cache = forward(params, config, tokens, positions, mask, cache, base)
        return cache, hidden[:, -1]
    live = jnp.any(mask, axis=0)
    first = jnp.where(jnp.any(live), jnp.argmax(live), t - 1).astype(jnp.int32)

    def body(k, carry):
        cache, _ = carry
        start = k * chunk
        cols = [lax.dynamic_slice_in_dim(a, start, chunk, axis=1)
                for a in (tokens, positions, mask)]
        hidden, cache = forward(params, config, *cols, cache, base + start)
        return cache, hidden[:, -1]

    last = jnp.zeros((b, config.hidden_size), params["embed"].dtype)
    return lax.fori_loop(first // chunk, t // chunk, body, (cache, last))


def compact_rows(cache: KVCache, width: int, extra: int) -> KVCache:
    """Each row's valid slots, in slot order, right-aligned in a cache of ``width + extra``
    slots (the last ``extra`` free for decoding).

    Attention depends on slot order only through the causal rule (key slot <= query slot),
    and every later query sits after all of them, so decoding on the packed cache gives the
    same values; RoPE positions are stored in the keys, not implied by the slots.

    Args:
      cache: KVCache [L, B, S, K, Dh] / valid [B, S]. width: static, >= every row's valid
        count (a filler row with more keeps its last ``width``). extra: static free slots.
    Returns:
      KVCache [L, B, width + extra, K, Dh], valid: the last n_b of the first ``width`` slots.
    """
    s = cache.valid.shape[1]
    n_valid = jnp.sum(cache.valid, axis=1, dtype=jnp.int32)                   # [B]
    order = jnp.argsort(~cache.valid, axis=1, stable=True).astype(jnp.int32)  # valid first
    rank = jnp.arange(width, dtype=jnp.int32)[None, :] - (width - n_valid[:, None])
    keep = rank >= 0
    src = jnp.take_along_axis(order, jnp.clip(rank, 0, s - 1), axis=1)        # [B, width]

    def gather(x):                                         # [L, B, S, K, Dh] -> width slots
        rows = jax.vmap(lambda xb, sb: jnp.take(xb, sb, axis=1), in_axes=(1, 0),
                        out_axes=1)(x, src)
        rows = jnp.where(keep[None, :, :, None, None], rows, jnp.zeros((), x.dtype))
        return jnp.pad(rows, ((0, 0), (0, 0), (0, extra), (0, 0), (0, 0)))

    return KVCache(k=gather(cache.k), v=gather(cache.v),
                   valid=jnp.pad(keep, ((0, 0), (0, extra))))


@functools.partial(jax.jit,
                   static_argnames=("config", "rows_len", "n_out", "cache_dtype", "chunk"))
def prefill(params: Params, tokens: jax.Array, positions: jax.Array, mask: jax.Array, *,
            config: Qwen2Config, rows_len: int, n_out: int, cache_dtype: str | None,
            chunk: int) -> tuple[KVCache, jax.Array]:
    """Run the left-padded prompts into a fresh KV cache of rows_len + n_out slots
    (design.md §6.1).

    Args:
      params: model params (float32 or bfloat16). tokens / positions: [B, T] int32 ids and RoPE
        positions (`packing.pack_left`); mask: [B, T] bool, True for real tokens.
      config: static model config. rows_len: static, <= T and >= every row's token count:
        the prompt slots decoding attends over (rows_len < T packs the rows' slots with
        `compact_rows`, so a wide prompt bucket is not paid for at every decoded token).
        n_out: static free slots (the bucketed max_new_tokens). cache_dtype: static, None =
        the params' dtype. chunk: static prefill chunk (`prefill_chunks`).
    Returns:
      (KVCache [L, B, rows_len + n_out, K, Dh], each row's prompt in the last of the first
      rows_len slots, the hidden state after each row's last prompt token [B, D] in the
      params' dtype). No logits: `decode` makes them for one position per row.
    Raises:
      ValueError: rows_len > T.
    """
    b, t = tokens.shape
    if rows_len > t:
        raise ValueError(f"rows_len {rows_len} exceeds the prompt width {t}")
    packed = rows_len < t
    cache = _constrain_cache(init_cache(config, b, t + (0 if packed else n_out),
                                        _cache_dtype(params, cache_dtype)))
    cache, last = prefill_chunks(params, config, tokens, positions, mask, cache, 0, chunk)
    if packed:
        cache = compact_rows(cache, rows_len, n_out)
    return _constrain_cache(cache), last


def _prefix_kv(params: Params, tokens: jax.Array, positions: jax.Array, mask: jax.Array,
               config: Qwen2Config, dtype: Any, chunk: int) -> KVCache:
    """The prefixes' own KV cache, [L, P, Lp, K, Dh] (their hidden states are unused: XLA
    drops the last layer's MLP and final norm)."""
    n_prefix, prefix_len = tokens.shape
    pcache = init_cache(config, n_prefix, prefix_len, dtype)
    pcache, _ = prefill_chunks(params, config, tokens, positions, mask, pcache, 0, chunk)
    return pcache


def _on_prefixes(params: Params, pcache: KVCache, row_prefix: jax.Array, s_tokens: jax.Array,
                 s_positions: jax.Array, s_mask: jax.Array, config: Qwen2Config,
                 rows_len: int, n_out: int, chunk: int) -> tuple[KVCache, jax.Array]:
    """Gather each row's prefix KV, run the suffixes on top, and leave the rows in a cache of
    rows_len + n_out slots (packed by `compact_rows` when rows_len < Lp + Ts)."""
    prefix_len, suffix_len = pcache.k.shape[2], s_tokens.shape[1]
    if rows_len > prefix_len + suffix_len:
        raise ValueError(f"rows_len {rows_len} exceeds prefix + suffix width "
                         f"{prefix_len + suffix_len}")
    packed = rows_len < prefix_len + suffix_len
    pad = suffix_len + (0 if packed else n_out)
    kv_pad = ((0, 0), (0, 0), (0, pad), (0, 0), (0, 0))
    cache = KVCache(k=jnp.pad(jnp.take(pcache.k, row_prefix, axis=1), kv_pad),
                    v=jnp.pad(jnp.take(pcache.v, row_prefix, axis=1), kv_pad),
                    valid=jnp.pad(jnp.take(pcache.valid, row_prefix, axis=0), ((0, 0), (0, pad))))
    cache = _constrain_cache(cache)
    cache, last = prefill_chunks(params, config, s_tokens, s_positions, s_mask, cache,
                                 prefix_len, chunk)
    if packed:
        cache = compact_rows(cache, rows_len, n_out)
    return _constrain_cache(cache), last


@functools.partial(jax.jit,
                   static_argnames=("config", "rows_len", "n_out", "cache_dtype", "chunk"))
def prefill_prefixed(params: Params, p_tokens: jax.Array, p_positions: jax.Array,
                     p_mask: jax.Array, row_prefix: jax.Array, s_tokens: jax.Array,
                     s_positions: jax.Array, s_mask: jax.Array, *, config: Qwen2Config,
                     rows_len: int, n_out: int, cache_dtype: str | None,
                     chunk: int) -> tuple[KVCache, jax.Array]:
    """Shared prefixes once, gathered per row, then the rows' suffixes on top (design.md §6.1).

    Args:
      p_tokens / p_positions / p_mask: [P, Lp] the P distinct prefixes (left padded; int32,
        int32, bool). row_prefix: [B] int32 index of each row's prefix.
      s_tokens / s_positions / s_mask: [B, Ts] the rows' suffixes, positions continuing the
        row's prefix. config / cache_dtype / chunk: as for `prefill`. rows_len: static R,
        at least every row's prefix + suffix length and at most Lp + Ts. n_out: static N.
    Returns:
      (KVCache [L, B, R + N, K, Dh], each row's prefix and suffix slots right-aligned in the
      first R, the hidden state after each row's last suffix token [B, D]). Same values as
      `prefill` over prefix + suffix; the prefixes' compute is done P times instead of B.
    Raises:
      ValueError: rows_len > Lp + Ts.
    """
    pcache = _prefix_kv(params, p_tokens, p_positions, p_mask, config,
                        _cache_dtype(params, cache_dtype), chunk)
    return _on_prefixes(params, pcache, row_prefix, s_tokens, s_positions, s_mask, config,
                        rows_len, n_out, chunk)


@functools.partial(jax.jit, static_argnames=("config", "cache_dtype", "chunk"))
def prefill_prefix_kv(params: Params, tokens: jax.Array, positions: jax.Array, mask: jax.Array,
                      *, config: Qwen2Config, cache_dtype: str | None, chunk: int) -> KVCache:
    """The KV cache of left-padded prefixes alone (the first half of `prefill_prefixed`), for
    `strata_jax.sampling.prefix_cache.PrefixKVCache` to keep across decode calls.

    Args: tokens / positions / mask [P, Lp] (`packing.pack_left`); config, cache_dtype, chunk
    as for `prefill`. Returns KVCache [L, P, Lp, K, Dh] (valid [P, Lp]: the real tokens' slots)."""
    return _constrain_cache(_prefix_kv(params, tokens, positions, mask, config,
                                       _cache_dtype(params, cache_dtype), chunk))


@functools.partial(jax.jit, static_argnames=("config", "rows_len", "n_out", "chunk"))
def prefill_on_prefixes(params: Params, pcache: KVCache, row_prefix: jax.Array,
                        s_tokens: jax.Array, s_positions: jax.Array, s_mask: jax.Array, *,
                        config: Qwen2Config, rows_len: int, n_out: int,
                        chunk: int) -> tuple[KVCache, jax.Array]:
    """The second half of `prefill_prefixed` on given prefix KV (`prefill_prefix_kv`'s, kept
    across calls): pcache [L, P, Lp, K, Dh] right-aligned prefixes, row_prefix [B] int32,
    suffixes [B, Ts] with positions continuing their prefix; rows_len, n_out, chunk as for
    `prefill_prefixed`. Returns what `prefill_prefixed` returns (the cache in pcache's dtype)."""
    return _on_prefixes(params, pcache, row_prefix, s_tokens, s_positions, s_mask, config,
                        rows_len, n_out, chunk)


@functools.partial(
    jax.jit,
    static_argnames=("config", "n_out", "greedy", "use_top_k", "use_top_p", "use_stop_text",
                     "key_impl"),
    donate_argnames=("cache",))
def decode(params: Params, cache: KVCache, last_hidden: jax.Array, key_data: jax.Array,
            next_position: jax.Array, active: jax.Array, max_new: jax.Array,
            stop_ids: jax.Array, temperature: jax.Array, top_p: jax.Array, top_k: jax.Array,
            stop_table: jax.Array, stop_accept: jax.Array, *,
            config: Qwen2Config, n_out: int, greedy: bool, use_top_k: bool,
            use_top_p: bool, use_stop_text: bool,
            key_impl: str | None) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, KVCache]:
    """The decode loop.

    Args:
      cache: from a prefill, S = T + n_out slots, slots [0, T) hold the prompts (donated).
      last_hidden: [B, D] state after each row's last prompt token.
      key_data: [B, ...] uint32 raw key data of one PRNG key per row (impl ``key_impl``, None =
        default); step t uses ``fold_in(key, t)``.
      next_position: [B] int32 RoPE position of the first generated token (prompt length).
      active: [B] bool, False for filler rows of the batch bucket (done from the start).
      max_new: int32 scalar in [1, n_out]. stop_ids: [n_stop] int32, -1 = unused slot.
      temperature, top_p: float32 scalars; top_k: int32 scalar.
      stop_table: [S, V] int16 stop-string transitions (`StopText.table_for_vocab`), state 0 =
        start; stop_accept: int32 scalar accepting state. Read only when ``use_stop_text``
        (otherwise a [1, 1] dummy).
    Returns:
      tokens [B, n_out] int32, logprobs [B, n_out] float32 (0 past each row's length),
      lengths [B] int32, stopped [B] bool, and the final cache: returning it lets XLA alias
      the donated input buffers to the loop's carry, so the cache is updated in place instead
      of copied once (the caller drops it).
    """
    b = last_hidden.shape[0]
    keys = jax.random.wrap_key_data(key_data, impl=key_impl)
    start_slot = cache.max_len - n_out  # first free slot (static)

    def choose(hidden, step):
        logits = logits_from_hidden(params, config, hidden)  # [B, V] fp32, one position only
        # Gather the vocabulary (split over tensor) once, so selection's reductions and
        # gathers run on whole rows instead of being rematerialised piecemeal by SPMD.
        logits = shd.constrain(logits, ("batch", None))
        step_keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, step)
        return select_next_tokens(logits, step_keys, temperature, top_p, top_k, greedy=greedy,
                                  use_top_k=use_top_k, use_top_p=use_top_p)

    def is_stop(tok):
        return jnp.any(tok[:, None] == stop_ids[None, :], axis=-1)

    def advance_text(text_state, tok, live):
        """Stop-string automaton: one gather per row; (new state, completed now)."""
        if not use_stop_text:
            return text_state, jnp.zeros_like(live)
        new = stop_table[text_state, tok].astype(jnp.int32)
        new = jnp.where(live, new, text_state)
        return new, live & (new == stop_accept)

    tok0, lp0 = choose(last_hidden, jnp.int32(0))
    tok0 = jnp.where(active, tok0, 0)
    lp0 = jnp.where(active, lp0, 0.0)
    out_tokens = jnp.zeros((b, n_out), jnp.int32).at[:, 0].set(tok0)
    out_logprobs = jnp.zeros((b, n_out), jnp.float32).at[:, 0].set(lp0)
    text_state, text_hit = advance_text(jnp.zeros((b,), jnp.int32), tok0, active)
    stopped = active & (is_stop(tok0) | text_hit)
    done = ~active | stopped | (max_new <= 1)
    lengths = active.astype(jnp.int32)

    def cond(state: DecodeState):
        return (state.step < max_new) & ~jnp.all(state.done)

    def body(state: DecodeState) -> DecodeState:
        step, done = state.step, state.done
        position = (next_position + step - 1)[:, None]
        hidden, cache = forward(params, config, state.prev[:, None], position,
                                jnp.ones((b, 1), bool), state.cache, start_slot + step - 1)
        tok, lp = choose(hidden[:, 0], step)
        live = ~done
        tok = jnp.where(live, tok, 0)
        lp = jnp.where(live, lp, 0.0)
        zero = jnp.int32(0)
        out_tokens = lax.dynamic_update_slice(state.tokens, tok[:, None], (zero, step))
        out_logprobs = lax.dynamic_update_slice(state.logprobs, lp[:, None], (zero, step))
        text_state, text_hit = advance_text(state.text_state, tok, live)
        hit = live & (is_stop(tok) | text_hit)
        return DecodeState(step=step + 1, cache=cache, prev=tok,
                           done=done | hit | (step + 1 >= max_new),
                           lengths=state.lengths + live.astype(jnp.int32),
                           stopped=state.stopped | hit, tokens=out_tokens,
                           logprobs=out_logprobs, text_state=text_state)

    state = DecodeState(step=jnp.int32(1), cache=cache, prev=tok0, done=done, lengths=lengths,
                        stopped=stopped, tokens=out_tokens, logprobs=out_logprobs,
                        text_state=text_state)
    final = lax.while_loop(cond, body, state)
    return final.tokens, final.logprobs, final.lengths, final.stopped, final.cache


@functools.partial(jax.jit, static_argnames=("config", "n_resp"))
def score(params: Params, tokens: jax.Array, positions: jax.Array, mask: jax.Array,
          temperature: jax.Array, *, config: Qwen2Config, n_resp: int) -> jax.Array:
    """Logprobs of the responses under the policy, by one full forward (no cache).

    Args:
      tokens / positions / mask: [B, T] left-padded prompt + response rows (int32, int32,
        bool), the response in the last ``n_resp`` columns (static). temperature: float32
        scalar the logits are divided by (the sampler's).
    Returns:
      [B, n_resp] float32 log pi(token | prefix) of the last n_resp columns
      (`models.heads.token_logprobs_and_entropy`, the training scorer's function).
    """
    hidden, _ = forward(params, config, tokens, positions, mask)
    t = tokens.shape[1]
    lp, _ = token_logprobs_and_entropy(params, config, hidden[:, t - n_resp - 1:t - 1],
                                       tokens[:, t - n_resp:], temperature)
    return lp


def compiled_program_count() -> int:
    """Number of programs compiled so far by the sampler's jitted functions (all instances)."""
    return sum(f._cache_size() for f in (prefill, prefill_prefixed, prefill_prefix_kv,
                                         prefill_on_prefixes, decode, score))
