"""The synchronizer's HTTP face: an aiohttp application in front of the actor.

Routes (JSON bodies, pydantic-validated) and the credential each needs
(``Authorization: Bearer <credential>``, see :mod:`diloco_async.protocol.auth`):

* ``POST /join``, ``/heartbeat``, ``/announce``, ``/lease`` (slices, DESIGN §5.2) and the WebSocket
  ``GET /ws?learner_id=L`` (pushes ``round_open``, ``version`` and ``stop`` events, and answers the heartbeats and
  announcements learner L sends on it: :mod:`~diloco_async.sync.ws_requests`) — the token of the
  learner named in the body (or the query), or the run secret. An announced object key must lie
  under the announcing learner's own key prefix (:func:`diloco_async.storage.keys.contribution_learner`).
* ``POST /checkpoint`` (write a checkpoint now; answers when written) and ``GET /metrics?since=N``
  — the run secret only.
* ``GET /status`` (run figures, learners, open rounds) and ``GET /health`` — open, read-only,
  served from the snapshot the actor publishes (:mod:`~diloco_async.sync.snapshot`), never
  through the actor's queue.

A request without a valid credential gets 401 (``unauthenticated``); a learner's token used as
another learner, for another learner's object key, or on an admin route gets 403
(``forbidden``). Neither reaches the actor: each is counted under its reason (a fixed set, shown in
``/status`` under ``rejected_by_reason``) and logged at most once per reason every 10 s. A body not
received within ``synchronizer.request_body_timeout_s`` gets 408 (``body_timeout``, counted the
same way); a connection that sends no complete request within ``synchronizer.idle_timeout_s`` is
closed. A join beyond ``synchronizer.max_learners`` gets 403 with reason ``learner_cap``.

With mutual TLS (``network.client_ca``, docs/network-modes.md) a learner's route also needs the
connection's verified certificate to name that learner (``diloco://learner/<id>``; else 401
``no_client_certificate`` or 403 ``certificate_identity``), an admin route the operator's.

A body or query that does not validate (not UTF-8, not JSON, nested too deep, an integer of more
than 4300 digits, not an object, a field out of its bounds — see :mod:`diloco_async.protocol.messages`)
gets 400 with ``{"error": "bad_request: ...", "reason": ...}`` naming the field, counted under
``bad_request`` and by reason (a body from a sender with no valid credential gets 401 instead).
JSON out is always standard JSON: non-finite floats become null.

The fast path (issue 17): a learner's body is parsed and validated in one step by pydantic from
the raw bytes (:meth:`~pydantic.BaseModel.model_validate_json`), its credential checked against
the validated ``learner_id``, and the reply serialized by pydantic; only a body that does not
validate takes the slow path, which finds the exact reason (and checks the credential first, so a
sender without one gets 401, never a hint about its body). A body already received whole is read
without arming the body timeout. A pushed event is serialized once for every WebSocket, and
handed to the WebSockets a batch per pass of the event loop (:class:`_FanOut`), so a push to
every learner does not hold the loop for the whole burst.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections import Counter
from typing import Any

from aiohttp import WSCloseCode, web
from pydantic import BaseModel

from diloco_async.protocol.auth import FORBIDDEN, UNAUTHENTICATED, Credentials, Verdict, bearer_credential
from diloco_async.protocol.messages import Announcement, Heartbeat, JoinRequest, LeaseRequest, MetricsQuery
from diloco_async.protocol.tls import OPERATOR_URI, learner_uri, peer_identity
from diloco_async.storage import keys
from diloco_async.sync.actor import HandlerError, Refused, Stopped, Synchronizer
from diloco_async.sync.bodies import BadRequest as _BadRequest
from diloco_async.sync.bodies import decode as _decode
from diloco_async.sync.bodies import validate as _validate
from diloco_async.sync.gate import BODY_TIMEOUT, CERTIFICATE_IDENTITY, NO_CERTIFICATE, Gate
from diloco_async.sync.snapshot import dumps as _dumps
from diloco_async.sync.state import Broadcaster
from diloco_async.sync.ws_requests import LearnerSocket

__all__ = ["make_app", "runner_options"]

log = logging.getLogger("diloco.server")

_OPEN_PATHS = {"/health", "/status"}


SYNC = web.AppKey("sync", Synchronizer)
GATE = web.AppKey("gate", Gate)


def _json(value: Any, status: int = 200) -> web.Response:
    return web.json_response(value, status=status, dumps=_dumps)


def _model_json(model: BaseModel) -> web.Response:
    """A reply model as standard JSON (pydantic writes non-finite floats as null)."""
    return web.Response(body=model.__pydantic_serializer__.to_json(model), content_type="application/json")


def _credential(request: web.Request) -> str | None:
    return bearer_credential(request.headers.get("Authorization"))


def _denied(request: web.Request, reason: str, detail: str) -> web.HTTPException:
    """The 401/403/408 answer to a request refused at the edge; counted and (rate-limited) logged."""
    request.app[GATE].refuse(reason, request.remote or "?", f"{request.method} {request.path}: {detail}")
    kind = {UNAUTHENTICATED: web.HTTPUnauthorized, FORBIDDEN: web.HTTPForbidden, NO_CERTIFICATE: web.HTTPUnauthorized,
            CERTIFICATE_IDENTITY: web.HTTPForbidden}.get(reason, web.HTTPRequestTimeout)
    return kind(text=_dumps({"error": f"{reason}: {detail}", "reason": reason}), content_type="application/json")


def _check(request: web.Request, verdict: Verdict, wanted: str) -> None:
    """Raise the refusal of ``verdict`` (``wanted`` names what was asked, for the log)."""
    if not verdict.ok:
        who = f"a token of {verdict.role}" if verdict.role else "a credential that matches nothing"
        raise _denied(request, verdict.reason, f"{who} may not act as {wanted}")


def _check_peer(request: web.Request, wanted: str | None, who: str) -> None:
    """Mutual TLS: the connection's verified certificate must name ``wanted`` (None: any identity)."""
    if not request.app[GATE].peers_checked:
        return
    transport = request.transport
    identity = peer_identity(transport.get_extra_info("peercert") if transport is not None else None)
    if identity is None:
        raise _denied(request, NO_CERTIFICATE, f"no client certificate with a diloco:// identity: may not act as {who}")
    if wanted is not None and identity != wanted:
        raise _denied(request, CERTIFICATE_IDENTITY, f"its certificate names {identity}, not {wanted}: may not act "
                                                     f"as {who}")


