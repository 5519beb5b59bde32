"""The statistics of a learning study: success rates with intervals, trained-vs-start tests,
a trend test over training rollouts, and the effect size a sample can detect.

Every test is one-sided in the direction the study claims (the trained policy succeeds MORE
often than its start; success RISES with iterations) and is computed by scipy.stats, a
well-kept library, except the Cochran-Armitage statistic, which is three lines over scipy's
normal distribution (scipy has no trend test for proportions).

- `wilson`: Wilson score interval of a binomial proportion (Wilson 1927; scipy's
  ``BinomTestResult.proportion_ci(method="wilson")``).
- `fisher_greater`: Fisher's exact test on two independent samples (e.g. trained vs start on
  separately drawn eval episodes), ``alternative="greater"``.
- `mcnemar_greater`: McNemar's exact test on paired outcomes (the same eval tasks played by
  both policies): a binomial test of the discordant pairs at p = 1/2 (McNemar 1947; the exact
  form, as ``binomtest``).
- `cochran_armitage`: trend in proportions over ordered groups (Armitage 1955), scores = the
  group index.
- `detectable_rate`: the smallest success rate a one-sided Fisher test at level alpha detects
  with the given power against a start rate, at n episodes per arm (exact power by enumerating
  both binomials).
"""
from __future__ import annotations

import math
from typing import Sequence

from scipy import stats


