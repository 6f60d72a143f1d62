"""The status the actor publishes for ``GET /status`` and ``GET /health`` (issue 14, item 2).

Polling the status must not queue behind the actor's work (48 pollers once raised a learner's
heartbeat latency a hundredfold): the actor publishes a snapshot of :func:`reporting.status`
after each pass of its loop (a message handled, or its 50 ms tick), and the HTTP layer serves the
newest one, however many pollers there are. A snapshot costs time proportional to the number of
learners, so the actor skips a pass's snapshot while the last one is younger than
:data:`COST_FACTOR` times what building it took: snapshots take at most about 1/COST_FACTOR of the
actor's time (a run of 4 learners publishes after every message; one of 256, about every 25 ms).
Requests refused at the edge are counted outside the actor; their
counters are laid over the snapshot when it is served, so they are never stale.
"""

from __future__ import annotations

import json
import math
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

__all__ = ["StatusBoard", "dumps", "COST_FACTOR", "STALE_AFTER_S"]

COST_FACTOR = 20.0
"""A snapshot is skipped while the last one is younger than this many times its build time."""
STALE_AFTER_S = 30.0
"""``/health`` answers 503 when the newest snapshot is older than this: the actor is stuck."""


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
    """The newest status snapshot and its encoded form.

    Written by the actor (:meth:`publish`), read by the HTTP handlers (:meth:`status_body`,
    :meth:`health`); both run on one event loop, so no lock is needed.

    Args:
        clock: monotonic clock in seconds for the snapshot's age (real time, not the actor's clock).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.doc: dict | None = None
        self.seq = 0
        self.published_s = 0.0
        self.build_s = 0.0  # what building the last snapshot took
        self._body: tuple[tuple[int, tuple], str] | None = None  # (seq, edge counts) -> encoded body

    def publish(self, doc: dict, build_s: float = 0.0) -> None:
        """A new snapshot that took ``build_s`` seconds to build (the dict is kept, not copied:
        the actor builds a new one each time)."""
        self.doc, self.seq, self.published_s, self.build_s = doc, self.seq + 1, self.clock(), build_s

    def due(self) -> bool:
        """May a new snapshot be built now (see :data:`COST_FACTOR`)?"""
        return self.doc is None or self.clock() - self.published_s >= COST_FACTOR * self.build_s

    def age_s(self) -> float | None:
        return None if self.doc is None else self.clock() - self.published_s

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
        """(healthy, body): healthy while the newest snapshot is younger than :data:`STALE_AFTER_S`."""
        age = self.age_s()
        ok = age is not None and age < STALE_AFTER_S
        phase = self.doc.get("phase") if self.doc is not None else None
        return ok, {"ok": ok, "run_id": run_id, "phase": phase, "status_age_s": age}
