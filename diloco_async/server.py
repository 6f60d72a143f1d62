"""The synchronizer process: an aiohttp server in front of the :class:`Synchronizer` actor.

Routes (JSON bodies, pydantic-validated):

* ``POST /join``, ``POST /heartbeat``, ``POST /announce``, ``GET /metrics?since=N`` and the
  WebSocket ``GET /ws`` (pushes ``round_open``, ``version`` and ``stop`` events) — need the
  run's secret token as ``Authorization: Bearer <token>``; without it: 401, logged and counted.
* ``POST /checkpoint`` — write a checkpoint now (answers when written); needs the token.
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

from typing import Optional

from diloco_async.config import Config, apply_overrides, config_differences, config_hash, load_config
from diloco_async.messages import Announcement, Heartbeat, JoinRequest
from diloco_async.synchronizer import Synchronizer
from storage import keys
from storage.checkpoint import Checkpoint, latest_checkpoint, load_checkpoint
from storage.options import STORAGE_OPTIONS_ENV, storage_options_from_env
from storage.store import IntegrityError, ObjectStore

__all__ = ["make_app", "serve", "main", "open_checkpoint", "TOKEN_ENV", "STORAGE_OPTIONS_ENV"]

log = logging.getLogger("diloco.server")

TOKEN_ENV = "DILOCO_RUN_TOKEN"
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

    async def checkpoint(_request: web.Request) -> web.Response:
        """Write a checkpoint now; answers once it is written (or failed)."""
        result = await sync.request("checkpoint", None)
        return web.json_response(result, status=200 if result["ok"] else 500)

    async def health(_request: web.Request) -> web.Response:
        return web.json_response({"ok": True, "run_id": sync.run_id})

    app = web.Application(middlewares=[auth], client_max_size=sync.sc.client_max_size_bytes)
    app.add_routes([web.post("/join", join), web.post("/heartbeat", heartbeat), web.post("/announce", announce),
                    web.get("/status", status), web.get("/metrics", metrics), web.get("/health", health), web.get("/ws", push),
                    web.post("/checkpoint", checkpoint)])
    return app


async def serve(cfg: Config, store: ObjectStore, run_id: str, token: str, ready_file: str | None = None,
                resume: Optional[Checkpoint] = None) -> dict:
    """Run a synchronizer until its budget is spent; returns the run summary.

    With ``resume``, the outer state comes from that verified checkpoint of the same run.

    Writes ``{"url", "run_id", "pid", "epoch"}`` to ``ready_file`` (atomically) once the server listens.
    SIGTERM and SIGINT start a clean stop (final checkpoint, learners told to stop).
    """
    sync = Synchronizer(cfg, store, run_id)
    if resume is None:
        await asyncio.to_thread(sync.publish_initial)
    else:
        await asyncio.to_thread(sync.restore, resume)
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
        tmp.write_text(json.dumps({"url": url, "run_id": run_id, "pid": os.getpid(), "epoch": sync.epoch}))
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
    ap.add_argument("--run-id", default=None, help="id of a new run (not with --resume)")
    ap.add_argument("--resume", default=None, metavar="CHECKPOINT_URL",
                    help="continue a run: {store}/{run_id}/checkpoints/{seq}, or {store}/{run_id} for the newest")
    ap.add_argument("--ready-file", default=None)
    args = ap.parse_args(argv)
    if (args.run_id is None) == (args.resume is None):
        ap.error("give exactly one of --run-id (new run) or --resume (continue a run)")
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s synchronizer %(levelname)s %(name)s: %(message)s")
    token = os.environ.get(TOKEN_ENV, "")
    if not token:
        print(f"error: {TOKEN_ENV} is not set; the synchronizer needs the run's secret token", file=sys.stderr)
        return 2
    import torch

    torch.set_num_threads(1)
    env_options = storage_options_from_env()
    try:
        if args.resume:
            cfg, store, run_id, ckpt = open_checkpoint(args.resume, args.config, args.set, env_options)
        else:
            cfg = load_config(args.config, args.set)
            store = ObjectStore(cfg.run.store, {**cfg.run.storage_options, **env_options})
            run_id, ckpt = args.run_id, None
        asyncio.run(serve(cfg, store, run_id, token, args.ready_file, resume=ckpt))
    except ValueError as err:
        log.error("%s", err)
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


def open_checkpoint(url: str, config_path: Optional[str], overrides: list[str],
                    storage_options: dict) -> tuple[Config, ObjectStore, str, Checkpoint]:
    """Resolve a checkpoint URL into (config, store, run id, verified checkpoint).

    The config is the given recipe, or the run's own ``config.json`` from the store when none
    is given; overrides apply on top (a budget may be extended; training fields must match).

    Raises:
        ValueError: nothing verifies at that URL, or the URL is malformed.
    """
    root, run_id, seq = keys.split_checkpoint_url(url)
    if config_path is None:
        stored = ObjectStore(root, storage_options).get_json(keys.config_key(run_id))
        raw = apply_overrides(stored, overrides)
        raw["run"]["store"] = root
        cfg = Config.model_validate(raw)
    else:
        cfg = load_config(config_path, [*overrides, f"run.store={root}"])
    store = ObjectStore(root, {**cfg.run.storage_options, **storage_options})
    if seq is None:
        ckpt = latest_checkpoint(store, run_id)
        if ckpt is None:
            raise ValueError(f"no verified checkpoint under {root}/{run_id}")
    else:
        try:
            ckpt = load_checkpoint(store, run_id, seq)
        except FileNotFoundError:
            raise ValueError(f"checkpoint {seq} of run {run_id} is incomplete or missing (no manifest)") from None
        except IntegrityError as err:
            raise ValueError(f"checkpoint {seq} of run {run_id} does not verify: {err}") from None
    if ckpt.manifest.get("config_hash") != config_hash(cfg):
        diffs = config_differences(ckpt.manifest.get("config", {}), cfg.public_dict())
        raise ValueError(f"config differs from checkpoint {ckpt.seq}'s: " + ("; ".join(diffs) or "hash only"))
    return cfg, store, run_id, ckpt


if __name__ == "__main__":
    raise SystemExit(main())
