"""Argument types for the benchmarks' command lines: a count or a duration that must be positive
is refused by argparse with its option's name (exit status 2), before any process starts, instead
of failing deep inside a run or measuring nothing and reporting a miss."""

from __future__ import annotations

import argparse
import logging
import math
import signal
import sys
import tempfile
from pathlib import Path

__all__ = ["description", "exit_on_sigterm", "non_negative_float", "non_negative_int", "positive_float",
           "positive_int"]


def description(doc: str | None) -> str:
    """A module docstring's first paragraph on one line: the ``--help`` description of its
    benchmark (its first line alone can stop mid-sentence)."""
    first = (doc or "").strip().split("\n\n", 1)[0]
    return " ".join(first.split())


def _number(text: str, kind: type) -> int | float:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
    if isinstance(value, float) and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not finite")
    return value


def positive_int(text: str) -> int:
    """An integer >= 1 (a count of learners, repeats, processes)."""
    value = _number(text, int)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    """An integer >= 0 (warm-up steps)."""
    value = _number(text, int)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0 (seconds, minutes, a period)."""
    value = _number(text, float)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def speed_factor(text: str) -> float:
    """A number in (0, 1]: an emulated learner's speed (``faults.speed_factors``)."""
    value = positive_float(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"a speed factor is at most 1 (full speed), got {value}")
    return value


def non_negative_float(text: str) -> float:
    """A finite number >= 0 (seconds, where 0 turns a part off)."""
    value = _number(text, float)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def workdir_or_temp(workdir: str | None, prefix: str) -> Path:
    """``workdir`` as a path, or a new temporary folder named ``prefix…`` when it is None (the
    caller removes that one)."""
    return Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix=prefix))


def exit_on_sigterm() -> None:
    """A SIGTERM to this benchmark exits through ``SystemExit(143)``, so the clean-up of the run it
    drives (its ``finally`` blocks stop every process they started) runs; Python's default would end
    this process alone and leave the synchronizer and learners running."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def chaos_logging() -> None:
    """INFO logs with times for a benchmark that drives real processes (kills, restarts), without
    the supervisor's own restart errors."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("diloco.supervisor").setLevel(logging.ERROR)
