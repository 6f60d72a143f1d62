"""The synchronizer behind its real HTTP server on loopback, driven by scripted learners.

Each bad input (NaN, wrong shape, wrong sha256, replay, missing token) is rejected with a reason
that is logged and counted, the round goes on with the rest, and nothing non-finite is published
or checkpointed. Assertions read the public surfaces: ``GET /status``, ``/metrics`` and the store.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import uuid

import pytest
import torch
from aiohttp.test_utils import TestClient, TestServer

from diloco_async.codec import wire
from diloco_async.config.schema import load_config
from diloco_async.merge.core import OuterOptimizer, merge_outer_gradients
from diloco_async.policy.fragments import FragmentPlan
from diloco_async.storage import keys
from diloco_async.storage.checkpoint import latest_checkpoint
from diloco_async.storage.store import ObjectStore
from diloco_async.sync import Synchronizer, make_app
from diloco_async.sync.actor import MemoryTails

from polling import await_until, client_status

TOKEN = "test-token-123"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
LEARNERS = ["a", "b", "c"]


def small_config(**extra):
    overrides = [
        "model.n_layer=1", "model.d_model=16", "model.n_head=2", "model.context=8",
        "learners.count=3", "synchronizer.num_fragments=2", "synchronizer.sync_every=4",
        "synchronizer.min_quorum=2", "synchronizer.grace_initial_s=10.0",
        "synchronizer.heartbeat_timeout_s=60", "synchronizer.checkpoint_every_s=1000",
        "synchronizer.drain_s=0", "budget.wall_s=600",
    ]
    overrides += [f"{k}={v}" for k, v in extra.items()]
    return load_config(None, overrides)


class FakeClock:
    """A monotonic clock that moves only when the test says so (seconds)."""

    def __init__(self, now_s: float = 1000.0) -> None:
        self.now_s = now_s

    def __call__(self) -> float:
        return self.now_s

    def advance(self, seconds: float) -> None:
        self.now_s += seconds


@contextlib.asynccontextmanager
async def running(cfg, **sync_kw):
    """The synchronizer behind its HTTP app on a memory store; every wait at the end is bounded, so
    a dead actor fails the test instead of hanging it."""
    store = ObjectStore(f"memory://sync-{uuid.uuid4().hex}")
    sync = Synchronizer(cfg, store, "run1", **sync_kw)
    await asyncio.to_thread(sync.publish_initial)
    client = TestClient(TestServer(make_app(sync, TOKEN), host="127.0.0.1"))
    await client.start_server()
    task = asyncio.create_task(sync.run())
    try:
        yield sync, client, store
    finally:
        try:
            if not task.done():
                await asyncio.wait_for(sync.request("stop", "test over"), 5)
                for lid in list((await asyncio.wait_for(status(client), 5))["learners"]):
                    if task.done():  # finished meanwhile (a fake clock past its finish wait): nobody answers
                        break
                    with contextlib.suppress(TimeoutError):  # the wait for the task below says if it hangs
                        await asyncio.wait_for(client.post("/heartbeat", json={"learner_id": lid, "step": 0},
                                                           headers=AUTH), 5)
            await asyncio.wait_for(task, 30)
        finally:
            task.cancel()
            await client.close()


async def status(client) -> dict:
    return await client_status(client)


async def join_all(client) -> FragmentPlan:
    for lid in LEARNERS:
        r = await client.post("/join", json={"learner_id": lid}, headers=AUTH)
        assert r.status == 200
    return FragmentPlan.from_json((await r.json())["plan"])


def round_of(st: dict, fragment: int, round_n: int):
    return next((r for r in st["rounds"] if (r["fragment"], r["round"]) == (fragment, round_n)), None)


async def open_first_round(client):
    for lid in LEARNERS:
        r = await client.post("/heartbeat", json={"learner_id": lid, "step": 4}, headers=AUTH)
        assert r.status == 200

    async def opened():
        return round_of(await status(client), 0, 1)
    await await_until(opened, 30, "round (0, 1) to open")


def fragment_delta(plan: FragmentPlan, seed: float) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(int(seed * 1000))
    return {s.name: torch.randn(s.shape, generator=g) * 0.01 for s in plan.fragments[0]}


async def contribute(client, store, lid, delta, *, tokens=1000, steps=4, sha=None, codec="fp32",
                     update_id=None):
    data = wire.encode_to_bytes(delta, codec, {})
    key = keys.contribution_key("run1", 0, 1, lid, uuid.uuid4().hex[:8])
    ref = store.put(key, data)
    body = {"learner_id": lid, "fragment": 0, "round_n": 1, "base_version": 0, "c_steps": steps,
            "c_tokens": tokens, "compute_s": 1.0, "key": ref.key, "nbytes": ref.nbytes,
            "sha256": sha or ref.sha256, "codec": codec, "update_id": update_id or uuid.uuid4().hex[:8]}
    r = await client.post("/announce", json=body, headers=AUTH)
    assert r.status == 200
    return body, await r.json()


async def wait_version(client, fragment, version, timeout_s=30.0) -> dict:
    """The status once ``fragment`` has reached ``version`` and its round 1 is closed."""
    async def reached():
        st = await status(client)
        return st if st["versions"][str(fragment)] >= version and not round_of(st, fragment, 1) else None
    return await await_until(reached, timeout_s, f"fragment {fragment} to reach version {version}")


def published(store, plan: FragmentPlan, version: int) -> dict[str, torch.Tensor]:
    shapes = {s.name: s.shape for s in plan.fragments[0]}
    tensors, _ = wire.decode_from_bytes(store.get_unverified(keys.version_key("run1", 0, version)), "fp32", shapes)
    return tensors


def expected_after(store, plan: FragmentPlan, deltas, weights):
    opt = OuterOptimizer(published(store, plan, 0), lr=0.7, momentum=0.9)
    emb = [s.name for s in plan.fragments[0] if s.name in plan.embedding_names]
    return opt.step(merge_outer_gradients(deltas, weights, "rda", emb))


async def test_nan_contribution_rejected_round_goes_on(caplog):
    caplog.set_level(logging.WARNING, logger="diloco.synchronizer")
    async with running(small_config()) as (_sync, client, store):
        plan = await join_all(client)
        await open_first_round(client)
        da, dc = fragment_delta(plan, 1), fragment_delta(plan, 3)
        db = fragment_delta(plan, 2)
        first = next(iter(db))
        db[first].view(-1)[0] = float("nan")
        await contribute(client, store, "b", db)  # the bad one arrives first
        await contribute(client, store, "a", da)
        await contribute(client, store, "c", dc)
        st = await wait_version(client, 0, 1)
        assert st["rejected_by_reason"] == {"non_finite": 1}
        assert st["contributions_merged"] == 2
        assert "non_finite" in caplog.text and "learner=b" in caplog.text
        got = published(store, plan, 1)
        want = expected_after(store, plan, [da, dc], [1000**2 / 4] * 2)
        for n in want:
            assert torch.isfinite(got[n]).all()
            assert torch.allclose(got[n], want[n], atol=1e-6)
    ck = latest_checkpoint(store, "run1")
    assert ck is not None and all(torch.isfinite(t).all() for t in ck.tensors.values())
    assert ck.manifest["versions"]["0"] == 1
    resumed = Synchronizer(small_config(), store, "run1")  # the counters by reason continue on a resume
    await asyncio.to_thread(resumed.restore, ck)
    assert resumed.report.rejected_by_reason == {"non_finite": 1}
    assert resumed.report.counters["contributions_merged"] == 2


async def test_wrong_shape_rejected():
    async with running(small_config()) as (_sync, client, store):
        plan = await join_all(client)
        await open_first_round(client)
        good_a, good_c = fragment_delta(plan, 1), fragment_delta(plan, 3)
        bad = fragment_delta(plan, 2)
        name = next(iter(bad))
        bad[name] = torch.zeros(bad[name].numel() + 1)
        await contribute(client, store, "b", bad)
        await contribute(client, store, "a", good_a)
        await contribute(client, store, "c", good_c)
        st = await wait_version(client, 0, 1)
        assert st["rejected_by_reason"] == {"shape": 1}
        assert st["contributions_merged"] == 2


async def test_sha256_mismatch_rejected():
    async with running(small_config()) as (_sync, client, store):
        plan = await join_all(client)
        await open_first_round(client)
        await contribute(client, store, "b", fragment_delta(plan, 2), sha="ab" * 32)
        await contribute(client, store, "a", fragment_delta(plan, 1))
        await contribute(client, store, "c", fragment_delta(plan, 3))
        st = await wait_version(client, 0, 1)
        assert st["rejected_by_reason"] == {"digest": 1}
        assert st["contributions_merged"] == 2
        assert st["learners"]["b"]["contributions"] == {"rejected": 1}


async def test_replayed_announcement_counted_once():
    async with running(small_config()) as (_sync, client, store):
        plan = await join_all(client)
        await open_first_round(client)
        da, db, dc = (fragment_delta(plan, s) for s in (1, 2, 3))
        body, ack = await contribute(client, store, "a", da, tokens=3000, steps=12)  # <= 2 x B x T tokens per step
        assert ack["status"] == "accepted"
        again = await client.post("/announce", json=body, headers=AUTH)  # a client retry
        assert (await again.json())["status"] == "duplicate"
        await contribute(client, store, "b", db)
        await contribute(client, store, "c", dc)
        await wait_version(client, 0, 1)
        late_replay = await client.post("/announce", json=body, headers=AUTH)  # after the merge
        assert (await late_replay.json())["status"] == "duplicate"
        st = await status(client)
        assert st["contributions_merged"] == 3
        assert st["duplicates"] == 2
        assert st["learners"]["a"]["tokens_merged"] == pytest.approx(3000 * plan.numel_fraction(0))
        want = expected_after(store, plan, [da, db, dc], [3000**2 / 12, 1000**2 / 4, 1000**2 / 4])
        got = published(store, plan, 1)
        for n in want:
            assert torch.allclose(got[n], want[n], atol=1e-6)


async def round_1_merged_from_a_and_b(client, store) -> FragmentPlan:
    """Every learner joined, round 1 of fragment 0 opened and merged from a's and b's contributions
    (version 1); c has not announced. Returns the plan."""
    plan = await join_all(client)
    await open_first_round(client)
    for lid, seed in (("a", 1), ("b", 2)):
        await contribute(client, store, lid, fragment_delta(plan, seed))
    await wait_version(client, 0, 1)
    return plan


async def a_contributes_to_round_2(client, store, plan: FragmentPlan, body: dict) -> dict:
    """Learner a's own contribution to round 2 of fragment 0 (base version 1; ``body`` another
    announcement to copy), accepted; then the status once fragment 0 reached version 2."""
    ref = store.put(keys.contribution_key("run1", 0, 2, "a", uuid.uuid4().hex[:8]),
                    wire.encode_to_bytes(fragment_delta(plan, 4), "fp32", {}))
    a2 = dict(body, learner_id="a", round_n=2, base_version=1, key=ref.key, nbytes=ref.nbytes,
              sha256=ref.sha256, update_id=uuid.uuid4().hex[:8])
    assert (await (await client.post("/announce", json=a2, headers=AUTH)).json())["status"] == "accepted"

    async def version_2():
        st = await status(client)
        return st if st["versions"]["0"] >= 2 else None
    return await await_until(version_2, 30, "fragment 0 to reach version 2")


@pytest.mark.parametrize("fold", [True, False])
async def test_a_contribution_announced_after_its_round_closed_joins_the_next_round(fold):
    """Learner c's contribution to round 1 arrives once round 1 merged without it and round 2 is
    open: it is admitted into round 2 and merged there (``synchronizer.fold_late``, DESIGN §3.5),
    once only; a second key of a learner whose round-1 contribution merged is not folded (late);
    with folding off the late one is answered late and thrown away."""
    cfg = small_config(**{"synchronizer.grace_enabled": "false", "synchronizer.fold_late": str(fold).lower()})
    async with running(cfg) as (_sync, client, store):
        plan = await round_1_merged_from_a_and_b(client, store)
        for lid in LEARNERS:  # the global step reaches round 2's due step (H = 4)
            assert (await client.post("/heartbeat", json={"learner_id": lid, "step": 8}, headers=AUTH)).status == 200

        async def round_2_open():
            return round_of(await status(client), 0, 2)
        await await_until(round_2_open, 30, "round (0, 2) to open")
        body, ack = await contribute(client, store, "c", fragment_delta(plan, 3))  # announced for round 1
        if not fold:
            assert (ack["status"], ack["round_n"]) == ("late", None) and ack["reason"] == "round p0 r1 is closed"
            st = await status(client)
            assert st["contributions_late"] == 1 and st["contributions_folded"] == 0
            assert st["learners"]["c"]["contributions"] == {"late": 1}
            return
        assert (ack["status"], ack["round_n"]) == ("accepted", 2) and "round 1 had closed" in ack["reason"]
        again = await (await client.post("/announce", json=body, headers=AUTH)).json()  # a retry (first ack lost)
        assert (again["status"], again["round_n"]) == ("duplicate", 2)  # it learns the round it joined
        _, second = await contribute(client, store, "a", fragment_delta(plan, 5))  # a's round 1 merged: no 2nd key
        assert (second["status"], second["round_n"]) == ("late", None), second
        st = await a_contributes_to_round_2(client, store, plan, body)
        assert st["contributions_folded"] == 1 and st["contributions_late"] == 1 and st["contributions_merged"] == 4
        assert st["learners"]["c"]["contributions"] == {"merged": 1}
        merge = next(m for m in st["recent_merges"] if m["round"] == 2)
        assert sorted(merge["learners"]) == ["a", "c"]
        replay = await (await client.post("/announce", json=body, headers=AUTH)).json()  # after round 2 merged
        assert replay["status"] == "duplicate"
        assert (await status(client))["contributions_merged"] == 4


@pytest.mark.parametrize("step", [8, 40])
async def test_a_late_contribution_waits_for_the_round_that_opens_next(step):
    """Learner c's contribution to round 1 arrives once round 1 merged and before round 2 opens (the
    global step is short of its due step): it is accepted for round 2 and waits (DESIGN §3.5), is
    admitted when round 2 opens, counts toward its quorum and merges there with a's, once only. When
    the learners then run far ahead (step 40: round 10 is due), round 2 still opens under its number,
    not round 10, which would leave c's abandoned with a skipped round."""
    cfg = small_config(**{"synchronizer.grace_enabled": "false"})
    async with running(cfg) as (_sync, client, store):
        plan = await round_1_merged_from_a_and_b(client, store)
        assert round_of(await status(client), 0, 2) is None  # due at step 8; the learners are at 4
        body, ack = await contribute(client, store, "c", fragment_delta(plan, 3))  # announced for round 1
        assert (ack["status"], ack["round_n"]) == ("accepted", 2) and "round 1 had closed" in ack["reason"], ack
        again = await (await client.post("/announce", json=body, headers=AUTH)).json()  # a retry while it waits
        assert (again["status"], again["round_n"]) == ("duplicate", 2), again
        st = await status(client)
        assert st["contributions_folded"] == 1 and st["contributions_late"] == 0 and round_of(st, 0, 2) is None
        for lid in LEARNERS:
            assert (await client.post("/heartbeat", json={"learner_id": lid, "step": step}, headers=AUTH)).status == 200

        async def round_2_open():
            return round_of(await status(client), 0, 2)
        assert (await await_until(round_2_open, 30, "round (0, 2) to open"))["announced"] == ["c"]
        st = await a_contributes_to_round_2(client, store, plan, body)
        merge = next(m for m in st["recent_merges"] if m["round"] == 2)
        assert sorted(merge["learners"]) == ["a", "c"] and st["contributions_merged"] == 4
        assert st["learners"]["c"]["contributions"] == {"merged": 1} and st["contributions_late"] == 0


