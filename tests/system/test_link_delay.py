"""Link latency added by the processes themselves (issue 13; the kernel here has no netem): the
synchronizer client, the object store and the DDP all-reduce each wait their round trips. Short real
sleeps (50 ms one way) against real loopback HTTP, a real file:// store and real gloo ranks; every
check is a lower bound (at least the added latency), so a loaded machine cannot make it pass falsely."""

from __future__ import annotations

import asyncio
import sys
import time

import pytest
from test_client import TOKEN, _app, serving

from diloco_async.protocol.client import SyncClient
from diloco_async.runtime.link_delay import LINK_DELAY_ENV, link_delay_s_from_env, ring_allreduce_latency_s
from diloco_async.storage.faults import FaultyStore
from diloco_async.storage.latency import LatencyStore
from diloco_async.storage.store import ObjectStore
from diloco_async.wan.methods import WanPlacement
from diloco_async.wan.scenario import load_wan_scenario

DELAY_S = 0.05


def test_the_delay_comes_from_the_environment_and_bad_values_are_refused():
    assert link_delay_s_from_env({}) == 0.0
    assert link_delay_s_from_env({LINK_DELAY_ENV: "25"}) == pytest.approx(0.025)
    for bad in ("fast", "-1", "nan", "inf"):
        with pytest.raises(ValueError, match=LINK_DELAY_ENV):
            link_delay_s_from_env({LINK_DELAY_ENV: bad})
    # a ring of N: 2 (N - 1) steps, each hop up one link and down another
    assert ring_allreduce_latency_s(0.01, 4) == pytest.approx(2 * 3 * 2 * 0.01)
    assert ring_allreduce_latency_s(0.01, 1) == 0.0
    with pytest.raises(ValueError):
        LatencyStore(ObjectStore("memory://x"), -0.1)
    with pytest.raises(ValueError):
        SyncClient("http://127.0.0.1:1", link_delay_s=-1.0)


def test_each_client_request_takes_a_round_trip_longer(monkeypatch):
    waits: list[float] = []  # the client's own sleeps: the delay it adds, counted rather than timed
    real_sleep = asyncio.sleep

    def sleep(delay: float, result=None):
        if sys._getframe(1).f_globals.get("__name__") == "diloco_async.protocol.client":
            waits.append(delay)
        return real_sleep(delay, result)

    monkeypatch.setattr(asyncio, "sleep", sleep)

    async def timed(delay_s: float) -> tuple[float, float]:
        async with SyncClient(url, TOKEN, link_delay_s=delay_s) as c:
            t0 = time.monotonic()
            await c.health()
            await c.heartbeat({"step": 1})
            t1 = time.monotonic()
            async with c.push("a") as events:  # handshake: a round trip; each message: one way
                got = [e async for e in events]
            t2 = time.monotonic()
        assert [e["type"] for e in got] == ["round_open", "stop"]
        return t1 - t0, t2 - t1

    with serving(_app([])) as url:
        requests_s, push_s = asyncio.run(timed(DELAY_S))
        delayed, waits[:] = list(waits), []
        asyncio.run(timed(0.0))
    assert requests_s >= 2 * 2 * DELAY_S  # two requests, a round trip each
    assert push_s >= 2 * DELAY_S + 2 * DELAY_S  # the handshake's round trip, then two messages one way each
    # two requests and the handshake wait a round trip, the two messages one way each ...
    assert sorted(delayed) == sorted([2 * DELAY_S] * 3 + [DELAY_S] * 2), delayed
    assert waits == []  # ... and without a delay nothing waits (not "faster": a loaded machine may not be)


def test_each_store_request_takes_a_round_trip_longer_also_under_faults(tmp_path):
    store = LatencyStore(ObjectStore(f"file://{tmp_path}/s"), DELAY_S)
    t0 = time.monotonic()
    ref = store.put("a/b.bin", b"x" * 1000)
    t1 = time.monotonic()
    assert store.get(ref) == b"x" * 1000
    t2 = time.monotonic()
    assert t1 - t0 >= 2 * DELAY_S and t2 - t1 >= 2 * DELAY_S
    assert store.requests_delayed >= 2
    child = store.child("a")  # children share the delayed backend
    before = store.requests_delayed
    assert child.exists("b.bin")
    assert store.requests_delayed == before + 1
    # the learner's fault layer goes on top of it (FaultyStore wraps the delayed backend)
    faulty = FaultyStore(store)
    t3 = time.monotonic()
    assert faulty.sizes("") == {"a/b.bin": 1000}
    assert time.monotonic() - t3 >= 2 * DELAY_S


def test_the_wan_placement_gives_the_delay_to_processes_in_regions_only():
    sc = load_wan_scenario("configs/wan/wan-ci.toml")
    sc = sc.model_copy(update={"links": sc.links.model_copy(update={"delay_ms": 7.5})})
    place = WanPlacement(sc, net=object(), endpoint_url="http://x", bucket="b")  # a net: only "is it shaped"
    assert place.env_for("learner-1") == {LINK_DELAY_ENV: "7.5"}
    assert place.env_for("ddp-rank-0") == {LINK_DELAY_ENV: "7.5"}  # two regions: the ring crosses the hub
    assert place.env_for("synchronizer") == {}
    assert WanPlacement(sc, None, "http://x", "b").env_for("learner-1") == {}  # unshaped: no links, no delay
    one = sc.model_copy(update={"links": sc.links.model_copy(update={"regions": ["r0"], "learners_per_region": 2})})
    assert WanPlacement(one, object(), "http://x", "b").env_for("ddp-rank-1") == {}  # the ring stays in r0


def test_each_ddp_all_reduce_waits_the_rings_latency(tmp_path):
    from test_ddp import TINY, read_timeline

    from diloco_async.baselines.ddp_group import DdpGroup, RankPlacement, RankSchedule
    from diloco_async.config.schema import load_config

    g = DdpGroup(load_config(None, TINY), 2, "ddp-delay", f"file://{tmp_path}/store", tmp_path / "work",
                 RankSchedule(max_steps=4), RankPlacement(env={LINK_DELAY_ENV: str(DELAY_S * 1000)}))
    try:
        g.start(0)
        codes = g.wait(60)
        assert codes == {0: 0, 1: 0}, [h.log_path.read_text()[-2000:] for h in g.handles.values()]
    finally:
        g.kill_all()
    latency_s = ring_allreduce_latency_s(DELAY_S, 2)  # 2 (2 - 1) x 2 x 50 ms = 200 ms
    for r in range(2):
        waits = [ln["wait_s"] for ln in read_timeline(g.timeline_path(r)) if ln["kind"] == "step"]
        assert len(waits) == 4 and min(waits) >= latency_s, waits
