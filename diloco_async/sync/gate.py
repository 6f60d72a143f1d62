"""The HTTP edge's gate: credentials and the counters of requests refused before the actor.

A refused request (no valid credential, a learner acting as another, a body that did not arrive
in time) costs one counter increment and at most one log line per reason every
:data:`LOG_EVERY_S` seconds: no metric point, no actor message, nothing that grows with the number
of refused requests.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable

from diloco_async.auth import FORBIDDEN, UNAUTHENTICATED, Credentials
from diloco_async.sync.logs import RateLimitedLog

__all__ = ["Gate", "EDGE_REASONS", "BODY_TIMEOUT", "LOG_EVERY_S"]

log = logging.getLogger("diloco.server")

BODY_TIMEOUT = "body_timeout"
"""Reason: the request's body did not arrive within ``synchronizer.request_body_timeout_s``."""
EDGE_REASONS = (UNAUTHENTICATED, FORBIDDEN, BODY_TIMEOUT)
"""The fixed set of reasons counted at the edge."""
LOG_EVERY_S = 10.0
"""At most one log line per reason in this many seconds."""


class Gate:
    """Credentials of the run and the edge's refusal counters.

    Args:
        credentials: checks bearer credentials (:class:`~diloco_async.auth.Credentials`).
        counts: the counters by reason, shared with the status (written only here).
        clock: monotonic clock in seconds of the log's rate limit.
    """

    def __init__(self, credentials: Credentials, counts: Counter[str],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.credentials = credentials
        self.counts = counts
        self.log = RateLimitedLog(log, LOG_EVERY_S, clock)

    def refuse(self, reason: str, remote: str, detail: str) -> None:
        """Count one refused request under ``reason`` (one of :data:`EDGE_REASONS`) and maybe log it.

        Raises:
            ValueError: ``reason`` is not one of :data:`EDGE_REASONS` (the counters stay a fixed set).
        """
        if reason not in EDGE_REASONS:
            raise ValueError(f"unknown edge reason {reason!r}; known: {', '.join(EDGE_REASONS)}")
        self.counts[reason] += 1
        self.log.note(reason, f"refused request from {remote}: {detail} ({self.counts[reason]} so far)")