async def test_a_rebasing_learners_late_contribution_waits_only_after_a_late_one():
    """With ``learners.adopt = "rebase"`` a learner keeps the progress of a contribution answered late
    in θ and its next contribution carries it, measured from the newer version: so c's first late
    contribution (round 1, merged without it) is answered late instead of waiting for round 2,
    where it would be merged against a base one version older than the rest. Its next one, late
    again (round 2 merged without it), waits for round 3: a learner late every time would
    otherwise never be merged (DESIGN §3.5)."""
    cfg = small_config(**{"synchronizer.grace_enabled": "false", "learners.adopt": '"rebase"'})
    async with running(cfg) as (_sync, client, store):
        plan = await round_1_merged_from_a_and_b(client, store)
        body, ack = await contribute(client, store, "c", fragment_delta(plan, 3))  # round 2 not open yet
        assert ack["status"] == "late" and "closed" in ack["reason"], ack
        for lid in LEARNERS:
            assert (await client.post("/heartbeat", json={"learner_id": lid, "step": 8}, headers=AUTH)).status == 200

        async def round_2_open():
            return round_of(await status(client), 0, 2)
        await await_until(round_2_open, 30, "round (0, 2) to open")
        ref = store.put(keys.contribution_key("run1", 0, 2, "b", uuid.uuid4().hex[:8]),
                        wire.encode_to_bytes(fragment_delta(plan, 6), "fp32", {}))
        b2 = dict(body, learner_id="b", round_n=2, base_version=1, key=ref.key, nbytes=ref.nbytes, sha256=ref.sha256,
                  update_id=uuid.uuid4().hex[:8])
        assert (await (await client.post("/announce", json=b2, headers=AUTH)).json())["status"] == "accepted"
        await a_contributes_to_round_2(client, store, plan, body)  # the quorum of 2: round 2 merges without c
        ref = store.put(keys.contribution_key("run1", 0, 2, "c", uuid.uuid4().hex[:8]),
                        wire.encode_to_bytes(fragment_delta(plan, 5), "fp32", {}))
        c2 = dict(body, round_n=2, base_version=1, key=ref.key, nbytes=ref.nbytes, sha256=ref.sha256,
                  update_id=uuid.uuid4().hex[:8])
        again = await (await client.post("/announce", json=c2, headers=AUTH)).json()
        assert (again["status"], again["round_n"]) == ("accepted", 3) and "round 2 had closed" in again["reason"], again
        st = await status(client)
        assert st["contributions_late"] == 1 and st["contributions_folded"] == 1, st


