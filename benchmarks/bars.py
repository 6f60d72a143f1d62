"""The bars table that every ``make bench*`` target ends with: one line per goal.

A :class:`Bar` is one figure measured in the run (usually a ratio against a baseline measured in
the same run), its goal and the direction of the goal. :func:`print_bars` prints the table and
returns the exit status: 1 when a bar is missed or its figure could not be measured (``None``).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Literal, TextIO

__all__ = ["Bar", "print_bars"]


@dataclass(frozen=True)
class Bar:
    """One goal: ``value >= goal`` (``kind="min"``) or ``value <= goal`` (``kind="max"``).

    ``value`` is None when the figure could not be measured; that counts as a miss. ``shown``
    bars are printed for context and never missed (their goal is not a goal of the project).
    """

    figure: str
    value: float | None
    goal: float
    kind: Literal["min", "max"] = "min"
    detail: str = ""
    shown: bool = False

    @property
    def ok(self) -> bool:
        if self.shown:
            return True
        if self.value is None:
            return False
        return self.value >= self.goal if self.kind == "min" else self.value <= self.goal


def print_bars(bars: list[Bar], out: TextIO = sys.stdout, title: str = "bars") -> int:
    """Print ``bars`` as a table (figure, value, goal, ok/MISS); 1 if any bar is missed, else 0."""
    width = max([len(b.figure) for b in bars] + [len("figure")])
    print(f"\n{title}", file=out)
    print(f"{'figure':{width}s} {'value':>10s}   {'goal':<10s} result", file=out)
    for b in bars:
        value = "n/a" if b.value is None else f"{b.value:10.4g}"
        op = ">=" if b.kind == "min" else "<="
        result = "shown" if b.shown else ("ok" if b.ok else "MISS")
        line = f"{b.figure:{width}s} {value:>10s}   {op} {b.goal:<7g} {result}"
        print(line + (f"   ({b.detail})" if b.detail else ""), file=out)
    return 0 if all(b.ok for b in bars) else 1
