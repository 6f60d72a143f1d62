"""The synchronizer's HTTP face: an aiohttp application in front of the actor.

Routes (JSON bodies, pydantic-validated):

* ``POST /join``, ``POST /heartbeat``, ``POST /announce``, ``GET /metrics?since=N`` and the
  WebSocket ``GET /ws`` (pushes ``round_open``, ``version`` and ``stop`` events) — need the
  run's secret token as ``Authorization: Bearer <token>``; without it: 401, logged and counted.
* ``POST /checkpoint`` — write a checkpoint now (answers when written); needs the token.
* ``GET /status`` (run figures, learners, open rounds) and ``GET /health`` — open, read-only.

A body or query that does not validate (not UTF-8, not JSON, nested too deep, an integer of more
than 4300 digits, not an object, a field out of its bounds — see :mod:`diloco_async.messages`)
gets 400 with ``{"error": "bad_request: ...", "reason": ...}`` naming the field, counted under
``bad_request`` and by reason. A malformed ``Authorization`` header is a 401. JSON out is always
standard JSON: non-finite floats become null.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
from typing import Any

from aiohttp import web
from pydantic import BaseModel, ValidationError

from diloco_async.messages import Announcement, Heartbeat, JoinRequest, MetricsQuery
from diloco_async.sync.actor import HandlerError, Synchronizer

__all__ = ["make_app"]

log = logging.getLogger("diloco.server")

_OPEN_PATHS = {"/health", "/status"}


SYNC = web.AppKey("sync", Synchronizer)
TOKEN = web.AppKey("token", str)


_DETAIL_CHARS = 300  # longest reason echoed to the client and logged


def _finite(value: Any) -> Any:
    """``value`` with every non-finite float (at any depth) replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def _dumps(value: Any) -> str:
    """Standard JSON (RFC 8259): non-finite floats become null."""
    try:
        return json.dumps(value, allow_nan=False)
    except ValueError:
        return json.dumps(_finite(value), allow_nan=False)


def _json(value: Any, status: int = 200) -> web.Response:
    return web.json_response(value, status=status, dumps=_dumps)


def _authorized(given: str, token: str) -> bool:
    """Does the ``Authorization`` header carry the run token? (False for a non-ASCII header.)"""
    try:
        given_bytes = given.encode("ascii")
    except UnicodeEncodeError:
        return False
    return hmac.compare_digest(given_bytes, f"Bearer {token}".encode())


@web.middleware
async def _auth(request: web.Request, handler):
    if request.path not in _OPEN_PATHS and not _authorized(request.headers.get("Authorization", ""),
                                                           request.app[TOKEN]):
        request.app[SYNC].count_unauthenticated(request.remote or "?")
        return _json({"error": "unauthenticated: missing or wrong run token"}, status=401)
    return await handler(request)


