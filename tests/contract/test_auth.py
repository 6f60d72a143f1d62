"""Per-learner credentials and a synchronizer that hostile requests cannot wear down (issue 14, item 2).

Defect 9: every unauthenticated request appended a metric point and a log line, forever;
``/status`` went through the actor's queue; any number of learner ids could join; slow request
bodies were never timed out. Defect 10: one shared run token let any holder act as another
learner, announce another learner's object, or evict a learner by re-joining its id with a higher
incarnation.

A real synchronizer behind its real HTTP server on loopback (``make_app`` under an ``AppRunner``
with the production runner options), driven with aiohttp and raw sockets.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import socket
import time
import uuid

import aiohttp
import pytest
from aiohttp import web
from test_synchronizer import fragment_delta, small_config

from diloco_async.codec import wire
from diloco_async.policy.fragments import FragmentPlan
from diloco_async.protocol.auth import Credentials, learner_token
from diloco_async.protocol.client import LEARNER_TOKEN_ENV, TOKEN_ENV
from diloco_async.storage import keys
from diloco_async.storage.store import ObjectStore
from diloco_async.sync import Synchronizer, make_app, runner_options
from diloco_async.sync.logs import RateLimitedLog

from polling import await_until

pytestmark = pytest.mark.timeout(120)

SECRET = "run-secret-for-tests-0123456789abcdef"  # 32+ characters: weaker ones are refused
RUN = "run1"


def token(lid: str) -> str:
    return learner_token(SECRET, RUN, lid)


class CountingQueue(asyncio.Queue):
    """The actor's inbox, counting every message put into it."""

    def __init__(self) -> None:
        super().__init__()
        self.puts = 0

    def put_nowait(self, item) -> None:
        self.puts += 1
        super().put_nowait(item)


class Server:
    """What a test talks to: the URL, an HTTP session, the synchronizer and its store."""

    def __init__(self, sync: Synchronizer, url: str, session: aiohttp.ClientSession, store: ObjectStore) -> None:
        self.sync, self.url, self.session, self.store = sync, url, session, store
        self.port = int(url.rsplit(":", 1)[1])

    async def call(self, method: str, path: str, body=None, credential: str | None = None) -> tuple[int, dict]:
        headers = {"Authorization": f"Bearer {credential}"} if credential else {}
        async with self.session.request(method, self.url + path, json=body, headers=headers) as r:
            return r.status, await r.json(content_type=None)

    async def status(self) -> dict:
        code, st = await self.call("GET", "/status")
        assert code == 200
        return st


@contextlib.asynccontextmanager
async def serving(cfg):
    """The synchronizer of run ``run1`` on a memory store, served as the product serves it."""
    store = ObjectStore(f"memory://auth-{uuid.uuid4().hex}")
    sync = Synchronizer(cfg, store, RUN)
    sync.inbox = CountingQueue()
    await asyncio.to_thread(sync.publish_initial)
    runner = web.AppRunner(make_app(sync, SECRET), **runner_options(sync))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    actor = asyncio.create_task(sync.run())
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
            yield Server(sync, url, session, store)
    finally:
        actor.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await actor
        await runner.cleanup()


# -- the token itself ------------------------------------------------------------------------


def test_learner_token_is_the_hmac_of_the_contract():
    want = hmac.new(b"s3cret", b"diloco-learner\nrun-7\nlearner-2", hashlib.sha256).hexdigest()
    assert learner_token("s3cret", "run-7", "learner-2") == want
    assert learner_token("s3cret", "run-8", "learner-2") != want  # bound to the run
    assert learner_token("s3cret", "run-7", "learner-3") != want  # and to the learner
    with pytest.raises(ValueError, match="run_secret"):
        learner_token("", "run-7", "learner-2")
    creds = Credentials("s3cret", "run-7")
    assert creds.as_learner(want, "learner-2").ok
    assert creds.as_learner(want, "learner-3").reason == "forbidden"  # seen as learner-2 just before
    assert creds.as_learner("x" * 64, "learner-3").reason == "unauthenticated"
    assert creds.as_admin(want).reason == "forbidden" and creds.as_admin("s3cret").ok
    assert creds.as_learner("s3cret", "anyone").ok  # the run secret may act as any learner


def test_contribution_keys_name_their_learner():
    key = keys.contribution_key(RUN, 2, 7, "learner-1", "0a1b2c")
    assert keys.contribution_learner(RUN, key) == "learner-1"
    assert keys.contribution_learner(RUN, key.replace("learner-1-", "learner-1-x-")) == "learner-1-x"
    for other in (f"{RUN}/contrib/p002/r00000007/sub/learner-1-0a.safetensors", f"{RUN}/globals/p002/v1.safetensors",
                  key.replace(RUN, "run2", 1), key.replace(".safetensors", ".tmp")):
        assert keys.contribution_learner(RUN, other) is None, other
    with pytest.raises(ValueError, match="nonce"):
        keys.contribution_key(RUN, 2, 7, "learner", "x-1")  # would name learner "learner-x"


