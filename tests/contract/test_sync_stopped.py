"""A synchronizer whose actor has stopped answers every request at once, 503 with reason
``stopped``: a request that waited for an actor reply that never comes held the HTTP server's
shutdown for aiohttp's 60 s (so a finished synchronizer process exited, and released its lease,
a minute late; tests/system/test_fencing.py's restored-learner test took 65-72 s in 3 of 12 runs)."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from aiohttp.test_utils import TestClient, TestServer
from test_synchronizer import AUTH, TOKEN, small_config

from diloco_async.storage.store import ObjectStore
from diloco_async.sync import Synchronizer, make_app
from diloco_async.sync.actor import Request, Stopped

WAIT_S = 30.0  # the failure mode of an answer that never comes


async def test_requests_after_the_stop_are_answered_503_stopped():
    sync = Synchronizer(small_config(), ObjectStore(f"memory://stopped-{uuid.uuid4().hex}"), "run1")
    await asyncio.to_thread(sync.publish_initial)
    client = TestClient(TestServer(make_app(sync, TOKEN), host="127.0.0.1"))
    await client.start_server()
    try:
        task = asyncio.create_task(sync.run())
        await asyncio.wait_for(sync.request("stop", "test over"), WAIT_S)
        summary = await asyncio.wait_for(task, WAIT_S)
        assert summary["stop_reason"] == "test over" and sync.stopped
        for path, body in (("/heartbeat", {"learner_id": "a", "step": 0}), ("/join", {"learner_id": "b"})):
            resp = await asyncio.wait_for(client.post(path, json=body, headers=AUTH), WAIT_S)
            doc = await resp.json()
            assert resp.status == 503 and doc["reason"] == "stopped", (path, resp.status, doc)
        with pytest.raises(Stopped, match="answers no stop request"):  # a second signal: nothing to stop
            await sync.request("stop", "again")
    finally:
        await client.close()


async def test_a_request_queued_when_the_actor_stops_is_answered_stopped():
    sync = Synchronizer(small_config(), ObjectStore(f"memory://stopped-{uuid.uuid4().hex}"), "run1")
    reply = asyncio.get_running_loop().create_future()
    sync.inbox.put_nowait(Request("heartbeat", {"learner_id": "a"}, reply))
    gone = asyncio.get_running_loop().create_future()
    gone.cancel()  # its asker gave up: left alone
    sync.inbox.put_nowait(Request("heartbeat", {"learner_id": "b"}, gone))
    sync._refuse_what_is_left()  # what run() does as it returns
    with pytest.raises(Stopped, match="answers no heartbeat request"):
        await asyncio.wait_for(reply, WAIT_S)
    assert sync.inbox.empty() and gone.cancelled()