async def test_a_late_contribution_the_next_round_refuses_stays_late():
    """Folding never costs the learner its next round: a late contribution whose base round 2 no
    longer keeps (S = 0) is answered late, as without folding (not refused, which would also close
    round 2 to that learner), and the learner's own round-2 contribution is then accepted."""
    cfg = small_config(**{"synchronizer.grace_enabled": "false", "synchronizer.max_staleness": "0"})
    async with running(cfg) as (_sync, client, store):
        plan = await round_1_merged_from_a_and_b(client, store)
        for lid in LEARNERS:
            assert (await client.post("/heartbeat", json={"learner_id": lid, "step": 8}, headers=AUTH)).status == 200

        async def round_2_open():
            return round_of(await status(client), 0, 2)
        await await_until(round_2_open, 30, "round (0, 2) to open")
        _, stale = await contribute(client, store, "c", fragment_delta(plan, 3))  # round 1, base 0: not kept
        assert stale["status"] == "late" and "round 2 refused it: too_stale" in stale["reason"], stale
        data = wire.encode_to_bytes(fragment_delta(plan, 5), "fp32", {})
        ref = store.put(keys.contribution_key("run1", 0, 2, "c", uuid.uuid4().hex[:8]), data)
        own = {"learner_id": "c", "fragment": 0, "round_n": 2, "base_version": 1, "c_steps": 4, "c_tokens": 1000,
               "compute_s": 1.0, "key": ref.key, "nbytes": ref.nbytes, "sha256": ref.sha256, "codec": "fp32",
               "update_id": uuid.uuid4().hex[:8]}
        assert (await (await client.post("/announce", json=own, headers=AUTH)).json())["status"] == "accepted"
        st = await status(client)
        assert st["contributions_late"] == 1 and st["contributions_folded"] == 0 and st["rejected_by_reason"] == {}


