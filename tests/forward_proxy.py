"""Test infrastructure: a tiny forwarding HTTP proxy on loopback that counts what went through it.

It serves ``CONNECT host:port`` (the tunnel an HTTPS or WSS client opens through ``HTTPS_PROXY``)
and absolute-form requests (``GET http://host:port/path``, what a plain-HTTP client sends to
``HTTP_PROXY``, a WebSocket upgrade included): it opens a connection to the target, forwards the
request in origin form and then relays bytes both ways until either side closes. ``connections``
counts the connections opened to each ``host:port`` and ``kinds`` them by ``CONNECT`` / ``forward``.
It runs its own event loop in a daemon thread (``with ForwardProxy() as proxy: proxy.url``).
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from urllib.parse import urlsplit


class ForwardProxy:
    def __init__(self) -> None:
        self.connections: Counter[str] = Counter()
        self.kinds: Counter[str] = Counter()
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="forward-proxy")
        self._server: asyncio.AbstractServer | None = None
        self._writers: set[asyncio.StreamWriter] = set()  # both ends of every relayed connection

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ForwardProxy:
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("the proxy did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        """Close the listener and every relayed connection, then the loop (again: nothing to do)."""
        if self._loop.is_closed():
            return
        asyncio.run_coroutine_threadsafe(self._close(), self._loop).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    async def _close(self) -> None:
        assert self._server is not None
        self._server.close()
        for writer in list(self._writers):
            writer.close()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", 0))
        self.port = self._server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()
        self._loop.run_until_complete(self._loop.shutdown_asyncgens())

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            writer.close()
            return
        line, _, rest = head.partition(b"\r\n")
        method, target, version = line.decode("latin-1").split(" ", 2)
        if method == "CONNECT":
            host, port = target.rsplit(":", 1)
            kind, first = "CONNECT", b""
        else:
            url = urlsplit(target)
            host, port = url.hostname or "", str(url.port or 80)
            path = (url.path or "/") + (f"?{url.query}" if url.query else "")
            kind, first = "forward", f"{method} {path} {version}\r\n".encode("latin-1") + rest
        try:
            up_reader, up_writer = await asyncio.open_connection(host, int(port))
        except OSError:
            writer.write(b"HTTP/1.1 502 Bad Gateway\r\ncontent-length: 0\r\n\r\n")
            writer.close()
            return
        self._writers.add(up_writer)
        self.connections[f"{host}:{port}"] += 1
        self.kinds[kind] += 1
        if kind == "CONNECT":
            writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
        else:
            up_writer.write(first)
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))


async def _pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
    try:
        while data := await src.read(65536):
            dst.write(data)
            await dst.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        dst.close()
