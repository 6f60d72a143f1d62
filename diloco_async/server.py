"""The synchronizer process: an aiohttp server in front of the :class:`Synchronizer` actor.

Routes (JSON bodies, pydantic-validated):

* ``POST /join``, ``POST /heartbeat``, ``POST /announce``, ``GET /metrics?since=N`` and the
  WebSocket ``GET /ws`` (pushes ``round_open``, ``version`` and ``stop`` events) — need the
  run's secret token as ``Authorization: Bearer <token>``; without it: 401, logged and counted.
* ``GET /status`` (run figures, learners, open rounds) and ``GET /health`` — open, read-only.

The token comes from the environment (``DILOCO_RUN_TOKEN``) and is never logged.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import logging
import os
import signal
import sys
from pathlib import Path

from aiohttp import web
from pydantic import ValidationError

from diloco_async.config import Config, load_config
from diloco_async.messages import Announcement, Heartbeat, JoinRequest
from diloco_async.synchronizer import Synchronizer
from storage.store import ObjectStore

__all__ = ["make_app", "serve", "main", "TOKEN_ENV", "STORAGE_OPTIONS_ENV"]

log = logging.getLogger("diloco.server")

TOKEN_ENV = "DILOCO_RUN_TOKEN"
STORAGE_OPTIONS_ENV = "DILOCO_STORAGE_OPTIONS"
_OPEN_PATHS = {"/health", "/status"}


def make_app(sync: Synchronizer, token: str) -> web.Application:
    """The aiohttp application; handlers validate and hand typed messages to the actor."""
    if not token:
        raise ValueError("the run token must be a non-empty string")

    @web.middleware
    async def auth(request: web.Request, handler):
        if request.path not in _OPEN_PATHS:
            given = request.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
                sync.count_unauthenticated(request.remote or "?")
                return web.json_response({"error": "unauthenticated: missing or wrong run token"}, status=401)
        return await handler(request)

    async def parse(request: web.Request, model):
        try:
            return model.model_validate(await request.json())
        except (ValidationError, json.JSONDecodeError, UnicodeDecodeError) as err:
            sync.rejected_by_reason["bad_request"] += 1
            log.warning("bad %s request from %s: %s", request.path, request.remote, str(err).splitlines()[0])
            raise web.HTTPBadRequest(text=json.dumps({"error": f"bad_request: {err}"}),
                                     content_type="application/json") from None

    async def join(request: web.Request) -> web.Response:
        resp = await sync.request("join", await parse(request, JoinRequest))
        return web.json_response(resp.model_dump(mode="json"))

    async def heartbeat(request: web.Request) -> web.Response:
        resp = await sync.request("heartbeat", await parse(request, Heartbeat))
        return web.json_response(resp.model_dump(mode="json"))

    async def announce(request: web.Request) -> web.Response:
        resp = await sync.request("announce", await parse(request, Announcement))
        return web.json_response(resp.model_dump(mode="json"))

    async def status(_request: web.Request) -> web.Response:
        return web.json_response(await sync.request("status", None))

    async def metrics(request: web.Request) -> web.Response:
        try:
            since = int(request.query.get("since", "0"))
        except ValueError:
            raise web.HTTPBadRequest(text="since must be an integer") from None
        return web.json_response(await sync.request("metrics", since))

    async def push(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(heartbeat=10.0)
        await ws.prepare(request)
        handle, q = sync.push.subscribe()
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
            sync.push.unsubscribe(handle)
            reader.cancel()
        return ws

    async def health(_request: web.Request) -> web.Response:
        return web.json_response({"ok": True, "run_id": sync.run_id})

    app = web.Application(middlewares=[auth], client_max_size=sync.sc.client_max_size_bytes)
    app.add_routes([web.post("/join", join), web.post("/heartbeat", heartbeat), web.post("/announce", announce),
                    web.get("/status", status), web.get("/metrics", metrics), web.get("/health", health), web.get("/ws", push)])
    return app


async def serve(cfg: Config, store: ObjectStore, run_id: str, token: str, ready_file: str | None = None) -> dict:
    """Run a synchronizer until its budget is spent; returns the run summary.

    Writes ``{"url", "run_id", "pid"}`` to ``ready_file`` (atomically) once the server listens.
    SIGTERM and SIGINT start a clean stop (final checkpoint, learners told to stop).
    """
    sync = Synchronizer(cfg, store, run_id)
    await asyncio.to_thread(sync.publish_initial)
    runner = web.AppRunner(make_app(sync, token), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, cfg.synchronizer.host, cfg.synchronizer.port)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    url = f"http://{cfg.synchronizer.host}:{port}"
    log.info("synchronizer run=%s listening on %s", run_id, url)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, lambda s=sig: loop.create_task(sync.request("stop", f"signal {s.name}")))
        except (NotImplementedError, RuntimeError):
            pass
    if ready_file:
        tmp = Path(ready_file).with_suffix(".tmp")
        tmp.write_text(json.dumps({"url": url, "run_id": run_id, "pid": os.getpid()}))
        tmp.replace(ready_file)
    try:
        summary = await sync.run()
    finally:
        await runner.cleanup()
    log.info("synchronizer run=%s finished: %s", run_id, sync.stopping)
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m diloco_async.server", description="Run the synchronizer.")
    ap.add_argument("--config", default=None, help="recipe file (TOML); defaults when omitted")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--run-id", required=True)
    ap.add_argument("--ready-file", default=None)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s synchronizer %(levelname)s %(name)s: %(message)s")
    token = os.environ.get(TOKEN_ENV, "")
    if not token:
        print(f"error: {TOKEN_ENV} is not set; the synchronizer needs the run's secret token", file=sys.stderr)
        return 2
    cfg = load_config(args.config, args.set)
    options = dict(cfg.run.storage_options)
    options.update(json.loads(os.environ.get(STORAGE_OPTIONS_ENV, "{}")))
    store = ObjectStore(cfg.run.store, options)
    import torch

    torch.set_num_threads(1)
    asyncio.run(serve(cfg, store, args.run_id, token, args.ready_file))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
