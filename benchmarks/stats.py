"""Small statistics for benchmark bars measured over several seeds or repeats (``scipy.stats``)."""

from __future__ import annotations

import statistics

from scipy import stats

__all__ = ["mean_interval", "mean_over_runs"]


def mean_interval(values: list[float]) -> tuple[float, float]:
    """(mean, half-width of its 95% t-interval; 0 for a single value): ``t.ppf(0.975, n - 1)``
    times the standard error of the mean (``scipy.stats.sem``).

    Raises:
        statistics.StatisticsError: ``values`` is empty.
    """
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, 0.0
    return mean, float(stats.t.ppf(0.975, len(values) - 1) * stats.sem(values))


def mean_over_runs(values: list[float | None], unit: str = "", digits: int = 2) -> tuple[float | None, str]:
    """One figure measured once per run: its mean and the words a bar's detail shows for it,
    ``"mean of N runs +- H<unit> (v1, v2, ...)"`` (95% t-interval, ``digits`` decimals) or ``"one
    run"``; (None, ``"not measured in every run"``) when a run lacks it, so the bar is a miss."""
    if not values or any(v is None for v in values):
        return None, "not measured in every run"
    mean, half = mean_interval(values)
    if len(values) == 1:
        return mean, "one run"
    shown = ", ".join(f"{v:.{digits}f}" for v in values)
    return mean, f"mean of {len(values)} runs +- {half:.{digits}f}{unit} ({shown})"
