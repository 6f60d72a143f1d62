"""Polling helper shared by the tests that watch real processes."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(pred: Callable[[], T], timeout_s: float, what: str, interval_s: float = 0.1) -> T:
    """Call ``pred`` every ``interval_s`` seconds until it returns a truthy value, and return it.

    Raises AssertionError naming ``what`` after ``timeout_s`` seconds.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"timed out waiting for {what}")


async def await_until(pred: Callable[[], Awaitable[T]], timeout_s: float, what: str, interval_s: float = 0.02) -> T:
    """Async :func:`wait_until`: await ``pred()`` every ``interval_s`` seconds until it is truthy."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = await pred()
        if value:
            return value
        await asyncio.sleep(interval_s)
    raise AssertionError(f"timed out waiting for {what}")


async def newer_status(get: Callable[[], Awaitable[dict]], wait_s: float = 5.0) -> dict:
    """A synchronizer's /status (``await get()``, parsed) from a snapshot published after this call
    began, so that it counts every request answered before: the actor publishes snapshots at its
    own pace and one may lag. After ``wait_s`` without a newer one (a stopped actor publishes no
    more), the latest."""
    first = await get()
    deadline = time.monotonic() + wait_s
    latest = first
    while time.monotonic() < deadline:
        latest = await get()
        if latest.get("snapshot_seq", 0) > first.get("snapshot_seq", 0):
            return latest
        await asyncio.sleep(0.02)
    return latest


async def client_status(client) -> dict:
    """``GET /status`` through an aiohttp test ``client`` (200 asserted), from a snapshot newer
    than the call (:func:`newer_status`)."""
    async def get() -> dict:
        r = await client.get("/status")
        assert r.status == 200
        return await r.json()

    return await newer_status(get)
