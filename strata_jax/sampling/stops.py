"""Stop strings checked on device: a byte-level automaton folded into a token transition table.

Why not token ids: a byte-level BPE spells a string such as ``</action>`` in many ways
(``'</' 'action' '>'``, ``'.</' 'action' '>\\n'``, ...); the string may start in the middle of one
token and end in the middle of another. Matching the tail of the generated ids against a list of
id sequences misses spellings; matching decoded text needs a host round trip per token. Here
(decided for the sampler) the stop condition is a deterministic finite automaton over the
*bytes* of the generated text, and since every token is a fixed byte string, the automaton's
effect of a whole token is precomputed once per (tokenizer, patterns):

    table[s, t] = the state after feeding the bytes of token t to the automaton in state s.

The decode loop then carries one int32 state per row and does one gather per step,
``state = table[state, token]``, and a row stops when ``state == accept``. Exact for every
spelling, a few integer ops per row per step, no host sync, fixed shapes (no recompilation).

Patterns are matched IN ORDER: ``("</think>", "<action>", "</action>")`` accepts at the first
``</action>`` that follows an ``<action>`` that follows a ``</think>``, i.e. at the end of the
first action block after the closed think block, which is the parser's rule
(`envs_bridge.parsing`): an action block written inside the think block, or a stray
``</action>`` before the block, does not stop generation. Matching is ASCII case-insensitive (``</ACTION>``
counts), as the parser's tag matching is. Each pattern is tracked with Knuth-Morris-Pratt
failure links, so overlapping partial matches (``<</action>``) are found. A special token (``<|im_end|>``
etc.) or an id the tokenizer does not know spells no text: it resets the progress on the current
pattern. The row stops on the token that completes the last pattern; that token may carry more
characters of the same BPE piece (``'>\\n'``), which then stay in the output.

Source: KMP (Knuth, Morris, Pratt 1977); the same "stop string across token boundaries" problem
is handled on the host by vLLM / HF ``StopStringCriteria`` (the latter also with precomputed
per-token tables).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import numpy as np

STATE_BUCKET = 32  # table rows are padded to a multiple of this: one compiled shape for most patterns


@dataclasses.dataclass(frozen=True, eq=False)
class StopText:
    """A compiled ordered stop-string pattern (see the module docstring).

    Hashes by identity (cheap, stable), so it can sit in a frozen `SamplingParams`.

    Attributes:
      patterns: the strings, matched in order.
      table: [S, V] int16 transition table, S a multiple of `STATE_BUCKET`, V the vocabulary it
        was built for; state 0 = start.
      accept: the accepting state (absorbing).
      reset: [S] int16, the transition of a token that spells no text (specials, unknown ids);
        used to widen the table to a larger model vocabulary.
    """

    patterns: tuple[str, ...]
    table: np.ndarray
    accept: int
    reset: np.ndarray

    @property
    def vocab_size(self) -> int:
        """Columns of the table (token ids it knows)."""
        return int(self.table.shape[1])

    def table_for_vocab(self, vocab_size: int) -> np.ndarray:
        """The table with exactly `vocab_size` columns: extra model ids get the `reset`
        column (they spell nothing), ids beyond the model are dropped."""
        v = self.vocab_size
        if vocab_size <= v:
            return self.table[:, :vocab_size]
        extra = np.repeat(self.reset[:, None], vocab_size - v, axis=1)
        return np.concatenate([self.table, extra], axis=1)

    def scan(self, token_ids: Sequence[int]) -> int:
        """Host mirror of the device check: the number of ids up to and including the one that
        completes the patterns, or 0 when they are not completed."""
        s = 0
        for n, t in enumerate(token_ids, start=1):
            t = int(t)
            s = int(self.table[s, t]) if 0 <= t < self.vocab_size else int(self.reset[s])
            if s == self.accept:
                return n
        return 0


def _kmp_delta(p: bytes) -> np.ndarray:
    """[len(p) + 1, 256] KMP automaton of one pattern: state q = bytes of p matched so far."""
    m = len(p)
    delta = np.zeros((m + 1, 256), np.int32)
    delta[0, p[0]] = 1
    x = 0  # state of the longest proper border
    for q in range(1, m + 1):
        delta[q] = delta[x]
        if q < m:
            delta[q, p[q]] = q + 1
            x = int(delta[x, p[q]])
    return delta


def _byte_automaton(patterns: Sequence[bytes]) -> tuple[np.ndarray, np.ndarray, int]:
    """Global byte transitions [n_states, 256], reset transitions [n_states], accept state.

    Pattern j owns states offset_j .. offset_j + len(p_j) - 1; completing it moves to the first
    state of pattern j + 1 (or to accept after the last one).
    """
    offsets = np.cumsum([0] + [len(p) for p in patterns])
    accept = int(offsets[-1])
    n = accept + 1
    trans = np.zeros((n, 256), np.int32)
    reset = np.zeros((n,), np.int32)
    for j, p in enumerate(patterns):
        d = _kmp_delta(p)[: len(p)]  # states 0 .. m-1 of this pattern
        done = int(offsets[j + 1])    # next pattern's first state, or accept
        trans[offsets[j]: offsets[j] + len(p)] = np.where(d == len(p), done, d + offsets[j])
        reset[offsets[j]: offsets[j] + len(p)] = offsets[j]
    trans[accept] = accept
    reset[accept] = accept
    # ASCII case-insensitive, as the parser's tag regexes: an upper-case letter acts as its
    # lower-case twin (the patterns are lower-cased by the caller).
    upper = np.arange(ord("A"), ord("Z") + 1)
    trans[:, upper] = trans[:, upper + 32]
    return trans, reset, accept


def _ascii_lower(text: str) -> str:
    return "".join(ch.lower() if "A" <= ch <= "Z" else ch for ch in text)


def build_stop_text_from_bytes(token_bytes: Sequence[bytes | None],
                               patterns: Sequence[str]) -> StopText:
    """Compile `patterns` for a vocabulary given as one byte string per id.

    Args:
      token_bytes: V entries, the UTF-8 bytes each id adds to the text, or None for ids that
        spell no text (special tokens).
      patterns: one or more non-empty strings, matched in order, ASCII case-insensitively.
    Returns:
      `StopText` with a [S, V] table.
    Raises:
      ValueError: no pattern, an empty pattern, or more states than int16 holds.
    """
    pats = tuple(str(p) for p in patterns)
    if not pats or any(not p for p in pats):
        raise ValueError(f"stop patterns must be one or more non-empty strings, got {patterns!r}")
    trans, reset, accept = _byte_automaton([_ascii_lower(p).encode("utf-8") for p in pats])
    n_states = trans.shape[0]
    s_pad = -(-n_states // STATE_BUCKET) * STATE_BUCKET
    if s_pad > np.iinfo(np.int16).max:
        raise ValueError(f"stop patterns {pats!r} need {n_states} states; keep them shorter")
    v = len(token_bytes)
    lens = np.zeros((v,), np.int64)
    is_text = np.zeros((v,), bool)
    for i, b in enumerate(token_bytes):
        if b is not None:
            lens[i], is_text[i] = len(b), True
    # Feed every token's bytes from every state at once, longest tokens first, so column c only
    # touches the tokens longer than c: total work = states x total bytes of the vocabulary.
    order = np.argsort(-lens, kind="stable")
    width = int(lens.max()) if v else 0
    mat = np.zeros((v, max(width, 1)), np.uint8)
    for r, i in enumerate(order):
        b = token_bytes[i]
        if b:
            mat[r, : len(b)] = np.frombuffer(b, np.uint8)
    cur = np.repeat(np.arange(n_states, dtype=np.int32)[:, None], v, axis=1)  # [S, V], sorted ids
    sorted_lens = lens[order]
    for c in range(width):
        k = int(np.sum(sorted_lens > c))  # tokens longer than c: the first k (sorted)
        if k == 0:
            break
        cur[:, :k] = trans[cur[:, :k], mat[None, :k, c]]
    table = np.zeros((s_pad, v), np.int16)
    table[:n_states, order] = cur
    # Ids that spell nothing reset the current pattern's progress.
    table[:n_states, ~is_text] = reset[:, None]
    reset_pad = np.zeros((s_pad,), np.int16)
    reset_pad[:n_states] = reset
    return StopText(pats, table, int(accept), reset_pad)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map used by byte-level BPE vocabularies."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1))
          + list(range(ord("\xae"), ord("\xff") + 1)))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def token_bytes(tokenizer: Any) -> list[bytes | None]:
    """The bytes each id of a transformers tokenizer adds to the decoded text (None for
    special tokens), for every id below ``len(tokenizer)``.

    Byte-level BPE pieces (Qwen2.5, GPT-2 style) are mapped back through the byte alphabet;
    added non-special tokens (``<tool_call>``) give their content; a piece outside the byte
    alphabet (a non byte-level tokenizer) falls back to ``decode([id])``.
    """
    inv = {c: b for b, c in _bytes_to_unicode().items()}
    n = len(tokenizer)
    special = set(getattr(tokenizer, "all_special_ids", ()) or ())
    added = {int(i): t.content for i, t in (getattr(tokenizer, "added_tokens_decoder", {}) or {}).items()}
    pieces = tokenizer.convert_ids_to_tokens(list(range(n)))
    out: list[bytes | None] = []
    for i, piece in enumerate(pieces):
        if i in special or piece is None:
            out.append(None)
        elif i in added:
            out.append(added[i].encode("utf-8"))
        elif all(ch in inv for ch in piece):
            out.append(bytes(inv[ch] for ch in piece))
        else:
            out.append(tokenizer.decode([i]).encode("utf-8"))
    return out


@functools.lru_cache(maxsize=4)
def _cached_bytes(tokenizer: Any) -> list[bytes | None]:
    return token_bytes(tokenizer)


@functools.lru_cache(maxsize=16)
def _cached(tokenizer: Any, patterns: tuple[str, ...]) -> StopText:
    return build_stop_text_from_bytes(_cached_bytes(tokenizer), patterns)


def build_stop_text(tokenizer: Any, patterns: Sequence[str]) -> StopText:
    """`StopText` for a transformers tokenizer (cached per tokenizer object and patterns).

    Args:
      tokenizer: e.g. ``strata_jax.models.load_tokenizer(None)``.
      patterns: strings matched in order, e.g. ``("</think>", "<action>", "</action>")``.
    Raises:
      ValueError: see `build_stop_text_from_bytes`.
    """
    return _cached(tokenizer, tuple(patterns))
