"""Headless Chromium driven over the Chrome DevTools Protocol (CDP), for the UI tests that click:
open a page, wait until its DOM shows something, click an element, follow a link into the tab it
opens, read the rendered DOM. The protocol's JSON over a WebSocket (aiohttp's client); the browser
is Debian's ``chromium`` (``find_chromium``), a fresh profile per :class:`Chromium`.

Everything is read from the DOM (``Runtime.evaluate`` of an expression), never from pixels."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from polling import await_until

__all__ = ["Chromium", "Page", "find_chromium"]

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--remote-debugging-port=0", "--remote-allow-origins=*"]


def find_chromium() -> str | None:
    """The path of ``chromium`` (or ``chromium-browser``, ``google-chrome``); None when none is installed."""
    return next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)


class Page:
    """One tab, through its CDP WebSocket. ``wait_for`` polls a JavaScript expression until it is
    truthy and returns its value (JSON-serialisable values only)."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self._ws = ws
        self._ids = itertools.count(1)

    async def call(self, method: str, **params: Any) -> dict:
        """Send one CDP command and return its result; events that arrive meanwhile are dropped.

        Raises:
            RuntimeError: the browser answered with an error (its message).
        """
        cid = next(self._ids)
        await self._ws.send_json({"id": cid, "method": method, "params": params})
        while True:
            msg = await self._ws.receive_json(timeout=60)
            if msg.get("id") == cid:
                if "error" in msg:
                    raise RuntimeError(f"CDP {method}: {msg['error']}")
                return msg.get("result", {})

    async def evaluate(self, expression: str) -> Any:
        """The value of ``expression`` in the page (a Promise is awaited).

        Raises:
            RuntimeError: the expression threw (its description).
        """
        res = await self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in res:
            raise RuntimeError(f"{expression[:80]}: {res['exceptionDetails'].get('exception', {}).get('description')}")
        return res["result"].get("value")

    async def goto(self, url: str) -> None:
        await self.call("Page.navigate", url=url)

    async def wait_for(self, expression: str, what: str, timeout_s: float = 90.0) -> Any:
        """``expression``'s value once truthy; AssertionError naming ``what`` (and the page's text)
        after ``timeout_s``."""
        async def value() -> Any:
            try:
                return await self.evaluate(expression)
            except RuntimeError:  # the page is navigating: its context went away
                return None
        try:
            return await await_until(value, timeout_s, what, interval_s=0.25)
        except AssertionError:
            text = await self.evaluate("document.body ? document.body.innerText : ''")
            raise AssertionError(f"timed out waiting for {what} on {await self.url()}; the page shows:\n"
                                 f"{(text or '')[:3000]}") from None

    async def click(self, selector: str) -> None:
        """A mouse click (press and release of the left button, as a user's) at the centre of the
        first element matching the CSS ``selector``, scrolled into view first: a link with
        ``target="_blank"`` opens its tab, as it does for a user.

        Raises:
            AssertionError: no element matches ``selector`` with a size and on top within 30 s.
        """
        # the centre of the element, once it is the element there (a page still drawing moves it)
        box = await self.wait_for(f"""(() => {{
            const el = document.querySelector({json.dumps(selector)});
            if (!el) return null;
            el.scrollIntoView({{block: 'center'}});
            const r = el.getBoundingClientRect(), x = r.x + r.width / 2, y = r.y + r.height / 2;
            return r.width * r.height > 0 && el.contains(document.elementFromPoint(x, y)) ? [x, y] : null;
        }})()""", f"an element to click at {selector!r}", timeout_s=30.0)
        for kind in ("mousePressed", "mouseReleased"):
            await self.call("Input.dispatchMouseEvent", type=kind, x=box[0], y=box[1], button="left", clickCount=1)

    async def click_until(self, selector: str, expression: str, what: str, timeout_s: float = 90.0) -> Any:
        """Click ``selector`` (:meth:`click`) until ``expression`` is truthy and return its value: a
        click that landed while the page was still moving its layout is made again (every 10 s),
        while the element is still there (a click that navigated away is waited for). Not for a
        link that opens a tab (each click would open one)."""
        deadline = time.monotonic() + timeout_s
        clicks = 0
        while True:
            if clicks == 0 or await self.wait_for(f"document.readyState === 'complete' && "
                                                  f"String(document.querySelector({json.dumps(selector)}) !== null)",
                                                  "the page to load") == "true":
                await self.click(selector)
                clicks += 1
            try:
                return await self.wait_for(expression, what, min(10.0, max(0.1, deadline - time.monotonic())))
            except AssertionError:
                if time.monotonic() >= deadline:
                    raise

    async def url(self) -> str:
        return await self.evaluate("location.href")

    async def html(self) -> str:
        """The rendered DOM (``document.documentElement.outerHTML``)."""
        return await self.evaluate("document.documentElement.outerHTML")

    async def text(self) -> str:
        """The page's visible text (``document.body.innerText``)."""
        return await self.evaluate("document.body.innerText")