def test_rate_limited_log_writes_one_line_per_reason_and_period(caplog):
    now = [0.0]
    rl = RateLimitedLog(logging.getLogger("diloco.test"), period_s=10.0, clock=lambda: now[0])
    caplog.set_level(logging.WARNING, logger="diloco.test")
    written = [rl.note("unauthenticated", "x") for _ in range(1000)] + [rl.note("forbidden", "y")]
    assert sum(written) == 2
    now[0] = 10.0
    assert rl.note("unauthenticated", "z")
    assert "999 more since the last line" in caplog.records[-1].getMessage()


async def test_a_learner_cannot_announce_another_learners_object():
    cfg = small_config(**{"learners.count": 2})
    async with serving(cfg) as srv:
        for lid in ("a", "b"):
            code, answer = await srv.call("POST", "/join", {"learner_id": lid}, token(lid))
            assert code == 200
        plan = FragmentPlan.from_json(answer["plan"])
        for lid in ("a", "b"):
            assert (await srv.call("POST", "/heartbeat", {"learner_id": lid, "step": 4}, token(lid)))[0] == 200

        async def opened():
            return any((r["fragment"], r["round"]) == (0, 1) for r in (await srv.status())["rounds"])
        await await_until(opened, 30, "round (0, 1) to open")
        body = put_contribution(srv.store, plan, "b")
        stolen = dict(body, learner_id="a", update_id="steal1")
        code, answer = await srv.call("POST", "/announce", stolen, token("a"))
        assert (code, answer["reason"]) == (403, "forbidden"), answer
        # nor as b with a's token, nor a key that only starts like a's own prefix ("a-b-<nonce>" is learner a-b's)
        assert (await srv.call("POST", "/announce", body, token("a")))[0] == 403
        disguised = dict(body, learner_id="a", key=keys.contribution_key(RUN, 0, 1, "a-b", "0123abcd"))
        assert (await srv.call("POST", "/announce", disguised, token("a")))[0] == 403
        st = await srv.status()
        assert st["rounds"][0]["announced"] == [] and st["rejected_by_reason"] == {"forbidden": 3}
        code, answer = await srv.call("POST", "/announce", body, token("b"))  # b announces its own: accepted
        assert code == 200 and answer["status"] == "accepted", answer


def put_contribution(store: ObjectStore, plan: FragmentPlan, lid: str) -> dict:
    """Put ``lid``'s contribution to round 1 of fragment 0 under its own key; returns its announcement."""
    ref = store.put(keys.contribution_key(RUN, 0, 1, lid, uuid.uuid4().hex[:8]),
                    wire.encode_to_bytes(fragment_delta(plan, 2), "fp32", {}))
    return {"learner_id": lid, "fragment": 0, "round_n": 1, "base_version": 0, "c_steps": 4, "c_tokens": 1000,
            "compute_s": 1.0, "key": ref.key, "nbytes": ref.nbytes, "sha256": ref.sha256, "codec": "fp32",
            "update_id": uuid.uuid4().hex[:8]}


# -- defect 9: hostile requests cost nothing that grows --------------------------------------


async def test_refused_requests_never_reach_the_actor_nor_grow_the_logs(caplog):
    caplog.set_level(logging.INFO)
    async with serving(small_config()) as srv:
        assert (await srv.call("POST", "/join", {"learner_id": "a"}, token("a")))[0] == 200
        await srv.status()
        metrics_before, puts_before, lines_before = len(srv.sync.metrics), srv.sync.inbox.puts, len(caplog.records)
        n = 0
        for i in range(60):
            for path, body, credential in (
                    ("/join", {"learner_id": f"x{i}"}, None),
                    ("/heartbeat", {"learner_id": "a", "step": 1}, "wrong"),
                    ("/announce", {"learner_id": "a"}, "f" * 64),
                    ("/checkpoint", {}, None),
                    ("/join", {"learner_id": "b", "incarnation": i + 1}, token("a")),  # forbidden
                    ("/heartbeat", {"learner_id": "c", "step": 1}, token("a"))):  # forbidden
                code, _ = await srv.call("POST", path, body, credential)
                assert code in (401, 403)
                n += 1
            assert (await srv.call("GET", "/metrics", None, "nope"))[0] == 401
            n += 1
        assert len(srv.sync.metrics) == metrics_before  # no metric point per refused request
        assert srv.sync.inbox.puts == puts_before  # and not one message to the actor
        refusal_lines = [r for r in caplog.records[lines_before:] if "refused" in r.getMessage()]
        assert 1 <= len(refusal_lines) <= 2, [r.getMessage() for r in refusal_lines]  # one per reason per 10 s
        st = await srv.status()
        assert st["rejected_by_reason"] == {"unauthenticated": n - 120, "forbidden": 120}
        assert sorted(st["learners"]) == ["a"]


