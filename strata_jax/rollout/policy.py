"""The policy side of the rollout: a small protocol and its implementation on the Sampler.

The rollout needs two things from the policy: batched generation over shared-prefix rows and
strategy embeddings for farthest-point selection (docs/method.md §5.2). `Policy` is that protocol;
`SamplerPolicy` implements it on `strata_jax.sampling.Sampler` + params;
`strata_jax.rollout.scripted.ScriptedPolicy` is the scripted test double.
"""
from __future__ import annotations

import functools
from typing import Any, Protocol, Sequence, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np

from strata_jax.models import Qwen2Config, forward
from strata_jax.sampling import GenerationBatch, PrefixKVCache, Sampler, SamplingParams, bucket
from strata_jax.sampling.packing import as_id_lists, pack_left


@runtime_checkable
class Policy(Protocol):
    """What the rollout calls. Row b's prompt is ``prefixes[prefix_index[b]] + suffixes[b]``."""

    def generate(self, prefixes: Sequence[Sequence[int]], prefix_index: Sequence[int],
                 suffixes: Sequence[Sequence[int]], sampling: SamplingParams,
                 keys: np.ndarray) -> GenerationBatch:
        """One batched generation: keys are uint32 [B, 2] raw PRNG key data, one per row.
        Returns the sampler's `GenerationBatch` (ids incl. the stop token, or the token that
        completed ``sampling.stop_text``, and logprobs)."""

    def embed(self, token_lists: Sequence[Sequence[int]]) -> np.ndarray:
        """[n, D] float32 embeddings of token lists (strategies) for FPS."""


@functools.partial(jax.jit, static_argnames=("config",))
def _mean_hidden(params: Any, tokens: jax.Array, positions: jax.Array, mask: jax.Array, *,
                 config: Qwen2Config) -> jax.Array:
    """Mean of the final hidden states over the real tokens: [B, T] -> [B, D] float32."""
    hidden, _ = forward(params, config, tokens, positions, mask)
    m = mask.astype(jnp.float32)[..., None]
    return jnp.sum(hidden.astype(jnp.float32) * m, axis=1) / jnp.maximum(jnp.sum(m, axis=1), 1.0)


