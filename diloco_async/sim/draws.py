"""Random draws of the simulator: recovery times, the slowest of ``n`` slices, and the quorum
barrier's per-learner compute shares (paper §4, §5.3). Seeded generators in, numbers out."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
from scipy.special import log_ndtr, ndtri_exp

from diloco_async.sim.calibration import RecoveryParams

__all__ = ["sample_recovery_s", "expected_max_normal", "sample_max_normal", "Barrier", "make_barrier", "Draws"]


def sample_recovery_s(rng: np.random.Generator, p: RecoveryParams, size: int) -> np.ndarray:
    """Recovery times in s, exponentiated Weibull by inversion: ``scale (-ln(1 - U^(1/a)))^(1/k)``.

    ``1 - U^(1/a)`` is formed as ``-expm1(ln(U)/a)`` so that no draw rounds to an infinite time.
    """
    log_u = np.log(np.maximum(rng.random(size), 1e-300))
    return p.scale_s * (-np.log(-np.expm1(log_u / p.shape_alpha))) ** (1.0 / p.shape_k)


_X = np.linspace(-9.0, 12.0, 21_001)
_LOG_PHI = log_ndtr(_X)  # log P(Z <= x)


@lru_cache(maxsize=4096)
def expected_max_normal(n: int) -> float:
    """``E[max of n i.i.d. standard normals]`` by quadrature (0 for n = 1; ~3.85 for n = 10^4)."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if n == 1:
        return 0.0
    cdf_n = np.exp(n * _LOG_PHI)
    pos, neg = _X >= 0, _X <= 0
    return float(np.trapezoid(1.0 - cdf_n[pos], _X[pos]) - np.trapezoid(cdf_n[neg], _X[neg]))


def sample_max_normal(rng: np.random.Generator, n: int, size: int) -> np.ndarray:
    """Draws of the max of ``n`` standard normals: ``Q^-1(1 - U^(1/n)) = -Phi^-1(1 - U^(1/n))``,
    the tail probability kept as its log (``scipy.special.ndtri_exp``) and the draws clipped to
    the quadrature grid's [-9, 12], so that ``U = 0`` gives 12, not an infinity."""
    if n == 1:
        return rng.standard_normal(size)
    with np.errstate(divide="ignore"):  # U = 0: log(0) = -inf, clipped below
        log_tail = np.log(-np.expm1(np.log1p(-rng.random(size)) / n))
    return np.clip(-ndtri_exp(log_tail), _X[0], _X[-1])


@dataclass
class Barrier:
    """Per-learner share of time spent computing, given who is running (``K > 1``, paper §4).

    Each step every running learner ``m`` takes ``T_m = f_m (1 + s_L z_m)(1 + s_S Zmax_m)``; one
    that is among the ``K`` fastest waits for the ``K``-th fastest. Its productive time is its own
    compute ``f_m (1 + s_L z_m)``; the ratio of sums over sampled steps is cached per running set.
    It is a share of time, so at most 1: with one slice ``Zmax`` is a plain normal, and a learner
    the barrier does not hold would otherwise come out faster than its own chips.
    """

    own: np.ndarray  # (M, S) compute time per learner and step
    step: np.ndarray  # (M, S) step time including the slowest slice
    quorum: int
    cache: dict[int, tuple[float, ...]] = field(default_factory=dict)

    def factors(self, running: Sequence[bool]) -> tuple[float, ...]:
        key = sum(1 << i for i, r in enumerate(running) if r)
        hit = self.cache.get(key)
        if hit is None:
            idx = np.flatnonzero(np.asarray(running))
            out = np.zeros(len(running))
            if len(idx) >= self.quorum:
                t = self.step[idx]
                kth = np.partition(t, self.quorum - 1, axis=0)[self.quorum - 1]
                out[idx] = np.minimum(self.own[idx].sum(axis=1) / np.maximum(t, kth).sum(axis=1), 1.0)
            hit = self.cache[key] = tuple(out.tolist())
        return hit


def make_barrier(
    rng: np.random.Generator, factors: Sequence[float], noise_l: float, noise_s: float,
    n_slices: int, quorum: int, samples: int,
) -> Barrier:
    f = np.asarray(factors, dtype=float)[:, None]
    own = f * np.maximum(1.0 + noise_l * rng.standard_normal((len(factors), samples)), 0.05)
    zmax = sample_max_normal(rng, n_slices, len(factors) * samples).reshape(len(factors), samples)
    return Barrier(own=own, step=own * np.maximum(1.0 + noise_s * zmax, 0.05), quorum=quorum)


class Draws:
    """Buffered scalar draws (standard exponential, uniform, recovery time) from one generator."""

    def __init__(self, rng: np.random.Generator, recovery: RecoveryParams, size: int = 8192) -> None:
        self._rng, self._rec, self._size = rng, recovery, size
        self._e: list[float] = []
        self._u: list[float] = []
        self._r: list[float] = []

    def exp(self) -> float:
        if not self._e:
            self._e = self._rng.standard_exponential(self._size).tolist()
        return self._e.pop()

    def uniform(self) -> float:
        if not self._u:
            self._u = self._rng.random(self._size).tolist()
        return self._u.pop()

    def recovery(self) -> float:
        if not self._r:
            self._r = sample_recovery_s(self._rng, self._rec, self._size).tolist()
        return self._r.pop()
