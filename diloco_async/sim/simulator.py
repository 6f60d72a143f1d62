"""Discrete-event simulator of training goodput under chip failures (paper §5, DESIGN §7).

Pure and seeded: no I/O, no clock; the same scenario, calibration and seed give the same result.

The model (paper §5.2-5.4, every number in ``configs/calibration.toml``):

* A *job* owns slices of chips. Data-parallel (DP) is one job of all ``chips``; Decoupled DiLoCo is
  ``M`` jobs ("learners") of ``chips / M`` each. A job's chips are split into
  ``ceil(chips / chips_per_slice)`` equal slices.
* A computing slice of ``c`` chips fails at rate ``c / MTBI_chip`` (Poisson). Hazard accrues on the
  *busy* clock: chips that are paused, stalled or blocked do not fail.
* A failed slice is down for a recovery time drawn from an exponentiated Weibull
  (CDF ``(1 - exp(-(x/scale)^k))^alpha``), then comes back.
* Non-elastic DP stalls the whole job from a failure until the slice is back, then pays a restart.
* Elastic DP (and every learner) pauses ``reshard_pause_s`` on a failure and continues on the
  surviving slices. A recovered slice joins the next pause for free; if none comes within
  ``scale_up_batch_window_s`` the job pauses ``scale_up_pause_s`` to take it back.
* Stragglers: a step lasts as long as the slowest participating slice (relative noise
  ``slice_step_noise`` per slice and step), so a job of ``n`` slices runs at
  ``1 / (1 + noise * E[max of n standard normals])`` of its chips' speed.
* Learners never wait for each other when the quorum is ``K = 1``. With ``K > 1`` a running learner
  waits every step for the ``K``-th fastest running learner (the syncer needs ``K`` of them) and is
  blocked while fewer than ``K`` learners run; learners may differ in speed and have their own
  step noise (the heterogeneity case, paper §6.5).

Goodput is productive chip-seconds over provisioned chip-seconds, through
:func:`diloco_async.goodput.compute_goodput`, the definition the real harness uses. A chip-second is
productive when the chip computes a step of a running, unblocked job; time down, paused, stalled,
blocked or waiting for a slower slice or learner is not.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Literal, Sequence

import numpy as np

from diloco_async.goodput import compute_goodput
from diloco_async.sim.calibration import Calibration, RecoveryParams

__all__ = [
    "METHODS",
    "Scenario",
    "CellResult",
    "simulate",
    "simulate_many",
    "TABLE1_CHIPS",
    "PAPER_TABLE1",
    "paper_table1_scenarios",
    "paper_goodput",
    "heterogeneity_scenarios",
    "expected_max_normal",
    "sample_recovery_s",
]

METHODS = ("dp", "dp-elastic", "diloco")
"""``dp``: data-parallel, no elasticity; ``dp-elastic``: slice-elastic DP; ``diloco``: Decoupled DiLoCo."""

Method = Literal["dp", "dp-elastic", "diloco"]


@dataclass(frozen=True)
class Scenario:
    """One question: ``chips`` chips trained by ``method``.

    ``learners`` and ``quorum`` apply to ``diloco`` (both 1 for DP). ``mtbi_years`` is the chip
    MTBI (``math.inf``: no failures). ``step_factors`` (one per learner, default all 1.0) scale each
    learner's step time; ``learner_step_noise`` is the relative std of a learner's step time.
    ``paper`` is the paper's goodput (0-1) for this cell, when there is one.
    """

    method: Method
    chips: int
    learners: int = 1
    quorum: int = 1
    mtbi_years: float = 1.0
    step_factors: tuple[float, ...] | None = None
    learner_step_noise: float = 0.0
    paper: float | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        if self.chips < 1:
            raise ValueError(f"chips must be >= 1, got {self.chips}")
        if self.method != "diloco" and (self.learners != 1 or self.quorum != 1):
            raise ValueError(f"{self.method} has one job: learners=quorum=1, got {self.learners}, {self.quorum}")
        if not 1 <= self.learners <= self.chips:
            raise ValueError(f"learners must be in 1..chips={self.chips}, got {self.learners}")
        if not 1 <= self.quorum <= self.learners:
            raise ValueError(f"quorum must be in 1..learners={self.learners}, got {self.quorum}")
        if not self.mtbi_years > 0:
            raise ValueError(f"mtbi_years must be > 0, got {self.mtbi_years}")
        if self.step_factors is not None and (
            len(self.step_factors) != self.learners or min(self.step_factors) <= 0
        ):
            raise ValueError(f"step_factors needs {self.learners} positive values, got {self.step_factors}")
        if not 0 <= self.learner_step_noise < 1:
            raise ValueError(f"learner_step_noise must be in [0, 1), got {self.learner_step_noise}")

    @property
    def label(self) -> str:
        if self.method == "dp":
            return "DP, no elasticity"
        if self.method == "dp-elastic":
            return "DP, elastic"
        return f"Decoupled M={self.learners}" + (f" K={self.quorum}" if self.quorum != 1 else "")


@dataclass(frozen=True)
class CellResult:
    """Outcome of one scenario. Goodputs and uptime in [0, 1]; chip-seconds; wall time in s."""

    scenario: Scenario
    goodput: float
    uptime: float
    learner_goodput: tuple[float, ...]
    useful_chip_s: float
    provisioned_chip_s: float
    failures: int
    horizon_s: float
    seed: int

    def to_json(self) -> dict:
        """The JSON cell of ``diloco-async simulate --json``."""
        s = self.scenario
        out = {
            "method": s.method,
            "label": s.label,
            "chips": s.chips,
            "learners": s.learners,
            "quorum": s.quorum,
            "mtbi_years": s.mtbi_years if math.isfinite(s.mtbi_years) else None,
            "goodput": self.goodput,
            "uptime": self.uptime,
            "failures": self.failures,
            "horizon_s": self.horizon_s,
            "seed": self.seed,
        }
        if s.step_factors is not None:
            out["step_factors"] = list(s.step_factors)
            out["learner_step_noise"] = s.learner_step_noise
        if s.paper is not None:
            out["paper"] = s.paper
        return out


# --------------------------------------------------------------------------------------------
# Paper grids (paper §6.2, §6.5)

TABLE1_CHIPS = (150_000, 300_000, 600_000, 1_200_000, 2_400_000)

PAPER_TABLE1: dict[tuple[str, int], tuple[float, ...]] = {
    ("dp", 1): (0.72, 0.57, 0.38, 0.27, 0.18),
    ("dp-elastic", 1): (0.88, 0.80, 0.69, 0.58, 0.40),
    ("diloco", 2): (0.94, 0.88, 0.80, 0.70, 0.54),
    ("diloco", 4): (0.96, 0.93, 0.89, 0.82, 0.73),
    ("diloco", 8): (0.98, 0.96, 0.94, 0.88, 0.80),
    ("diloco", 16): (0.99, 0.98, 0.96, 0.93, 0.86),
}
"""Paper Table 1 (dense 5B, MTBI_chip = 1 year): goodput per (method, learners), one per chips."""


def paper_goodput(method: str, chips: int, learners: int = 1, quorum: int = 1,
                  mtbi_years: float = 1.0) -> float | None:
    """The paper's Table 1 goodput (0-1) for this question, or ``None`` if the table lacks it."""
    row = PAPER_TABLE1.get((method, learners))
    if row is None or quorum != 1 or mtbi_years != 1.0 or chips not in TABLE1_CHIPS:
        return None
    return row[TABLE1_CHIPS.index(chips)]


