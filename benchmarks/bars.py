"""The bars table that every ``make bench*`` target ends with: one line per goal.

A :class:`Bar` is one figure measured in the run (usually a ratio against a baseline measured in
the same run), its goal and the direction of the goal. :func:`print_bars` prints the table and
returns the exit status: 1 when a bar is missed or its figure could not be measured (``None``).

Where the environment names a results file (``BENCH_RESULTS``: `make bench` sets docs/figures.json),
:func:`print_bars` also merges its rows into it with :func:`record_bars`: per table title and figure,
the newest value, goal, result, commit and date. The docs site's "Current figures" page is rendered
from the committed copy (scripts/docs_reference.py ``figures_page``).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, TextIO

__all__ = ["Bar", "print_bars", "record_bars", "RESULTS_ENV"]

#: Environment variable naming the results file print_bars merges its rows into (unset: none).
RESULTS_ENV = "BENCH_RESULTS"


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


def print_bars(bars: list[Bar], out: TextIO = sys.stdout, title: str = "bars", results: Path | None = None) -> int:
    """Print ``bars`` as a table (figure, value, goal, ok/MISS); 1 if any bar is missed, else 0.

    ``results`` (default: the file ``$BENCH_RESULTS`` names, if set) gets the rows merged in
    (:func:`record_bars`, the commit of HEAD and today's UTC date)."""
    if results is None and os.environ.get(RESULTS_ENV):
        results = Path(os.environ[RESULTS_ENV])
    if results is not None:
        record_bars(results, title, bars, commit=_head_commit(results), date=dt.datetime.now(dt.UTC).date().isoformat())
    width = max([len(b.figure) for b in bars] + [len("figure")])
    print(f"\n{title}", file=out)
    print(f"{'figure':{width}s} {'value':>10s}   {'goal':<10s} result", file=out)
    for b in bars:
        value = "n/a" if b.value is None else f"{b.value:10.4g}"
        op = ">=" if b.kind == "min" else "<="
        result = _result(b)
        line = f"{b.figure:{width}s} {value:>10s}   {op} {b.goal:<7g} {result}"
        print(line + (f"   ({b.detail})" if b.detail else ""), file=out)
    return 0 if all(b.ok for b in bars) else 1


def _result(bar: Bar) -> str:
    return "shown" if bar.shown else ("ok" if bar.ok else "MISS")


def record_bars(path: Path, title: str, bars: list[Bar], *, commit: str, date: str) -> dict:
    """Merge ``bars`` into the JSON results file ``path`` under ``title``: each figure's row
    (value, goal, kind, result, detail, commit, date) replaces the one it had; the other tables and
    figures stay. The file is replaced whole (written beside it, then renamed). Returns the merged data."""
    data = json.loads(path.read_text()) if path.exists() and path.read_text().strip() else {}
    table = data.setdefault(title, {})
    for b in bars:
        table[b.figure] = {"value": b.value, "goal": b.goal, "kind": b.kind, "result": _result(b),
                           "detail": b.detail, "commit": commit, "date": date}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True, ensure_ascii=False) + "\n")
    os.replace(tmp, path)
    return data


def _head_commit(results: Path) -> str:
    """``git rev-parse --short HEAD``, with ``+dirty`` when tracked files other than ``results`` differ
    from it; ``unknown`` outside a git checkout."""
    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", *args], capture_output=True, text=True, check=False)
    head = git("rev-parse", "--short", "HEAD")
    if head.returncode != 0:
        return "unknown"
    top = git("rev-parse", "--show-toplevel").stdout.strip()
    changed = [Path(top, line[3:]).resolve() for line in git("status", "--porcelain", "--untracked-files=no")
               .stdout.splitlines()]
    dirty = any(p != results.resolve() for p in changed)
    return head.stdout.strip() + ("+dirty" if dirty else "")
