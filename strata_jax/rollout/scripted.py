"""Scripted output for tests, CPU demos and benchmarks: a `Policy` whose replies are chosen
texts, and a tiny Qwen2 whose weights make the real sampler write a chosen text.

`ScriptedPolicy` decodes each row's prompt (prefix + suffix ids) to text, asks a `respond`
function for the reply text, and returns its token ids (plus the stop id) in a
`GenerationBatch`, exactly the shape the real sampler returns. The token ids are the
tokenizer's encoding of the reply, so a test can check that the batch holds these ids and that
they decode to what reached the env. Logprobs are a fixed value per token (-0.5) so tests can
check they were carried.

`forced_output_params` builds the weights of a one-layer Qwen2 (`FORCED_CONFIG`) whose greedy
and sampled outputs both spell a chosen text (`FORCED_TEXT` by default in its callers), so the
real sampler, rollout and env pool run end to end with a known reply.
"""
from __future__ import annotations

import dataclasses
import time
import zlib
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from strata_jax.models import init_params, stop_token_ids
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


# A valid StraTA action reply whose token pairs each have one successor (the closing tag's case
# differs from the opening one's for that reason; the action parser ignores the case).
FORCED_TEXT = "<think>ok</think><action>look around</ACTION>"
# `Qwen2Config` fields of the forced-output model: the Qwen2.5 vocabulary, one 64-wide layer.
FORCED_CONFIG = dict(vocab_size=151936, hidden_size=64, intermediate_size=32, num_layers=1,
                     num_heads=1, num_kv_heads=1, head_dim=64, rope_theta=100.0,
                     max_position_embeddings=4096)


def forced_output_params(config, tokenizer, text: str, seed: int = 0):
    """Params for `config` (1 layer) whose next token depends only on (previous, current) token
    and spells `text` + <|im_end|> after any prompt ending in "assistant\\n".

    Construction: one-hot token embeddings in dims [0, K) for the K tokens involved; a
    previous-token attention head (q, k from biases only, so scores depend on relative position
    through RoPE, peaked at offset 1) copies the previous token's one-hot into dims [K, 2K);
    the MLP and the other tokens' embeddings stay out of those dims; the LM head scores each
    (previous, current) pair's successor with a large margin, so both greedy and temperature-1
    sampling emit the text. Everything else is random (non-zero weights elsewhere).

    Args:
      config: a `Qwen2Config` with one layer, one query and one KV head, and hidden_size above
        twice the number of distinct tokens of the text (e.g. ``Qwen2Config(**FORCED_CONFIG)``).
      tokenizer: the Qwen2.5 tokenizer (``strata_jax.models.load_tokenizer()``).
      text: the reply the model writes (then <|im_end|>).
      seed: seed of the random weights outside the construction.
    Returns the params pytree (float32 jax arrays) for `config`.
    Raises ValueError when a token pair of the text has two successors or a successor does not
    win the head's additive scores (change the case of a tag).
    """
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ctx = tokenizer.encode("assistant\n", add_special_tokens=False)  # [..., 'assistant', '\n']
    seq = ctx[-2:] + ids + [im_end]
    succ: dict = {}
    for prev, cur, nxt in zip(seq, seq[1:], seq[2:]):
        if succ.setdefault((prev, cur), nxt) != nxt:
            raise ValueError(f"{text!r}: the token pair {(prev, cur)} has two successors; change "
                             f"the text (e.g. the case of a closing tag)")
    # The head scores are additive (current-token term + previous-token term): each pair's
    # successor must win outright, or the model silently writes another text.
    score: dict = {}
    for (prev, cur), nxt in succ.items():
        score[(nxt, "cur", cur)] = score.get((nxt, "cur", cur), 0) + 1
        score[(nxt, "prev", prev)] = score.get((nxt, "prev", prev), 0) + 1
    for (prev, cur), nxt in succ.items():
        s = {m: score.get((m, "cur", cur), 0) + score.get((m, "prev", prev), 0)
             for m in set(succ.values())}
        if [m for m in s if s[m] == max(s.values())] != [nxt]:
            raise ValueError(f"{text!r}: the successor of the token pair {(prev, cur)} does not "
                             f"win the additive head scores; change the case of a tag")
    vocab = sorted(set(seq))
    slot = {t: i for i, t in enumerate(vocab)}
    k = len(vocab)
    d, dh = config.hidden_size, config.head_dim
    assert 2 * k < d and config.num_layers == 1 and config.num_heads == 1 and config.num_kv_heads == 1
    # random layer weights from a small-vocab twin (the embedding and head are replaced below)
    small = dataclasses.replace(config, vocab_size=8, tie_word_embeddings=False)
    p = jax.tree.map(np.array, init_params(small, jax.random.key(seed)))
    rng = np.random.default_rng(seed)
    emb = np.zeros((config.vocab_size, d), np.float32)
    emb[:, 2 * k:] = rng.standard_normal((config.vocab_size, d - 2 * k), np.float32)
    emb[vocab] = 0.0
    for t in vocab:
        emb[t, slot[t]] = 1.0
    p["embed"] = emb
    layer = p["layers"][0]
    # previous-token head: q, k constant vectors; k pre-rotated by one position.
    half = dh // 2
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(half) * 2.0 / dh))
    qv = np.concatenate([np.ones(half), np.zeros(half)])
    kv = np.concatenate([np.cos(inv_freq), np.sin(inv_freq)])  # peak at offset +1
    scale = 60.0 / np.sum(1 - np.cos(inv_freq))  # score margin of offset 1 over 0 and 2
    layer["q_proj"][:] = 0.0
    layer["k_proj"][:] = 0.0
    layer["q_bias"][:] = qv * np.sqrt(scale * np.sqrt(dh))
    layer["k_bias"][:] = kv * np.sqrt(scale * np.sqrt(dh))
    layer["v_proj"][:] = 0.0
    layer["v_bias"][:] = 0.0
    # the attention input is RMS-normalised (a one-hot becomes sqrt(d) * one-hot): undo it.
    layer["v_proj"][np.arange(k), np.arange(k)] = 1.0 / np.sqrt(d)
    layer["o_proj"][:] = 0.0
    layer["o_proj"][k + np.arange(k), np.arange(k)] = 1.0
    layer["down_proj"][:] = 0.0
    layer["input_norm"][:] = 1.0
    p["final_norm"][:] = 1.0
    head = np.zeros((config.vocab_size, d), np.float32)
    for (prev, cur), nxt in succ.items():
        head[nxt, slot[cur]] += 4.0
        head[nxt, k + slot[prev]] += 4.0
    p["lm_head"] = head
    return jax.tree.map(jnp.asarray, p)