def _check_learner(request: web.Request, learner_id: str) -> None:
    """The request may act as ``learner_id``: its token (or the run secret) and, with mutual TLS,
    its certificate both say so."""
    who = f"learner {learner_id[:64]!r}"
    _check(request, request.app[GATE].credentials.as_learner(_credential(request), learner_id), who)
    _check_peer(request, learner_uri(learner_id), who)


def _check_admin(request: web.Request) -> None:
    """The request is the operator's: the run secret and, with mutual TLS, the operator's certificate."""
    _check(request, request.app[GATE].credentials.as_admin(_credential(request)), "the operator")
    _check_peer(request, OPERATOR_URI, "the operator")


@web.middleware
async def _auth(request: web.Request, handler):
    """No credential at all: refused before anything is read. The route checks the rest."""
    if request.path not in _OPEN_PATHS and _credential(request) is None:
        raise _denied(request, UNAUTHENTICATED, "missing or malformed Authorization header")
    return await handler(request)


def _refuse(request: web.Request, bad: _BadRequest) -> web.HTTPBadRequest:
    request.app[SYNC].count_bad_request(bad.reason)
    request.app[GATE].bad_request()
    log.warning("bad %s request from %s: %s: %s", request.path, request.remote, bad.reason, bad.detail)
    return web.HTTPBadRequest(text=_dumps({"error": f"bad_request: {bad.detail}", "reason": bad.reason}),
                              content_type="application/json")


async def _read(request: web.Request) -> bytes:
    """The body, received within ``synchronizer.request_body_timeout_s`` (else 408, ``body_timeout``)."""
    try:
        if request.content.is_eof():  # received whole already (the common case): nothing to wait for
            return await request.read()
        async with asyncio.timeout(request.app[SYNC].ctx.sc.request_body_timeout_s):
            return await request.read()
    except web.HTTPRequestEntityTooLarge:
        request.app[SYNC].count_bad_request("too_large")
        raise
    except TimeoutError:
        raise _denied(request, BODY_TIMEOUT, "the body did not arrive in time") from None


