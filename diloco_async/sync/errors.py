"""The synchronizer actor's answers to a request it does not serve (DESIGN §2.1): each maps to an HTTP
status at the edge (:mod:`diloco_async.sync.http`, :mod:`diloco_async.sync.ws_requests`)."""

from __future__ import annotations

__all__ = ["HandlerError", "Refused", "Stopped"]


class HandlerError(RuntimeError):
    """The reply to a request whose handling raised inside the actor (the run goes on)."""


class Refused(Exception):
    """The reply to a request the actor refuses on purpose: ``reason`` (e.g. ``learner_cap``), ``detail``."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


class Stopped(Exception):
    """A request reached a stopped actor (run over, or fenced): nothing would answer it; HTTP 503 ``stopped``."""

    def __init__(self, kind: str) -> None:
        super().__init__(f"the synchronizer has stopped and answers no {kind} request")
        self.kind = kind
