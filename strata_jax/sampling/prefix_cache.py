"""Prefix KV kept across decode calls: each distinct prompt prefix prefilled once per policy.

Why: a rollout's step prompts repeat their prefix (chat header, role line, task, strategy:
`strata_jax.rollout.prompts`) at every step of every episode of a strategy. One
`Sampler.generate_with_prefixes` call prefills each distinct prefix of its rows once, but the
next step's call prefills it again, so an episode of T steps pays for its prefix T times. Given
a `PrefixKVCache`, the sampler prefills a prefix the first time a call needs it and gathers
the kept KV in every later call, until the params change (`clear`, which
`strata_jax.rollout.policy.SamplerPolicy.set_params` calls). The anchor is SGLang's
RadixAttention (a radix tree over prompt tokens, LRU eviction); here the unit is the whole
prefix the rollout already names, which is what repeats between calls (the suffixes hold the
history, which shifts every step).

Timing independence: a prefix is always prefilled alone, at its own length bucket (one row;
on a mesh the smallest batch bucket, its filler rows masked), so its KV, and every row that
reads it, does not depend on which rows or prefixes shared the call that first needed it.
Against `generate_with_prefixes` without the cache, which prefills a call's prefixes together
at their common width, the values agree to float rounding (the same tokens and positions, other
padding), not bit for bit.

Memory: an entry holds ``2 x layers x kv_heads x head_dim`` values per slot of its bucket
(the 0.5B in fp32: 24.6 KB per token); past ``max_bytes`` the least recently used entries are
dropped (a later call prefills them again).
"""
from __future__ import annotations

import collections
from typing import Any

from strata_jax.models import KVCache


class PrefixKVCache:
    """Prefix token ids -> their KV (`programs.prefill_prefix_kv`, one row), LRU-bounded.

    Args:
      max_bytes: the entries' device bytes kept at most (> 0).
    Counters (`stats`): hits / misses (prefix lookups), computed_tokens / reused_tokens
    (prefix tokens prefilled / served from the cache), evictions, entries, bytes.
    Raises ValueError for max_bytes <= 0.
    """

    def __init__(self, max_bytes: int) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be > 0, got {max_bytes} (no cache: pass None to "
                             "the sampler instead)")
        self.max_bytes = int(max_bytes)
        self._entries: collections.OrderedDict[tuple[int, ...], KVCache] = (
            collections.OrderedDict())
        self._bytes = 0
        self._counts = dict(hits=0, misses=0, computed_tokens=0, reused_tokens=0, evictions=0)

    def __len__(self) -> int:
        return len(self._entries)

    @staticmethod
    def _size(entry: KVCache) -> int:
        return int(entry.k.nbytes + entry.v.nbytes + entry.valid.nbytes)

    def lookup(self, ids: tuple[int, ...]) -> KVCache | None:
        """The kept KV of prefix `ids` (marked most recently used), or None (a miss)."""
        entry = self._entries.get(ids)
        if entry is None:
            self._counts["misses"] += 1
            return None
        self._entries.move_to_end(ids)
        self._counts["hits"] += 1
        self._counts["reused_tokens"] += len(ids)
        return entry

    def insert(self, ids: tuple[int, ...], entry: KVCache) -> None:
        """Keep `entry` (KVCache [L, 1, Lb, K, Dh], valid [1, Lb]) for prefix `ids`, just
        prefilled; drop least recently used entries beyond max_bytes (never this one)."""
        old = self._entries.pop(ids, None)
        if old is not None:
            self._bytes -= self._size(old)
        self._entries[ids] = entry
        self._bytes += self._size(entry)
        self._counts["computed_tokens"] += len(ids)
        while self._bytes > self.max_bytes and len(self._entries) > 1:
            _, dropped = self._entries.popitem(last=False)
            self._bytes -= self._size(dropped)
            self._counts["evictions"] += 1

    def clear(self) -> None:
        """Drop every entry (new params: the kept KV is stale); the counters go on."""
        self._entries.clear()
        self._bytes = 0

    def stats(self) -> dict[str, Any]:
        """The counters, plus the current entries and bytes."""
        return dict(self._counts, entries=len(self._entries), bytes=self._bytes)


__all__ = ["PrefixKVCache"]