class SamplerPolicy:
    """`Policy` on the KV-cache sampler and the current policy params.

    Args:
      sampler: a `Sampler` for the policy's config (and mesh).
      params: the policy params (placed for the sampler's mesh); replace with `set_params`
        after each update.
      embed_batch: rows per embedding forward (bounds memory; lengths are bucketed).
      embed_floors: (rows, width) floors of the embedding forward's buckets (powers of two
        above them): the strategy candidates of a call and their longest generation bound
        them, so floors at those bounds give one program for every call
        (`strata_jax.training.bounds.embed_floors`). Independent of the sampler's prompt
        buckets: strategies are a few dozen tokens, prompts up to the whole budget.
      prefix_cache_mb: > 0: keep the prompt prefixes' KV across `generate` calls, up to this
        many MB (`strata_jax.sampling.PrefixKVCache`): each distinct prefix (header, role,
        task, strategy) is prefilled once per params instead of at every step; `set_params`
        empties it. 0: every call prefills its prefixes.
    The embedding is the default of docs/method.md §5.2: the policy's final hidden states (after the
    final RMSNorm) mean-pooled over the given tokens (the strategy's generated tokens without
    a final stop id, run without the prompt).
    """

    def __init__(self, sampler: Sampler, params: Any, embed_batch: int = 64,
                 prefix_cache_mb: float = 0.0, embed_floors: tuple[int, int] = (1, 16)) -> None:
        self.sampler = sampler
        self.params = params
        self.embed_batch = int(embed_batch)
        self.embed_floors = (int(embed_floors[0]), int(embed_floors[1]))
        self.prefix_cache = (PrefixKVCache(int(prefix_cache_mb * 2 ** 20))
                             if prefix_cache_mb > 0 else None)
        self._prefill = dict(prompt_tokens=0, prefill_tokens=0)

    def set_params(self, params: Any) -> None:
        """Use new policy params for the next rollout (the kept prefix KV is dropped)."""
        self.params = params
        if self.prefix_cache is not None:
            self.prefix_cache.clear()

    def generate(self, prefixes: Sequence[Sequence[int]], prefix_index: Sequence[int],
                 suffixes: Sequence[Sequence[int]], sampling: SamplingParams,
                 keys: np.ndarray) -> GenerationBatch:
        """`Sampler.generate_with_prefixes` with this policy's params (see `Policy`); counts
        the prompt tokens and the prefill's real tokens (`prefix_stats`)."""
        cached = self.prefix_cache.stats()["computed_tokens"] if self.prefix_cache else 0
        out = self.sampler.generate_with_prefixes(self.params, prefixes, prefix_index, suffixes,
                                                  sampling, keys, self.prefix_cache)
        if sampling.max_new_tokens > 0 and len(suffixes):   # else the sampler prefills nothing
            suffix = sum(len(x) for x in suffixes)
            if self.prefix_cache is not None:
                computed = self.prefix_cache.stats()["computed_tokens"] - cached
            else:   # every listed prefix once (the rollout lists each distinct one once)
                computed = sum(len(p) for p in prefixes)
            self._prefill["prompt_tokens"] += suffix + sum(len(prefixes[int(i)])
                                                           for i in prefix_index)
            self._prefill["prefill_tokens"] += suffix + computed
        return out

    def prefix_stats(self) -> dict[str, int]:
        """Running counters since construction: ``prompt_tokens`` (the rows' prompt tokens: what
        a prefill of every row's whole prompt computes), ``prefill_tokens`` (the real tokens
        the prefill computed: every suffix, and each listed prefix of a call once, or with the
        prefix cache only its misses), and the prefix cache's counters
        (`PrefixKVCache.stats`) when there is one."""
        out = dict(self._prefill)
        if self.prefix_cache is not None:
            out.update(self.prefix_cache.stats())
        return out

    def embed(self, token_lists: Sequence[Sequence[int]]) -> np.ndarray:
        """Mean-pooled final hidden states, [n, D] float32. An empty list embeds to zeros.

        Raises ValueError on ids outside the vocabulary."""
        cfg = self.sampler.config
        rows = as_id_lists(token_lists, "strategy", cfg.vocab_size, allow_empty=True)
        out = np.zeros((len(rows), cfg.hidden_size), np.float32)
        for start in range(0, len(rows), self.embed_batch):
            chunk = [(i, r) for i, r in enumerate(rows[start:start + self.embed_batch], start)
                     if len(r)]
            if not chunk:
                continue
            t = bucket(max(len(r) for _, r in chunk), self.embed_floors[1])
            b = bucket(len(chunk), self.embed_floors[0])
            packed = pack_left([r for _, r in chunk], t, b)
            emb = _mean_hidden(self.params, jnp.asarray(packed.tokens),
                               jnp.asarray(packed.positions), jnp.asarray(packed.mask), config=cfg)
            emb = np.asarray(jax.device_get(emb))
            for j, (i, _) in enumerate(chunk):
                out[i] = emb[j]
        return out


def prefix_metrics(before: dict[str, int], after: dict[str, int],
                   prefix: str = "rollout") -> dict[str, float]:
    """The prefill's work between two `SamplerPolicy.prefix_stats` readings (e.g. one
    iteration's rollout), as float token counts: ``<prefix>/prompt_tokens`` and
    ``<prefix>/prefill_tokens`` (the prompt tokens of the rows, and the real tokens the prefill
    computed for them: their ratio is what prefix sharing saves), and with the prefix cache
    ``<prefix>/prefix_computed_tokens`` (prefix tokens prefilled) and
    ``<prefix>/prefix_reused_tokens`` (served from the kept KV instead). Counters absent from
    `after` are left out (a policy without a prefix cache has no computed / reused tokens).
    prefix: "rollout" (train.py's iteration metrics) or "eval" (eval.py's)."""
    names = {"prompt_tokens": "prompt_tokens", "prefill_tokens": "prefill_tokens",
             "computed_tokens": "prefix_computed_tokens", "reused_tokens": "prefix_reused_tokens"}
    return {f"{prefix}/{name}": float(after[k] - before.get(k, 0))
            for k, name in names.items() if k in after}
