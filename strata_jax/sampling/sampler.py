"""Batched KV-cache sampler: the host side of generation (validation, padding, buckets,
placement) around the jitted device programs of `strata_jax.sampling.programs`.

Source: docs/design.md §6 and §12.

Flow of `Sampler.generate` (and of `Sampler.generate_with_prefixes`):

1. Host (here): validate and left-pad the prompts into bucketed ``[B, T]`` arrays (`packing`),
   one PRNG key per row, the stop ids and the stop-string table, and place the rows on the
   mesh.
2. ``programs.prefill`` / ``programs.prefill_prefixed`` (jit): the prompts into a KV cache of
   ``R + N`` slots (R the longest row's bucket above ``rows_floor``, the rows' slots packed
   by `programs.compact_rows` when the prompt bucket T is wider) and the last column's hidden
   state; a bucket wider than ``prefill_chunk`` runs chunk by chunk from the first chunk
   holding a real token, so the padding of a wide bucket is not computed
   (`programs.prefill_chunks`).
3. ``programs.decode`` (jit, cache donated): one ``lax.while_loop`` over the new tokens; one
   device->host copy at the end, no host round trip per token.

Compilation is bounded by bucketing the batch and every length to powers of two with a floor
(`buckets`); max_new_tokens, temperature, top_p, top_k, the stop ids and the stop-string table
([S, V], S a multiple of 32) are traced, so changing them does not recompile (only the greedy /
top-k-on / top-p-on / stop-string-on switches and the buckets do).

Sharding: pass a ``Mesh`` (``strata_jax.sharding.make_mesh``) and params placed with
``strata_jax.models.shard_params``; rows are split over (data, fsdp) and the cache's kv heads
over tensor, following ``strata_jax.sharding.LOGICAL_RULES``. The batch bucket is a multiple of
the number of batch shards.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from strata_jax import sharding as shd
from strata_jax.models import KVCache, Qwen2Config
from strata_jax.sampling import programs
from strata_jax.buckets import bucket
from strata_jax.sampling.outputs import GenerationBatch
from strata_jax.sampling.packing import PackedRows, as_id_lists, pack_left
from strata_jax.sampling.params import SamplingParams, check_temperature
from strata_jax.sampling.prefix_cache import PrefixKVCache

Params = dict[str, Any]
log = logging.getLogger(__name__)


class Sampler:
    """Batched KV-cache sampler for a Qwen2 model (see the module docstring).

    Args:
      config: the model's ``Qwen2Config`` (static).
      mesh: optional ``jax.sharding.Mesh`` with axes (data, fsdp, tensor); params must then be
        placed with ``strata_jax.models.shard_params``.
      max_cache_len: the longest prompt + max_new_tokens allowed (default
        ``config.max_position_embeddings``).
      batch_floor, length_floor, new_tokens_floor: smallest bucket for the batch, prompt /
        prefix / suffix lengths, and max_new_tokens (powers of two above them).
      batch_rungs: optional row counts a call's batch rounds up to (the smallest that holds
        it, each rounded up to a multiple of the mesh's batch shards); a call with more rows
        than the largest falls back to the powers of two. Bounds the compiled programs to the
        rungs a rollout's stages need (`strata_jax.training.bounds.sampler_floors`) without
        padding every stage to the largest.
      rows_floor: smallest bucket of the rows' cache after the prefill (default
        length_floor): decoding attends over bucket(longest row, rows_floor) + N slots, not
        over the prompt bucket, so a wide length_floor (every call's prompts at one width)
        does not widen every decoded token's attention.
      warm_ladder: when a call's shapes are first met, also compile its programs at every
        other rows' bucket it can meet (the powers of two from rows_floor to its prompt
        width), with a one-token decode: a run whose prompt widths, batch rungs and decode
        budgets are fixed then compiles nothing new once each of its stages has run once.
      cache_dtype: KV cache dtype name (default: the params' dtype).
      prefill_chunk: columns per prefill step when a bucket is wider (`programs.prefill_chunks`);
        a multiple of the attention's query block. Smaller skips padding more finely; larger
        runs fewer loop steps. Changes values only to float summation order.
    Raises:
      ValueError: prefill_chunk < 1, a batch rung < 1, or rows_floor < 1.
    """

    def __init__(self, config: Qwen2Config, *, mesh: jax.sharding.Mesh | None = None,
                 max_cache_len: int | None = None, batch_floor: int = 1,
                 length_floor: int = 16, new_tokens_floor: int = 16,
                 cache_dtype: str | None = None, prefill_chunk: int = 256,
                 batch_rungs: Sequence[int] | None = None, rows_floor: int | None = None,
                 warm_ladder: bool = False) -> None:
        if rows_floor is not None and int(rows_floor) < 1:
            raise ValueError(f"rows_floor must be >= 1, got {rows_floor}")
        if int(prefill_chunk) < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        if batch_rungs is not None and any(int(r) < 1 for r in batch_rungs):
            raise ValueError(f"batch_rungs must all be >= 1, got {list(batch_rungs)}")
        self.config = config
        self.prefill_chunk = int(prefill_chunk)
        self.mesh = mesh
        self.max_cache_len = int(max_cache_len or config.max_position_embeddings)
        self.batch_floor = batch_floor
        self.length_floor = length_floor
        self.rows_floor = int(rows_floor or length_floor)
        self.warm_ladder = bool(warm_ladder)
        self._warmed: set[tuple] = set()   # the call shapes whose ladder is compiled
        self.new_tokens_floor = new_tokens_floor
        self.cache_dtype = None if cache_dtype is None else jnp.dtype(cache_dtype).name
        self._batch_multiple = 1
        self._stop_tables: dict[Any, jax.Array] = {}  # StopText -> its device table (this vocab)
        if mesh is not None:
            self._batch_multiple = math.prod(
                mesh.shape[a] for a in (shd.LOGICAL_RULES["batch"] or ()) if a in mesh.shape)
        m = self._batch_multiple
        self.batch_rungs = (None if batch_rungs is None else
                            tuple(sorted({-(-max(int(r), batch_floor) // m) * m
                                          for r in batch_rungs})))

    # ----------------------------------------------------------------- helpers

    def _mesh_context(self):
        return jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()

    def _put_rows(self, *arrays: Any) -> list[Any]:
        """Place host arrays on device, rows split over the batch mesh axes."""
        if self.mesh is None:
            return [jnp.asarray(a) for a in arrays]
        out = []
        for a in arrays:
            axes = ("batch",) + (None,) * (np.ndim(a) - 1)
            spec = shd.logical_to_spec(axes, np.shape(a), self.mesh)
            out.append(jax.device_put(a, NamedSharding(self.mesh, spec)))
        return out

    def _batch_bucket(self, n: int) -> int:
        for rung in self.batch_rungs or ():
            if rung >= n:
                return rung
        return bucket(n, self.batch_floor, self._batch_multiple)

    def _check_keys(self, keys: Any, n: int) -> tuple[np.ndarray, str | None]:
        """Per-row keys -> (raw key data [n, ...] uint32 on host, PRNG impl name or None).

        Unwrapping on the host keeps the batch padding of keys out of eager jax ops, which
        would compile a small program for every new row count.
        """
        impl = None
        if isinstance(keys, jax.Array) and jnp.issubdtype(keys.dtype, jax.dtypes.prng_key):
            impl = str(jax.random.key_impl(keys))
            keys = jax.random.key_data(keys)
        raw = np.asarray(keys)
        if raw.dtype != np.uint32 or raw.ndim != 2 or raw.shape[0] != n:
            raise ValueError(f"need one PRNG key per row: {n} rows, keys of shape {raw.shape} "
                             f"dtype {raw.dtype} (pass jax.random.split(key, n) or typed keys "
                             f"derived per row)")
        return raw, impl

    def _check_lengths(self, totals: Sequence[int], max_new: int, what: str) -> None:
        for i, n in enumerate(totals):
            if n > self.max_cache_len or n + max_new > self.max_cache_len:
                raise ValueError(
                    f"{what} {i} has {n} tokens; with max_new_tokens={max_new} that exceeds the "
                    f"cache length {self.max_cache_len} (max_cache_len): shorten the prompt, "
                    f"lower max_new_tokens or build the Sampler with a larger max_cache_len")

    def _stop_table(self, stop_text: Any) -> jax.Array:
        """The device copy of a stop-string table, widened to this model's vocabulary; uploaded
        once per `StopText` (a few MB) and reused by every later call."""
        if stop_text is None:
            return self._dummy_stop_table()
        table = self._stop_tables.get(stop_text)
        if table is None:
            if len(self._stop_tables) >= 8:
                self._stop_tables.clear()
            table = jnp.asarray(stop_text.table_for_vocab(self.config.vocab_size))
            self._stop_tables[stop_text] = table
        return table

    def _dummy_stop_table(self) -> jax.Array:
        table = self._stop_tables.get(None)
        if table is None:
            table = self._stop_tables[None] = jnp.zeros((1, 1), jnp.int16)
        return table

    def _empty(self, n: int) -> GenerationBatch:
        return GenerationBatch(token_ids=np.zeros((n, 0), np.int32),
                               logprobs=np.zeros((n, 0), np.float32),
                               lengths=np.zeros((n,), np.int32), stopped=np.zeros((n,), bool))

    def _decode_switches(self, sampling: SamplingParams) -> tuple[bool, bool, bool]:
        """`programs.decode`'s static (use_top_k, use_top_p, use_stop_text) for `sampling`."""
        sampled = not sampling.is_greedy
        return (sampled and 0 < sampling.top_k < self.config.vocab_size,
                sampled and sampling.top_p < 1.0, sampling.stop_text is not None)

    def rows_ladder(self, width: int) -> list[int]:
        """The rows' buckets a call of prompt width `width` (its packed columns, prefix +
        suffix for `generate_with_prefixes`) can meet: min(bucket(n, rows_floor), width) over
        the row lengths n a call admits with one new token (n < max_cache_len), so a call of
        any decode budget meets a subset. Ascending ints."""
        top = min(width, bucket(max(self.max_cache_len - 1, 1), self.rows_floor))
        out, n = [], self.rows_floor
        while n < top:
            out.append(n)
            n *= 2
        return out + [top]

    def _prefill_and_decode(self, params: Params, prefill_at: Callable, path: tuple, width: int,
                            longest: int, keys: tuple[np.ndarray, str | None],
                            next_position: np.ndarray, n_rows: int, b: int, n_out: int,
                            sampling: SamplingParams) -> GenerationBatch:
        """Prefill at the rows' own bucket, then decode; with warm_ladder, first compile this
        call shape's other rows' buckets (`rows_ladder`), a one-token decode each on the same
        rows (their outputs dropped).

        Args:
          prefill_at: rows_len -> (KVCache [L, b, rows_len + n_out, K, Dh], last hidden
            [b, D]), the call's prefill program at that static rows' bucket.
          path: what names the call's prefill program apart from rows_len (its kind and
            static widths). width: its packed columns (the ladder's top). longest: the
            longest row's token count. keys, next_position [b], n_rows, b, n_out, sampling:
            as `_run_decode` takes them.
        Returns:
          the call's `GenerationBatch` (n_rows rows).
        """
        rows_len = min(bucket(longest, self.rows_floor), width)
        if self.warm_ladder:
            # what keys the programs besides rows_len: the shapes and the decode's static
            # switches (`_run_decode`)
            shape = path + (n_out, sampling.is_greedy, self._decode_switches(sampling),
                            bucket(len(set(sampling.stop_token_ids)), 8),
                            self._stop_table(sampling.stop_text).shape, keys[1])
            if shape not in self._warmed:
                self._warmed.add(shape)
                others = [n for n in self.rows_ladder(width) if n != rows_len]
                one = dataclasses.replace(sampling, max_new_tokens=1)
                for i, n in enumerate(others):
                    log.info("compiling the rows' cache ladder of %d rows x %d columns + %d "
                             "new: %d/%d (%d slots)", b, width, n_out, i + 1, len(others), n)
                    cache, last_hidden = prefill_at(n)
                    self._run_decode(params, cache, last_hidden, keys, next_position, n_rows, b,
                                     n_out, one)
        cache, last_hidden = prefill_at(rows_len)
        return self._run_decode(params, cache, last_hidden, keys, next_position, n_rows, b,
                                n_out, sampling)

    def _run_decode(self, params: Params, cache: KVCache, last_hidden: jax.Array,
                    keys: tuple[np.ndarray, str | None], next_position: np.ndarray,
                    n_rows: int, b: int, n_out: int, sampling: SamplingParams) -> GenerationBatch:
        key_data, key_impl = keys
        # Filler rows reuse row 0's key; their output is dropped.
        key_data = np.concatenate([key_data, np.repeat(key_data[:1], b - n_rows, axis=0)])
        active = np.arange(b) < n_rows
        stop = sorted(set(sampling.stop_token_ids))
        stop_ids = np.full((bucket(len(stop), 8),), -1, np.int32)
        stop_ids[: len(stop)] = stop
        use_top_k, use_top_p, use_stop_text = self._decode_switches(sampling)
        stop_table = self._stop_table(sampling.stop_text)
        stop_accept = sampling.stop_text.accept if use_stop_text else -1
        key_data, next_position, active = self._put_rows(key_data, next_position, active)
        with self._mesh_context():
            out = programs.decode(params, cache, last_hidden, key_data, next_position, active,
                          jnp.int32(sampling.max_new_tokens), jnp.asarray(stop_ids),
                          jnp.float32(sampling.temperature if not sampling.is_greedy else 1.0),
                          jnp.float32(sampling.top_p), jnp.int32(max(sampling.top_k, 1)),
                          stop_table, jnp.int32(stop_accept),
                          config=self.config, n_out=n_out, greedy=sampling.is_greedy,
                          use_top_k=use_top_k, use_top_p=use_top_p,
                          use_stop_text=use_stop_text, key_impl=key_impl)
        tokens, logprobs, lengths, stopped = jax.device_get(out[:4])
        del out  # frees the cache
        m = sampling.max_new_tokens
        return GenerationBatch(token_ids=np.asarray(tokens[:n_rows, :m]),
                               logprobs=np.asarray(logprobs[:n_rows, :m]),
                               lengths=np.asarray(lengths[:n_rows]),
                               stopped=np.asarray(stopped[:n_rows]))

    # ----------------------------------------------------------------- public API

    def generate(self, params: Params, prompts: Sequence[Sequence[int]],
                 sampling: SamplingParams, keys: Any) -> GenerationBatch:
        """Generate a continuation for every prompt.

        Args:
          params: model params (sharded with ``shard_params`` when a mesh is used).
          prompts: B token-id lists of any lengths >= 1.
          sampling: `SamplingParams` for all rows.
          keys: [B] PRNG keys (typed, or raw uint32 [B, 2]), one per row; a row's tokens
            depend only on its prompt and its key, not on its place in the batch.
        Returns:
          `GenerationBatch` (index it for per-row `Generation`s).
        Raises:
          ValueError: no prompts, an empty prompt, ids outside the vocabulary, a prompt +
            max_new_tokens longer than ``max_cache_len``, or a wrong number of keys.
        """
        rows = as_id_lists(prompts, "prompt", self.config.vocab_size)
        if not rows:
            raise ValueError("generate needs at least one prompt")
        keys = self._check_keys(keys, len(rows))
        self._check_lengths([len(r) for r in rows], sampling.max_new_tokens, "prompt")
        if sampling.max_new_tokens == 0:
            return self._empty(len(rows))
        b = self._batch_bucket(len(rows))
        t = bucket(max(len(r) for r in rows), self.length_floor)
        n_out = bucket(sampling.max_new_tokens, self.new_tokens_floor)
        packed = pack_left(rows, t, b)
        tokens, positions, mask = self._put_rows(packed.tokens, packed.positions, packed.mask)

        def prefill_at(rows_len: int) -> tuple[KVCache, jax.Array]:
            with self._mesh_context():
                return programs.prefill(params, tokens, positions, mask, config=self.config,
                                        rows_len=rows_len, n_out=n_out,
                                        cache_dtype=self.cache_dtype, chunk=self.prefill_chunk)

        return self._prefill_and_decode(params, prefill_at, ("plain", b, t), t,
                                        int(packed.lengths.max()), keys, packed.lengths,
                                        len(rows), b, n_out, sampling)

    def generate_with_prefixes(self, params: Params, prefixes: Sequence[Sequence[int]],
                               prefix_index: Sequence[int], suffixes: Sequence[Sequence[int]],
                               sampling: SamplingParams, keys: Any,
                               prefix_cache: PrefixKVCache | None = None) -> GenerationBatch:
        """Generate for rows ``prefixes[prefix_index[b]] + suffixes[b]``, each prefix run once.

        The P prefixes' KV caches are computed in one prefill and gathered into the rows'
        caches; each suffix is then prefilled with RoPE positions continuing its prefix.
        Identical (up to float rounding) to `generate` on the concatenated prompts.

        Args:
          prefixes: P token-id lists (>= 1 token each), e.g. StraTA's role + task + strategy
            block, tokenised separately from the suffixes.
          prefix_index: [B] index into ``prefixes`` for each row.
          suffixes: B token-id lists (>= 1 token each): the per-row rest of the prompt.
          params, sampling, keys: as in `generate`.
          prefix_cache: prefix KV kept across calls (`PrefixKVCache`, valid for `params`
            only): a prefix it holds is not prefilled again, one it lacks is prefilled alone
            and kept (`strata_jax.sampling.prefix_cache`). None: every prefix prefilled here.
        Returns / Raises: as `generate`; also ValueError for a prefix index out of range or
          mismatched row counts.
        """
        pre = as_id_lists(prefixes, "prefix", self.config.vocab_size)
        suf = as_id_lists(suffixes, "suffix", self.config.vocab_size)
        idx = np.asarray(prefix_index, np.int64).reshape(-1)
        if not pre or not suf:
            raise ValueError("generate_with_prefixes needs at least one prefix and one row")
        if idx.shape[0] != len(suf):
            raise ValueError(f"{idx.shape[0]} prefix indices for {len(suf)} suffixes: give one "
                             f"prefix index per row")
        if idx.min() < 0 or idx.max() >= len(pre):
            raise ValueError(f"prefix_index must be in [0, {len(pre)}), got "
                             f"{idx.min()}..{idx.max()}")
        keys = self._check_keys(keys, len(suf))
        prefix_lens = np.asarray([len(p) for p in pre], np.int32)
        row_lens = prefix_lens[idx] + np.asarray([len(s) for s in suf], np.int32)
        self._check_lengths(row_lens.tolist(), sampling.max_new_tokens, "row")
        if sampling.max_new_tokens == 0:
            return self._empty(len(suf))
        b = self._batch_bucket(len(suf))
        p_b = self._batch_bucket(len(pre))
        lp = bucket(int(prefix_lens.max()), self.length_floor)
        ts = bucket(max(len(s) for s in suf), self.length_floor)
        n_out = bucket(sampling.max_new_tokens, self.new_tokens_floor)
        row_prefix = np.zeros((b,), np.int32)
        row_prefix[: len(suf)] = idx
        s_start = prefix_lens[row_prefix]
        s_packed = pack_left(suf, ts, b, start=s_start[: len(suf)])
        s_args = self._put_rows(row_prefix, s_packed.tokens, s_packed.positions, s_packed.mask)
        if prefix_cache is not None:
            pcache = self._kept_prefixes(params, pre, prefix_cache, p_b, lp)

            def prefill_at(rows_len: int) -> tuple[KVCache, jax.Array]:
                with self._mesh_context():
                    return programs.prefill_on_prefixes(
                        params, pcache, *s_args, config=self.config, rows_len=rows_len,
                        n_out=n_out, chunk=self.prefill_chunk)
        else:
            p_packed = pack_left(pre, lp, p_b)
            p_args = self._put_rows(p_packed.tokens, p_packed.positions, p_packed.mask)

            def prefill_at(rows_len: int) -> tuple[KVCache, jax.Array]:
                with self._mesh_context():
                    return programs.prefill_prefixed(
                        params, *p_args, *s_args, config=self.config, rows_len=rows_len,
                        n_out=n_out, cache_dtype=self.cache_dtype, chunk=self.prefill_chunk)
        next_position = np.ones((b,), np.int32)
        next_position[: len(suf)] = row_lens
        path = ("kept" if prefix_cache is not None else "prefixed", b, p_b, lp, ts)
        return self._prefill_and_decode(params, prefill_at, path, lp + ts, int(row_lens.max()),
                                        keys, next_position, len(suf), b, n_out, sampling)

    def _kept_prefixes(self, params: Params, prefixes: list[np.ndarray], kept: PrefixKVCache,
                       p_b: int, lp: int) -> KVCache:
        """The prefixes' KV [L, p_b, lp, K, Dh] (right-aligned, as `pack_left` lays them out):
        each from `kept`, or prefilled alone at its own length bucket and kept there (so its
        values do not depend on this call's other prefixes). Filler rows repeat prefix 0."""
        entries = []
        for p in prefixes:
            ids = tuple(int(t) for t in p)
            entry = kept.lookup(ids)
            if entry is None:
                # one row, not the smallest batch rung: a rung of filler rows would be
                # prefilled with it at every new prefix
                width = bucket(len(p), self.length_floor)
                packed = pack_left([p], width, bucket(1, self.batch_floor, self._batch_multiple))
                args = self._put_rows(packed.tokens, packed.positions, packed.mask)
                with self._mesh_context():
                    full = programs.prefill_prefix_kv(params, *args, config=self.config,
                                                      cache_dtype=self.cache_dtype,
                                                      chunk=self.prefill_chunk)
                entry = KVCache(k=full.k[:, :1], v=full.v[:, :1], valid=full.valid[:1])
                kept.insert(ids, entry)
            entries.append(entry)
        entries += entries[:1] * (p_b - len(entries))

        def left_pad(x: jax.Array, axis: int) -> jax.Array:
            widths = [(0, 0)] * x.ndim
            widths[axis] = (lp - x.shape[axis], 0)
            return jnp.pad(x, widths)

        return KVCache(k=jnp.concatenate([left_pad(e.k, 2) for e in entries], axis=1),
                       v=jnp.concatenate([left_pad(e.v, 2) for e in entries], axis=1),
                       valid=jnp.concatenate([left_pad(e.valid, 1) for e in entries], axis=0))

    def score(self, params: Params, prompts: Sequence[Sequence[int]],
              responses: Sequence[Sequence[int]], temperature: float = 1.0) -> list[np.ndarray]:
        """Logprobs of each response given its prompt, by one full forward (no cache).

        Uses ``models.heads.token_logprobs_and_entropy`` on the response positions only, the
        same function the trainer uses, so it is the reference for the sampler's logprobs.

        Args:
          prompts: B token-id lists (>= 1 token each). responses: B token-id lists (may be
            empty). temperature: >= `params.MIN_TEMPERATURE`.
        Returns:
          B float32 arrays, ``[len(responses[b])]`` each.
        Raises:
          ValueError: mismatched counts, empty prompts, bad ids, a temperature below
            `params.MIN_TEMPERATURE` or not finite.
        """
        if len(prompts) != len(responses):
            raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
        check_temperature(temperature, allow_greedy=False)
        pr = as_id_lists(prompts, "prompt", self.config.vocab_size)
        rs = as_id_lists(responses, "response", self.config.vocab_size, allow_empty=True)
        rows = [np.concatenate([p, r]) for p, r in zip(pr, rs)]
        b = self._batch_bucket(len(rows))
        n_resp = bucket(max(len(r) for r in rs), self.new_tokens_floor)
        t = bucket(max(len(x) for x in rows), self.length_floor)
        t = max(t, bucket(n_resp + 1, self.length_floor))
        packed: PackedRows = pack_left(rows, t, b)
        args = self._put_rows(packed.tokens, packed.positions, packed.mask)
        with self._mesh_context():
            lp = programs.score(params, *args, jnp.float32(temperature), config=self.config,
                        n_resp=n_resp)
        lp = np.asarray(jax.device_get(lp))
        return [lp[i, n_resp - len(r):] if len(r) else np.zeros((0,), np.float32)
                for i, r in enumerate(rs)]
