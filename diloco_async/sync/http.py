"""The synchronizer's HTTP face: an aiohttp application in front of the actor.

Routes (JSON bodies, pydantic-validated):

* ``POST /join``, ``POST /heartbeat``, ``POST /announce``, ``GET /metrics?since=N`` and the
  WebSocket ``GET /ws`` (pushes ``round_open``, ``version`` and ``stop`` events) — need the
  run's secret token as ``Authorization: Bearer <token>``; without it: 401, logged and counted.
* ``POST /checkpoint`` — write a checkpoint now (answers when written); needs the token.
* ``GET /status`` (run figures, learners, open rounds) and ``GET /health`` — open, read-only.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging

from aiohttp import web
from pydantic import ValidationError

from diloco_async.messages import Announcement, Heartbeat, JoinRequest
from diloco_async.sync.actor import Synchronizer

__all__ = ["make_app"]

log = logging.getLogger("diloco.server")

_OPEN_PATHS = {"/health", "/status"}


SYNC = web.AppKey("sync", Synchronizer)
TOKEN = web.AppKey("token", str)


@web.middleware
async def _auth(request: web.Request, handler):
    if request.path not in _OPEN_PATHS:
        given = request.headers.get("Authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {request.app[TOKEN]}".encode()):
            request.app[SYNC].count_unauthenticated(request.remote or "?")
            return web.json_response({"error": "unauthenticated: missing or wrong run token"}, status=401)
    return await handler(request)


async def _parse(request: web.Request, model):
    try:
        return model.model_validate(await request.json())
    except (ValidationError, json.JSONDecodeError, UnicodeDecodeError) as err:
        request.app[SYNC].count_bad_request()
        log.warning("bad %s request from %s: %s", request.path, request.remote, str(err).splitlines()[0])
        raise web.HTTPBadRequest(text=json.dumps({"error": f"bad_request: {err}"}),
                                 content_type="application/json") from None


async def _join(request: web.Request) -> web.Response:
    resp = await request.app[SYNC].request("join", await _parse(request, JoinRequest))
    return web.json_response(resp.model_dump(mode="json"))


async def _heartbeat(request: web.Request) -> web.Response:
    resp = await request.app[SYNC].request("heartbeat", await _parse(request, Heartbeat))
    return web.json_response(resp.model_dump(mode="json"))


async def _announce(request: web.Request) -> web.Response:
    resp = await request.app[SYNC].request("announce", await _parse(request, Announcement))
    return web.json_response(resp.model_dump(mode="json"))


async def _status(request: web.Request) -> web.Response:
    return web.json_response(await request.app[SYNC].request("status", None))


async def _metrics(request: web.Request) -> web.Response:
    try:
        since = int(request.query.get("since", "0"))
    except ValueError:
        raise web.HTTPBadRequest(text="since must be an integer") from None
    return web.json_response(await request.app[SYNC].request("metrics", since))


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
            await ws.send_json(getter.result())
    except (ConnectionResetError, RuntimeError):
        pass
    finally:
        push.unsubscribe(handle)
        reader.cancel()
    return ws


async def _checkpoint(request: web.Request) -> web.Response:
    """Write a checkpoint now; answers once it is written (or failed)."""
    result = await request.app[SYNC].request("checkpoint", None)
    return web.json_response(result, status=200 if result["ok"] else 500)


async def _health(request: web.Request) -> web.Response:
    return web.json_response({"ok": True, "run_id": request.app[SYNC].run_id})


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
