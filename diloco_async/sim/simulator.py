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
:func:`diloco_async.metrics.goodput.compute_goodput`, the definition the real harness uses. A chip-second is
productive when the chip computes a step of a running, unblocked job; time down, paused, stalled,
blocked or waiting for a slower slice or learner is not.

The scenarios and the paper's grids are in :mod:`~diloco_async.sim.scenarios`, the random draws in
:mod:`~diloco_async.sim.draws`, the event loop in :mod:`~diloco_async.sim.engine`; this module
runs them and re-exports the public names.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from diloco_async.metrics.goodput import compute_goodput
from diloco_async.sim.calibration import Calibration
from diloco_async.sim.draws import Draws, expected_max_normal, make_barrier
from diloco_async.sim.engine import Engine, Jobs
from diloco_async.sim.scenarios import (
    METHODS,
    CellResult,
    Scenario,
)

__all__ = ["simulate", "simulate_many"]


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
        barrier = make_barrier(
            _rng(seed, s, 1), s.step_factors or (1.0,) * jobs, s.learner_step_noise, noise_s,
            n_slices, s.quorum, cal.stragglers.barrier_samples,
        )
    spec = Jobs(
        n=jobs, n_slices=n_slices, chips_per_slice=chips_per_slice, elastic=s.method != "dp",
        quorum=s.quorum, straggle=1.0 / (1.0 + noise_s * expected_max_normal(n_slices)),
        barrier=barrier,
    )
    mtbi_s = s.mtbi_years * cal.failures.seconds_per_year
    engine = Engine(spec, cal, mtbi_s, Draws(_rng(seed, s, 0), cal.recovery))
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
