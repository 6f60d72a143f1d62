"""The synchronizer behind its real HTTP server on loopback, driven by scripted learners.

Each bad input (NaN, wrong shape, wrong sha256, replay, missing token) is rejected with a reason
that is logged and counted, the round goes on with the rest, and nothing non-finite is published
or checkpointed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid

import pytest
import torch
from aiohttp.test_utils import TestClient, TestServer

from diloco_async import codec as wire
from diloco_async.config import load_config
from diloco_async.merge import OuterOptimizer, merge_outer_gradients
from diloco_async.server import make_app
from diloco_async.synchronizer import Synchronizer
from storage import keys
from storage.checkpoint import latest_checkpoint
from storage.store import ObjectStore

TOKEN = "test-token-123"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
LEARNERS = ["a", "b", "c"]


def small_config(**extra):
    overrides = [
        "model.n_layer=1", "model.d_model=16", "model.n_head=2", "model.context=8",
        "learners.count=3", "synchronizer.num_fragments=2", "synchronizer.sync_every=4",
        "synchronizer.min_quorum=2", "synchronizer.grace_initial_s=10.0",
        "synchronizer.heartbeat_timeout_s=60", "synchronizer.checkpoint_every_s=1000",
        "budget.wall_s=600",
    ]
    overrides += [f"{k}={v}" for k, v in extra.items()]
    return load_config(None, overrides)


@contextlib.asynccontextmanager
async def running(cfg):
    store = ObjectStore(f"memory://sync-{uuid.uuid4().hex}")
    sync = Synchronizer(cfg, store, "run1")
    await asyncio.to_thread(sync.publish_initial)
    client = TestClient(TestServer(make_app(sync, TOKEN), host="127.0.0.1"))
    await client.start_server()
    task = asyncio.create_task(sync.run())
    try:
        yield sync, client, store
    finally:
        await sync.request("stop", "test over")
        for lid in list(sync.learners):
            await client.post("/heartbeat", json={"learner_id": lid, "step": 0}, headers=AUTH)
        await asyncio.wait_for(task, 30)
        await client.close()


async def join_all(client):
    for lid in LEARNERS:
        r = await client.post("/join", json={"learner_id": lid}, headers=AUTH)
        assert r.status == 200


async def open_first_round(client, sync):
    for lid in LEARNERS:
        r = await client.post("/heartbeat", json={"learner_id": lid, "step": 4}, headers=AUTH)
        assert r.status == 200
    for _ in range(200):
        if (0, 1) in sync.rounds:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("round (0, 1) did not open")


def fragment_delta(sync, seed: float) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(int(seed * 1000))
    f = sync.fragments[0]
    return {n: torch.randn(f.shapes[n], generator=g) * 0.01 for n in f.names}


async def contribute(client, store, lid, delta, *, tokens=1000, steps=4, sha=None, codec="fp32",
                     shapes_ok=True, update_id=None):
    data = wire.encode_to_bytes(delta, codec, {})
    key = keys.contribution_key("run1", 0, 1, lid, uuid.uuid4().hex[:8])
    ref = store.put(key, data)
    body = {"learner_id": lid, "fragment": 0, "round_n": 1, "base_version": 0, "c_steps": steps,
            "c_tokens": tokens, "compute_s": 1.0, "key": ref.key, "nbytes": ref.nbytes,
            "sha256": sha or ref.sha256, "codec": codec, "update_id": update_id or uuid.uuid4().hex[:8]}
    r = await client.post("/announce", json=body, headers=AUTH)
    assert r.status == 200
    return body, await r.json()


async def wait_version(sync, fragment, version, timeout_s=15.0):
    for _ in range(int(timeout_s / 0.02)):
        if sync.fragments[fragment].version >= version and (fragment, 1) not in sync.rounds:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"fragment {fragment} never reached version {version}; rounds={sync.rounds}")


def expected_after(sync, deltas, weights):
    f = sync.fragments[0]
    opt = OuterOptimizer(f.history[0], lr=0.7, momentum=0.9)
    emb = [n for n in f.names if n in sync.plan.embedding_names]
    return opt.step(merge_outer_gradients(deltas, weights, "rda", emb))


def published(store, sync, version):
    ref = sync.fragments[0].refs[version]
    tensors, _ = wire.decode_from_bytes(store.get(ref), "fp32", sync.fragments[0].shapes)
    return tensors


async def test_nan_contribution_rejected_round_goes_on(caplog):
    caplog.set_level(logging.WARNING, logger="diloco.synchronizer")
    async with running(small_config()) as (sync, client, store):
        await join_all(client)
        await open_first_round(client, sync)
        da, dc = fragment_delta(sync, 1), fragment_delta(sync, 3)
        db = fragment_delta(sync, 2)
        first = next(iter(db))
        db[first].view(-1)[0] = float("nan")
        await contribute(client, store, "b", db)  # the bad one arrives first
        await contribute(client, store, "a", da)
        await contribute(client, store, "c", dc)
        await wait_version(sync, 0, 1)
        assert sync.rejected_by_reason["non_finite"] == 1
        assert sync.counters["contributions_merged"] == 2
        assert "non_finite" in caplog.text and "learner=b" in caplog.text
        got = published(store, sync, 1)
        want = expected_after(sync, [da, dc], [1000**2 / 4] * 2)
        for n in want:
            assert torch.isfinite(got[n]).all()
            assert torch.allclose(got[n], want[n], atol=1e-6)
    ck = latest_checkpoint(store, "run1")
    assert ck is not None and all(torch.isfinite(t).all() for t in ck.tensors.values())
    assert ck.manifest["versions"]["0"] == 1


async def test_wrong_shape_rejected():
    async with running(small_config()) as (sync, client, store):
        await join_all(client)
        await open_first_round(client, sync)
        good_a, good_c = fragment_delta(sync, 1), fragment_delta(sync, 3)
        bad = fragment_delta(sync, 2)
        name = next(iter(bad))
        bad[name] = torch.zeros(bad[name].numel() + 1)
        await contribute(client, store, "b", bad)
        await contribute(client, store, "a", good_a)
        await contribute(client, store, "c", good_c)
        await wait_version(sync, 0, 1)
        assert sync.rejected_by_reason["bad_tensor"] == 1
        assert sync.counters["contributions_merged"] == 2


async def test_sha256_mismatch_rejected():
    async with running(small_config()) as (sync, client, store):
        await join_all(client)
        await open_first_round(client, sync)
        await contribute(client, store, "b", fragment_delta(sync, 2), sha="ab" * 32)
        await contribute(client, store, "a", fragment_delta(sync, 1))
        await contribute(client, store, "c", fragment_delta(sync, 3))
        await wait_version(sync, 0, 1)
        assert sync.rejected_by_reason["digest_mismatch"] == 1
        assert sync.counters["contributions_merged"] == 2
        assert sync.status()["learners"]["b"]["contributions"] == {"rejected": 1}


async def test_replayed_announcement_counted_once():
    async with running(small_config()) as (sync, client, store):
        await join_all(client)
        await open_first_round(client, sync)
        da, db, dc = (fragment_delta(sync, s) for s in (1, 2, 3))
        body, ack = await contribute(client, store, "a", da, tokens=3000)
        assert ack["status"] == "accepted"
        again = await client.post("/announce", json=body, headers=AUTH)  # a client retry
        assert (await again.json())["status"] == "duplicate"
        await contribute(client, store, "b", db)
        await contribute(client, store, "c", dc)
        await wait_version(sync, 0, 1)
        late_replay = await client.post("/announce", json=body, headers=AUTH)  # after the merge
        assert (await late_replay.json())["status"] == "duplicate"
        assert sync.counters["contributions_merged"] == 3
        assert sync.counters["duplicates"] == 2
        assert sync.ledgers["a"].tokens_merged == pytest.approx(3000 * sync.fragments[0].share)
        want = expected_after(sync, [da, db, dc], [3000**2 / 4, 1000**2 / 4, 1000**2 / 4])
        got = published(store, sync, 1)
        for n in want:
            assert torch.allclose(got[n], want[n], atol=1e-6)


async def test_request_without_token_gets_401_and_is_counted():
    async with running(small_config()) as (sync, client, _store):
        r = await client.post("/join", json={"learner_id": "a"})
        assert r.status == 401
        r = await client.post("/join", json={"learner_id": "a"}, headers={"Authorization": "Bearer wrong"})
        assert r.status == 401
        r = await client.get("/metrics")
        assert r.status == 401
        assert sync.rejected_by_reason["unauthenticated"] == 3
        assert "a" not in sync.learners
        assert (await client.get("/health")).status == 200  # open routes stay open
        r = await client.post("/join", json={"learner_id": "a"}, headers=AUTH)
        assert r.status == 200


async def test_malformed_message_rejected_with_400():
    async with running(small_config()) as (sync, client, _store):
        r = await client.post("/join", json={"learner_id": "a", "surprise": 1}, headers=AUTH)
        assert r.status == 400
        r = await client.post("/join", data=b"not json", headers=AUTH)
        assert r.status == 400
        assert sync.rejected_by_reason["bad_request"] == 2


async def test_stale_and_unknown_rounds_rejected():
    async with running(small_config()) as (sync, client, store):
        await join_all(client)
        await open_first_round(client, sync)
        body, _ = await contribute(client, store, "a", fragment_delta(sync, 1))
        stale = dict(body, base_version=7, update_id="x1", learner_id="b")
        ack = await (await client.post("/announce", json=stale, headers=AUTH)).json()
        assert ack["status"] == "rejected" and ack["reason"].startswith("too_stale")
        unknown = dict(body, round_n=9, update_id="x2", learner_id="c")
        ack = await (await client.post("/announce", json=unknown, headers=AUTH)).json()
        assert ack["status"] == "rejected" and ack["reason"].startswith("unknown_round")
        assert sync.rejected_by_reason["too_stale"] == 1 and sync.rejected_by_reason["unknown_round"] == 1


async def test_quorum_not_met_when_only_bad_contributions():
    # K = 2: one good and one NaN contribution must not complete the quorum.
    async with running(small_config()) as (sync, client, store):
        await join_all(client)
        await open_first_round(client, sync)
        bad = fragment_delta(sync, 2)
        next(iter(bad.values())).view(-1)[0] = float("inf")
        await contribute(client, store, "a", fragment_delta(sync, 1))
        await contribute(client, store, "b", bad)
        await asyncio.sleep(0.5)
        assert sync.fragments[0].version == 0
        assert sync.rounds[(0, 1)].state.stage.value == "open"
        await contribute(client, store, "c", fragment_delta(sync, 3))
        await wait_version(sync, 0, 1)
        assert sync.counters["contributions_merged"] == 2


async def test_status_view_renders_a_live_synchronizer():
    from rich.console import Console

    from flows.status_view import render_status

    async with running(small_config()) as (sync, client, store):
        await join_all(client)
        await open_first_round(client, sync)
        await contribute(client, store, "a", fragment_delta(sync, 1))
        st = await (await client.get("/status")).json()
        console = Console(record=True, width=160)
        console.print(render_status(st))
        text = console.export_text()
        assert "learners" in text and "open rounds" in text
        for lid in LEARNERS:
            assert lid in text
        assert "p0: v0" in text
