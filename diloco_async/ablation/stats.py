"""Statistics of an ablation: intervals per arm, paired differences and a verdict per claim.

Pure functions, no I/O, on ``scipy.stats``. Intervals are two-sided at ``confidence`` (0.95 by
default): Student t and a percentile bootstrap of the mean with a seeded generator. A comparison
of arm ``b`` against arm ``a`` is the difference ``b - a``: per seed when both arms ran the same
seeds (paired: same model initialisation and data order), else Welch's interval of the
difference of means.

A :class:`Claim` is what the paper says about ``b - a``, fixed in the suite file before running:

* ``lower`` / ``higher``: reproduced when the interval excludes zero on that side, not
  reproduced when it excludes zero on the other side, inconclusive otherwise;
* ``equivalent`` (margin ``m`` > 0): reproduced when the whole interval lies in [-m, m], not
  reproduced when it lies wholly outside (beyond ``m`` or below ``-m``), inconclusive otherwise;
* ``not-higher`` / ``not-lower`` (non-inferiority, margin ``m`` >= 0): reproduced when the
  interval's upper end is <= ``m`` (lower end >= ``-m``), not reproduced when its lower end is
  > ``m`` (upper end < ``-m``), inconclusive otherwise.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from scipy import stats

__all__ = ["Interval", "Claim", "CLAIM_KINDS", "VERDICTS", "t_quantile", "t_cdf", "t_interval",
           "bootstrap_interval", "difference_interval", "verdict"]

CLAIM_KINDS = ("lower", "higher", "equivalent", "not-higher", "not-lower")
VERDICTS = ("reproduced", "not reproduced", "inconclusive")


@dataclass(frozen=True)
class Interval:
    """A mean with its spread and a two-sided interval.

    Attributes:
        mean: the sample mean (of the values, or of the per-seed differences).
        sd: sample standard deviation (n - 1); 0 for one value.
        n: number of values (pairs, for a paired difference).
        low, high: the interval's ends (``-inf``/``inf`` when ``n`` < 2: nothing is excluded).
        method: ``t``, ``bootstrap``, ``paired-t`` or ``welch-t``.
        confidence: e.g. 0.95.
    """

    mean: float
    sd: float
    n: int
    low: float
    high: float
    method: str
    confidence: float = 0.95

    @property
    def half_width(self) -> float:
        return (self.high - self.low) / 2

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Claim:
    """What the paper says about ``b - a`` of one figure (see the module's docstring).

    Raises:
        ValueError: an unknown ``kind``, or a margin missing (equivalent: > 0) or negative.
    """

    kind: str
    margin: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in CLAIM_KINDS:
            raise ValueError(f"claim kind {self.kind!r} unknown; known: {', '.join(CLAIM_KINDS)}")
        if not math.isfinite(self.margin) or self.margin < 0:
            raise ValueError(f"claim margin must be a finite number >= 0, got {self.margin}")
        if self.kind == "equivalent" and self.margin <= 0:
            raise ValueError("an equivalence claim needs a margin > 0, fixed before running")


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with ``df`` > 0 degrees of freedom (need not be an integer):
    ``scipy.stats.t.cdf``.

    Raises:
        ValueError: ``df`` <= 0 (SciPy would answer NaN).
    """
    if not df > 0:
        raise ValueError(f"degrees of freedom must be > 0, got {df}")
    return float(stats.t.cdf(t, df))


def t_quantile(p: float, df: float) -> float:
    """The ``p`` quantile of Student's t with ``df`` degrees of freedom (``scipy.stats.t.ppf``),
    e.g. ``t_quantile(0.975, 4)`` = 2.7764.

    Raises:
        ValueError: ``p`` not in (0, 1) or ``df`` <= 0 (SciPy would answer NaN or an infinity).
    """
    if not 0.0 < p < 1.0:
        raise ValueError(f"p must be in (0, 1), got {p}")
    if not df > 0:
        raise ValueError(f"degrees of freedom must be > 0, got {df}")
    return float(stats.t.ppf(p, df))


def _finite(values: list[float], what: str) -> list[float]:
    out = [float(v) for v in values]
    if not out:
        raise ValueError(f"{what}: no values")
    bad = [v for v in out if not math.isfinite(v)]
    if bad:
        raise ValueError(f"{what}: non-finite values {bad}")
    return out


def _check_confidence(confidence: float) -> None:
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")


def _ends(test: Callable[[], Any], confidence: float, mean: float, spread: float) -> tuple[float, float]:
    """The two-sided ``confidence`` interval of the SciPy t test ``test()``, as floats; with no
    ``spread`` (sd or standard error 0) the point ``[mean, mean]``, where SciPy would warn of a
    catastrophic cancellation or answer NaN."""
    if spread == 0.0:
        return mean, mean
    ci = test().confidence_interval(confidence_level=confidence)
    return float(ci.low), float(ci.high)


def t_interval(values: list[float], confidence: float = 0.95, method: str = "t") -> Interval:
    """Mean, sd and the Student t interval of the mean of ``values`` (floats, any unit): the
    interval of ``scipy.stats.ttest_1samp``; ``method`` only labels the result.

    Raises:
        ValueError: no values, a non-finite value, or ``confidence`` not in (0, 1).
    """
    xs = _finite(values, "t_interval")
    _check_confidence(confidence)
    mean = statistics.fmean(xs)
    if len(xs) < 2:
        return Interval(mean, 0.0, len(xs), -math.inf, math.inf, method, confidence)
    sd = statistics.stdev(xs)
    low, high = _ends(lambda: stats.ttest_1samp(xs, 0.0), confidence, mean, sd)
    return Interval(mean, sd, len(xs), low, high, method, confidence)


def bootstrap_interval(values: list[float], seed: int, confidence: float = 0.95,
                       resamples: int = 4000) -> Interval:
    """Percentile bootstrap interval of the mean (``scipy.stats.bootstrap``, ``method="percentile"``):
    ``resamples`` resamples with replacement drawn by ``numpy.random.default_rng(seed)`` (the same
    seed gives the same interval).

    Raises:
        ValueError: no values, a non-finite value, ``resamples`` < 100, ``confidence`` not in (0, 1).
    """
    xs = _finite(values, "bootstrap_interval")
    if resamples < 100:
        raise ValueError(f"resamples must be >= 100, got {resamples}")
    _check_confidence(confidence)
    mean, n = statistics.fmean(xs), len(xs)
    if n < 2:
        return Interval(mean, 0.0, n, -math.inf, math.inf, "bootstrap", confidence)
    boot = stats.bootstrap((np.asarray(xs),), np.mean, n_resamples=resamples, confidence_level=confidence,
                           method="percentile", rng=np.random.default_rng(seed))
    low, high = float(boot.confidence_interval.low), float(boot.confidence_interval.high)
    return Interval(mean, statistics.stdev(xs), n, low, high, "bootstrap", confidence)


def difference_interval(a: dict[int, float], b: dict[int, float], confidence: float = 0.95) -> Interval:
    """Interval of ``b - a``, each a map seed -> value. When at least two seeds are in both, the
    paired t interval over the shared seeds (``scipy.stats.ttest_rel``; ``sd`` is that of the
    per-seed differences); otherwise Welch's t interval of the difference of the two means
    (``scipy.stats.ttest_ind(equal_var=False)``, Welch-Satterthwaite degrees of freedom; ``sd`` is
    the standard error of the difference, ``n`` the smaller arm).

    Raises:
        ValueError: an arm without values, a non-finite value, or ``confidence`` not in (0, 1).
    """
    _check_confidence(confidence)
    shared = sorted(set(a) & set(b))
    if len(shared) >= 2:
        xa = _finite([a[s] for s in shared], "arm a")
        xb = _finite([b[s] for s in shared], "arm b")
        diffs = [vb - va for va, vb in zip(xa, xb, strict=True)]
        mean, sd = statistics.fmean(diffs), statistics.stdev(diffs)
        low, high = _ends(lambda: stats.ttest_rel(xb, xa), confidence, mean, sd)
        return Interval(mean, sd, len(shared), low, high, "paired-t", confidence)
    xa, xb = _finite(list(a.values()), "arm a"), _finite(list(b.values()), "arm b")
    diff, n = statistics.fmean(xb) - statistics.fmean(xa), min(len(xa), len(xb))
    if n < 2:
        return Interval(diff, 0.0, n, -math.inf, math.inf, "welch-t", confidence)
    se = math.sqrt(statistics.variance(xa) / len(xa) + statistics.variance(xb) / len(xb))
    low, high = _ends(lambda: stats.ttest_ind(xb, xa, equal_var=False), confidence, diff, se)
    return Interval(diff, se, n, low, high, "welch-t", confidence)


def verdict(diff: Interval, claim: Claim) -> str:
    """``reproduced``, ``not reproduced`` or ``inconclusive`` for the interval of ``b - a`` under
    ``claim`` (rules in the module's docstring); an infinite interval is always inconclusive."""
    low, high, m = diff.low, diff.high, claim.margin
    if claim.kind == "lower":
        return "reproduced" if high < 0 else "not reproduced" if low > 0 else "inconclusive"
    if claim.kind == "higher":
        return "reproduced" if low > 0 else "not reproduced" if high < 0 else "inconclusive"
    if claim.kind == "equivalent":
        if -m <= low and high <= m:
            return "reproduced"
        return "not reproduced" if low > m or high < -m else "inconclusive"
    if claim.kind == "not-higher":
        return "reproduced" if high <= m else "not reproduced" if low > m else "inconclusive"
    return "reproduced" if low >= -m else "not reproduced" if high < -m else "inconclusive"
