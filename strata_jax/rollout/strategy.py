"""StraTA strategies: the format check (P_fmt, |z|) and farthest-point selection (FPS).

Source: docs/method.md §5.1-§5.2 (the strategy body, P_fmt, |z|, greedy max-min cosine FPS,
format failures dropped first and used only as fill).
"""
from __future__ import annotations

import dataclasses
import re
from typing import Callable, Sequence

import numpy as np

from envs_bridge.parsing import contains_cjk

_OPEN_RE = re.compile(r"<strategy>", re.IGNORECASE)
_CLOSE_RE = re.compile(r"</strategy>", re.IGNORECASE)
_BLOCK_RE = re.compile(r"<strategy>(.*?)</strategy>", re.IGNORECASE | re.DOTALL)


@dataclasses.dataclass(frozen=True)
class StrategyCheck:
    """Result of `check_strategy`.

    Attributes:
      text: z as it is prepended to the step prompts: the stripped body of the first
        ``<strategy>`` block, or, when there is no closed block, the whole stripped output
        (a failed candidate used as fill still needs some plan text).
      token_len: |z|, the token count of `text` (the estimator's P_len input).
      format_fail: P_fmt = 1 (bool): not exactly one non-empty block, truncated, or CJK.
      reason: why it failed ("" when it passed), for logs.
    """

    text: str
    token_len: int
    format_fail: bool
    reason: str = ""


def check_strategy(output: str, truncated: bool,
                   count_tokens: Callable[[str], int]) -> StrategyCheck:
    """Check one strategy candidate (docs/method.md §5.1).

    Args:
      output: the decoded generation (stop token removed).
      truncated: the generation hit the token limit (finish reason "length").
      count_tokens: text -> token count (the policy's tokenizer, no special tokens).
    Returns:
      `StrategyCheck`; never raises on any string.
    """
    blocks = _BLOCK_RE.findall(output)
    z = blocks[0].strip() if blocks else output.strip()
    n_open, n_close = len(_OPEN_RE.findall(output)), len(_CLOSE_RE.findall(output))
    reason = ""
    if truncated:
        reason = "truncated at the token limit"
    elif not blocks:
        reason = "no closed <strategy> block"
    elif n_open != 1 or n_close != 1:
        reason = f"{n_open} <strategy> / {n_close} </strategy> tags, need exactly one block"
    elif not z:
        reason = "empty <strategy> block"
    elif contains_cjk(output):
        reason = "cjk"
    return StrategyCheck(z, int(count_tokens(z)) if z else 0, bool(reason), reason)


def _unit_rows(embeddings: np.ndarray) -> np.ndarray:
    x = np.asarray(embeddings, np.float64)
    if x.ndim != 2:
        raise ValueError(f"embeddings must be [n, D], got shape {x.shape}")
    norm = np.linalg.norm(x, axis=1, keepdims=True)
    return np.where(norm > 0, x / np.where(norm > 0, norm, 1.0), 0.0)


def farthest_point_selection(embeddings: np.ndarray, k: int, *,
                             candidates: Sequence[int] | None = None,
                             selected: Sequence[int] = (), first: int | None = None,
                             rng: np.random.Generator | None = None) -> list[int]:
    """Greedy max-min cosine-distance selection (farthest-point sampling).

    Distance = 1 - cosine similarity (a zero vector has similarity 0 to everything). With
    nothing `selected` yet, the first point is `first` if given, else drawn uniformly from
    `candidates` by `rng` (else the lowest candidate). Each next point maximises its minimum
    distance to the points chosen so far; ties go to the lowest index.

    Args:
      embeddings: [n, D] float.
      k: points to add (at most the number of candidates not already selected).
      candidates: indices allowed to be picked (default all).
      selected: indices already chosen (they count for the distances, are not returned).
      first: explicit first point (must be a candidate), used only when `selected` is empty.
      rng: numpy Generator for the first point.
    Returns:
      the k newly chosen indices, in selection order.
    Raises:
      ValueError: bad shapes, k larger than the candidates left, or `first` not a candidate.
    """
    x = _unit_rows(embeddings)
    n = x.shape[0]
    cand = list(range(n)) if candidates is None else sorted(int(c) for c in candidates)
    chosen = [int(s) for s in selected]
    pool = [c for c in cand if c not in chosen]
    if k > len(pool):
        raise ValueError(f"asked for {k} points but only {len(pool)} candidates are left")
    if k <= 0:
        return []
    out: list[int] = []
    if not chosen:
        if first is None:
            first = pool[int(rng.integers(len(pool)))] if rng is not None else pool[0]
        if first not in pool:
            raise ValueError(f"first point {first} is not among the candidates {pool}")
        out.append(int(first))
        chosen.append(int(first))
    sims = x @ x.T
    min_dist = np.min(1.0 - sims[:, chosen], axis=1)
    while len(out) < k:
        mask = np.full(n, -np.inf)
        free = [c for c in pool if c not in chosen]
        mask[free] = min_dist[free]
        nxt = int(np.argmax(mask))  # argmax returns the lowest index among equal maxima
        out.append(nxt)
        chosen.append(nxt)
        min_dist = np.minimum(min_dist, 1.0 - sims[:, nxt])
    return out


def select_strategies(embeddings: np.ndarray, format_fail: Sequence[bool], k: int, *,
                      diverse: bool = True, first: int | None = None,
                      rng: np.random.Generator | None = None) -> list[int]:
    """Pick the k strategies of one task from its candidates (docs/method.md §5.2).

    Format failures are dropped first; FPS runs over the passing candidates; if fewer than k
    pass, all passing ones are kept and the rest is filled with failed candidates, continuing
    the same max-min rule (they keep their P_fmt penalty). With ``diverse=False`` the first k
    passing candidates are kept (then the first failed ones), no FPS.

    Args:
      embeddings: [n, D]; format_fail: [n] bool; k <= n.
      first / rng: see `farthest_point_selection` (first must be a passing candidate).
    Returns:
      k candidate indices: the passing ones first, in selection order.
    Raises:
      ValueError: k > n or mismatched lengths.
    """
    fail = np.asarray(format_fail, bool)
    n = fail.shape[0]
    if np.shape(embeddings)[0] != n:
        raise ValueError(f"{np.shape(embeddings)[0]} embeddings for {n} format flags")
    if k > n:
        raise ValueError(f"cannot keep {k} strategies out of {n} candidates; raise the oversample")
    good = [i for i in range(n) if not fail[i]]
    bad = [i for i in range(n) if fail[i]]
    if not diverse:
        return (good + bad)[:k]
    if len(good) >= k:
        return farthest_point_selection(embeddings, k, candidates=good, first=first, rng=rng)
    if not good:
        return farthest_point_selection(embeddings, k, candidates=bad, first=first, rng=rng)
    kept = farthest_point_selection(embeddings, len(good), candidates=good, first=first, rng=rng)
    return kept + farthest_point_selection(embeddings, k - len(good), candidates=bad,
                                           selected=kept)
