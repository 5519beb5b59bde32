"""The learning study's statistics (benchmarks/_stats.py) on hand-computed cases."""
from __future__ import annotations

import math

import pytest

from benchmarks import _stats as st


def test_wilson_interval_matches_the_formula():
    # Wilson (1927): (p + z^2/2n +- z sqrt(p(1-p)/n + z^2/4n^2)) / (1 + z^2/n), 2 of 8
    z, n, p = 1.959963984540054, 8, 0.25
    d = 1 + z * z / n
    mid, half = (p + z * z / (2 * n)) / d, z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    lo, hi = st.wilson(2, 8)
    assert lo == pytest.approx(mid - half, abs=1e-9) and hi == pytest.approx(mid + half, abs=1e-9)
    assert (round(lo, 4), round(hi, 4)) == (0.0715, 0.5907)
    assert st.wilson(0, 48)[0] == 0.0
    with pytest.raises(ValueError, match="0 <= k <= n"):
        st.wilson(9, 8)


def test_fisher_one_sided_is_the_hypergeometric_tail():
    # margins: 2 successes among 16 episodes, 8 per arm; P(arm 1 holds both) = C(8,2)/C(16,2)
    assert st.fisher_greater(2, 8, 0, 8) == pytest.approx(28 / 120)
    # the other direction: arm 1 holds none of them is no evidence at all
    assert st.fisher_greater(0, 8, 2, 8) == pytest.approx(1.0)


def test_mcnemar_counts_the_discordant_pairs():
    after = [True, True, True, False, False]
    before = [False, False, True, True, False]
    p, b, c = st.mcnemar_greater(after, before)
    assert (b, c) == (2, 1) and p == pytest.approx(4 / 8)     # P(Binom(3, 1/2) >= 2)
    assert st.mcnemar_greater([True] * 6, [False] * 6)[0] == pytest.approx(1 / 64)
    assert st.mcnemar_greater([True, False], [True, False]) == (1.0, 0, 0)
    with pytest.raises(ValueError, match="equal lengths"):
        st.mcnemar_greater([True], [True, False])


def test_cochran_armitage_by_hand():
    # p = 3/12; T = sum t (s - n p) = 2; Var = p q (sum n t^2 - (sum n t)^2 / N) = 0.1875 * 8
    z, p = st.cochran_armitage([0, 1, 2], [4, 4, 4])
    assert z == pytest.approx(2 / math.sqrt(1.5))
    assert p == pytest.approx(0.5 * math.erfc(z / math.sqrt(2)))
    assert st.cochran_armitage([2, 1, 0], [4, 4, 4])[0] == pytest.approx(-z)
    assert st.cochran_armitage([0, 0, 0], [4, 4, 4]) == (0.0, 1.0)


def test_fisher_power_and_the_detectable_rate():
    # equal rates: the rejection probability is the exact test's size, at most alpha
    assert st.fisher_power(0.1, 0.1, 20) <= 0.05
    # n=4 per arm: the only rejecting table is 4 of 4 against 0 of 4 (p = 1/70)
    assert st.fisher_power(0.5, 0.5, 4) == pytest.approx(0.5 ** 4 * 0.5 ** 4)
    p1 = st.detectable_rate(0.1, 48)
    assert st.fisher_power(p1, 0.1, 48) >= 0.8 > st.fisher_power(p1 - 0.01, 0.1, 48)
