"""The end of a run (issue 44, docs/end-of-run.md): the drain's last round of a fragment waits for
every live learner until the drain ends, not only for a grace window after the quorum, and takes
its outer step without the momentum look-ahead (``synchronizer.drain_lookahead = 0``).

A real synchronizer behind its HTTP app on a memory store and a fake clock; three scripted
learners announce their contributions in an order the test chooses. Assertions read ``/status``
and the published versions.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid

import pytest
import torch
from aiohttp.test_utils import TestClient, TestServer

from diloco_async.codec import wire
from diloco_async.config.schema import load_config
from diloco_async.merge.core import OuterOptimizer, merge_outer_gradients
from diloco_async.policy.fragments import FragmentPlan
from diloco_async.storage import keys
from diloco_async.storage.store import ObjectStore
from diloco_async.sync import Synchronizer, make_app

from polling import await_until, client_status

TOKEN = "test-token-end-of-run"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
LEARNERS = ("a", "b", "c")
ETA, MU = 0.7, 0.9


class FakeClock:
    """Monotonic seconds that move only when the test says so."""

    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


def config(**extra):
    """One fragment, K = 1 of 3, a 1 s grace window, a 30 s drain; no direction guard (random outer
    gradients are not aligned, and the expected values weight them equally)."""
    fields = {"learners.count": 3, "synchronizer.num_fragments": 1, "synchronizer.sync_every": 4,
              "synchronizer.min_quorum": 1, "synchronizer.grace_initial_s": 1.0, "synchronizer.grace_cap_s": 1.0,
              "synchronizer.heartbeat_timeout_s": 600, "synchronizer.checkpoint_every_s": 1000,
              "synchronizer.drain_s": 30.0, "guard.direction_fraction": 0.0, "budget.wall_s": 6000, **extra}
    return load_config(None, [f"{k}={v}" for k, v in fields.items()])


@contextlib.asynccontextmanager
async def running(cfg, clock):
    store = ObjectStore(f"memory://end-of-run-{uuid.uuid4().hex}")
    sync = Synchronizer(cfg, store, "run1", clock=clock)
    await asyncio.to_thread(sync.publish_initial)
    client = TestClient(TestServer(make_app(sync, TOKEN), host="127.0.0.1"))
    await client.start_server()
    task = asyncio.create_task(sync.run())
    try:
        yield sync, client, store
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, 30)
        await client.close()


async def status(client) -> dict:
    return await client_status(client)


def round_of(st: dict, n: int) -> dict | None:
    return next((r for r in st["rounds"] if (r["fragment"], r["round"]) == (0, n)), None)


async def heartbeats(client, step: int) -> None:
    for lid in LEARNERS:
        r = await client.post("/heartbeat", json={"learner_id": lid, "step": step}, headers=AUTH)
        assert r.status == 200


async def announce(client, store, lid: str, n: int, base: int, delta: dict[str, torch.Tensor]) -> None:
    key = keys.contribution_key("run1", 0, n, lid, uuid.uuid4().hex[:8])
    ref = store.put(key, wire.encode_to_bytes(delta, "fp32", {}))
    body = {"learner_id": lid, "fragment": 0, "round_n": n, "base_version": base, "c_steps": 4, "c_tokens": 1000,
            "compute_s": 1.0, "key": ref.key, "nbytes": ref.nbytes, "sha256": ref.sha256, "codec": "fp32",
            "update_id": uuid.uuid4().hex[:8]}
    r = await client.post("/announce", json=body, headers=AUTH)
    assert r.status == 200 and (await r.json())["status"] == "accepted"


def version(store, plan: FragmentPlan, v: int) -> dict[str, torch.Tensor]:
    shapes = {s.name: s.shape for s in plan.fragments[0]}
    return wire.decode_from_bytes(store.get_unverified(keys.version_key("run1", 0, v)), "fp32", shapes)[0]


def deltas(plan: FragmentPlan, seed: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [{s.name: torch.randn(s.shape, generator=g) * 0.01 for s in plan.fragments[0]} for _ in LEARNERS]


async def wait_version(client, v: int) -> dict:
    async def reached():
        st = await status(client)
        return st if st["versions"]["0"] >= v else None
    return await await_until(reached, 30, f"fragment 0 to reach version {v}")


async def in_grace(client, n: int) -> dict:
    async def grace():
        st = await status(client)
        rnd = round_of(st, n)
        return st if rnd is not None and rnd["stage"] == "grace" else None
    return await await_until(grace, 30, f"round {n} to reach its grace stage")


@pytest.mark.parametrize("lookahead", [0.0, 1.0])
async def test_a_drains_last_round_waits_for_every_learner_and_takes_no_lookahead(lookahead):
    clock = FakeClock()
    async with running(config(**{"synchronizer.drain_lookahead": lookahead}), clock) as (sync, client, store):
        for lid in LEARNERS:
            r = await client.post("/join", json={"learner_id": lid}, headers=AUTH)
        plan = FragmentPlan.from_json((await r.json())["plan"])
        emb = [s.name for s in plan.fragments[0] if s.name in plan.embedding_names]
        first, last = deltas(plan, 1), deltas(plan, 2)
        await heartbeats(client, 4)  # round 1 is due: a round like any other
        await await_until(lambda: _open(client, 1), 30, "round 1 to open")
        for lid, d in zip(LEARNERS, first, strict=True):
            await announce(client, store, lid, 1, 0, d)
        await wait_version(client, 1)
        await heartbeats(client, 6)  # half a round later the run is stopped: the drain opens round 2
        await asyncio.wait_for(sync.request("stop", "budget spent"), 30)
        await await_until(lambda: _open(client, 2), 30, "the drain's last round to open")
        await announce(client, store, "a", 2, 1, last[0])
        await in_grace(client, 2)
        clock.now_s += 5.0  # five grace windows, well inside the 30 s drain
        for _ in range(3):  # each answer follows at least one pass of the actor at the new time
            st = await status(client)
        assert st["versions"]["0"] == 1, "the drain's last round closed on a quorum of one, before the others"
        for lid, d in zip(LEARNERS[1:], last[1:], strict=True):
            await announce(client, store, lid, 2, 1, d)
        st = await wait_version(client, 2)
        assert st["contributions_merged"] == 6
        # what was published: round 1 a Nesterov step; round 2 the merged g, and lookahead x the look-ahead
        opt = OuterOptimizer(version(store, plan, 0), lr=ETA, momentum=MU, dtype=torch.float64)
        opt.step({k: v.double() for k, v in merge_outer_gradients(first, [1.0] * 3, "rda", emb).items()})
        theta1 = opt.params()
        g2 = {k: v.double() for k, v in merge_outer_gradients(last, [1.0] * 3, "rda", emb).items()}
        b2 = {k: MU * b + g2[k] for k, b in opt.momentum().items()}
        got = version(store, plan, 2)
        for name, t in got.items():
            want = theta1[name] - ETA * (g2[name] + lookahead * MU * b2[name])
            torch.testing.assert_close(t.double(), want, rtol=1e-5, atol=1e-6)


async def test_a_second_stop_during_the_drain_merges_the_last_round_at_once():
    """A second stop while draining stops at once (the learners are told to stop and contribute no
    more): the last round merges what it has without waiting for the drain's end (the fake clock
    never moves here)."""
    clock = FakeClock()
    async with running(config(), clock) as (sync, client, store):
        for lid in LEARNERS:
            r = await client.post("/join", json={"learner_id": lid}, headers=AUTH)
        plan = FragmentPlan.from_json((await r.json())["plan"])
        await heartbeats(client, 2)
        await asyncio.wait_for(sync.request("stop", "budget spent"), 30)
        await await_until(lambda: _open(client, 1), 30, "the drain's last round to open")
        await announce(client, store, "a", 1, 0, deltas(plan, 3)[0])
        await in_grace(client, 1)
        await asyncio.wait_for(sync.request("stop", "Ctrl-C again"), 30)
        st = await wait_version(client, 1)
        assert st["contributions_merged"] == 1 and st["phase"] != "draining"


async def _open(client, n: int) -> dict | None:
    rnd = round_of(await status(client), n)
    return rnd if rnd is not None and rnd["stage"] in ("open", "grace") else None


async def test_a_late_contribution_waiting_at_a_stop_joins_the_drains_last_round():
    """A contribution to round 1 that arrives after round 1 merged waits for round 2 (DESIGN §3.5); a
    stop then opens round 2 as the drain's last round, and the waiting one is in it and merged."""
    clock = FakeClock()
    async with running(config(), clock) as (sync, client, store):
        for lid in LEARNERS:
            r = await client.post("/join", json={"learner_id": lid}, headers=AUTH)
        plan = FragmentPlan.from_json((await r.json())["plan"])
        first, last = deltas(plan, 1), deltas(plan, 2)
        await heartbeats(client, 4)
        await await_until(lambda: _open(client, 1), 30, "round 1 to open")
        for lid, d in zip(LEARNERS[:2], first[:2], strict=True):
            await announce(client, store, lid, 1, 0, d)
        await in_grace(client, 1)
        clock.now_s += 5.0  # past round 1's grace window: it merges without c
        await wait_version(client, 1)
        await announce(client, store, "c", 1, 0, first[2])  # accepted for round 2, which is not open
        assert round_of(await status(client), 2) is None
        await asyncio.wait_for(sync.request("stop", "budget spent"), 30)
        rnd = await await_until(lambda: _open(client, 2), 30, "the drain's last round to open")
        assert rnd["announced"] == ["c"], rnd
        for lid, d in zip(LEARNERS[:2], last[:2], strict=True):
            await announce(client, store, lid, 2, 1, d)
        st = await wait_version(client, 2)
        assert st["contributions_merged"] == 5 and st["contributions_folded"] == 1
        assert st["learners"]["c"]["contributions"] == {"merged": 1}