async def _parse_as_learner(request: web.Request, model: type[BaseModel]) -> Any:
    """Read, authorize and validate the body of a learner's request: the credential must be the
    token of the body's ``learner_id`` (or the run secret); then the body must validate."""
    raw = await _read(request)
    creds = request.app[GATE].credentials
    credential = _credential(request)
    try:  # the fast path: parse and validate at once; any failure takes the slow path for its reason
        msg = model.model_validate_json(raw)
    except ValueError:
        pass
    else:
        _check_learner(request, msg.learner_id)
        return msg
    try:
        doc = _decode(raw)
    except _BadRequest as bad:
        _check(request, creds.as_anyone(credential), "anyone")
        _check_peer(request, None, "anyone")
        raise _refuse(request, bad) from None
    claimed = doc.get("learner_id") if isinstance(doc, dict) else None
    if isinstance(claimed, str) and claimed:
        _check_learner(request, claimed)
    else:
        _check(request, creds.as_anyone(credential), "anyone")
        _check_peer(request, None, "anyone")
    try:
        return _validate(doc, model)
    except _BadRequest as bad:
        raise _refuse(request, bad) from None


async def _ask(request: web.Request, kind: str, body: Any) -> Any:
    """The actor's answer to one request; an error while handling it is a 500 with its reason, a
    refusal (e.g. ``learner_cap``) a 403, a request to a stopped actor a 503 (reason ``stopped``)."""
    try:
        return await request.app[SYNC].request(kind, body)
    except Refused as err:
        raise web.HTTPForbidden(text=_dumps({"error": f"{err.reason}: {err.detail}", "reason": err.reason}),
                                content_type="application/json") from None
    except HandlerError as err:
        raise web.HTTPInternalServerError(text=_dumps({"error": f"handler_error: {err}"}),
                                          content_type="application/json") from None
    except Stopped as err:
        raise web.HTTPServiceUnavailable(text=_dumps({"error": f"stopped: {err}", "reason": "stopped"}),
                                         content_type="application/json") from None


async def _join(request: web.Request) -> web.Response:
    req = await _parse_as_learner(request, JoinRequest)  # its mode is the port's it came on, not what it says
    resp = await _ask(request, "join", req.model_copy(update={"network_mode": request.app[GATE].mode}))
    return _model_json(resp)


class _ReplyBytes:
    """The JSON of the actor's heartbeat replies, by model: learners in the same state get the same
    model (:class:`~diloco_async.sync.version_infos.HeartbeatReplies`), serialized once here (the
    models are held, so their identities cannot be reused meanwhile)."""

    def __init__(self, cap: int = 512) -> None:
        self.cap = cap
        self._bytes: dict[int, tuple[BaseModel, bytes]] = {}

    def json(self, model: BaseModel) -> bytes:
        got = self._bytes.get(id(model))
        if got is None or got[0] is not model:
            if len(self._bytes) >= self.cap:
                self._bytes.clear()
            got = self._bytes[id(model)] = (model, model.__pydantic_serializer__.to_json(model))
        return got[1]

    def __call__(self, model: BaseModel) -> web.Response:
        return web.Response(body=self.json(model), content_type="application/json")


REPLY_BYTES = web.AppKey("reply_bytes", _ReplyBytes)
WS_COUNTS = web.AppKey("ws_counts", Counter)
"""Requests answered over the WebSockets, by ``"<kind> <status>"`` (:mod:`~diloco_async.sync.ws_requests`)."""


async def _heartbeat(request: web.Request) -> web.Response:
    resp = await _ask(request, "heartbeat", await _parse_as_learner(request, Heartbeat))
    return request.app[REPLY_BYTES](resp)


async def _announce(request: web.Request) -> web.Response:
    ann = await _parse_as_learner(request, Announcement)
    run_id = request.app[SYNC].run_id
    for key in ann.object_keys():  # a sharded group's shard objects too
        if keys.contribution_learner(run_id, key) != ann.learner_id:
            raise _denied(request, FORBIDDEN, f"learner {ann.learner_id!r} announced key {key[:200]!r}, which is "
                                              "not under its own contribution prefix")
    resp = await _ask(request, "announce", ann)
    return _model_json(resp)


