"""Statistics of an ablation: intervals per arm, paired differences and a verdict per claim.

Pure functions, no I/O. Intervals are two-sided at ``confidence`` (0.95 by default): Student t
(the t quantile from the regularized incomplete beta function, no SciPy) and a percentile
bootstrap of the mean with a seeded generator. A comparison of arm ``b`` against arm ``a``
is the difference ``b - a``: per seed when both arms ran the same seeds (paired: same model
initialisation and data order), else Welch's interval of the difference of means.

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
import random
import statistics
from dataclasses import asdict, dataclass

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


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the regularized incomplete beta function (modified Lentz)."""
    tiny, c, d = 1e-300, 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 400):
        for num in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                    -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def _betainc(a: float, b: float, x: float) -> float:
    """Regularized incomplete beta function I_x(a, b) for x in [0, 1]."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    ln_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(ln_front) * _betacf(a, b, x) / a
    return 1.0 - math.exp(ln_front) * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with ``df`` > 0 degrees of freedom (need not be an integer)."""
    if df <= 0:
        raise ValueError(f"degrees of freedom must be > 0, got {df}")
    tail = 0.5 * _betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t >= 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The ``p`` quantile of Student's t with ``df`` degrees of freedom (bisection on
    :func:`t_cdf` to 1e-10), e.g. ``t_quantile(0.975, 4)`` = 2.7764.

    Raises:
        ValueError: ``p`` not in (0, 1) or ``df`` <= 0.
    """
    if not 0.0 < p < 1.0:
        raise ValueError(f"p must be in (0, 1), got {p}")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    low, high = 0.0, 1.0
    while t_cdf(high, df) < p:
        low, high = high, high * 2.0
    while high - low > 1e-10 * max(1.0, high):
        mid = (low + high) / 2.0
        low, high = (mid, high) if t_cdf(mid, df) < p else (low, mid)
    return (low + high) / 2.0


def _finite(values: list[float], what: str) -> list[float]:
    out = [float(v) for v in values]
    if not out:
        raise ValueError(f"{what}: no values")
    bad = [v for v in out if not math.isfinite(v)]
    if bad:
        raise ValueError(f"{what}: non-finite values {bad}")
    return out


def t_interval(values: list[float], confidence: float = 0.95, method: str = "t") -> Interval:
    """Mean, sd and the Student t interval of the mean of ``values`` (floats, any unit).

    Raises:
        ValueError: no values, a non-finite value, or ``confidence`` not in (0, 1).
    """
    xs = _finite(values, "t_interval")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    mean = statistics.fmean(xs)
    if len(xs) < 2:
        return Interval(mean, 0.0, len(xs), -math.inf, math.inf, method, confidence)
    sd = statistics.stdev(xs)
    half = t_quantile(0.5 + confidence / 2.0, len(xs) - 1) * sd / math.sqrt(len(xs))
    return Interval(mean, sd, len(xs), mean - half, mean + half, method, confidence)


def bootstrap_interval(values: list[float], seed: int, confidence: float = 0.95,
                       resamples: int = 4000) -> Interval:
    """Percentile bootstrap interval of the mean: ``resamples`` resamples with replacement drawn
    by ``random.Random(seed)`` (the same seed gives the same interval).

    Raises:
        ValueError: no values, a non-finite value, ``resamples`` < 100.
    """
    xs = _finite(values, "bootstrap_interval")
    if resamples < 100:
        raise ValueError(f"resamples must be >= 100, got {resamples}")
    mean, n = statistics.fmean(xs), len(xs)
    sd = statistics.stdev(xs) if n > 1 else 0.0
    if n < 2:
        return Interval(mean, sd, n, -math.inf, math.inf, "bootstrap", confidence)
    rng = random.Random(seed)
    means = sorted(statistics.fmean(rng.choices(xs, k=n)) for _ in range(resamples))
    tail = (1.0 - confidence) / 2.0
    low = means[max(0, int(math.floor(tail * resamples)))]
    high = means[min(resamples - 1, int(math.ceil((1.0 - tail) * resamples)) - 1)]
    return Interval(mean, sd, n, low, high, "bootstrap", confidence)


def difference_interval(a: dict[int, float], b: dict[int, float], confidence: float = 0.95) -> Interval:
    """Interval of ``b - a``, each a map seed -> value. When at least two seeds are in both,
    the paired t interval of the per-seed differences over the shared seeds; otherwise Welch's t
    interval of the difference of the two means (Welch-Satterthwaite degrees of freedom).

    Raises:
        ValueError: an arm without values, or a non-finite value.
    """
    shared = sorted(set(a) & set(b))
    if len(shared) >= 2:
        return t_interval([b[s] - a[s] for s in shared], confidence, method="paired-t")
    xa, xb = _finite(list(a.values()), "arm a"), _finite(list(b.values()), "arm b")
    diff = statistics.fmean(xb) - statistics.fmean(xa)
    if len(xa) < 2 or len(xb) < 2:
        return Interval(diff, 0.0, min(len(xa), len(xb)), -math.inf, math.inf, "welch-t", confidence)
    va, vb = statistics.variance(xa) / len(xa), statistics.variance(xb) / len(xb)
    se = math.sqrt(va + vb)
    if se == 0.0:
        return Interval(diff, 0.0, min(len(xa), len(xb)), diff, diff, "welch-t", confidence)
    df = (va + vb) ** 2 / (va ** 2 / (len(xa) - 1) + vb ** 2 / (len(xb) - 1))
    half = t_quantile(0.5 + confidence / 2.0, df) * se
    return Interval(diff, se, min(len(xa), len(xb)), diff - half, diff + half, "welch-t", confidence)


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