def paper_table1_scenarios(mtbi_years: float = 1.0) -> list[Scenario]:
    """The 30 cells of paper Table 1, row by row; the paper's goodput attached when MTBI = 1 year."""
    return [
        Scenario(method, chips, learners=m, mtbi_years=mtbi_years,  # type: ignore[arg-type]
                 paper=paper_goodput(method, chips, m, 1, mtbi_years))
        for method, m in PAPER_TABLE1
        for chips in TABLE1_CHIPS
    ]


def heterogeneity_scenarios(cal: Calibration) -> list[Scenario]:
    """The heterogeneity case (paper §6.5): one scenario per quorum in the calibration file."""
    h = cal.heterogeneity
    factors = (1.0,) * (h.learners - h.slow_learners) + (h.slow_step_factor,) * h.slow_learners
    mtbi = cal.failures.mtbi_chip_years if h.with_failures else math.inf
    return [
        Scenario(
            "diloco", h.chips_per_learner * h.learners, learners=h.learners, quorum=k,
            mtbi_years=mtbi, step_factors=factors, learner_step_noise=h.learner_step_noise,
            paper=h.paper_goodput.get(str(k)),
        )
        for k in h.quorums
    ]


# --------------------------------------------------------------------------------------------
# Distributions


def sample_recovery_s(rng: np.random.Generator, p: RecoveryParams, size: int) -> np.ndarray:
    """Recovery times in s, exponentiated Weibull by inversion: ``scale (-ln(1 - U^(1/a)))^(1/k)``.

    ``1 - U^(1/a)`` is formed as ``-expm1(ln(U)/a)`` so that no draw rounds to an infinite time.
    """
    log_u = np.log(np.maximum(rng.random(size), 1e-300))
    return p.scale_s * (-np.log(-np.expm1(log_u / p.shape_alpha))) ** (1.0 / p.shape_k)