async def _lease(request: web.Request) -> web.Response:
    return _model_json(await _ask(request, "lease", await _parse_as_learner(request, LeaseRequest)))


def _board(request: web.Request):
    sync = request.app[SYNC]
    if sync.board.doc is None and sync.board.ticked_s is None:  # the actor has not run yet: nothing else
        sync.board.publish(sync.status())                        # touches the state
    return sync.board


async def _status(request: web.Request) -> web.Response:
    board, sync = _board(request), request.app[SYNC]
    await board.wait_fresh()  # the actor builds a snapshot at the end of its pass when the newest is stale
    if board.doc is None:  # none came in time (the actor is stuck): built here, between two of its steps
        board.publish(sync.status())
    body = board.status_body(sync.report.edge_rejections)
    return web.Response(text=body, content_type="application/json")


async def _health(request: web.Request) -> web.Response:
    ok, body = _board(request).health(request.app[SYNC].run_id)
    return _json(body, status=200 if ok else 503)


async def _metrics(request: web.Request) -> web.Response:
    _check_admin(request)
    try:
        query = _validate({k: v for k, v in request.query.items() if k == "since"}, MetricsQuery)
    except _BadRequest as bad:
        raise _refuse(request, bad) from None
    return _json(await _ask(request, "metrics", query.since))


class _EventText:
    """The text of the newest pushed event: one event goes to every WebSocket, so it is
    serialized once (the event dict is held, so its identity cannot be reused meanwhile)."""

    def __init__(self) -> None:
        self.event: dict | None = None
        self.text = ""

    def __call__(self, event: dict) -> str:
        if event is not self.event:
            self.event, self.text = event, _dumps(event)
        return self.text


EVENT_TEXT = web.AppKey("event_text", _EventText)

FANOUT_BATCH = 16
"""WebSockets woken per pass of the event loop when an event is pushed to all of them (issue 17): a
send costs ~70-90 µs on the 2-core machine, so 16 hold the loop ~1.5 ms; the requests that arrive
during a push to 1,000 learners wait less behind each batch (64: announce p99 313 and 339 ms, 16:
82 and 118 ms, back to back; 8 was no better than 16)."""


class _FanOut(Broadcaster):
    """Hands each pushed event to every WebSocket's own queue, :data:`FANOUT_BATCH` at a time.

    One event goes to every learner at once (``round_open``, ``version``); waking all their
    connections in one pass of the event loop holds it for the whole burst (N sends), and every
    request that arrives meanwhile waits behind it. This relay, one task subscribed to the
    actor's :class:`~diloco_async.sync.state.Broadcaster`, yields to the loop after each batch, so
    requests are served between batches. Events keep their order; a connection whose queue is
    full (a stuck learner) loses the push, as before (heartbeats carry the same information).
    The WebSockets subscribe to it as to a :class:`~diloco_async.sync.state.Broadcaster`.
    """

    async def relay(self, source: asyncio.Queue) -> None:
        """Forward every event of ``source`` until cancelled."""
        while True:
            event = await source.get()
            for i, q in enumerate(list(self.queues.values()), 1):
                try:
                    q.put_nowait(event)
                except asyncio.QueueFull:
                    pass
                if i % FANOUT_BATCH == 0:
                    await asyncio.sleep(0)  # the woken batch sends, and requests come in, before the next

    async def running(self, app: web.Application):
        """``cleanup_ctx`` of the application: the relay runs while the application does."""
        handle, source = app[SYNC].push.subscribe()
        task = asyncio.get_running_loop().create_task(self.relay(source))
        yield
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        app[SYNC].push.unsubscribe(handle)


FANOUT = web.AppKey("fanout", _FanOut)
#: the push sockets open now (closed by :func:`_close_sockets` when the server shuts down)
OPEN_SOCKETS = web.AppKey("open_sockets", weakref.WeakSet)


async def _close_sockets(app: web.Application) -> None:
    """On shutdown: close every open push socket with 1001 (going away). aiohttp's shutdown waits
    for running handlers (up to 60 s) and a push handler runs as long as its learner holds the
    socket; closed here, the handlers end at once, and each learner sends what it had in flight
    over HTTP and reconnects (to the synchronizer that replaces this one)."""
    sockets = list(app[OPEN_SOCKETS])
    await asyncio.gather(*(ws.close(code=WSCloseCode.GOING_AWAY, message=b"synchronizer stopping")
                           for ws in sockets), return_exceptions=True)


