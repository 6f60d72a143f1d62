"""The status the actor publishes for ``GET /status`` and ``GET /health`` (issue 14, item 2; issue 17).

Polling the status must not queue behind the actor's work (48 pollers once raised a learner's
heartbeat latency a hundredfold), and building it must not stall the actor when nobody reads it
(at 1,000 learners one :func:`~diloco_async.sync.summary.status` takes 25-35 ms of the event loop). So:

* After every pass of its loop the actor ticks the board (:meth:`StatusBoard.tick`, O(1): the
  time and the lifecycle phase); ``/health`` is served from that alone.
* The full snapshot is built on demand: a ``GET /status`` that finds the newest snapshot stale
  asks for one (:meth:`StatusBoard.wait_fresh`) and the actor builds it at the end of its current
  pass, once for every request waiting; a request never goes through the actor's queue. A
  snapshot is stale once it is older than :data:`COST_FACTOR` times what building it took, so
  snapshots take at most about 1/COST_FACTOR of the actor's time however many pollers there are
  (a run of 4 learners answers every poll with a fresh one; one of 1,000, one every ~0.6 s).
* When the actor is gone (finished, or stuck longer than :data:`WAIT_FRESH_S`), the newest
  snapshot is served as it is.

Requests refused at the edge are counted outside the actor; their counters are laid over the
snapshot when it is served, so they are never stale.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

__all__ = ["StatusBoard", "dumps", "COST_FACTOR", "STALE_AFTER_S", "WAIT_FRESH_S"]

COST_FACTOR = 20.0
"""A snapshot is skipped while the last one is younger than this many times its build time."""
STALE_AFTER_S = 30.0
"""``/health`` answers 503 when the actor has not ticked the board for this long: it is stuck."""
WAIT_FRESH_S = 2.0
"""Longest wait of a ``GET /status`` for a fresh snapshot before it is served the newest one."""


def _finite(value: Any) -> Any:
    """``value`` with every non-finite float (at any depth) replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def dumps(value: Any) -> str:
    """Standard JSON (RFC 8259): non-finite floats become null."""
    try:
        return json.dumps(value, allow_nan=False)
    except ValueError:
        return json.dumps(_finite(value), allow_nan=False)


class StatusBoard:
    """The newest status snapshot, its encoded form, and the actor's last tick.

    Written by the actor (:meth:`tick`, :meth:`publish`, :meth:`close`), read by the HTTP
    handlers (:meth:`wait_fresh`, :meth:`status_body`, :meth:`health`); both run on one event
    loop, so no lock is needed.

    Args:
        clock: monotonic clock in seconds for the snapshot's age (real time, not the actor's clock).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.doc: dict | None = None
        self.seq = 0
        self.published_s = 0.0
        self.build_s = 0.0  # what building the last snapshot took
        self.ticked_s: float | None = None  # the actor's last pass (None: not yet)
        self.phase: str | None = None  # the lifecycle phase at that pass
        self.closed = False  # the actor is gone: no snapshot will come
        self._waiters: list[asyncio.Future] = []  # GET /status requests waiting for a fresh snapshot
        self._body: tuple[tuple[int, tuple], str] | None = None  # (seq, edge counts) -> encoded body

    def tick(self, phase: str) -> None:
        """The actor finished a pass in lifecycle ``phase`` (O(1); what ``/health`` reads)."""
        self.ticked_s, self.phase = self.clock(), phase

    def publish(self, doc: dict, build_s: float = 0.0) -> None:
        """A new snapshot that took ``build_s`` seconds to build (the dict is kept, not copied:
        the actor builds a new one each time); wakes the requests waiting for one."""
        self.doc, self.seq, self.published_s, self.build_s = doc, self.seq + 1, self.clock(), build_s
        self.phase = doc.get("phase", self.phase)
        self._wake()

    def close(self) -> None:
        """The actor stopped: requests are served the newest snapshot from now on."""
        self.closed = True
        self._wake()

    def _wake(self) -> None:
        waiters, self._waiters = self._waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    def due(self) -> bool:
        """Is the newest snapshot stale (see :data:`COST_FACTOR`), or is there none?"""
        return self.doc is None or self.clock() - self.published_s >= COST_FACTOR * self.build_s

    def wanted(self) -> bool:
        """Does a request wait for a fresh snapshot (the actor builds one at the end of its pass)?"""
        return bool(self._waiters)

    async def wait_fresh(self, timeout_s: float = WAIT_FRESH_S) -> None:
        """Return once the snapshot is fresh: at once when it is (or the actor is gone), else when
        the actor published a new one, or after ``timeout_s`` (the newest is served then)."""
        if self.closed or not self.due():
            return
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await asyncio.shield(fut)

    def age_s(self) -> float | None:
        """Seconds since the actor's last sign of life (a tick or a snapshot); None before any."""
        marks = [t for t in (self.ticked_s, self.published_s if self.doc is not None else None) if t is not None]
        return None if not marks else self.clock() - max(marks)

    def status_body(self, edge: Counter[str]) -> str:
        """The snapshot as standard JSON, with its sequence number (``snapshot_seq``) and the
        edge's refusal counters (by reason) laid over ``rejected_by_reason``; encoded once per
        (snapshot, counters).

        Raises:
            RuntimeError: nothing published yet.
        """
        if self.doc is None:
            raise RuntimeError("no status snapshot published yet")
        key = (self.seq, tuple(sorted(edge.items())))
        if self._body is None or self._body[0] != key:
            doc = dict(self.doc)
            doc["snapshot_seq"] = self.seq  # rises with every snapshot: a client can wait for a newer one
            doc["rejected_by_reason"] = {**doc.get("rejected_by_reason", {}), **{k: v for k, v in edge.items() if v}}
            self._body = (key, dumps(doc))
        return self._body[1]

    def health(self, run_id: str) -> tuple[bool, dict]:
        """(healthy, body): healthy while the actor's last sign of life is younger than
        :data:`STALE_AFTER_S` (``status_age_s``: its age, s)."""
        age = self.age_s()
        ok = age is not None and age < STALE_AFTER_S
        return ok, {"ok": ok, "run_id": run_id, "phase": self.phase, "status_age_s": age}