async def test_request_without_token_gets_401_and_is_counted():
    async with running(small_config()) as (_sync, client, _store):
        r = await client.post("/join", json={"learner_id": "a"})
        assert r.status == 401
        r = await client.post("/join", json={"learner_id": "a"}, headers={"Authorization": "Bearer wrong"})
        assert r.status == 401
        r = await client.get("/metrics")
        assert r.status == 401
        st = await status(client)  # open route
        assert st["rejected_by_reason"] == {"unauthenticated": 3}
        assert "a" not in st["learners"]
        assert (await client.get("/health")).status == 200  # open routes stay open
        r = await client.post("/join", json={"learner_id": "a"}, headers=AUTH)
        assert r.status == 200


async def test_malformed_message_rejected_with_400():
    async with running(small_config()) as (_sync, client, _store):
        r = await client.post("/join", json={"learner_id": "a", "surprise": 1}, headers=AUTH)
        assert r.status == 400
        r = await client.post("/join", data=b"not json", headers=AUTH)
        assert r.status == 400
        assert (await status(client))["rejected_by_reason"] == {"bad_request": 2}


async def test_stale_and_unknown_rounds_rejected():
    async with running(small_config()) as (_sync, client, store):
        plan = await join_all(client)
        await open_first_round(client)
        body, _ = await contribute(client, store, "a", fragment_delta(plan, 1))
        own = {lid: body["key"].replace("/a-", f"/{lid}-") for lid in ("b", "c")}  # a learner announces its own keys
        stale = dict(body, base_version=7, update_id="x1", learner_id="b", key=own["b"])
        ack = await (await client.post("/announce", json=stale, headers=AUTH)).json()
        assert ack["status"] == "rejected" and ack["reason"].startswith("too_stale")
        unknown = dict(body, round_n=9, update_id="x2", learner_id="c", key=own["c"])
        ack = await (await client.post("/announce", json=unknown, headers=AUTH)).json()
        assert ack["status"] == "rejected" and ack["reason"].startswith("unknown_round")
        assert (await status(client))["rejected_by_reason"] == {"too_stale": 1, "unknown_round": 1}


