"""The numbers of an ablation report, from the finished runs' records (pure, no I/O).

A run record is the dict the ``ablate`` flow saves per (arm, seed): at least ``arm``, ``seed``
and ``figures`` (figure name -> float or None). :func:`analyse` turns a suite and its records
into per-arm intervals of every figure and one row per comparison with the interval of the
difference and the verdict.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from diloco_async.ablation.stats import Interval, bootstrap_interval, difference_interval, t_interval, verdict
from diloco_async.ablation.suite import Suite

__all__ = ["ArmFigure", "ComparisonRow", "Analysis", "analyse", "values_by_seed"]


@dataclass(frozen=True)
class ArmFigure:
    """One figure of one arm over its seeds: the t interval and the bootstrap interval of the mean."""

    arm: str
    figure: str
    values: dict[int, float]
    t: Interval | None
    bootstrap: Interval | None


@dataclass(frozen=True)
class ComparisonRow:
    """One row of the report: the paper's claim, both arms, the difference ``b - a``, a verdict."""

    name: str
    figure: str
    a: str
    b: str
    expect: str
    margin: float
    paper: str
    arm_a: ArmFigure
    arm_b: ArmFigure
    diff: Interval | None
    verdict: str
    why: str = ""


@dataclass
class Analysis:
    suite: str
    arms: dict[tuple[str, str], ArmFigure] = field(default_factory=dict)  # (arm, figure) -> ...
    rows: list[ComparisonRow] = field(default_factory=list)
    runs: int = 0
    missing: list[tuple[str, int]] = field(default_factory=list)  # (arm, seed) without a record


def values_by_seed(records: list[dict], arm: str, figure: str) -> dict[int, float]:
    """seed -> value of ``figure`` in ``arm``'s records (records lacking the figure left out)."""
    out = {}
    for r in records:
        v = r.get("figures", {}).get(figure)
        if r.get("arm") == arm and isinstance(v, (int, float)) and math.isfinite(v):
            out[int(r["seed"])] = float(v)
    return out


def _arm_figure(records: list[dict], arm: str, figure: str, confidence: float, seed: int) -> ArmFigure:
    vals = values_by_seed(records, arm, figure)
    if not vals:
        return ArmFigure(arm, figure, vals, None, None)
    xs = [vals[s] for s in sorted(vals)]
    return ArmFigure(arm, figure, vals, t_interval(xs, confidence),
                     bootstrap_interval(xs, seed=seed, confidence=confidence))


def analyse(suite: Suite, records: list[dict], bootstrap_seed: int = 0) -> Analysis:
    """Per-arm intervals of every figure of ``suite`` and one :class:`ComparisonRow` per
    comparison. A comparison with fewer than two values in an arm is ``inconclusive`` (its
    ``why`` says so): one run has no interval."""
    s = suite.suite
    out = Analysis(suite=s.name, runs=len(records))
    have = {(r.get("arm"), int(r.get("seed", -1))) for r in records}
    out.missing = [(a.name, seed) for seed in s.seeds for a in suite.arms if (a.name, seed) not in have]
    for arm in suite.arms:
        for fig in s.figures:
            out.arms[(arm.name, fig)] = _arm_figure(records, arm.name, fig, s.confidence, bootstrap_seed)
    for c in suite.comparisons:
        fa, fb = out.arms[(c.a, c.figure)], out.arms[(c.b, c.figure)]
        diff, why = None, ""
        if len(fa.values) < 2 or len(fb.values) < 2:
            why = f"fewer than 2 runs with {c.figure} ({c.a}: {len(fa.values)}, {c.b}: {len(fb.values)})"
        else:
            diff = difference_interval(fa.values, fb.values, s.confidence)
        v = verdict(diff, c.claim()) if diff is not None else "inconclusive"
        out.rows.append(ComparisonRow(c.name, c.figure, c.a, c.b, c.expect, c.margin, c.paper, fa, fb, diff, v, why))
    return out
