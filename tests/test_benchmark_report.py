"""The benchmark scripts' summaries: decode figures only when measurable (no timings run)."""
from __future__ import annotations

import pytest

from benchmarks.sampler import summarize


def test_sampler_summary_medians_spread_and_unmeasurable():
    runs = [{"total": 3.0, "prefill": 1.0, "decode": 2.0},
            {"total": 2.5, "prefill": 0.9, "decode": 1.6},
            {"total": 4.0, "prefill": 1.2, "decode": 2.5}]
    s = summarize(runs, batch=8, new=65)
    assert s["decode"] == 2.0 and s["prefill"] == 1.0 and s["total"] == 3.0
    assert s["total_tps"] == pytest.approx(8 * 65 / 3.0)
    assert s["decode_tps"] == pytest.approx(8 * 64 / 2.0)          # 256 tok/s
    assert s["spread"] == pytest.approx((8 * 64 / 2.5, 8 * 64 / 1.6))
    # A repeat whose 1-token run took longer than the N-token one: never a figure.
    bad = runs[:2] + [{"total": 1.0, "prefill": 1.1, "decode": -0.1}]
    assert summarize(bad, 8, 65)["decode_tps"] is None
    # Spread wider than the median decode time itself: not measurable either.
    noisy = [{"total": 1, "prefill": 0.5, "decode": d} for d in (0.01, 0.02, 0.5)]
    assert summarize(noisy, 8, 65)["decode_tps"] is None