async def _push(request: web.Request) -> web.WebSocketResponse:
    lid = request.query.get("learner_id", "")
    if lid:
        _check_learner(request, lid)
    else:
        _check_admin(request)
    ws = web.WebSocketResponse(heartbeat=10.0, max_msg_size=request.app[SYNC].ctx.sc.client_max_size_bytes)
    await ws.prepare(request)
    app = request.app
    app[OPEN_SOCKETS].add(ws)
    requests = LearnerSocket(app[SYNC], app[GATE], app[REPLY_BYTES].json, lid, request.remote or "?", app[WS_COUNTS])
    push, text = request.app[FANOUT], request.app[EVENT_TEXT]
    handle, q = push.subscribe()

    def gone(_reader: asyncio.Future) -> None:  # the learner went away: wake the loop below
        while True:
            try:
                q.put_nowait(None)
                return
            except asyncio.QueueFull:
                q.get_nowait()

    reader = asyncio.ensure_future(requests.serve(ws))  # answers requests; completes when the learner goes away
    reader.add_done_callback(gone)
    try:
        while not ws.closed:
            event = await q.get()
            if event is None:
                break
            await ws.send_str(text(event))
    except (ConnectionResetError, RuntimeError):
        pass
    finally:
        push.unsubscribe(handle)
        reader.remove_done_callback(gone)
        reader.cancel()
    return ws


async def _checkpoint(request: web.Request) -> web.Response:
    """Write a checkpoint now; answers once it is written (or failed)."""
    _check_admin(request)
    result = await _ask(request, "checkpoint", None)
    return _json(result, status=200 if result["ok"] else 500)


def make_app(sync: Synchronizer, run_secret: str, mode: str = "direct", peers_checked: bool = False) -> web.Application:
    """The aiohttp application; handlers check credentials, validate and hand typed messages to the actor.

    Args:
        sync: the synchronizer (its ``run_id`` names the run the learner tokens are derived for).
        run_secret: the run's secret (admin credential; learners' tokens derive from it).
        mode: the network mode of the port it serves (``direct`` or ``tls``): each joining learner's.
        peers_checked: mutual TLS: learner and admin routes also need the client certificate naming
            the learner (``diloco://learner/<id>``) or the operator (:mod:`diloco_async.protocol.tls`).

    Raises:
        ValueError: an empty ``run_secret``.
    """
    if not run_secret:
        raise ValueError("the run secret must be a non-empty string")
    app = web.Application(middlewares=[_auth], client_max_size=sync.ctx.sc.client_max_size_bytes)
    app[SYNC] = sync
    app[GATE] = Gate(Credentials(run_secret, sync.run_id), sync.report.edge_rejections, mode=mode,
                     by_mode=sync.report.edge_by_mode, peers_checked=peers_checked)
    app[EVENT_TEXT] = _EventText()
    app[REPLY_BYTES] = _ReplyBytes()
    app[WS_COUNTS] = Counter()
    app[FANOUT] = _FanOut(sync.push.max_queue)
    app.cleanup_ctx.append(app[FANOUT].running)
    app[OPEN_SOCKETS] = weakref.WeakSet()
    app.on_shutdown.append(_close_sockets)
    app.add_routes([web.post("/join", _join), web.post("/heartbeat", _heartbeat), web.post("/announce", _announce),
                    web.get("/status", _status), web.get("/metrics", _metrics), web.get("/health", _health),
                    web.get("/ws", _push), web.post("/checkpoint", _checkpoint), web.post("/lease", _lease)])
    return app


def runner_options(sync: Synchronizer) -> dict[str, Any]:
    """Keyword arguments of ``web.AppRunner`` for this synchronizer: ``keepalive_timeout`` closes a
    connection that sends no complete request within ``synchronizer.idle_timeout_s`` (a slow
    client cannot hold a connection by trickling its headers)."""
    return {"access_log": None, "keepalive_timeout": sync.ctx.sc.idle_timeout_s}
