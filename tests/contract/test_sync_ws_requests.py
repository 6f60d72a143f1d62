"""Heartbeats and announcements over the learner's WebSocket (issue 17): the same checks as the
HTTP routes, answered on the socket, and the real learner's comms using it while it is open and
HTTP when it is not (a synchronizer restart included).

A real synchronizer behind its real HTTP server on loopback (``serving`` of ``test_auth``), driven
over real WebSockets; the learner's comms thread runs against it as in a learner process.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid

import aiohttp
import pytest
from aiohttp import web
from test_auth import RUN, SECRET, put_contribution, serving, token
from test_synchronizer import small_config

from diloco_async.policy.fragments import FragmentPlan
from diloco_async.protocol.client import ChannelClosed, ProtocolError, ReplyError, RequestChannel, SyncClient
from diloco_async.storage.store import ObjectStore
from diloco_async.sync import Synchronizer, make_app, runner_options
from diloco_async.sync.http import OPEN_SOCKETS, WS_COUNTS

from polling import await_until

pytestmark = pytest.mark.timeout(120)


@contextlib.asynccontextmanager
async def socket_of(srv, lid: str, credential: str | None = None):
    """``lid``'s WebSocket as a :class:`RequestChannel`, its reader running; yields (channel, ws, every
    message received: answers and pushed events)."""
    ws = await srv.session.ws_connect(f"{srv.url}/ws?learner_id={lid}",
                                      headers={"Authorization": f"Bearer {credential or token(lid)}"})
    channel, received = RequestChannel(ws, srv.url), []

    async def read() -> None:
        async for msg in ws:
            doc = json.loads(msg.data)
            received.append(doc)
            channel.take(doc)
        channel.close()

    reader = asyncio.create_task(read())
    try:
        yield channel, ws, received
    finally:
        await ws.close()
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)


async def raw_answer(ws: aiohttp.ClientWebSocketResponse, received: list, data: str | bytes) -> dict:
    """Send ``data`` as it is and wait for the answer (a reply message, read by ``socket_of``'s reader)."""
    before = len(received)
    await (ws.send_bytes(data) if isinstance(data, bytes) else ws.send_str(data))
    return await await_until(lambda: _async(next((d for d in received[before:] if d.get("type") == "reply"), None)),
                             30, "the answer to a raw message")


async def _async(value):
    return value


async def open_round(srv, lids=("a", "b")) -> FragmentPlan:
    for lid in lids:
        code, answer = await srv.call("POST", "/join", {"learner_id": lid}, token(lid))
        assert code == 200, answer
    for lid in lids:
        assert (await srv.call("POST", "/heartbeat", {"learner_id": lid, "step": 4}, token(lid)))[0] == 200

    async def opened():
        return any((r["fragment"], r["round"]) == (0, 1) for r in (await srv.status())["rounds"])

    await await_until(opened, 30, "round (0, 1) to open")
    return FragmentPlan.from_json(answer["plan"])


async def test_websocket_requests_are_answered_like_http_ones():
    async with serving(small_config(**{"learners.count": 2})) as srv:
        plan = await open_round(srv)
        async with socket_of(srv, "a") as (channel, _ws, _pushed):
            over_ws = await channel.request("heartbeat", {"learner_id": "a", "step": 5}, 10)
            code, over_http = await srv.call("POST", "/heartbeat", {"learner_id": "a", "step": 5}, token("a"))
            assert code == 200 and over_ws == over_http and over_ws["known"]
            assert [(r["fragment"], r["round_n"]) for r in over_ws["open_rounds"]] == [(0, 1)]
            body = put_contribution(srv.store, plan, "a")
            assert (await channel.request("announce", body, 10))["status"] == "accepted"
            replay = await channel.request("announce", body, 10)  # the same update again: a replay
            code, replay_http = await srv.call("POST", "/announce", body, token("a"))
            assert replay["status"] == "duplicate" and (code, replay_http) == (200, replay)
            stale = dict(put_contribution(srv.store, plan, "a"), base_version=-1)
            with pytest.raises(ReplyError) as err:  # out of its field's bounds, as over HTTP (400)
                await channel.request("announce", stale, 10)
            assert err.value.status == 400 and "field:base_version" in str(err.value)
            # a rejoin with a higher incarnation makes heartbeats of the old one unknown, on both transports
            assert (await srv.call("POST", "/join", {"learner_id": "a", "incarnation": 1}, token("a")))[0] == 200
            old = await channel.request("heartbeat", {"learner_id": "a", "incarnation": 0, "step": 6}, 10)
            code, old_http = await srv.call("POST", "/heartbeat", {"learner_id": "a", "incarnation": 0, "step": 6},
                                            token("a"))
            assert old["known"] is False and old == old_http
        counts = srv.sync.report.counters
        assert counts["duplicates"] == 2  # one replay over each transport, neither merged again
        assert srv.sync.registry.get("a").incarnation == 1


async def test_a_learner_id_not_the_sockets_is_refused_counted_and_never_reaches_the_actor():
    async with serving(small_config(**{"learners.count": 2})) as srv:
        plan = await open_round(srv)
        step_b = srv.sync.registry.get("b").step
        async with socket_of(srv, "a") as (channel, _ws, _pushed):
            puts = srv.sync.inbox.puts
            with pytest.raises(ProtocolError, match="forbidden"):
                await channel.request("heartbeat", {"learner_id": "b", "step": 40}, 10)
            theirs = put_contribution(srv.store, plan, "b")
            with pytest.raises(ProtocolError, match="forbidden"):
                await channel.request("announce", theirs, 10)
            with pytest.raises(ProtocolError, match="not under its own"):  # b's object announced as a's
                await channel.request("announce", dict(theirs, learner_id="a"), 10)
            assert srv.sync.inbox.puts == puts  # none of them reached the actor
            assert (await channel.request("heartbeat", {"learner_id": "a", "step": 5}, 10))["known"]  # still open
        async with socket_of(srv, "", SECRET) as (channel, _ws, _pushed):  # the operator's socket: no learner's
            with pytest.raises(ProtocolError, match="forbidden"):
                await channel.request("heartbeat", {"learner_id": "b", "step": 40}, 10)
        assert srv.sync.registry.get("b").step == step_b
        st = await srv.status()
        assert st["rejected_by_reason"] == {"forbidden": 4}
        assert st["rounds"][0]["announced"] == []


async def test_malformed_messages_are_answered_with_their_reason_and_the_socket_lives_on():
    async with serving(small_config()) as srv:
        assert (await srv.call("POST", "/join", {"learner_id": "a"}, token("a")))[0] == 200
        async with socket_of(srv, "a") as (channel, ws, received):
            cases = [("not json {", None, "invalid_json"), ("[1, 2]", None, "bad_frame"),
                     ('{"id": 3, "kind": "merge", "body": {}}', 3, "bad_frame"),
                     ('{"id": -1, "kind": "heartbeat", "body": {"learner_id": "a", "step": 1}}', None, "bad_frame"),
                     ('{"id": 4, "kind": "heartbeat", "body": {"learner_id": "a", "step": -1}}', 4, "field:step"),
                     ('{"id": 5, "kind": "heartbeat", "body": {"learner_id": "a", "step": 1, "x": 1}}', 5,
                      "unexpected_field"),
                     ("[" * 100_000, None, "json_too_deep"), (b"\x00\x01", None, "bad_frame")]
            for data, rid, reason in cases:
                got = await raw_answer(ws, received, data)
                assert (got["id"], got["status"], got["reason"]) == (rid, 400, reason), (data, got)
                assert got["error"].startswith("bad_request: ")
            assert (await channel.request("heartbeat", {"learner_id": "a", "step": 1}, 10))["known"]
        assert srv.sync.rejected_by_reason["bad_request"] == len(cases)
        assert sum(srv.sync.report.bad_requests.values()) == len(cases)
        st = await srv.status()  # the synchronizer answers on
        assert st["learners"]["a"]["live"] and st["rejected_by_reason"] == {"bad_request": len(cases)}


async def test_the_client_sends_over_the_socket_while_it_is_open_and_over_http_otherwise():
    async with serving(small_config()) as srv:
        async with SyncClient(srv.url, token("a")) as client:
            await client.join({"learner_id": "a"})
            assert (await client.heartbeat({"learner_id": "a", "step": 1}))["known"]
            async with client.push("a") as events:
                reader = asyncio.create_task(anext(events, None))  # reads the socket: answers come this way
                assert (await client.heartbeat({"learner_id": "a", "step": 2}))["known"]
                with pytest.raises(ProtocolError, match="forbidden"):
                    await client.heartbeat({"learner_id": "b", "step": 2})
                reader.cancel()
            assert (await client.heartbeat({"learner_id": "a", "step": 3}))["known"]
            assert client.sent_by_transport == {"http": 2, "ws": 2}  # sent: the forbidden one too
        assert srv.sync.registry.get("a").step == 3


async def test_a_request_on_a_closed_channel_raises_channel_closed():
    async with serving(small_config()) as srv:
        async with socket_of(srv, "a") as (channel, ws, _pushed):
            await ws.close()
            with pytest.raises(ChannelClosed):
                await channel.request("heartbeat", {"learner_id": "a", "step": 1}, 10)


class _Restartable:
    """A synchronizer served on one port that can be replaced by a new one (a restart: new epoch)."""

    def __init__(self) -> None:
        self.port = 0
        self.sync: Synchronizer | None = None

    async def start(self) -> None:
        self.sync = Synchronizer(small_config(), ObjectStore(f"memory://ws-{uuid.uuid4().hex}"), RUN)
        await asyncio.to_thread(self.sync.publish_initial)
        self.app = make_app(self.sync, SECRET)
        self.runner = web.AppRunner(self.app, **runner_options(self.sync))
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", self.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        self.actor = asyncio.create_task(self.sync.run())

    async def stop(self) -> None:
        self.actor.cancel()
        await asyncio.gather(self.actor, return_exceptions=True)
        await self.runner.cleanup()


async def test_the_learners_comms_use_the_socket_and_fall_back_to_http_across_a_restart(tmp_path):
    from diloco_async.learner.comms import Comms
    from diloco_async.learner.state import LearnerSlot, Shared, SyncEndpoint

    server = _Restartable()
    await server.start()
    shared = Shared()
    endpoint = SyncEndpoint(f"http://127.0.0.1:{server.port}", token("a"), give_up_after_s=60.0)
    comms = Comms(LearnerSlot("a", 0), endpoint, ObjectStore(f"file://{tmp_path}/s"), shared, time.monotonic())
    sent = comms.client.sent_by_transport
    comms.start()
    try:
        # counted by the client when sent and by the server when answered: wait for both (a
        # heartbeat still in flight made the server's count one short under CI's load)
        await await_until(lambda: _async(sent["ws"] >= 3 and server.app[WS_COUNTS]["heartbeat 200"] >= 3), 30,
                          "heartbeats answered over the WebSocket")
        first_epoch, http_before = server.sync.epoch, sent["http"]
        await server.stop()
        # the socket is gone: the heartbeats are sent over HTTP (and find nobody until the restart)
        await await_until(lambda: _async(sent["http"] >= http_before + 2), 30, "heartbeats over HTTP")
        await server.start()  # same port, a new synchronizer: the learner is unknown to it
        assert server.sync.epoch != first_epoch
        await await_until(lambda: _async(server.sync.registry.get("a") is not None), 30, "the learner to rejoin")
        await await_until(lambda: _async(server.app[WS_COUNTS]["heartbeat 200"] >= 3), 30,
                          "heartbeats over the new synchronizer's WebSocket")
        assert shared.epoch_changed.is_set() and comms.epoch == server.sync.epoch
    finally:
        shared.stop_event.set()
        await asyncio.to_thread(comms.join, 10.0)
        await server.stop()
    assert shared.fatal is None


async def test_the_actor_handles_the_queued_messages_before_one_clock_driven_pass():
    from diloco_async.protocol.messages import Heartbeat, JoinRequest
    from diloco_async.sync.actor import BATCH_MAX
    from diloco_async.sync.state import Request

    sync = Synchronizer(small_config(), ObjectStore(f"memory://batch-{uuid.uuid4().hex}"), RUN)
    await asyncio.to_thread(sync.publish_initial)
    left_at_pass: list[int] = []  # messages still queued at each clock-driven pass
    advance = sync._advance
    sync._advance = lambda: (left_at_pass.append(sync.inbox.qsize()), advance())[1]
    loop = asyncio.get_running_loop()
    replies = [loop.create_future() for _ in range(41)]
    sync.inbox.put_nowait(Request("join", JoinRequest(learner_id="a"), replies[0]))
    for i, reply in enumerate(replies[1:]):
        sync.inbox.put_nowait(Request("heartbeat", Heartbeat(learner_id="a", step=i), reply))
    actor = asyncio.create_task(sync.run())
    try:
        answers = await asyncio.wait_for(asyncio.gather(*replies), 30)
    finally:
        actor.cancel()
        await asyncio.gather(actor, return_exceptions=True)
    assert all(a.known for a in answers[1:])  # every one handled, in order (the join came first)
    assert left_at_pass[:2] == [41 - BATCH_MAX, 0]  # BATCH_MAX in the first pass, the rest in the next
    assert sync.registry.get("a").step == 39


async def test_a_server_shutting_down_closes_every_push_socket_going_away():
    """The HTTP server's shutdown closes each open push socket with 1001 (going away) instead of
    waiting up to aiohttp's 60 s for the learners to hang up (a learner then sends what it had in
    flight over HTTP: the restart test above)."""
    server = _Restartable()
    await server.start()
    try:
        async with aiohttp.ClientSession() as session:
            url = f"http://127.0.0.1:{server.port}"
            sockets = [await session.ws_connect(f"{url}/ws?learner_id={lid}",
                                                headers={"Authorization": f"Bearer {token(lid)}"})
                       for lid in ("a", "b")]
            await await_until(lambda: _async(len(server.app[OPEN_SOCKETS]) == 2), 30, "both sockets open")
            cleanup = asyncio.create_task(server.runner.cleanup())
            for ws in sockets:
                msg = await asyncio.wait_for(ws.receive(), 30)  # no close within 30 s: the failure mode
                assert (msg.type, msg.data, msg.extra) == (aiohttp.WSMsgType.CLOSE, 1001, "synchronizer stopping")
            await asyncio.wait_for(cleanup, 30)
            assert all(ws.closed for ws in [*sockets, *server.app[OPEN_SOCKETS]])
    finally:
        server.actor.cancel()
        await asyncio.gather(server.actor, return_exceptions=True)
