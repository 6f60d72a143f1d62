"""Goodput simulator at paper scale (paper §5-6): pure, seeded, no I/O.

``simulate(Scenario(...), load_calibration())`` answers one question; ``paper_table1_scenarios()``
and ``heterogeneity_scenarios(cal)`` are the paper's grids. The command line is
``diloco-async simulate`` (``diloco_async/flows/simulate_cli.py``).
"""

from diloco_async.sim.calibration import Calibration, load_calibration
from diloco_async.sim.draws import expected_max_normal, sample_recovery_s
from diloco_async.sim.scenarios import (
    METHODS,
    PAPER_TABLE1,
    TABLE1_CHIPS,
    CellResult,
    Scenario,
    heterogeneity_scenarios,
    paper_goodput,
    paper_table1_scenarios,
)
from diloco_async.sim.simulator import simulate, simulate_many

__all__ = [
    "Calibration",
    "load_calibration",
    "METHODS",
    "PAPER_TABLE1",
    "TABLE1_CHIPS",
    "CellResult",
    "Scenario",
    "heterogeneity_scenarios",
    "paper_goodput",
    "paper_table1_scenarios",
    "expected_max_normal",
    "sample_recovery_s",
    "simulate",
    "simulate_many",
]