def wilson(k: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval (low, high) of k successes in n trials. Raises ValueError if
    n < 1 or k is outside [0, n]."""
    if n < 1 or not 0 <= k <= n:
        raise ValueError(f"need 0 <= k <= n and n >= 1, got k={k}, n={n}")
    ci = stats.binomtest(int(k), int(n)).proportion_ci(confidence_level=confidence,
                                                       method="wilson")
    return float(ci.low), float(ci.high)


def fisher_greater(k1: int, n1: int, k0: int, n0: int) -> float:
    """One-sided Fisher exact p-value that sample 1's success rate (k1 of n1) exceeds sample
    0's (k0 of n0)."""
    return float(stats.fisher_exact([[k1, n1 - k1], [k0, n0 - k0]],
                                    alternative="greater").pvalue)


def mcnemar_greater(after: Sequence[bool], before: Sequence[bool]) -> tuple[float, int, int]:
    """Exact one-sided McNemar test that `after` succeeds more often than `before` on the same
    tasks (paired by index). Returns (p, b, c): b = tasks only `after` solved, c = tasks only
    `before` solved; p = P(Binom(b + c, 1/2) >= b) (1.0 when there is no discordant pair).
    Raises ValueError when the two lists differ in length."""
    if len(after) != len(before):
        raise ValueError(f"paired outcomes need equal lengths, got {len(after)} and {len(before)}")
    b = sum(1 for a, o in zip(after, before) if a and not o)
    c = sum(1 for a, o in zip(after, before) if o and not a)
    if b + c == 0:
        return 1.0, 0, 0
    return float(stats.binomtest(b, b + c, 0.5, alternative="greater").pvalue), b, c


def cochran_armitage(successes: Sequence[int], totals: Sequence[int]) -> tuple[float, float]:
    """Cochran-Armitage test for an increasing trend of success over ordered groups (training
    iterations 0, 1, ...). Returns (z, one-sided p = P(Z >= z)); (0.0, 1.0) when every group
    has the same outcome (no variance). Raises ValueError on mismatched or empty inputs."""
    if len(successes) != len(totals) or not totals:
        raise ValueError("successes and totals must be non-empty and of equal length")
    n_all = sum(totals)
    p = sum(successes) / n_all
    t = range(len(totals))
    stat = sum(ti * (s - n * p) for ti, s, n in zip(t, successes, totals))
    var = p * (1 - p) * (sum(n * ti * ti for ti, n in zip(t, totals))
                         - sum(n * ti for ti, n in zip(t, totals)) ** 2 / n_all)
    if var <= 0:
        return 0.0, 1.0
    z = stat / math.sqrt(var)
    return float(z), float(stats.norm.sf(z))


def fisher_power(p1: float, p0: float, n: int, alpha: float = 0.05) -> float:
    """Exact power of the one-sided Fisher test (`fisher_greater`) at level `alpha` with n
    episodes per arm, when the arms' true rates are p1 and p0."""
    pm1 = stats.binom.pmf(range(n + 1), n, p1)
    pm0 = stats.binom.pmf(range(n + 1), n, p0)
    power = 0.0
    for k0 in range(n + 1):
        if pm0[k0] < 1e-12:
            continue
        # the rejection region in k1 is an upper tail: find its smallest member
        for k1 in range(k0, n + 1):
            if fisher_greater(k1, n, k0, n) < alpha:
                power += pm0[k0] * float(pm1[k1:].sum())
                break
    return power


def detectable_rate(p0: float, n: int, alpha: float = 0.05, power: float = 0.8,
                    step: float = 0.01) -> float:
    """Smallest rate p1 (on a grid of `step`) that a one-sided Fisher test at `alpha` detects
    against start rate p0 with at least `power`, n episodes per arm; 1.0 if none below it."""
    p1 = p0
    while p1 < 1.0:
        p1 = min(1.0, round(p1 + step, 10))
        if fisher_power(p1, p0, n, alpha) >= power:
            return p1
    return 1.0


def mean_t_interval(values: Sequence[float], confidence: float = 0.95
                    ) -> tuple[float, float, float]:
    """(mean, low, high): the mean of `values` (e.g. one gain per seed) with its Student t
    interval (n - 1 degrees of freedom; scipy.stats.t). One value: (v, nan, nan). Raises
    ValueError on an empty sequence."""
    n = len(values)
    if n == 0:
        raise ValueError("mean_t_interval needs at least one value")
    m = sum(values) / n
    if n == 1:
        return m, math.nan, math.nan
    sd = math.sqrt(sum((v - m) ** 2 for v in values) / (n - 1))
    half = float(stats.t.ppf(0.5 + confidence / 2, n - 1)) * sd / math.sqrt(n)
    return m, m - half, m + half


def welch_p(a: Sequence[float], b: Sequence[float]) -> float:
    """Two-sided Welch t-test p-value that the means of `a` and `b` (per-seed gains of two
    arms) differ (scipy.stats.ttest_ind, equal_var=False); nan with fewer than 2 per side or
    no spread in either."""
    if len(a) < 2 or len(b) < 2:
        return math.nan
    return float(stats.ttest_ind(a, b, equal_var=False).pvalue)


def wilcoxon_greater(diffs: Sequence[float]) -> float:
    """One-sided paired Wilcoxon signed-rank p-value that the paired differences `diffs`
    (after - before, e.g. one per task variation) lean positive (scipy.stats.wilcoxon,
    alternative "greater", zero differences dropped, the exact distribution when scipy can use
    it). 1.0 when every difference is 0; nan on an empty sequence."""
    d = [float(x) for x in diffs if float(x) != 0.0]
    if not diffs:
        return math.nan
    if not d:
        return 1.0
    return float(stats.wilcoxon(d, alternative="greater").pvalue)


def bootstrap_mean_interval(values: Sequence[float], confidence: float = 0.95,
                            resamples: int = 10000, seed: int = 0) -> tuple[float, float, float]:
    """(mean, low, high): the mean of `values` (e.g. paired score differences) with its
    percentile bootstrap interval over `resamples` resamples with replacement (numpy's
    default_rng(seed): the same interval every time). Raises ValueError on an empty sequence."""
    import numpy as np
    v = np.asarray(values, np.float64)
    if v.size == 0:
        raise ValueError("bootstrap_mean_interval needs at least one value")
    rng = np.random.default_rng(seed)
    means = v[rng.integers(0, v.size, size=(resamples, v.size))].mean(axis=1)
    tail = (1.0 - confidence) / 2
    lo, hi = np.quantile(means, [tail, 1.0 - tail])
    return float(v.mean()), float(lo), float(hi)


__all__ = ["wilson", "fisher_greater", "mcnemar_greater", "cochran_armitage", "fisher_power",
           "detectable_rate", "mean_t_interval", "welch_p", "wilcoxon_greater",
           "bootstrap_mean_interval"]
