"""The questions the simulator answers and the paper's grids (paper §6.2 Table 1, §6.5).

A :class:`Scenario` is ``chips`` chips trained by one method; a :class:`CellResult` is what one
simulated run of it gave. Pure: no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from diloco_async.sim.calibration import Calibration

__all__ = ["METHODS", "Method", "Scenario", "CellResult", "TABLE1_CHIPS", "PAPER_TABLE1", "paper_goodput",
           "paper_table1_scenarios", "heterogeneity_scenarios"]

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
