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

from diloco_async.protocol.auth import FORBIDDEN, UNAUTHENTICATED, Credentials
from diloco_async.protocol.tls import TLS_REASONS
from diloco_async.sync.logs import RateLimitedLog

__all__ = ["Gate", "EDGE_REASONS", "BODY_TIMEOUT", "NO_CERTIFICATE", "CERTIFICATE_IDENTITY", "LOG_EVERY_S",
           "ProtocolErrorFilter", "quiet_protocol_errors"]

log = logging.getLogger("diloco.server")

BODY_TIMEOUT = "body_timeout"
"""Reason: the request's body did not arrive within ``synchronizer.request_body_timeout_s``."""
NO_CERTIFICATE = "no_client_certificate"
"""Reason (mutual TLS): a learner or admin request on a connection without a verified client certificate."""
CERTIFICATE_IDENTITY = "certificate_identity"
"""Reason (mutual TLS): the connection's certificate names another learner (or not the operator)."""
EDGE_REASONS = (UNAUTHENTICATED, FORBIDDEN, BODY_TIMEOUT, NO_CERTIFICATE, CERTIFICATE_IDENTITY,
                *(f"tls_{r}" for r in TLS_REASONS))
"""The fixed set of reasons counted at the edge."""
LOG_EVERY_S = 10.0
"""At most one log line per reason in this many seconds."""


class Gate:
    """Credentials of the run and the edge's refusal counters.

    Args:
        credentials: checks bearer credentials (:class:`~diloco_async.protocol.auth.Credentials`).
        counts: the counters by reason, shared with the status (written only here).
        clock: monotonic clock in seconds of the log's rate limit.
        mode: the network mode of this edge's port (``direct`` or ``tls``).
        by_mode: requests refused (here and by :meth:`bad_request`) by network mode, shared with the status.
        peers_checked: mutual TLS: learner and admin requests need a verified client certificate
            naming who they act as (:mod:`diloco_async.protocol.tls`).
    """

    def __init__(self, credentials: Credentials, counts: Counter[str],
                 clock: Callable[[], float] = time.monotonic, mode: str = "direct",
                 by_mode: Counter[str] | None = None, peers_checked: bool = False) -> None:
        self.credentials = credentials
        self.counts = counts
        self.log = RateLimitedLog(log, LOG_EVERY_S, clock)
        self.mode, self.peers_checked = mode, peers_checked
        self.by_mode: Counter[str] = by_mode if by_mode is not None else Counter()

    def bad_request(self) -> None:
        """Count one request refused as malformed (400) under this edge's mode."""
        self.by_mode[self.mode] += 1

    def refuse_handshake(self, reason: str, detail: str) -> None:
        """Count one TLS handshake refused for ``reason`` (one of
        :data:`~diloco_async.protocol.tls.TLS_REASONS`, counted as ``tls_<reason>``) and maybe log it."""
        self.refuse(f"tls_{reason}", "a TLS client", f"handshake refused: {detail}")

    def refuse(self, reason: str, remote: str, detail: str) -> None:
        """Count one refused request under ``reason`` (one of :data:`EDGE_REASONS`) and maybe log it.

        Raises:
            ValueError: ``reason`` is not one of :data:`EDGE_REASONS` (the counters stay a fixed set).
        """
        if reason not in EDGE_REASONS:
            raise ValueError(f"unknown edge reason {reason!r}; known: {', '.join(EDGE_REASONS)}")
        self.counts[reason] += 1
        self.by_mode[self.mode] += 1
        self.log.note(reason, f"refused request from {remote}: {detail} ({self.counts[reason]} so far)")


class ProtocolErrorFilter(logging.Filter):
    """On aiohttp's server logger: a request that does not parse as HTTP (a bad request line,
    header or chunk, or a client gone mid-body) becomes one rate-limited warning line without a
    traceback (:class:`~diloco_async.sync.logs.RateLimitedLog`, reason ``protocol_error``); any
    other record passes unchanged. aiohttp answers such a request 400 itself."""

    def __init__(self, refusals: RateLimitedLog) -> None:
        super().__init__()
        self.refusals = refusals

    def filter(self, record: logging.LogRecord) -> bool:
        from aiohttp.http_exceptions import HttpProcessingError

        err = record.exc_info[1] if record.exc_info else None
        if not isinstance(err, HttpProcessingError | ConnectionResetError):
            return True
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        self.refusals.note("protocol_error", f"{type(err).__name__}: {first}")
        return False


def quiet_protocol_errors(logger: logging.Logger | None = None) -> ProtocolErrorFilter:
    """Install :class:`ProtocolErrorFilter` on aiohttp's ``aiohttp.server`` logger (once)."""
    logger = logger or logging.getLogger("aiohttp.server")
    for f in logger.filters:
        if isinstance(f, ProtocolErrorFilter):
            return f
    installed = ProtocolErrorFilter(RateLimitedLog(log, LOG_EVERY_S))
    logger.addFilter(installed)
    return installed
