"""Small statistics for benchmark bars measured over several seeds or repeats (the t quantile is
the ablation statistics' own, :func:`diloco_async.ablation.stats.t_quantile`)."""

from __future__ import annotations

import math
import statistics

from diloco_async.ablation.stats import t_quantile

__all__ = ["mean_interval"]


def mean_interval(values: list[float]) -> tuple[float, float]:
    """(mean, half-width of its 95% t-interval; 0 for a single value).

    Raises:
        statistics.StatisticsError: ``values`` is empty.
    """
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, 0.0
    return mean, t_quantile(0.975, len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
