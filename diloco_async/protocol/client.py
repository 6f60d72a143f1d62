"""The one client of the synchronizer's HTTP API (DESIGN §4): async over aiohttp, plus a blocking helper.

Routes (``diloco_async.server``): ``POST /join``, ``/heartbeat``, ``/announce`` and the WebSocket
push channel ``GET /ws`` (a learner's own token, or the run secret), ``POST /checkpoint`` and
``GET /metrics`` (the run secret), ``GET /status`` and ``/health`` (open); see
:mod:`diloco_async.protocol.auth`. Bodies are JSON objects shaped like the models of
:mod:`diloco_async.protocol.messages`; this module sends and returns plain dicts so that it imports
neither torch nor the learner (the status view and the flows use it).

Errors:

* :class:`ProtocolError` — HTTP 401, 403 or 413: retrying the same request cannot help.
* ``aiohttp.ClientResponseError`` — any other status >= 400 (async methods); :class:`ReplyError`
  (an ``aiohttp.ClientError``) for the same over the WebSocket.
* ``aiohttp.ClientError``, ``TimeoutError``, ``OSError`` — the synchronizer did not answer.
* The blocking helpers raise ``ConnectionError`` (an ``OSError``) for the last two kinds.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import ssl
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp

from diloco_async.protocol.tls import client_context_from_env

__all__ = ["TOKEN_ENV", "LEARNER_TOKEN_ENV", "DEFAULT_REQUEST_TIMEOUT_S", "ProtocolError", "ReplyError",
           "ChannelClosed", "RequestChannel", "SyncClient",
           "call_blocking", "fetch_status",
           "request_checkpoint"]

#: The environment variable that carries the run's secret to the synchronizer and the operator's
#: processes (flows, checkpoint requests); never to a learner.
TOKEN_ENV = "DILOCO_RUN_TOKEN"
#: The environment variable that carries a learner's own token
#: (:func:`diloco_async.protocol.auth.learner_token`) to that learner's process.
LEARNER_TOKEN_ENV = "DILOCO_LEARNER_TOKEN"
#: Seconds one request may take (the default of ``learners.request_timeout_s``).
DEFAULT_REQUEST_TIMEOUT_S = 10.0
_FATAL_STATUSES = (401, 403, 413)


class ProtocolError(RuntimeError):
    """The synchronizer answered with something this client cannot work with (HTTP 401, 403, 413)."""


class ReplyError(aiohttp.ClientError):
    """A request over the WebSocket answered with a status >= 400 other than 401, 403 and 413
    (the counterpart of ``aiohttp.ClientResponseError``): ``status``, and the error in the message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class ChannelClosed(ConnectionError):
    """The WebSocket of a :class:`RequestChannel` closed before a request was answered (or was
    closed already): the request may not have arrived; send it again (over HTTP)."""


class RequestChannel:
    """Requests over an open WebSocket of the push channel (``heartbeat`` and ``announce``; see
    :mod:`diloco_async.sync.ws_requests`): each is sent as ``{"id", "kind", "body"}`` and its
    answer, a message of type ``reply`` with the same id, is handed over by :meth:`take`, which
    the socket's reader calls on every message it receives.

    Args:
        ws: the open WebSocket.
        url: the synchronizer's base URL (named in errors).
    """

    def __init__(self, ws: aiohttp.ClientWebSocketResponse, url: str = "") -> None:
        self.ws, self.url = ws, url
        self.closed = False
        self._pending: dict[int, asyncio.Future] = {}
        self._next_id = 0

    async def request(self, kind: str, body: dict, timeout_s: float) -> dict:
        """Send one request; returns the body of its answer (a dict, as the HTTP route's JSON).

        Raises:
            ChannelClosed: the socket closed before the answer came (or was closed already).
            ProtocolError: answered 401, 403 or 413 (e.g. the body names another learner).
            ReplyError: answered with another status >= 400.
            TimeoutError: no answer within ``timeout_s``.
        """
        if self.closed or self.ws.closed:
            raise ChannelClosed(f"closed: {self.url}/ws")
        rid, self._next_id = self._next_id, self._next_id + 1
        fut = self._pending[rid] = asyncio.get_running_loop().create_future()
        try:
            await self.ws.send_str(json.dumps({"id": rid, "kind": kind, "body": body}))
            async with asyncio.timeout(timeout_s):
                doc = await fut
        except (ConnectionError, aiohttp.ClientConnectionError) as err:
            raise ChannelClosed(f"{type(err).__name__}: {err} on {self.url}/ws") from err
        finally:
            self._pending.pop(rid, None)
        status = doc.get("status")
        if status == 200:
            return doc["body"]
        text = json.dumps({k: doc.get(k) for k in ("error", "reason")})
        if status in _FATAL_STATUSES:
            raise ProtocolError(f"/ws {kind}: HTTP {status} {text}")
        raise ReplyError(int(status or 0), f"/ws {kind}: HTTP {status} {text}")

    def take(self, doc: Any) -> bool:
        """Hand over ``doc`` (a decoded message of the socket) if it answers a request: True then."""
        if not isinstance(doc, dict) or doc.get("type") != "reply":
            return False
        fut = self._pending.get(doc.get("id"))  # type: ignore[arg-type]
        if fut is not None and not fut.done():
            fut.set_result(doc)
        return True

    def close(self) -> None:
        """The socket closed: every request waiting for an answer raises :class:`ChannelClosed`."""
        self.closed = True
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(ChannelClosed(f"closed before the answer: {self.url}/ws"))