async def test_quorum_not_met_when_only_bad_contributions():
    # K = 2: one good and one NaN contribution must not complete the quorum.
    async with running(small_config()) as (_sync, client, store):
        plan = await join_all(client)
        await open_first_round(client)
        bad = fragment_delta(plan, 2)
        next(iter(bad.values())).view(-1)[0] = float("inf")
        await contribute(client, store, "a", fragment_delta(plan, 1))
        await contribute(client, store, "b", bad)

        async def both_settled():  # a verified, b rejected: the quorum decision has been taken
            rnd = round_of(await status(client), 0, 1)
            return rnd if rnd["verified"] == ["a"] and rnd["rejected"] == ["b"] else None
        rnd = await await_until(both_settled, 30, "both contributions to be verified")
        assert rnd["stage"] == "open" and rnd["pending"] == []
        assert (await status(client))["versions"]["0"] == 0
        await contribute(client, store, "c", fragment_delta(plan, 3))
        st = await wait_version(client, 0, 1)
        assert st["contributions_merged"] == 2


async def test_garbage_collection_keeps_the_version_a_live_learner_is_still_reading():
    """Read leases (issue 47): with no version kept behind the current one (max_staleness = 0), gc
    after a checkpoint would delete v0 of fragment 0 once v1 is out; while learner c's heartbeats
    say it is still reading v0, v0 stays (counted), and it goes once c's read has ended."""
    async with running(small_config(**{"synchronizer.max_staleness": 0})) as (sync, client, store):
        plan = await join_all(client)
        await open_first_round(client)
        for lid, seed in zip(LEARNERS, (1, 2, 3), strict=True):
            await contribute(client, store, lid, fragment_delta(plan, seed))
        await wait_version(client, 0, 1)
        v0 = keys.version_key("run1", 0, 0)

        async def heartbeats(c_reading: dict[str, int]) -> None:
            for lid in LEARNERS:
                body = {"learner_id": lid, "step": 4, "known_versions": {"0": 1, "1": 0},
                        "fetching_versions": c_reading if lid == "c" else {}}
                assert (await client.post("/heartbeat", json=body, headers=AUTH)).status == 200

        async def kept_for_reads() -> dict | None:
            st = await status(client)
            return st if st["gc_kept_for_reads"] else None

        async def v0_collected() -> bool:
            return not await asyncio.to_thread(store.exists, v0)

        await heartbeats({"0": 0})
        await asyncio.wait_for(sync.request("checkpoint", None), 30)
        st = await await_until(kept_for_reads, 30, "gc behind the first checkpoint to keep v0 for c")
        assert st["gc_kept_for_reads"] == 1 and store.exists(v0)
        await heartbeats({})  # c's read ended
        await asyncio.wait_for(sync.request("checkpoint", None), 30)
        await await_until(v0_collected, 30, "gc behind the second checkpoint to delete v0")
        assert not store.exists(v0) and store.exists(keys.version_key("run1", 1, 0))