class _BadRequest(Exception):
    """A request that does not validate: ``reason`` (a counter name from a bounded set) and a detail."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason, self.detail = reason, detail[:_DETAIL_CHARS]


def _field_errors(err: ValidationError, model: type[BaseModel]) -> _BadRequest:
    """The fields that failed, named in the detail; the reason is ``field:<name>`` for a field of
    ``model`` (``unexpected_field`` for any other name, which the sender chose)."""
    errors = err.errors(include_input=False, include_url=False)
    top = str(errors[0]["loc"][0]) if errors and errors[0]["loc"] else ""
    reason = f"field:{top}" if top in model.model_fields else "unexpected_field"
    detail = "; ".join(f"{'.'.join(str(x) for x in e['loc'])}: {e['msg']}" for e in errors[:4])
    return _BadRequest(reason, detail)


def _validate(doc: Any, model: type[BaseModel]) -> BaseModel:
    if not isinstance(doc, dict):
        raise _BadRequest("not_an_object", f"the body must be a JSON object, not {type(doc).__name__}")
    try:
        return model.model_validate(doc)
    except ValidationError as err:
        raise _field_errors(err, model) from None


def _decode(raw: bytes) -> Any:
    """The JSON document in ``raw``; hostile bodies raise :class:`_BadRequest`, nothing else."""
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise _BadRequest("not_utf8", "the body is not UTF-8") from None
    except RecursionError:
        raise _BadRequest("json_too_deep", "the JSON document is nested too deep") from None
    except json.JSONDecodeError as err:
        raise _BadRequest("invalid_json", f"not JSON: {err}") from None
    except ValueError as err:  # e.g. an integer of more than 4300 digits
        raise _BadRequest("number_too_long", str(err)) from None


def _refuse(request: web.Request, bad: _BadRequest) -> web.HTTPBadRequest:
    request.app[SYNC].count_bad_request(bad.reason)
    log.warning("bad %s request from %s: %s: %s", request.path, request.remote, bad.reason, bad.detail)
    return web.HTTPBadRequest(text=_dumps({"error": f"bad_request: {bad.detail}", "reason": bad.reason}),
                              content_type="application/json")


async def _parse(request: web.Request, model: type[BaseModel]) -> BaseModel:
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        request.app[SYNC].count_bad_request("too_large")
        raise
    try:
        return _validate(_decode(raw), model)
    except _BadRequest as bad:
        raise _refuse(request, bad) from None


async def _ask(request: web.Request, kind: str, body: Any) -> Any:
    """The actor's answer to one request; an error while handling it is a 500 with its reason."""
    try:
        return await request.app[SYNC].request(kind, body)
    except HandlerError as err:
        raise web.HTTPInternalServerError(text=_dumps({"error": f"handler_error: {err}"}),
                                          content_type="application/json") from None


async def _join(request: web.Request) -> web.Response:
    resp = await _ask(request, "join", await _parse(request, JoinRequest))
    return _json(resp.model_dump(mode="json"))


async def _heartbeat(request: web.Request) -> web.Response:
    resp = await _ask(request, "heartbeat", await _parse(request, Heartbeat))
    return _json(resp.model_dump(mode="json"))


async def _announce(request: web.Request) -> web.Response:
    resp = await _ask(request, "announce", await _parse(request, Announcement))
    return _json(resp.model_dump(mode="json"))


async def _status(request: web.Request) -> web.Response:
    return _json(await _ask(request, "status", None))


async def _metrics(request: web.Request) -> web.Response:
    try:
        query = _validate({k: v for k, v in request.query.items() if k == "since"}, MetricsQuery)
    except _BadRequest as bad:
        raise _refuse(request, bad) from None
    return _json(await _ask(request, "metrics", query.since))


async def _push(request: web.Request) -> web.WebSocketResponse:
    ws = web.WebSocketResponse(heartbeat=10.0)
    await ws.prepare(request)
    push = request.app[SYNC].push
    handle, q = push.subscribe()
    reader = asyncio.ensure_future(ws.receive())  # completes when the learner goes away
    try:
        while not ws.closed:
            getter = asyncio.ensure_future(q.get())
            done, _ = await asyncio.wait({getter, reader}, return_when=asyncio.FIRST_COMPLETED)
            if getter not in done:
                getter.cancel()
                break
            await ws.send_json(getter.result(), dumps=_dumps)
    except (ConnectionResetError, RuntimeError):
        pass
    finally:
        push.unsubscribe(handle)
        reader.cancel()
    return ws


async def _checkpoint(request: web.Request) -> web.Response:
    """Write a checkpoint now; answers once it is written (or failed)."""
    result = await _ask(request, "checkpoint", None)
    return _json(result, status=200 if result["ok"] else 500)


async def _health(request: web.Request) -> web.Response:
    return _json({"ok": True, "run_id": request.app[SYNC].run_id})


def make_app(sync: Synchronizer, token: str) -> web.Application:
    """The aiohttp application; handlers validate and hand typed messages to the actor.

    Raises:
        ValueError: an empty ``token``.
    """
    if not token:
        raise ValueError("the run token must be a non-empty string")
    app = web.Application(middlewares=[_auth], client_max_size=sync.sc.client_max_size_bytes)
    app[SYNC], app[TOKEN] = sync, token
    app.add_routes([web.post("/join", _join), web.post("/heartbeat", _heartbeat), web.post("/announce", _announce),
                    web.get("/status", _status), web.get("/metrics", _metrics), web.get("/health", _health),
                    web.get("/ws", _push), web.post("/checkpoint", _checkpoint)])
    return app
