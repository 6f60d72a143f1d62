"""Slow clients for the API fuzz (issue 14, item 2: request bodies and slow clients time out).

:class:`SlowClients` opens raw TCP connections to a synchronizer that stop half-way: some send a
request line and part of the headers, others complete headers that promise a body
(``Content-Length``) and send one byte of it. Then they wait; :meth:`SlowClients.wait_closed`
says how long the server took to close every one of them (None: some still open at the limit).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

__all__ = ["SlowClients"]


class SlowClients:
    """``count`` stalled connections to ``host:port``; ``headers_for(None)`` gives valid auth
    headers, used by half of the slow bodies (the others send none)."""

    def __init__(self, host: str, port: int, count: int, headers_for: Callable[[str | None], dict[str, str]]) -> None:
        self.host, self.port, self.count, self.headers_for = host, port, count, headers_for
        self.opened_at = 0.0
        self.closed_after: list[float | None] = []
        self._tasks: list[asyncio.Task] = []

    def _request(self, i: int) -> bytes:
        if i % 3 == 0:  # headers that never end
            return b"GET /status HTTP/1.1\r\nHost: fuzz\r\nX-Slow: "
        auth = "".join(f"{k}: {v}\r\n" for k, v in self.headers_for(None).items()) if i % 2 else ""
        path = "/heartbeat" if i % 3 == 1 else "/join"
        return (f"POST {path} HTTP/1.1\r\nHost: fuzz\r\nContent-Type: application/json\r\n{auth}"
                f"Content-Length: 100000\r\n\r\n{{").encode()

    async def _one(self, i: int) -> None:
        try:
            reader, writer = await asyncio.open_connection(self.host, self.port)
        except OSError:
            self.closed_after[i] = 0.0
            return
        try:
            writer.write(self._request(i))
            await writer.drain()
            while await reader.read(65536):  # an answer (e.g. 401 or 408) is fine; we wait for the close
                pass
            self.closed_after[i] = time.monotonic() - self.opened_at
        except OSError:
            self.closed_after[i] = time.monotonic() - self.opened_at
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    def open(self) -> None:
        """Open the connections (each in its own task)."""
        self.opened_at = time.monotonic()
        self.closed_after = [None] * self.count
        self._tasks = [asyncio.create_task(self._one(i)) for i in range(self.count)]

    async def wait_closed(self, limit_s: float) -> float | None:
        """Seconds from :meth:`open` until the server had closed every connection, or None if some
        were still open ``limit_s`` after :meth:`open` (those are then closed from this side)."""
        left = self.opened_at + limit_s - time.monotonic()
        if self._tasks:
            _, pending = await asyncio.wait(self._tasks, timeout=max(left, 0.0))
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        if any(t is None for t in self.closed_after):
            return None
        return max(self.closed_after, default=0.0)