_X = np.linspace(-9.0, 12.0, 21_001)
_LOG_Q = np.log([0.5 * math.erfc(x / math.sqrt(2.0)) for x in _X])  # log P(Z > x)
_LOG_PHI = np.log([0.5 * math.erfc(-x / math.sqrt(2.0)) for x in _X])  # log P(Z <= x)


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


def _sample_max_normal(rng: np.random.Generator, n: int, size: int) -> np.ndarray:
    """Draws of the max of ``n`` standard normals: ``Q^-1(1 - U^(1/n))`` on the quadrature grid."""
    if n == 1:
        return rng.standard_normal(size)
    log_tail = np.log(-np.expm1(np.log1p(-rng.random(size)) / n))
    return np.interp(log_tail, _LOG_Q[::-1], _X[::-1])


# --------------------------------------------------------------------------------------------
# Quorum barrier


@dataclass
class _Barrier:
    """Per-learner share of time spent computing, given who is running (``K > 1``, paper §4).

    Each step every running learner ``m`` takes ``T_m = f_m (1 + s_L z_m)(1 + s_S Zmax_m)``; one
    that is among the ``K`` fastest waits for the ``K``-th fastest. Its productive time is its own
    compute ``f_m (1 + s_L z_m)``; the ratio of sums over sampled steps is cached per running set.
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
                out[idx] = self.own[idx].sum(axis=1) / np.maximum(t, kth).sum(axis=1)
            hit = self.cache[key] = tuple(out.tolist())
        return hit


def _make_barrier(
    rng: np.random.Generator, factors: Sequence[float], noise_l: float, noise_s: float,
    n_slices: int, quorum: int, samples: int,
) -> _Barrier:
    f = np.asarray(factors, dtype=float)[:, None]
    own = f * np.maximum(1.0 + noise_l * rng.standard_normal((len(factors), samples)), 0.05)
    zmax = _sample_max_normal(rng, n_slices, len(factors) * samples).reshape(len(factors), samples)
    return _Barrier(own=own, step=own * np.maximum(1.0 + noise_s * zmax, 0.05), quorum=quorum)


# --------------------------------------------------------------------------------------------
# Event loop

_RETURN, _PAUSE_END, _DEADLINE = 0, 1, 2


class _Draws:
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


@dataclass
class _Jobs:
    """What is simulated: ``n`` jobs of ``n_slices`` slices of ``chips_per_slice`` chips each."""

    n: int
    n_slices: int
    chips_per_slice: float
    elastic: bool
    quorum: int
    straggle: float  # productive share of a running job's time when quorum == 1
    barrier: _Barrier | None  # per-learner shares when quorum > 1


class _Engine:
    """Event loop over jobs (module docstring). Events: slice failure (competing exponential
    clocks on busy slices, redrawn after every event), slice return, end of a pause, end of a
    scale-up batch window. Productive chip-seconds are settled lazily per job when its rate changes.
    """

    def __init__(self, jobs: _Jobs, cal: Calibration, mtbi_s: float, draws: _Draws) -> None:
        n = jobs.n
        self.jobs, self.draws, self.horizon = jobs, draws, cal.run.horizon_s
        self.c_down, self.c_up = cal.elastic.reshard_pause_s, cal.elastic.scale_up_pause_s
        self.window = cal.elastic.scale_up_batch_window_s
        self.c_restart = cal.non_elastic.restart_pause_s
        self.hazard_per_slice = jobs.chips_per_slice / mtbi_s  # failures per busy slice-second
        self.healthy = [jobs.n_slices] * n  # slices in the job (computing, or paused with it)
        self.down = [0] * n  # slices being recovered
        self.waiting = [0] * n  # recovered slices not yet taken back (elastic)
        self.paused = [False] * n
        self.pause_ver = [0] * n
        self.deadline_ver = [0] * n
        self.deadline_set = [False] * n
        self.running = [True] * n
        self.n_running = n
        self.busy_slices = 0  # sum of healthy slices over busy jobs
        self.counted = [0] * n  # each job's share of busy_slices
        self.busy = [False] * n
        self.rate = [0.0] * n  # productive chip-seconds per second
        self.useful = [0.0] * n
        self.last = [0.0] * n
        self.heap: list[tuple[float, int, int, int, int]] = []
        self.seq = 0
        self.now = 0.0
        self.failures = 0
        self.up_s = 0.0
        self.up_since: float | None = None

    # -- accounting ------------------------------------------------------------------------

    def _settle(self, j: int, factors: Sequence[float] | None) -> None:
        now, jobs = self.now, self.jobs
        self.useful[j] += (now - self.last[j]) * self.rate[j]
        self.last[j] = now
        busy = self.running[j] and self.n_running >= jobs.quorum
        counted = self.healthy[j] if busy else 0
        self.busy_slices += counted - self.counted[j]
        self.counted[j] = counted
        self.busy[j] = busy
        f = factors[j] if factors is not None else jobs.straggle
        self.rate[j] = self.healthy[j] * jobs.chips_per_slice * f if busy else 0.0

    def _update(self, j: int) -> None:
        """Job ``j`` changed state at ``now``: re-derive what depends on it."""
        jobs = self.jobs
        run = not self.paused[j] and self.healthy[j] > 0 and (jobs.elastic or self.down[j] == 0)
        was_active = self.n_running >= jobs.quorum
        self.n_running += int(run) - int(self.running[j])
        self.running[j] = run
        active = self.n_running >= jobs.quorum
        if active != was_active:
            if active:
                self.up_since = self.now
            elif self.up_since is not None:
                self.up_s += self.now - self.up_since
                self.up_since = None
        if jobs.barrier is None and active == was_active:
            self._settle(j, None)
        else:
            self._settle_all()

    def _settle_all(self) -> None:
        barrier = self.jobs.barrier
        factors = barrier.factors(self.running) if barrier is not None else None
        for i in range(self.jobs.n):
            self._settle(i, factors)

    # -- events ----------------------------------------------------------------------------

    def _push(self, t: float, kind: int, j: int, ver: int) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, j, ver))

    def _pause(self, j: int, length_s: float) -> None:
        self.paused[j] = True
        self.pause_ver[j] += 1
        self._push(self.now + length_s, _PAUSE_END, j, self.pause_ver[j])

    def _fail(self) -> int:
        """A slice of a busy job fails, chosen in proportion to busy slices."""
        self.failures += 1
        pick = self.draws.uniform() * self.busy_slices
        j = -1
        for i in range(self.jobs.n):
            if self.busy[i]:
                j = i
                pick -= self.healthy[i]
                if pick < 0:
                    break
        assert j >= 0, "a failure needs a busy job"
        self.healthy[j] -= 1
        self.down[j] += 1
        self._push(self.now + self.draws.recovery(), _RETURN, j, 0)
        if self.jobs.elastic:  # re-shard; slices waiting to rejoin come back with it
            self.deadline_ver[j] += 1
            self.deadline_set[j] = False
            self._pause(j, self.c_down)
        return j

    def _on_return(self, j: int) -> None:
        self.down[j] -= 1
        if not self.jobs.elastic:
            self.healthy[j] += 1
            if self.down[j] == 0:
                self._pause(j, self.c_restart)
            return
        self.waiting[j] += 1
        if self.paused[j]:
            return  # joins when the pause ends
        if self.healthy[j] == 0 or self.window == 0:
            self._pause(j, self.c_up)
        elif not self.deadline_set[j]:
            self.deadline_set[j] = True
            self._push(self.now + self.window, _DEADLINE, j, self.deadline_ver[j])

    def _on_deadline(self, j: int) -> None:
        self.deadline_set[j] = False
        if self.waiting[j] and not self.paused[j]:
            self._pause(j, self.c_up)

    def _on_pause_end(self, j: int) -> None:
        self.paused[j] = False
        self.healthy[j] += self.waiting[j]
        self.waiting[j] = 0
        self.deadline_ver[j] += 1
        self.deadline_set[j] = False

    def run(self) -> tuple[list[float], float, int]:
        """Per-job productive chip-seconds, seconds with >= quorum jobs running, failures."""
        self.up_since = 0.0 if self.n_running >= self.jobs.quorum else None
        self._settle_all()
        heap, draws, horizon = self.heap, self.draws, self.horizon
        while True:
            hazard = self.busy_slices * self.hazard_per_slice
            t_fail = self.now + draws.exp() / hazard if hazard > 0 else math.inf
            t_event = heap[0][0] if heap else math.inf
            if min(t_fail, t_event) >= horizon:
                break
            if t_fail < t_event:
                self.now = t_fail
                j = self._fail()
            else:
                self.now, _, kind, j, ver = heapq.heappop(heap)
                if kind == _RETURN:
                    self._on_return(j)
                elif kind == _DEADLINE:
                    if ver != self.deadline_ver[j]:
                        continue
                    self._on_deadline(j)
                else:
                    if ver != self.pause_ver[j]:
                        continue
                    self._on_pause_end(j)
            self._update(j)
        self.now = horizon
        self._settle_all()
        if self.up_since is not None:
            self.up_s += horizon - self.up_since
        return self.useful, self.up_s, self.failures


# --------------------------------------------------------------------------------------------
# Public entry points


def _rng(seed: int, s: Scenario, stream: int) -> np.random.Generator:
    key = [seed, METHODS.index(s.method), s.chips, s.learners, s.quorum, stream]
    return np.random.default_rng(key)


def simulate(scenario: Scenario, cal: Calibration, seed: int = 0) -> CellResult:
    """Simulate one scenario for ``cal.run.horizon_s`` seconds.

    Raises:
        ValueError: a learner would have less than one chip.
    """
    s = scenario
    jobs = s.learners if s.method == "diloco" else 1
    chips_per_job = s.chips / jobs
    n_slices = max(1, math.ceil(chips_per_job / cal.slices.chips_per_slice - 1e-9))
    chips_per_slice = chips_per_job / n_slices
    noise_s = cal.stragglers.slice_step_noise
    barrier = None
    if s.quorum > 1:
        barrier = _make_barrier(
            _rng(seed, s, 1), s.step_factors or (1.0,) * jobs, s.learner_step_noise, noise_s,
            n_slices, s.quorum, cal.stragglers.barrier_samples,
        )
    spec = _Jobs(
        n=jobs, n_slices=n_slices, chips_per_slice=chips_per_slice, elastic=s.method != "dp",
        quorum=s.quorum, straggle=1.0 / (1.0 + noise_s * expected_max_normal(n_slices)),
        barrier=barrier,
    )
    mtbi_s = s.mtbi_years * cal.failures.seconds_per_year
    engine = _Engine(spec, cal, mtbi_s, _Draws(_rng(seed, s, 0), cal.recovery))
    useful, up_s, failures = engine.run()
    horizon = cal.run.horizon_s
    per_job = chips_per_job * horizon
    total_useful = min(sum(useful), s.chips * horizon)
    return CellResult(
        scenario=s,
        goodput=compute_goodput(total_useful, s.chips * horizon),
        uptime=min(1.0, up_s / horizon),
        learner_goodput=tuple(compute_goodput(min(u, per_job), per_job) for u in useful),
        useful_chip_s=total_useful,
        provisioned_chip_s=s.chips * horizon,
        failures=failures,
        horizon_s=horizon,
        seed=seed,
    )


def simulate_many(scenarios: Sequence[Scenario], cal: Calibration, seed: int = 0) -> list[CellResult]:
    """:func:`simulate` for each scenario, in order (each cell has its own seeded stream)."""
    return [simulate(s, cal, seed) for s in scenarios]