async def test_grace_window_and_liveness_on_a_fake_clock():
    # K = 2 of 3, no step time reported yet: the grace window is the initial 10 s of the fake clock.
    clock = FakeClock()
    async with running(small_config(), clock=clock) as (_sync, client, store):
        plan = await join_all(client)
        await open_first_round(client)
        await contribute(client, store, "a", fragment_delta(plan, 1))
        await contribute(client, store, "b", fragment_delta(plan, 2))

        async def in_grace():
            rnd = round_of(await status(client), 0, 1)
            return rnd if rnd["stage"] == "grace" else None
        await await_until(in_grace, 30, "the quorum of two to start the grace window")
        clock.advance(9.9)
        for _ in range(3):  # each answer follows at least one pass of the actor at the new time
            st = await status(client)
        assert round_of(st, 0, 1)["stage"] == "grace" and st["versions"]["0"] == 0
        clock.advance(0.2)  # past the deadline: the round merges without c
        st = await wait_version(client, 0, 1)
        assert st["contributions_merged"] == 2
        assert all(st["learners"][lid]["live"] for lid in LEARNERS)
        clock.advance(60.5)  # heartbeat_timeout_s = 60 of silence on the fake clock

        async def all_lost():
            st = await status(client)
            return st if not any(st["learners"][lid]["live"] for lid in LEARNERS) else None
        st = await await_until(all_lost, 30, "every learner to be marked lost")
        assert st["phase"] == "running"


async def test_metrics_since_reads_points_older_than_the_memory_tail():
    async with running(small_config(), tails=MemoryTails(metrics=8)) as (sync, client, _store):
        await join_all(client)
        for step in range(1, 21):
            r = await client.post("/heartbeat", json={"learner_id": "a", "step": step, "train_loss": 1.0 / step},
                                  headers=AUTH)
            assert r.status == 200
        points, since = [], 0
        while True:
            body = await (await client.get(f"/metrics?since={since}", headers=AUTH)).json()
            points += body["metrics"]
            since = body["next"]
            if since >= body["total"]:
                break
        async def status_caught_up():  # /status is a snapshot the actor publishes: it may lag a little
            st = await status(client)
            return st if st["metrics_total"] == body["total"] else None

        await await_until(status_caught_up, 30, "/status to count every metric point")
        assert len(points) == body["total"] > 8
        assert sync.metrics.in_memory == 8  # the rest is read from the spill file
        losses = [m["value"] for m in points if m["key"] == "learner/a/train_loss"]
        assert losses == [1.0 / step for step in range(1, 21)]