class SyncClient:
    """Async client of one synchronizer; use as ``async with SyncClient(url, token) as client``.

    Args:
        url: the synchronizer's base URL, e.g. ``http://127.0.0.1:8765``.
        token: the credential sent as ``Authorization: Bearer <token>``: a learner's own token or
            the run secret; None sends no header (enough for the open routes ``/status`` and ``/health``).
        request_timeout_s: seconds one request (or a WebSocket handshake) may take; an attribute
            that may be changed while the client is open (``learners.request_timeout_s``).
        before_post: awaited with the path before every POST (chaos: delay or drop a control
            message by raising ``aiohttp.ClientConnectionError``).
        link_delay_s: one-way latency this client adds to each exchange with the synchronizer
            (:mod:`diloco_async.runtime.link_delay`; the WAN harness's regions): every request and the
            WebSocket handshake wait one round trip (``2 x link_delay_s``) before they are sent,
            every pushed message waits ``link_delay_s`` before it is handed on. Not part of
            ``request_timeout_s``. Raises ValueError when negative.
        ws_requests: send heartbeats and announcements over the push channel's WebSocket while
            :meth:`push` holds it open (:class:`RequestChannel`), over HTTP otherwise; a request
            whose socket closes before the answer is sent again over HTTP. False: always HTTP.
        ssl_context: how an ``https://`` synchronizer is verified and which client certificate is
            presented (mutual TLS); None: from ``DILOCO_TLS_CA`` / ``_CERT`` / ``_KEY``
            (:func:`~diloco_async.protocol.tls.client_context_from_env`). Requests and the WebSocket
            go through ``HTTPS_PROXY`` / ``HTTP_PROXY`` unless ``NO_PROXY`` names the host
            (aiohttp's ``trust_env``; docs/network-modes.md).

    ``sent_by_transport`` counts the heartbeats and announcements sent (answered or not), by
    ``"ws"`` and ``"http"``.
    """

    def __init__(self, url: str, token: str | None = None, *,
                 request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
                 before_post: Callable[[str], Awaitable[None]] | None = None,
                 link_delay_s: float = 0.0, ws_requests: bool = True,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        if not 0 <= link_delay_s < float("inf"):
            raise ValueError(f"link_delay_s must be a finite number >= 0, got {link_delay_s!r}")
        self.url = url.rstrip("/")
        self.link_delay_s = float(link_delay_s)
        self.token = token
        self.request_timeout_s = request_timeout_s
        self.before_post = before_post
        self.ws_requests = ws_requests
        self.ssl_context = ssl_context
        self.sent_by_transport: Counter[str] = Counter()
        self._session: aiohttp.ClientSession | None = None
        self._channel: RequestChannel | None = None  # the push channel's socket while it is open

    async def __aenter__(self) -> SyncClient:
        # no session-wide timeout: each request carries request_timeout_s as it is when sent
        ctx = self.ssl_context
        if ctx is None and self.url.startswith("https://"):
            ctx = client_context_from_env()
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None), trust_env=True,
                                              connector=aiohttp.TCPConnector(ssl=ctx if ctx is not None else True))
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def auth_headers(self) -> dict[str, str]:
        """The headers that authenticate this client's requests (``{}`` without a token); for
        callers that send a request this client has no method for (the API fuzz's raw bodies)."""
        return self._headers()

    async def _request(self, method: str, path: str, body: dict | None = None,
                       ok_statuses: tuple[int, ...] = ()) -> Any:
        """Send one request; returns the decoded JSON body of a status < 400 or in ``ok_statuses``."""
        if self._session is None:
            raise RuntimeError("SyncClient used outside 'async with'")
        if method == "POST" and self.before_post is not None:
            await self.before_post(path)
        if self.link_delay_s > 0:
            await asyncio.sleep(2 * self.link_delay_s)  # one round trip over the emulated link
        timeout = aiohttp.ClientTimeout(total=self.request_timeout_s)
        async with self._session.request(method, f"{self.url}{path}", json=body, headers=self._headers(),
                                         timeout=timeout) as resp:
            if resp.status in _FATAL_STATUSES:
                raise ProtocolError(f"{path}: HTTP {resp.status} {await resp.text()}")
            if resp.status >= 400 and resp.status not in ok_statuses:
                raise aiohttp.ClientResponseError(resp.request_info, (), status=resp.status,
                                                  message=await resp.text())
            return await resp.json()

    async def join(self, body: dict) -> dict:
        """``POST /join`` with a ``JoinRequest``; returns a ``JoinResponse``."""
        return await self._request("POST", "/join", body)

    async def _learner_request(self, kind: str, body: dict) -> Any:
        """``kind`` over the push channel's socket when it is open (see ``ws_requests``), else ``POST /kind``."""
        channel = self._channel
        if channel is not None and not channel.closed and self.ws_requests:
            if self.before_post is not None:
                await self.before_post(f"/{kind}")
            if self.link_delay_s > 0:
                await asyncio.sleep(2 * self.link_delay_s)  # one round trip over the emulated link
            try:
                self.sent_by_transport["ws"] += 1
                return await channel.request(kind, body, self.request_timeout_s)
            except ChannelClosed:  # it may not have arrived: again, over HTTP (announcements are idempotent)
                pass
        self.sent_by_transport["http"] += 1
        return await self._request("POST", f"/{kind}", body)

    async def heartbeat(self, body: dict) -> dict:
        """A ``Heartbeat`` (over the push channel's socket when open, else ``POST /heartbeat``);
        returns a ``HeartbeatResponse``."""
        return await self._learner_request("heartbeat", body)

    async def step_boundary(self, body: dict) -> dict:
        """A replayed run's step boundary (a ``Heartbeat`` with ``replay_announcements``; DESIGN §3.2), always
        as ``POST /heartbeat``: the push channel's socket answers its requests one at a time, and a boundary
        the synchronizer holds there would hold the learner's other heartbeats too. Returns a ``HeartbeatResponse``."""
        self.sent_by_transport["http"] += 1
        return await self._request("POST", "/heartbeat", body)

    async def announce(self, body: dict) -> dict:
        """An ``Announcement`` (over the push channel's socket when open, else ``POST /announce``);
        returns an ``AnnouncementAck``."""
        return await self._learner_request("announce", body)

    async def lease(self, body: dict) -> dict:
        """A ``LeaseRequest`` (over the push channel's socket when open, else ``POST /lease``);
        returns a ``LeaseResponse`` (DESIGN §5.2)."""
        return await self._learner_request("lease", body)

    async def checkpoint(self) -> dict:
        """``POST /checkpoint``: write a checkpoint now. Returns ``{"ok": True, "seq": n, ...}``, or
        ``{"ok": False, "reason": ...}`` when the synchronizer could not write it (HTTP 500)."""
        return await self._request("POST", "/checkpoint", {}, ok_statuses=(500,))

    async def status(self) -> dict:
        """``GET /status`` (open route): run figures, learners, open rounds, versions."""
        return await self._request("GET", "/status")

    async def metrics(self, since: int = 0) -> dict:
        """``GET /metrics?since=n``: ``{"metrics": [points from index n], "next": i, "total": t}``."""
        return await self._request("GET", f"/metrics?since={int(since)}")

    async def health(self) -> dict:
        """``GET /health`` (open route): ``{"ok": True, "run_id": ...}``."""
        return await self._request("GET", "/health")

    @contextlib.asynccontextmanager
    async def push(self, learner_id: str) -> AsyncIterator[AsyncIterator[dict]]:
        """The WebSocket push channel of ``learner_id``, as ``async with client.push(id) as events:
        async for event in events: ...``; each event is a dict with ``type`` ``round_open``,
        ``version`` or ``stop``. The iteration ends when the channel closes; the caller reconnects.
        While the caller iterates, :meth:`heartbeat` and :meth:`announce` go over this socket
        (``ws_requests``): their answers arrive as the caller reads it.

        Raises:
            aiohttp.ClientError, TimeoutError: the handshake failed or took over ``request_timeout_s``.
        """
        if self._session is None:
            raise RuntimeError("SyncClient used outside 'async with'")
        connect = self._session.ws_connect(f"{self.url}/ws?learner_id={learner_id}", headers=self._headers(),
                                           heartbeat=10.0)
        if self.link_delay_s > 0:
            await asyncio.sleep(2 * self.link_delay_s)  # the handshake's round trip
        async with await asyncio.wait_for(connect, self.request_timeout_s) as ws:
            channel = self._channel = RequestChannel(ws, self.url)
            try:
                yield _events(ws, self.link_delay_s, channel)
            finally:
                channel.close()
                if self._channel is channel:
                    self._channel = None