class Chromium:
    """A headless Chromium with a fresh profile, its DevTools on a free loopback port, stopped (its
    whole process group) on leaving the ``async with`` block. ``window`` is ``"width,height"``."""

    def __init__(self, binary: str, window: str = "1600,1200") -> None:
        self.binary, self.window = binary, window
        self._profile = tempfile.TemporaryDirectory(prefix="chromium-cdp-")
        self._proc: subprocess.Popen | None = None
        self._http: aiohttp.ClientSession | None = None
        self._sockets: list[aiohttp.ClientWebSocketResponse] = []
        self.base = ""

    async def __aenter__(self) -> Chromium:
        profile = self._profile.name
        self._proc = await asyncio.to_thread(
            subprocess.Popen,
            [self.binary, *FLAGS, f"--user-data-dir={profile}", f"--window-size={self.window}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=dict(os.environ, HOME=profile),
            start_new_session=True)
        port_file = Path(profile) / "DevToolsActivePort"  # Chromium writes its port there once listening

        async def port() -> str | None:
            assert self._proc.poll() is None, f"chromium exited with {self._proc.returncode}"
            text = port_file.read_text() if port_file.exists() else ""
            return text.split("\n", 1)[0] if "\n" in text else None
        self.base = f"http://127.0.0.1:{await await_until(port, 60, 'the DevTools port of chromium', 0.1)}"
        self._http = aiohttp.ClientSession()
        return self

    async def targets(self) -> list[dict]:
        """The open tabs: ``{"id", "url", "webSocketDebuggerUrl", ...}`` each."""
        async with self._http.get(f"{self.base}/json/list") as resp:
            return [t for t in json.loads(await resp.text()) if t.get("type") == "page"]

    async def attach(self, target: dict) -> Page:
        ws = await self._http.ws_connect(target["webSocketDebuggerUrl"], max_msg_size=0)
        self._sockets.append(ws)
        page = Page(ws)
        await page.call("Runtime.enable")
        return page

    async def open(self, url: str) -> Page:
        """A page of the first tab, navigated to ``url``."""
        page = await self.attach((await self.targets())[0])
        await page.goto(url)
        return page

    async def tab_opened(self, url_prefix: str, timeout_s: float = 60.0) -> Page:
        """The tab whose address starts with ``url_prefix`` (one a click opened), once it exists."""
        async def find() -> dict | None:
            return next((t for t in await self.targets() if t["url"].startswith(url_prefix)), None)
        return await self.attach(await await_until(find, timeout_s, f"a tab at {url_prefix}", 0.2))

    async def __aexit__(self, *exc: object) -> None:
        for ws in self._sockets:
            await ws.close()
        if self._http is not None:
            await self._http.close()
        if self._proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._proc.pid, signal.SIGTERM)
            try:
                await asyncio.to_thread(self._proc.wait, 15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self._proc.pid, signal.SIGKILL)
                self._proc.wait()
            with contextlib.suppress(ProcessLookupError):  # a renderer that outlived the browser
                os.killpg(self._proc.pid, signal.SIGKILL)
        self._profile.cleanup()