async def test_status_view_renders_a_live_synchronizer():
    from rich.console import Console

    from diloco_async.flows.status_view import render_status

    async with running(small_config()) as (_sync, client, store):
        plan = await join_all(client)
        await open_first_round(client)
        await contribute(client, store, "a", fragment_delta(plan, 1))
        st = await status(client)
        console = Console(record=True, width=160)
        console.print(render_status(st))
        text = console.export_text()
        assert "learners" in text and "open rounds" in text
        for lid in LEARNERS:
            assert lid in text
        assert "p0: v0" in text


async def test_status_lists_the_last_merges_and_the_view_shows_them_in_100_columns():
    """A round is open for a fraction of a second in a run, so `status --watch` (every 2 s) almost
    never caught one open: /status lists the last merges too, and the view shows them."""
    from rich.console import Console

    from diloco_async.flows.status_view import render_status

    async with running(small_config()) as (_sync, client, store):
        plan = await join_all(client)
        await open_first_round(client)
        st = await status(client)
        assert round_of(st, 0, 1)["open_s"] >= 0 and st["recent_merges"] == []
        for i, lid in enumerate(LEARNERS):
            await contribute(client, store, lid, fragment_delta(plan, i + 1))
        st = await wait_version(client, 0, 1)
        (merge,) = st["recent_merges"]
        assert (merge["fragment"], merge["round"], merge["version"]) == (0, 1, 1) and merge["age_s"] >= 0
        assert sorted(merge["learners"]) == LEARNERS
        texts = []
        for wide in (False, True):
            console = Console(record=True, width=200)
            console.print(render_status(st, wide))
            texts.append(console.export_text())
            assert "merged: v1" in texts[-1] and "open rounds" in texts[-1]
        assert max(len(line.rstrip()) for line in texts[0].splitlines()) <= 100  # --wide may take more
        assert ", ".join(merge["learners"]) in texts[1] and ", ".join(merge["learners"]) not in texts[0]


async def test_a_cancelled_actor_stops_even_when_a_message_lands_with_the_cancel():
    """A message put into the inbox in the same pass as the actor's cancel: on Python 3.11,
    ``asyncio.wait_for`` returns the finished get() and swallows the cancel (CPython gh-86296), so
    an actor built on it kept looping after its owner had cancelled it (a test's teardown hung 120 s)."""
    from diloco_async.sync.state import Request

    for _ in range(5):
        sync = Synchronizer(small_config(), ObjectStore(f"memory://cancel-{uuid.uuid4().hex}"), "run1")
        await asyncio.to_thread(sync.publish_initial)
        actor = asyncio.create_task(sync.run())

        async def passed_once(sync: Synchronizer = sync) -> bool:  # then the actor waits in inbox.get()
            return sync.board.ticked_s is not None  # (the loop's only await)

        await await_until(passed_once, 30, "the actor's first pass")
        dropped = asyncio.get_running_loop().create_future()
        dropped.cancel()  # a request nobody waits for any more: the actor skips it
        sync.inbox.put_nowait(Request("status", None, dropped))
        actor.cancel()
        done, _ = await asyncio.wait({actor}, timeout=30)  # a failure mode: a stuck actor never stops
        assert done, "the actor did not stop after its cancel"
        assert actor.cancelled()


