"""The synchronizer client against a small stand-in server on loopback: routes, headers, errors, timeouts."""

from __future__ import annotations

import asyncio
import contextlib
import threading

import aiohttp
import pytest
from aiohttp import web

from diloco_async.protocol.client import ProtocolError, SyncClient, call_blocking, fetch_status, request_checkpoint

TOKEN = "client-token"


def _app(seen: list, checkpoint_ok: bool = True, slow_s: float = 0.0) -> web.Application:
    async def record(request: web.Request) -> dict:
        body = await request.json() if request.can_read_body else None
        seen.append((request.method, request.path_qs, request.headers.get("Authorization"), body))
        if request.path not in ("/status", "/health") and request.headers.get("Authorization") != f"Bearer {TOKEN}":
            raise web.HTTPUnauthorized(text="unauthenticated")
        await asyncio.sleep(slow_s)
        return body

    async def echo(request: web.Request) -> web.Response:
        return web.json_response({"echo": await record(request)})

    async def checkpoint(request: web.Request) -> web.Response:
        await record(request)
        body = {"ok": True, "seq": 3} if checkpoint_ok else {"ok": False, "reason": "store down"}
        return web.json_response(body, status=200 if checkpoint_ok else 500)

    async def metrics(request: web.Request) -> web.Response:
        await record(request)
        return web.json_response({"metrics": [], "next": int(request.query["since"]), "total": 0})

    async def push(request: web.Request) -> web.WebSocketResponse:
        await record(request)
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        await ws.send_json({"type": "round_open", "fragment": 0, "round_n": 1, "version": 0})
        await ws.send_json({"type": "stop", "reason": "done"})
        await ws.close()
        return ws

    async def teapot(request: web.Request) -> web.Response:
        return web.Response(status=418, text="no")

    app = web.Application()
    app.add_routes([web.post("/join", echo), web.post("/heartbeat", echo), web.post("/announce", echo),
                    web.post("/checkpoint", checkpoint), web.get("/status", echo), web.get("/health", echo),
                    web.get("/metrics", metrics), web.get("/ws", push), web.get("/teapot", teapot)])
    return app


@contextlib.contextmanager
def serving(app: web.Application):
    """Run ``app`` on loopback in a thread of its own; yields its base URL."""
    loop = asyncio.new_event_loop()
    started = threading.Event()
    box: dict = {}

    async def start() -> None:
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        box["runner"], box["url"] = runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        started.set()

    thread = threading.Thread(target=lambda: (loop.run_until_complete(start()), loop.run_forever()), daemon=True)
    thread.start()
    assert started.wait(10)
    try:
        yield box["url"]
    finally:
        asyncio.run_coroutine_threadsafe(box["runner"].cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def test_async_routes_send_the_token_and_json():
    seen: list = []

    async def main() -> None:
        async with SyncClient(url + "/", TOKEN) as c:
            assert (await c.join({"learner_id": "a"}))["echo"] == {"learner_id": "a"}
            assert (await c.heartbeat({"step": 1}))["echo"] == {"step": 1}
            assert (await c.announce({"k": 2}))["echo"] == {"k": 2}
            assert (await c.metrics(5))["next"] == 5
            assert await c.checkpoint() == {"ok": True, "seq": 3}
            assert "echo" in await c.status() and "echo" in await c.health()
            async with c.push("a") as events:
                got = [e async for e in events]
            assert [e["type"] for e in got] == ["round_open", "stop"]

    with serving(_app(seen)) as url:
        asyncio.run(main())
    assert [(m, p) for m, p, _, _ in seen] == [("POST", "/join"), ("POST", "/heartbeat"), ("POST", "/announce"),
                                                ("GET", "/metrics?since=5"), ("POST", "/checkpoint"),
                                                ("GET", "/status"), ("GET", "/health"), ("GET", "/ws?learner_id=a")]
    assert all(auth == f"Bearer {TOKEN}" for _, _, auth, _ in seen)


def test_errors_and_the_before_post_hook():
    seen: list = []
    posted: list = []

    async def hook(path: str) -> None:
        posted.append(path)
        if path == "/announce":
            raise aiohttp.ClientConnectionError("chaos: dropped")

    async def main() -> None:
        async with SyncClient(url, "wrong") as c:
            with pytest.raises(ProtocolError, match="401"):
                await c.join({})
        async with SyncClient(url, TOKEN, before_post=hook) as c:
            await c.heartbeat({})
            with pytest.raises(aiohttp.ClientConnectionError):
                await c.announce({})
            with pytest.raises(aiohttp.ClientResponseError) as err:
                await c._request("GET", "/teapot")
            assert err.value.status == 418
        with pytest.raises(RuntimeError, match="outside"):
            await SyncClient(url).status()

    with serving(_app(seen)) as url:
        asyncio.run(main())
    assert posted == ["/heartbeat", "/announce"]
    assert [p for _, p, _, _ in seen] == ["/join", "/heartbeat"]  # the dropped announce never left


def test_request_timeout_is_per_request_and_changeable():
    async def main() -> None:
        async with SyncClient(url, TOKEN, request_timeout_s=0.05) as c:
            with pytest.raises(asyncio.TimeoutError):
                await c.heartbeat({})
            c.request_timeout_s = 30.0  # now the slow (0.3 s) answer comes in time, however loaded the machine
            assert (await c.heartbeat({"n": 1}))["echo"] == {"n": 1}

    with serving(_app([], slow_s=0.3)) as url:
        asyncio.run(main())


def test_blocking_helpers():
    seen: list = []
    with serving(_app(seen)) as url:
        assert fetch_status(url)["echo"] is None
        assert request_checkpoint(url, TOKEN) == {"ok": True, "seq": 3}
        assert call_blocking(url, TOKEN, "metrics", 7)["next"] == 7
        with pytest.raises(ProtocolError, match="401"):
            request_checkpoint(url, "wrong")
        with pytest.raises(ConnectionError):
            call_blocking(url, TOKEN, "_request", "GET", "/teapot")

        async def inside_a_loop() -> dict:  # e.g. called from a flow that runs an event loop
            return fetch_status(url)

        assert asyncio.run(inside_a_loop())["echo"] is None
    assert seen[0][2] is None  # /status is sent without a token
    with serving(_app([], checkpoint_ok=False)) as url:
        assert request_checkpoint(url, TOKEN) == {"ok": False, "reason": "store down"}
    with pytest.raises(OSError):  # nobody listens there any more
        fetch_status(url, timeout_s=2.0)
