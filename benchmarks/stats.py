"""Small statistics for benchmark bars measured over several seeds or repeats."""

from __future__ import annotations

import math
import statistics

__all__ = ["mean_interval"]

#: two-sided 95% Student t quantiles by degrees of freedom (1..9); 1.96 beyond
_T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


def mean_interval(values: list[float]) -> tuple[float, float]:
    """(mean, half-width of its 95% t-interval; 0 for a single value).

    Raises:
        statistics.StatisticsError: ``values`` is empty.
    """
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, 0.0
    return mean, _T95.get(len(values) - 1, 1.96) * statistics.stdev(values) / math.sqrt(len(values))