async def test_badput_by_cause_on_a_fake_clock_adds_up_with_goodput_to_one():
    """Every cause the synchronizer sees, on a fake clock: first start-ups (starting), blocked
    time the learner reports, a rejected contribution's compute (thrown away), a silence that
    ends in the same process (stalled) and one that ends in a new process (down, then
    restarting). Goodput and the badput shares sum to 1; contributions.jsonl says who went where."""
    import json

    clock = FakeClock()
    async with running(small_config(), clock=clock) as (_sync, client, store):
        for lid, up_s in zip(LEARNERS, (3.0, 2.0, 1.0), strict=True):
            r = await client.post("/join", json={"learner_id": lid, "uptime_s": up_s}, headers=AUTH)
            assert r.status == 200
        plan = FragmentPlan.from_json((await r.json())["plan"])
        clock.advance(1.0)
        for lid in LEARNERS:
            body = {"learner_id": lid, "step": 4, "blocked_s": 0.5 if lid == "a" else 0.0}
            assert (await client.post("/heartbeat", json=body, headers=AUTH)).status == 200

        async def opened():
            return round_of(await status(client), 0, 1)
        await await_until(opened, 30, "round (0, 1) to open")
        await contribute(client, store, "c", fragment_delta(plan, 3), sha="ab" * 32)  # rejected: thrown away
        await contribute(client, store, "a", fragment_delta(plan, 1))
        await contribute(client, store, "b", fragment_delta(plan, 2))

        async def settled():  # every learner answered: the round merges without waiting out its grace
            st = await status(client)
            return st if st["rejected_by_reason"] and st["versions"]["0"] >= 1 else None
        await await_until(settled, 30, "the rejection and the merge")
        clock.advance(60.5)  # heartbeat_timeout_s = 60: everyone lost

        async def all_lost():
            st = await status(client)
            return st if not any(st["learners"][lid]["live"] for lid in LEARNERS) else None
        await await_until(all_lost, 30, "every learner to be marked lost")
        clock.advance(4.0)
        assert (await client.post("/heartbeat", json={"learner_id": "b", "step": 4}, headers=AUTH)).status == 200
        r = await client.post("/join", json={"learner_id": "a", "incarnation": 1, "uptime_s": 2.0}, headers=AUTH)
        assert r.status == 200

        async def judged():
            st = await status(client)
            return st if st["learners"]["a"]["live"] and st["learners"]["b"]["live"] else None
        st = await await_until(judged, 30, "a and b to be back")
        secs = st["badput_s"]
        assert secs["starting"] == pytest.approx(6.0)  # 3 + 2 + 1 s from process start to join
        assert secs["restarting"] == pytest.approx(2.0)
        assert secs["blocked"] == pytest.approx(0.5)
        assert secs["thrown_away"] == pytest.approx(1.0 * plan.numel_fraction(0))  # compute_s 1 x the share
        assert 64.5 <= secs["stalled"] <= 76.5  # b: silent from its last message until it spoke again
        # a: silent until its new process started 2 s before the join; c: still silent, counted down
        assert secs["down"] >= 62.5 + 64.5
        shares = st["badput"]
        assert set(shares) == {"down", "starting", "restarting", "stalled", "blocked", "thrown_away", "other"}
        assert st["compute_goodput"] + sum(shares.values()) == pytest.approx(1.0, abs=1e-9)
        assert shares["starting"] == pytest.approx(6.0 / st["provisioned_s"])
        clock.advance(120.0)  # lost again: the stop at the end does not wait for a's new incarnation
        await await_until(all_lost, 30, "every learner to be marked lost again")
    records = [json.loads(line) for line in
               store.get_unverified(keys.contribution_log_key("run1", _sync.epoch)).decode().splitlines()]
    fates = {(r["learner"], r["fragment"], r["round"]): r for r in records}
    assert fates[("a", 0, 1)]["fate"] == fates[("b", 0, 1)]["fate"] == "merged"
    assert fates[("c", 0, 1)]["fate"] == "rejected" and fates[("c", 0, 1)]["reason"].startswith("digest")
    assert fates[("a", 0, 1)]["c_tokens"] == 1000 and fates[("a", 0, 1)]["staleness_versions"] == 0


@pytest.mark.parametrize("slots", [1, 3])
async def test_verifications_in_flight_are_bounded_by_the_setting(monkeypatch, slots):
    """``synchronizer.verifies_in_flight``: at most that many contributions are fetched and
    verified at once (each holds its payload and a decoded tensor), and the round still merges.
    The real fetch_and_verify runs, each held until all three verifications have arrived (running,
    or waiting for a slot), so that they overlap as far as the bound lets them, whatever the pace."""
    from diloco_async.sync import work

    real, running_now, most = work.fetch_and_verify, [0], [0]
    lock, release = threading.Lock(), threading.Event()

    def counted(*args, **kw):
        with lock:
            running_now[0] += 1
            most[0] = max(most[0], running_now[0])
        try:
            release.wait(30)
            return real(*args, **kw)
        finally:
            with lock:
                running_now[0] -= 1

    monkeypatch.setattr(work, "fetch_and_verify", counted)
    async with running(small_config(**{"synchronizer.min_quorum": 3, "synchronizer.verifies_in_flight": slots})) \
            as (sync, client, store):
        plan = await join_all(client)
        await open_first_round(client)
        for i, lid in enumerate(LEARNERS):
            await contribute(client, store, lid, fragment_delta(plan, 0.1 + i))

        async def all_arrived() -> bool:  # in fetch_and_verify, or queued for a slot
            waiting = sum(not w.done() for w in (getattr(sync.table.verify_slots, "_waiters", None) or ()))
            return running_now[0] + waiting == len(LEARNERS)

        await await_until(all_arrived, 30, "three verifications running or waiting for a slot")
        release.set()
        await wait_version(client, 0, 1)
    assert most[0] == slots