async def test_status_and_health_pollers_do_not_touch_the_actors_queue():
    async with serving(small_config()) as srv:
        assert (await srv.call("POST", "/join", {"learner_id": "a"}, token("a")))[0] == 200
        async def a_listed():
            return "a" in (await srv.status())["learners"]

        await await_until(a_listed, 30, "learner a in /status")
        puts = srv.sync.inbox.puts

        async def poller(path: str) -> None:
            for _ in range(25):
                async with srv.session.get(srv.url + path) as r:
                    assert r.status == 200
                    await r.read()
        await asyncio.gather(*(poller("/status" if i % 2 else "/health") for i in range(24)))
        assert srv.sync.inbox.puts == puts  # 600 polls, no message to the actor
        # the actor still answers learners: the heartbeat goes through its queue and is answered
        # (the session's 10 s timeout is the failure mode, not a bound on seconds)
        assert (await srv.call("POST", "/heartbeat", {"learner_id": "a", "step": 1}, token("a")))[0] == 200
        assert srv.sync.inbox.puts == puts + 1
        code, health = await srv.call("GET", "/health")
        assert code == 200 and health["ok"] and health["phase"] == "running" and health["run_id"] == RUN


def _raw(port: int, timeout_s: float = 10.0) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout_s)
    s.settimeout(timeout_s)
    return s


BODY_TIMEOUT_S, IDLE_TIMEOUT_S = 0.5, 1.0


async def test_slow_bodies_and_slow_headers_time_out():
    """The server answers a stalled body 408 ``body_timeout`` and closes a connection whose headers
    never end, each after its configured timeout (a lower bound: it waited, then acted). The client
    waits 60 s for either: a server that never acts fails the test there, not a bound on seconds."""
    cfg = small_config(**{"synchronizer.request_body_timeout_s": BODY_TIMEOUT_S,
                          "synchronizer.idle_timeout_s": IDLE_TIMEOUT_S})
    async with serving(cfg) as srv:
        def slow_body() -> tuple[bytes, float]:
            with _raw(srv.port, timeout_s=60) as s:
                t0 = time.monotonic()
                s.sendall(b"POST /join HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Authorization: Bearer " + SECRET.encode() + b"\r\nContent-Length: 100\r\n\r\n"
                          b'{"learner_')
                return s.recv(200), time.monotonic() - t0

        def slow_headers() -> tuple[bytes, float]:
            with _raw(srv.port, timeout_s=60) as s:
                t0 = time.monotonic()
                s.sendall(b"POST /join HTTP/1.1\r\nHost: x\r\n")  # and never the rest
                return s.recv(200), time.monotonic() - t0

        (answer, body_s), (closed, header_s) = await asyncio.gather(asyncio.to_thread(slow_body),
                                                                    asyncio.to_thread(slow_headers))
        assert answer.startswith(b"HTTP/1.1 408") and b"body_timeout" in answer, answer
        assert body_s >= BODY_TIMEOUT_S  # answered by the body timeout, not at once for another reason
        assert closed == b"", closed  # the connection is closed, nothing answered
        assert header_s >= IDLE_TIMEOUT_S  # by the idle timeout
        st = await srv.status()
        assert st["rejected_by_reason"] == {"body_timeout": 1}
        assert st["learners"] == {}


async def test_learners_beyond_the_cap_are_refused():
    async with serving(small_config(**{"synchronizer.max_learners": 3})) as srv:
        for lid in ("a", "b", "c"):
            assert (await srv.call("POST", "/join", {"learner_id": lid}, token(lid)))[0] == 200
        code, answer = await srv.call("POST", "/join", {"learner_id": "d"}, token("d"))
        assert (code, answer["reason"]) == (403, "learner_cap"), answer
        # rejoining one's own id (a restart) does not count twice
        assert (await srv.call("POST", "/join", {"learner_id": "a", "incarnation": 1}, token("a")))[0] == 200
        assert (await srv.call("POST", "/join", {"learner_id": "b"}, token("b")))[0] == 200
        async def three_listed():  # /status is a snapshot the actor publishes: it may lag a join
            st = await srv.status()
            return st if sorted(st["learners"]) == ["a", "b", "c"] and st["rejected_by_reason"] else None

        st = await await_until(three_listed, 30, "learners a, b, c in /status")
        assert sorted(st["learners"]) == ["a", "b", "c"] and st["learners"]["a"]["incarnation"] == 1
        assert st["rejected_by_reason"] == {"learner_cap": 1}


def test_token_command_prints_a_learners_token(monkeypatch, capsys):
    from diloco_async.flows.cli import main

    monkeypatch.setenv(TOKEN_ENV, SECRET)
    assert main(["token", "--run-id", "r9", "--learner-id", "learner-4"]) == 0
    assert capsys.readouterr().out.strip() == learner_token(SECRET, "r9", "learner-4")
    assert main(["token", "--run-id", "r9", "--learner-id", "learner-4", "--env"]) == 0
    assert capsys.readouterr().out.strip() == f"{LEARNER_TOKEN_ENV}={learner_token(SECRET, 'r9', 'learner-4')}"
    monkeypatch.delenv(TOKEN_ENV)
    assert main(["token", "--run-id", "r9", "--learner-id", "learner-4"]) == 2
    assert TOKEN_ENV in capsys.readouterr().err
