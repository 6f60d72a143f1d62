"""``make bench-end``'s figures (benchmarks/end_of_run.py, issue 44): the bar is on the upper end of
the 95% t-interval of (final loss - best periodic eval) over the seeds, and a run without a
periodic eval is a miss, not a pass."""

from __future__ import annotations

import datetime as dt

import pytest
from scipy import stats

from benchmarks.end_of_run import GAP_GOAL_NATS, gap_bars
from benchmarks.end_trace import drain_started_s


def test_the_bar_is_the_upper_end_of_the_gaps_95_percent_interval():
    gaps = [0.002, -0.004, 0.001, 0.0, 0.003]
    bar = gap_bars([{"gap": g} for g in gaps])[0]
    upper = sum(gaps) / 5 + stats.t.ppf(0.975, 4) * stats.sem(gaps)
    assert bar.value == pytest.approx(upper) and bar.kind == "max" and bar.goal == GAP_GOAL_NATS
    assert bar.ok


def test_a_regression_at_the_end_misses_the_bar_even_when_one_seed_is_fine():
    bar = gap_bars([{"gap": g} for g in (0.059, 0.016, 0.058, -0.009, 0.04)])[0]
    assert bar.value > GAP_GOAL_NATS and not bar.ok


def test_a_run_without_a_periodic_eval_is_a_miss():
    assert not gap_bars([{"gap": 0.0}, {"gap": None}])[0].ok
    assert not gap_bars([])[0].ok


def test_the_drains_start_is_read_from_the_synchronizers_log():
    log = ("2026-12-06 16:24:14,109 synchronizer INFO diloco.synchronizer: fragment 2 round 59 merged 4\n"
           "2026-12-06 16:24:16,243 synchronizer INFO diloco.synchronizer: stopping (wall-time budget reached "
           "(480s)): draining, last rounds p0 r60, at most 10s\n")
    want = dt.datetime(2026, 12, 6, 16, 24, 16, 243000).timestamp()
    assert drain_started_s(log) == pytest.approx(want)
    assert drain_started_s("2026-12-06 16:24:16,243 synchronizer INFO diloco.synchronizer: stopping: x\n") is None
