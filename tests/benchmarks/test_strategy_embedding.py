"""benchmarks/strategy_embedding.py's helpers on hand values (no timing, no encoder)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from benchmarks.strategy_embedding import (candidate_sets, load_strategies,
                                           mean_pairwise_cosine_distance,
                                           mean_pairwise_word_jaccard)


def test_mean_pairwise_cosine_distance_hand_values():
    e = np.array([[1.0, 0.0], [0.0, 2.0], [-3.0, 0.0]])
    # pairs: (0,1) 1 - 0 = 1, (0,2) 1 - (-1) = 2, (1,2) 1 - 0 = 1 -> mean 4/3
    assert mean_pairwise_cosine_distance(e) == pytest.approx(4 / 3)
    assert mean_pairwise_cosine_distance(e[:1]) == 0.0
    # {go, north} / {go, south} share 1 of 3 words; {go, north} / {look} share 0 of 3; the
    # last pair 0 of 3: mean of (2/3, 1, 1)
    assert mean_pairwise_word_jaccard(["Go north", "go south", "look"]) == pytest.approx(8 / 9)


def test_candidate_sets_and_loading(tmp_path):
    pool = [("a", "<strategy>a</strategy>")] * 3 + [("b", "rb"), ("c", "rc")]
    sampled = candidate_sets(pool, "sampled", 6, 4, seed=0)
    assert [len(s) for s in sampled] == [6] * 4 and all(set(x) <= set(pool) for x in sampled)
    distinct = candidate_sets(pool, "distinct", 6, 4, seed=0)   # capped at 3 distinct texts
    assert all(sorted(z for z, _ in s) == ["a", "b", "c"] for s in distinct)
    run = tmp_path / "studies" / "x" / "results" / "r"
    run.mkdir(parents=True)
    ep = dict(env="memory_key", step=1, task_uid=0, strategy_id=0, strategy="go",
              strategy_raw="<strategy>go</strategy>", strategy_format_ok=True)
    lines = [ep, ep,                                     # M episodes of one strategy: once
             dict(ep, strategy_id=1, strategy="look", strategy_raw="<strategy>look</strategy>"),
             dict(ep, strategy_id=2, strategy_format_ok=False)]   # format failure: left out
    (run / "trajectories.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    assert load_strategies(str(tmp_path)) == {
        "memory_key": [("go", "<strategy>go</strategy>"), ("look", "<strategy>look</strategy>")]}