async def _events(ws: aiohttp.ClientWebSocketResponse, delay_s: float = 0.0,
                  channel: RequestChannel | None = None) -> AsyncIterator[dict]:
    """The pushed events of ``ws``; answers to requests go to ``channel`` (their round trip was
    waited for when they were sent), not to the caller."""
    try:
        async for msg in ws:
            if msg.type != aiohttp.WSMsgType.TEXT:
                return
            doc = json.loads(msg.data)
            if channel is not None and channel.take(doc):
                continue
            if delay_s > 0:
                await asyncio.sleep(delay_s)  # one way, hub -> region
            yield doc
    finally:
        if channel is not None:
            channel.close()


def call_blocking(url: str, token: str | None, method: str, *args: Any,
                  request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
                  ssl_context: ssl.SSLContext | None = None) -> Any:
    """Run one :class:`SyncClient` method to completion from synchronous code, e.g.
    ``call_blocking(url, token, "metrics", 0)``; safe to call from a thread that runs an event loop.
    ``ssl_context``: as :class:`SyncClient`'s.

    Raises:
        ProtocolError: HTTP 401, 403 or 413.
        ConnectionError: no answer in time, or another HTTP status >= 400.
        ValueError: the answer is not JSON.
    """
    async def once() -> Any:
        async with SyncClient(url, token, request_timeout_s=request_timeout_s, ssl_context=ssl_context) as client:
            return await getattr(client, method)(*args)

    try:
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # the usual case: no loop in this thread
            return asyncio.run(once())
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            return pool.submit(asyncio.run, once()).result()
    except aiohttp.ContentTypeError as err:
        raise ValueError(f"{method} answered no JSON ({err.message}) at {url}") from err
    except aiohttp.ClientError as err:
        if isinstance(err, OSError):  # ClientOSError, ClientConnectorError (TimeoutError is one already)
            raise
        raise ConnectionError(f"{method} failed ({type(err).__name__}: {err}) at {url}") from err


def fetch_status(url: str, timeout_s: float = 5.0, ssl_context: ssl.SSLContext | None = None) -> dict:
    """``GET {url}/status`` from synchronous code (open route, no token; ``ssl_context`` as :class:`SyncClient`'s).

    Raises:
        ConnectionError (OSError): the synchronizer does not answer.
    """
    return call_blocking(url, None, "status", request_timeout_s=timeout_s, ssl_context=ssl_context)


def request_checkpoint(url: str, token: str, timeout_s: float = 300.0) -> dict:
    """``POST {url}/checkpoint`` from synchronous code; see :meth:`SyncClient.checkpoint`.

    Raises:
        ProtocolError (RuntimeError): a wrong credential (HTTP 401) or not the run secret (403).
        ConnectionError (OSError): the synchronizer does not answer within ``timeout_s``.
    """
    return call_blocking(url, token, "checkpoint", request_timeout_s=timeout_s)
