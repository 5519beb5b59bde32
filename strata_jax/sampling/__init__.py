"""Batched KV-cache sampler: jitted prefill + one ``lax.while_loop`` decode (docs/design.md §6).

Public API:
  ``Sampler(config, mesh=None, max_cache_len=None, ...)`` with ``generate``,
  ``generate_with_prefixes`` and ``score``; ``SamplingParams``; ``Generation`` /
  ``GenerationBatch``; ``select_next_tokens`` and its parts (top-k / top-p masks, sampling,
  argmax); ``bucket``; ``compiled_program_count``; ``StopText`` / ``build_stop_text`` (stop
  strings checked on device, `strata_jax.sampling.stops`); ``PrefixKVCache`` (prefix KV kept
  across ``generate_with_prefixes`` calls, `strata_jax.sampling.prefix_cache`); ``SamplerCopy``
  (params -> the copy a sampler reads: cast, host-local gather, layout;
  `strata_jax.sampling.sampler_copy`).
"""

from strata_jax.buckets import bucket
from strata_jax.sampling.outputs import FINISH_LENGTH, FINISH_STOP, Generation, GenerationBatch
from strata_jax.sampling.params import SamplingParams
from strata_jax.sampling.prefix_cache import PrefixKVCache
from strata_jax.sampling.programs import compiled_program_count
from strata_jax.sampling.sampler import Sampler
from strata_jax.sampling.sampler_copy import SamplerCopy
from strata_jax.sampling.selection import (greedy_argmax, sample_categorical,
                                           select_next_tokens, top_k_mask, top_p_mask)
from strata_jax.sampling.stops import StopText, build_stop_text

__all__ = [
    "Sampler", "SamplingParams", "Generation", "GenerationBatch", "FINISH_STOP",
    "FINISH_LENGTH", "bucket", "compiled_program_count", "select_next_tokens", "top_k_mask",
    "top_p_mask", "sample_categorical", "greedy_argmax", "StopText", "build_stop_text",
    "PrefixKVCache", "SamplerCopy",
]
