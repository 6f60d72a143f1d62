"""Learner requests over the WebSocket push channel (issue 17): heartbeats and announcements
sent as messages on the socket a learner already holds (``GET /ws?learner_id=L``), answered on
the same socket, instead of one HTTP POST each.

A request is a text message ``{"id": n, "kind": "heartbeat" | "announce" | "lease", "body": {...}}``
(``n`` an integer in [0, 2**53), chosen by the learner to match the answer; ``body`` the same
JSON object ``POST /heartbeat``, ``POST /announce`` or ``POST /lease`` takes). The answer is a text message
``{"type": "reply", "id": n, "status": 200, "body": {...}}`` (the route's answer), or
``{"type": "reply", "id": n, "status": s, "error": "...", "reason": "..."}`` with the status and
reason the HTTP route would give (``id`` is null when the message named none that could be read).
Pushed events never carry ``"type": "reply"``.

The checks are those of the HTTP routes: the socket was authenticated when it opened, as its
``learner_id``; a message naming another learner (or any message on an operator's socket, opened
without ``learner_id``) gets 403 ``forbidden``, counted and logged at the edge like a forbidden
request (:class:`~diloco_async.sync.gate.Gate`), and never reaches the actor; an announced key
must lie under the learner's own prefix (403 otherwise). A message that does not decode or
validate gets 400 with the reason of :mod:`~diloco_async.sync.bodies` (a message that is not a
request frame: ``bad_frame``), counted under ``bad_request`` and logged; the socket stays open.
Everything else (unknown learner or incarnation, replayed or stale announcements, refusals) is the
actor's, exactly as over HTTP. A socket handles its messages one at a time, in order.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from typing import Any

import aiohttp
from aiohttp import web
from pydantic import BaseModel

from diloco_async.protocol.auth import FORBIDDEN
from diloco_async.protocol.messages import Announcement, Heartbeat, LeaseRequest
from diloco_async.storage import keys
from diloco_async.sync.actor import HandlerError, Refused, Stopped, Synchronizer
from diloco_async.sync.bodies import BadRequest, decode, validate
from diloco_async.sync.gate import Gate
from diloco_async.sync.snapshot import dumps

__all__ = ["KINDS", "ID_LIMIT", "LearnerSocket"]

log = logging.getLogger("diloco.server")

KINDS: dict[str, type[BaseModel]] = {"heartbeat": Heartbeat, "announce": Announcement, "lease": LeaseRequest}
"""The requests a learner may send over its WebSocket, and the model of each body."""
ID_LIMIT = 2**53  # request ids are integers in [0, ID_LIMIT): exact in every JSON reader


class _Refusal(Exception):
    """An answer other than 200: its HTTP status, reason and detail."""

    def __init__(self, status: int, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.status, self.reason, self.detail = status, reason, detail


class LearnerSocket:
    """Answers the requests that arrive on one WebSocket.

    Args:
        sync: the synchronizer whose actor handles them.
        gate: the edge's counters and log of refusals.
        reply_json: the JSON bytes of an answer model (heartbeat answers are shared, so cached).
        learner_id: the learner the socket was authenticated as; "" for an operator's socket.
        remote: the peer's address, for the logs.
        counts: answers by ``"<kind> <status>"`` (shared by every socket of the application).
    """

    def __init__(self, sync: Synchronizer, gate: Gate, reply_json: Callable[[BaseModel], bytes], learner_id: str,
                 remote: str, counts: Counter[str]) -> None:
        self.sync, self.gate, self.reply_json = sync, gate, reply_json
        self.learner_id, self.remote, self.counts = learner_id, remote, counts

    async def serve(self, ws: web.WebSocketResponse) -> None:
        """Answer every request of ``ws`` until the learner closes it or goes away."""
        try:
            while True:
                msg = await ws.receive()
                if msg.type == aiohttp.WSMsgType.TEXT:
                    answer = await self.answer(msg.data)
                elif msg.type == aiohttp.WSMsgType.BINARY:
                    answer = self._bad(None, BadRequest("bad_frame", "requests are text messages, not binary"))
                else:  # CLOSE, CLOSING, CLOSED, ERROR: the learner went away
                    return
                await ws.send_str(answer)
        except (ConnectionResetError, RuntimeError):  # closed while answering: nobody to answer
            return

    async def answer(self, text: str) -> str:
        """The answer (a JSON text) to one request message ``text``; never raises for bad input."""
        rid: int | None = None
        kind = "bad"
        try:
            doc = decode(text)
            rid = _request_id(doc)
            kind, body = _frame(doc)
            msg = self._admit(kind, body)
            resp = await self.sync.request(kind, msg)
        except BadRequest as bad:
            return self._bad(rid, bad)
        except _Refusal as no:
            return self._error(rid, kind, no.status, no.reason, no.detail)
        except Refused as err:
            return self._error(rid, kind, 403, err.reason, err.detail)
        except HandlerError as err:
            return self._error(rid, kind, 500, "handler_error", str(err))
        except Stopped as err:
            return self._error(rid, kind, 503, "stopped", str(err))
        self.counts[f"{kind} 200"] += 1
        return f'{{"type":"reply","id":{rid},"status":200,"body":{self.reply_json(resp).decode()}}}'

    def _admit(self, kind: str, body: dict) -> BaseModel:
        """The validated body; the edge's checks (learner id, then fields, then the announced key)."""
        claimed = body.get("learner_id")
        if not self.learner_id or claimed != self.learner_id:
            who = f"learner {self.learner_id!r}" if self.learner_id else "the operator"
            detail = f"{kind} over the WebSocket of {who} may not act as learner {str(claimed)[:64]!r}"
            self.gate.refuse(FORBIDDEN, self.remote, f"GET /ws: {detail}")
            raise _Refusal(403, FORBIDDEN, detail)
        msg = validate(body, KINDS[kind])
        if kind == "announce":
            key = next((k for k in msg.object_keys()  # a sharded group's shard objects too
                        if keys.contribution_learner(self.sync.run_id, k) != msg.learner_id), None)
            if key is not None:
                detail = (f"learner {msg.learner_id!r} announced key {key[:200]!r}, which is not under its own "
                          "contribution prefix")
                self.gate.refuse(FORBIDDEN, self.remote, f"GET /ws: {detail}")
                raise _Refusal(403, FORBIDDEN, detail)
        return msg

    def _bad(self, rid: int | None, bad: BadRequest) -> str:
        self.sync.count_bad_request(bad.reason)
        log.warning("bad WebSocket request from %s (learner %r): %s: %s", self.remote, self.learner_id[:64],
                    bad.reason, bad.detail)
        return self._error(rid, "bad", 400, bad.reason, f"bad_request: {bad.detail}", prefixed=True)

    def _error(self, rid: int | None, kind: str, status: int, reason: str, detail: str, prefixed: bool = False) -> str:
        self.counts[f"{kind} {status}"] += 1
        error = detail if prefixed else f"{reason}: {detail}"
        return dumps({"type": "reply", "id": rid, "status": status, "error": error, "reason": reason})


def _request_id(doc: Any) -> int | None:
    """The request's id when it has a valid one (so even a refusal can be matched), else None."""
    rid = doc.get("id") if isinstance(doc, dict) else None
    return rid if type(rid) is int and 0 <= rid < ID_LIMIT else None


def _frame(doc: Any) -> tuple[str, dict]:
    """The kind and body of a request message.

    Raises:
        BadRequest: ``bad_frame`` — not an object, no valid id, an unknown kind or a body that is not an object.
    """
    if not isinstance(doc, dict):
        raise BadRequest("bad_frame", f"a request must be a JSON object, not {type(doc).__name__}")
    if _request_id(doc) is None:
        raise BadRequest("bad_frame", f"a request needs an integer id in [0, 2**53), got {str(doc.get('id'))[:40]!r}")
    kind, body = doc.get("kind"), doc.get("body")
    if kind not in KINDS:
        raise BadRequest("bad_frame", f"unknown kind {str(kind)[:40]!r}; known: {', '.join(KINDS)}")
    if not isinstance(body, dict):
        raise BadRequest("bad_frame", f"the body must be a JSON object, not {type(body).__name__}")
    return kind, body
