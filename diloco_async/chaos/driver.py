"""Apply a fault schedule to a target in real time, and keep each slot's bookkeeping.

:func:`drive` walks the seeded events of :func:`~diloco_async.chaos.scenario.make_schedule`:
at ``t_start + t_s`` a slot fails (``target.on_fail``) or stalls (``target.on_stall``); the drawn
recovery delay or stall length later it comes back (``on_recover``, ``on_cont``); between events
``target.tick(now)`` runs (supervision, metrics). The clock and the sleep are injected, so a test
runs a schedule on a fake clock. :class:`SlotBook` is what both targets record about their
slots: down and stalled intervals, launches, kills, failure and restart counts.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Protocol

from diloco_async.chaos.scenario import FaultEvent
from diloco_async.metrics.timeline import Interval

__all__ = ["FaultTarget", "SlotBook", "drive", "restarting_intervals"]


class FaultTarget(Protocol):
    """What :func:`drive` does to a method's processes; ``slot`` is 0 .. M-1."""

    def on_fail(self, slot: int, duration_s: float) -> None: ...
    def on_recover(self, slot: int) -> None: ...
    def on_stall(self, slot: int) -> None: ...
    def on_cont(self, slot: int) -> None: ...
    def tick(self, now: float) -> None: ...


class SlotBook:
    """What each of ``n`` slots is doing and the intervals so far (unix seconds).

    Attributes:
        intervals: closed ``down``/``stalled`` (and, for DDP, ``blocked``) intervals.
        down_since, stalled_since: slot -> start of its open interval.
        launched: slot -> unix times its processes were launched.
        ended: slot -> unix times the harness killed them.
        failures, restarts: counts over the run.
    """

    def __init__(self, n: int) -> None:
        self.n = n
        self.intervals: list[Interval] = []
        self.down_since: dict[int, float] = {}
        self.stalled_since: dict[int, float] = {}
        self.launched: dict[int, list[float]] = {i: [] for i in range(n)}
        self.ended: dict[int, list[float]] = {i: [] for i in range(n)}
        self.failures = 0
        self.restarts = 0

    def open_down(self, slot: int, now: float) -> None:
        self.down_since.setdefault(slot, now)

    def close(self, kind: str, slot: int, now: float) -> None:
        """Close the slot's open ``kind`` ("down" or "stalled") interval at ``now``, if any."""
        since = (self.down_since if kind == "down" else self.stalled_since).pop(slot, None)
        if since is not None and now > since:
            self.intervals.append(Interval(f"slot-{slot}", kind, since, now))

    def close_all(self, now: float) -> None:
        for slot in list(self.down_since):
            self.close("down", slot, now)
        for slot in list(self.stalled_since):
            self.close("stalled", slot, now)


def drive(events: Sequence[FaultEvent], t_start: float, wall_s: float, target: FaultTarget,
          poll_s: float = 0.05, clock: Callable[[], float] = time.time,
          sleep: Callable[[float], None] = time.sleep) -> None:
    """Apply the schedule in real time until ``t_start + wall_s`` (seconds of ``clock``).

    An event is applied once ``clock() >= t_start + t_s``; a failure's recovery (a stall's end)
    ``duration_s`` after it was applied; ``target.tick(now)`` after each pass, then
    ``sleep(poll_s)``. A target whose ``finished`` attribute turns true (it reached its token
    budget: WAN runs) ends the walk early. Exceptions of the target propagate.
    """
    timers: list[tuple[float, str, int]] = []
    pending = sorted(events, key=lambda e: e.t_s)
    end = t_start + wall_s
    while True:
        now = clock()
        if now >= end or getattr(target, "finished", False):
            return
        while pending and t_start + pending[0].t_s <= now:
            e = pending.pop(0)
            if e.kind == "fail":
                target.on_fail(e.slot, e.duration_s)
                timers.append((now + e.duration_s, "recover", e.slot))
            else:
                target.on_stall(e.slot)
                timers.append((now + e.duration_s, "cont", e.slot))
        timers.sort()
        while timers and timers[0][0] <= now:
            _, what, slot = timers.pop(0)
            (target.on_recover if what == "recover" else target.on_cont)(slot)
        target.tick(now)
        sleep(poll_s)


def restarting_intervals(lid: str, launches: list[float], recs: list[dict], ends: list[float],
                         t_end: float) -> list[Interval]:
    """``starting`` from the slot's first launch, ``restarting`` from each later launch of its
    process, to its ``ready`` record, or to its kill (``ends``) or ``t_end`` when that comes first."""
    readies = sorted(float(r["t"]) for r in recs if r["kind"] == "ready")
    out = []
    for n, t0 in enumerate(sorted(launches)):
        ready = next((t for t in readies if t >= t0 - 1e-3), None)
        death = next((t for t in sorted(ends) if t > t0), t_end)
        t1 = min(x for x in (ready, death, t_end) if x is not None)
        if t1 > t0:
            out.append(Interval(lid, "starting" if n == 0 else "restarting", t0, t1))
    return out
