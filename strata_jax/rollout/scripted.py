"""A scripted `Policy` for tests and CPU demos: chosen texts in, sampler-shaped output out.

`ScriptedPolicy` decodes each row's prompt (prefix + suffix ids) to text, asks a `respond`
function for the reply text, and returns its token ids (plus the stop id) in a
`GenerationBatch`, exactly the shape the real sampler returns. The token ids are the
tokenizer's encoding of the reply, so a test can check that the batch holds these ids and that
they decode to what reached the env. Logprobs are a fixed value per token (-0.5) so tests can
check they were carried.
"""
from __future__ import annotations

import time
import zlib
from typing import Any, Callable, Sequence

import numpy as np

from strata_jax.models import stop_token_ids
from strata_jax.sampling import GenerationBatch, SamplingParams

SCRIPTED_LOGPROB = -0.5


class ScriptedPolicy:
    """`Policy` whose replies come from `respond(prompt_text, key) -> reply_text`.

    Args:
      tokenizer: the policy tokenizer (decodes prompts, encodes replies).
      respond: (decoded prompt text, the row's uint32 [2] key data) -> reply text (without the
        stop token). Deterministic functions of the prompt make runs reproducible.
      embed_fn: token lists -> [n, D] embeddings; default: a 64-bucket bag of token ids.
      delay_s: seconds each generate call sleeps (simulates decoding, for overlap tests).
    Attributes:
      calls: one (t_start, t_end, rows, greedy) tuple per generate call.
    """

    def __init__(self, tokenizer: Any, respond: Callable[[str, np.ndarray], str],
                 embed_fn: Callable[[Sequence[Sequence[int]]], np.ndarray] | None = None,
                 delay_s: float = 0.0) -> None:
        self.tokenizer = tokenizer
        self.respond = respond
        self.embed_fn = embed_fn
        self.delay_s = float(delay_s)
        self.stop_id = stop_token_ids(tokenizer)[-1]  # <|im_end|>
        self.calls: list[tuple[float, float, int, bool]] = []

    def generate(self, prefixes: Sequence[Sequence[int]], prefix_index: Sequence[int],
                 suffixes: Sequence[Sequence[int]], sampling: SamplingParams,
                 keys: np.ndarray) -> GenerationBatch:
        """Scripted replies, cut as the sampler cuts them: after the token that completes
        ``sampling.stop_text`` (no stop id appended; the same host scan as the device check),
        else the stop id is appended; then at ``sampling.max_new_tokens`` (finish reason
        "length" when the cut falls before the end)."""
        t0 = time.perf_counter()
        keys = np.asarray(keys)
        if len(prefix_index) != len(suffixes) or keys.shape[0] != len(suffixes):
            raise ValueError(f"{len(prefix_index)} prefix indices, {keys.shape[0]} keys and "
                             f"{len(suffixes)} suffixes: give one of each per row")
        rows, stopped = [], []
        for b, suf in enumerate(suffixes):
            prompt = list(prefixes[int(prefix_index[b])]) + list(suf)
            text = self.tokenizer.decode(prompt)
            ids = list(self.tokenizer.encode(self.respond(text, keys[b]),
                                             add_special_tokens=False))
            hit = sampling.stop_text.scan(ids) if sampling.stop_text is not None else 0
            ids = ids[:hit] if hit else ids + [self.stop_id]
            stopped.append(len(ids) <= sampling.max_new_tokens)
            rows.append(ids[: sampling.max_new_tokens])
        n = max([len(r) for r in rows] + [sampling.max_new_tokens])
        tok = np.zeros((len(rows), n), np.int32)
        lp = np.zeros((len(rows), n), np.float32)
        for b, r in enumerate(rows):
            tok[b, : len(r)] = r
            lp[b, : len(r)] = SCRIPTED_LOGPROB
        if self.delay_s:
            time.sleep(self.delay_s)
        self.calls.append((t0, time.perf_counter(), len(rows), sampling.is_greedy))
        return GenerationBatch(token_ids=tok[:, : sampling.max_new_tokens],
                               logprobs=lp[:, : sampling.max_new_tokens],
                               lengths=np.asarray([len(r) for r in rows], np.int32),
                               stopped=np.asarray(stopped, bool))

    def embed(self, token_lists: Sequence[Sequence[int]]) -> np.ndarray:
        """`embed_fn`, or a deterministic 64-dim bag of token ids (crc32 bucket counts)."""
        if self.embed_fn is not None:
            return np.asarray(self.embed_fn(token_lists), np.float32)
        out = np.zeros((len(token_lists), 64), np.float32)
        for i, ids in enumerate(token_lists):
            for t in ids:
                out[i, zlib.crc32(str(int(t)).encode()) % 64] += 1.0
        return out
