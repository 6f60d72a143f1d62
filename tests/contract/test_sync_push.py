"""The synchronizer's push fan-out and its loop watch (issue 17, tail latency).

A pushed event reaches every WebSocket of a real server on loopback, in order, and the relay
wakes at most :data:`~diloco_async.sync.http.FANOUT_BATCH` connections per pass of the event
loop (so requests are served between batches). The loop watch sees a stall of the loop and the
collector's pauses, and its log line reads back in the load benchmark. Nothing here is timed
against a goal: speed is ``benchmarks/sync_load.py``'s business.
"""

from __future__ import annotations

import asyncio
import gc
import time
import uuid

import aiohttp
from aiohttp.test_utils import TestClient, TestServer

from benchmarks.sync_load import _sync_watch
from diloco_async.config.schema import load_config
from diloco_async.storage.store import ObjectStore
from diloco_async.sync import Synchronizer, make_app
from diloco_async.sync.http import FANOUT, FANOUT_BATCH, _FanOut
from diloco_async.sync.process import LoopWatch

from polling import await_until

TOKEN = "test-token-push-123"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _config():
    return load_config(None, ["model.n_layer=1", "model.d_model=16", "model.n_head=2", "model.context=8",
                              "synchronizer.num_fragments=2", "budget.wall_s=600"])


def test_every_websocket_hears_every_event_in_order():
    n_ws = 2 * FANOUT_BATCH + 7  # more than two batches

    async def main() -> None:
        sync = Synchronizer(_config(), ObjectStore(f"memory://push-{uuid.uuid4().hex}"), "run1")
        client = TestClient(TestServer(make_app(sync, TOKEN), host="127.0.0.1"))
        await client.start_server()
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))  # more than 100 connections
        try:
            sockets = [await session.ws_connect(client.make_url("/ws"), headers=AUTH) for _ in range(n_ws)]
            fanout = client.server.app[FANOUT]

            async def subscribed(n: int) -> bool:
                return len(fanout.queues) == n

            # every connection subscribed (its handler ran up to its queue)
            await await_until(lambda: subscribed(n_ws), 30, f"{n_ws} subscriptions")
            events = [{"type": "round_open", "fragment": 0, "round_n": 1, "version": 0},
                      {"type": "version", "fragment": 0, "version": 1}, {"type": "stop", "reason": "test"}]
            for ev in events:
                sync.push.publish(ev)
            for ws in sockets:
                got = [await asyncio.wait_for(ws.receive_json(), 30) for _ in events]
                assert got == events
            await sockets[0].close()
            await await_until(lambda: subscribed(n_ws - 1), 30, "the closed WebSocket to be unsubscribed")
            for ws in sockets[1:]:
                await ws.close()
        finally:
            await session.close()
            await client.close()
            sync.close()

    asyncio.run(main())


def test_the_relay_wakes_one_batch_per_pass_of_the_loop():
    async def main() -> list[int]:
        fanout = _FanOut()
        queues = [fanout.subscribe()[1] for _ in range(3 * FANOUT_BATCH + 1)]
        source: asyncio.Queue = asyncio.Queue()
        relay = asyncio.get_running_loop().create_task(fanout.relay(source))
        await asyncio.sleep(0)  # the relay waits on its source
        source.put_nowait({"type": "version"})
        filled = []
        for _ in range(10):
            await asyncio.sleep(0)  # one pass of the loop
            filled.append(sum(not q.empty() for q in queues))
        relay.cancel()
        await asyncio.gather(relay, return_exceptions=True)
        return filled

    filled = asyncio.run(main())
    assert filled[-1] == 3 * FANOUT_BATCH + 1  # everyone, once
    steps = [b - a for a, b in zip([0, *filled], filled, strict=False)]
    assert max(steps) <= FANOUT_BATCH, filled  # never more than a batch in one pass
    assert sum(s > 0 for s in steps) >= 4, filled


def _hold_the_loop(seconds: float) -> None:
    time.sleep(seconds)  # what a slow handler does to the loop


def test_the_loop_watch_sees_a_stall_and_the_collector():
    async def main() -> tuple[LoopWatch, str]:
        parts = {"heartbeat": 0.002, "_publish_status": 0.004}
        watch = LoopWatch(None, parts)
        task = asyncio.get_running_loop().create_task(watch.run())
        await asyncio.sleep(0.05)
        _hold_the_loop(0.15)
        gc.collect()
        await asyncio.sleep(0.05)
        line = watch.line()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return watch, line

    watch, line = asyncio.run(main())
    assert watch.lag_max_s >= 0.14 and watch.lag_over_20ms >= 1 and watch.ticks >= 3
    assert watch.gc_pauses[2][0] >= 1  # the full collection, timed
    assert watch._on_gc not in gc.callbacks  # removed when the watch stops
    mono = float(line.split("mono=")[1].split()[0])
    read = _sync_watch(f"2026-01-01 synchronizer INFO diloco.server: {line}\n", mono - 2.0, mono)
    assert read["lines"] == 1 and read["lag_max_ms"] >= 140 and read["gc"][2][0] >= 1
    assert read["slow"] == ("_publish_status", 4.0)
