"""Strategy format check (P_fmt, |z|) and farthest-point selection on hand-made embeddings."""
from __future__ import annotations

import numpy as np
import pytest

from strata_jax.rollout import check_strategy, farthest_point_selection, select_strategies

count = lambda s: len(s.split())  # noqa: E731  (a transparent token counter for the checks)


def test_check_strategy_rules():
    ok = check_strategy("Sure. <strategy> go north twice then enter 123 </strategy>", False, count)
    assert (ok.text, ok.token_len, ok.format_fail) == ("go north twice then enter 123", 6, False)
    assert check_strategy("<Strategy>a b</STRATEGY>", False, count).format_fail is False
    cases = {
        "truncated": ("<strategy>a b</strategy>", True),
        "two blocks": ("<strategy>a</strategy><strategy>b</strategy>", False),
        "empty": ("<strategy>  </strategy>", False),
        "unclosed": ("<strategy>a b c", False),
        "cjk": ("<strategy>先 go north</strategy>", False),
        "stray open tag": ("<strategy>a</strategy> <strategy>", False),
        # nothing a reader could see: zero-width space / joiners, word joiner, BOM, soft
        # hyphen, hangul filler, braille blank, controls, a lone combining mark
        "zero-width": ("<strategy>\u200b\u200c\u200d</strategy>", False),
        "word joiner + bom + shy": ("<strategy>\u2060\ufeff\u00ad</strategy>", False),
        "hangul filler + braille blank": ("<strategy>\u3164 \u2800</strategy>", False),
        "controls + combining": ("<strategy>\x01\x7f\u0301\u034f</strategy>", False),
    }
    for name, (text, trunc) in cases.items():
        assert check_strategy(text, trunc, count).format_fail, name
    blank = check_strategy("<strategy>\u3164\u2800\u200b</strategy>", False, count)
    assert (blank.format_fail, blank.reason) == (True, "empty <strategy> block")
    # a readable plan with invisible characters in it still passes
    assert check_strategy("<strategy>go\u200b north</strategy>", False, count).format_fail is False
    # |z| is counted on the first block's body even when the candidate fails
    two = check_strategy("<strategy>a b</strategy><strategy>c</strategy>", False, count)
    assert (two.text, two.token_len) == ("a b", 2)
    none = check_strategy("  just walk north  ", False, count)
    assert (none.text, none.token_len, none.format_fail) == ("just walk north", 3, True)


def test_fps_hand_made_embeddings():
    # unit vectors at angles 0, 10, 90, 180, 100 degrees
    ang = np.deg2rad([0, 10, 90, 180, 100])
    e = np.stack([np.cos(ang), np.sin(ang)], 1) * np.array([[1], [3], [2], [1], [5]])  # norms irrelevant
    # from 0: farthest is 3 (180deg, dist 2); then min distance to {0, 3}: 1 -> 1-cos10 = 0.015,
    # 2 -> 1-cos90 = 1, 4 -> min(1-cos100, 1-cos80) = 0.83; so 2; then 4 (0.015 vs 0.17... ):
    # 1 -> 0.015, 4 -> min(0.83, 1-cos10) = 0.015 is a float near-tie, so stop at 3 points
    assert farthest_point_selection(e, 3, first=0) == [0, 3, 2]
    # from 4 (100deg): 0 is 100deg away (1.17), 3 is 80deg (0.83), 1 is 90deg (1.0) -> 0; then
    # min distance to {4, 0}: 1 -> 0.015, 2 -> 0.015, 3 -> min(0.83, 2) = 0.83 -> 3
    assert farthest_point_selection(e, 3, first=4) == [4, 0, 3]
    # ties go to the lowest index: 1 and 2 are both at distance 1 from 0
    tie = np.array([[1.0, 0, 0], [0, 1, 0], [0, 0, 1], [1, 0, 0]])
    assert farthest_point_selection(tie, 3, first=0) == [0, 1, 2]
    assert farthest_point_selection(tie, 2, first=3) == [3, 1]
    # a restricted candidate set and already-selected points
    assert farthest_point_selection(e, 1, candidates=[1, 2, 4], selected=[0]) == [4]
    # random first point from the seeded rng
    rng_first = int(np.random.default_rng(7).integers(5))
    assert farthest_point_selection(e, 1, rng=np.random.default_rng(7)) == [rng_first]
    with pytest.raises(ValueError, match="candidates"):
        farthest_point_selection(e, 6)
    with pytest.raises(ValueError, match="not among"):
        farthest_point_selection(e, 2, candidates=[1, 2], first=0)


def test_select_drops_failures_then_fills():
    ang = np.deg2rad([0, 180, 90, 45, 170])
    e = np.stack([np.cos(ang), np.sin(ang)], 1)
    fail = [False, True, False, False, True]
    # failures dropped: FPS over {0, 2, 3} from 0 -> 2 (90deg) beats 3 (45deg)
    assert select_strategies(e, fail, 2, first=0) == [0, 2]
    # 3 passing < 4 wanted: all passing (FPS order), then the failed one farthest from them
    assert select_strategies(e, fail, 4, first=0) == [0, 2, 3, 1]
    # no passing candidate: FPS over the failed ones
    assert select_strategies(e, [True] * 5, 2, first=4) == [4, 0]
    # no FPS: the first passing ones, then failed ones
    assert select_strategies(e, fail, 4, diverse=False) == [0, 2, 3, 1]
    with pytest.raises(ValueError, match="oversample"):
        select_strategies(e, fail, 6)
