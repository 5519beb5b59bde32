"""strata_jax/buckets.py's run-planned widths: `plan_rungs` against an exhaustive search, by
hand, and at its edges; `rung_for`."""
import itertools

import numpy as np
import pytest

from strata_jax.buckets import plan_rungs, rung_for


def _padded_sum(sizes, rungs, multiple):
    return sum(rung_for(-(-max(n, 1) // multiple) * multiple, rungs) for n in sizes)


def _best_by_search(sizes, k, multiple):
    """The least padded sum over every set of <= k rungs drawn from the rounded sizes that
    holds the largest (a rung between two rounded sizes only pads more than the next one up)."""
    vals = sorted({-(-max(n, 1) // multiple) * multiple for n in sizes})
    best = None
    for m in range(1, k + 1):
        for rest in itertools.combinations(vals[:-1], m - 1):
            rungs = (*rest, vals[-1])
            key = (_padded_sum(sizes, rungs, multiple), m)
            if best is None or key < best[0]:
                best = (key, tuple(sorted(rungs)))
    return best


def test_plan_rungs_by_hand():
    # rounded to 8: 16, 16, 32, 32, 104. {32, 104}: 4 * 32 + 104 = 232 beats {16, 104}: 344
    assert plan_rungs([10, 12, 30, 31, 100], k=2, multiple=8) == (32, 104)
    assert plan_rungs([10, 12, 30, 31, 100], k=1, multiple=8) == (104,)
    # three rungs: 2 * 16 + 2 * 32 + 104 = 200
    assert plan_rungs([10, 12, 30, 31, 100], k=3, multiple=8) == (16, 32, 104)
    # more rungs than distinct sizes: one rung per size, never a rung nobody needs
    assert plan_rungs([8, 16], k=4, multiple=8) == (8, 16)
    # 0 counts as 1; every rung a multiple
    assert plan_rungs([0, 0], k=2, multiple=64) == (64,)
    assert plan_rungs([2, 2, 1], k=2) == (1, 2) and plan_rungs([2, 2, 1], k=1) == (2,)


@pytest.mark.parametrize("seed", range(6))
def test_plan_rungs_is_the_exhaustive_optimum(seed):
    rng = np.random.default_rng(seed)
    sizes = [int(x) for x in rng.integers(0, 300, size=int(rng.integers(1, 40)))]
    for k in (1, 2, 3):
        for multiple in (1, 8, 64):
            rungs = plan_rungs(sizes, k, multiple)
            (cost, count), _ = _best_by_search(sizes, k, multiple)
            assert len(rungs) == count <= k and all(r % multiple == 0 for r in rungs)
            assert _padded_sum(sizes, rungs, multiple) == cost, (sizes, k, multiple, rungs)
            assert max(rungs) == -(-max(max(sizes), 1) // multiple) * multiple


def test_plan_rungs_and_rung_for_refuse_what_they_cannot_plan():
    with pytest.raises(ValueError, match="at least one size"):
        plan_rungs([], 2)
    with pytest.raises(ValueError, match="at least one size"):
        plan_rungs([3, -1], 2)
    with pytest.raises(ValueError, match="k >= 1"):
        plan_rungs([3], 0)
    assert rung_for(17, (16, 32)) == 32 and rung_for(16, (32, 16)) == 16
    with pytest.raises(ValueError, match="exceeds every planned rung"):
        rung_for(33, (16, 32))
