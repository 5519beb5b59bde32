"""Self-judgment verdicts -> per-step judge flags (docs/method.md §5.4).

The judge answers ``<bad_steps>1, 4</bad_steps>`` or ``<bad_steps>none</bad_steps>``. Rules
[P]: the first block counts; its body is ``none`` (any case) or a list of integers (optionally
signed) separated by commas and / or whitespace; the rule is "keep the integers in [1, T]":
integers outside it (0, negatives, > T) are dropped, the others kept
(``<bad_steps>3, 2, -1</bad_steps>`` with T = 3 gives (2, 3)); anything else in the body
(words, decimals), a missing or unclosed block, or CJK text means "unparsable" = no bad steps.
"""
from __future__ import annotations

import re

import numpy as np

from envs_bridge.parsing import contains_cjk

_BLOCK_RE = re.compile(r"<bad_steps>(.*?)</bad_steps>", re.IGNORECASE | re.DOTALL)


def parse_bad_steps(verdict: str, num_steps: int) -> tuple[int, ...]:
    """The 1-based bad step indices named by a judge verdict.

    Args:
      verdict: the judge's decoded output.
      num_steps: T, the trajectory's step count.
    Returns:
      sorted unique ints in [1, T]; () for "none" or unparsable output.
    """
    if contains_cjk(verdict):
        return ()
    m = _BLOCK_RE.search(verdict)
    if m is None:
        return ()
    body = m.group(1).strip()
    if not body or body.lower() == "none":
        return ()
    parts = [p for p in re.split(r"[,\s]+", body) if p]
    if not all(re.fullmatch(r"[+-]?\d+", p) for p in parts):
        return ()
    return tuple(sorted({int(p) for p in parts if 1 <= int(p) <= num_steps}))


def judge_flags(bad_steps: tuple[int, ...], num_steps: int) -> np.ndarray:
    """[T] bool, True at 0-based step t when t + 1 is in `bad_steps`."""
    flags = np.zeros((num_steps,), bool)
    for s in bad_steps:
        if 1 <= s <= num_steps:
            flags[s - 1] = True
    return flags
