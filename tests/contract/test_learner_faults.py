"""Storage faults on the learner side, end to end (cases C08 and C11).

Real learners (their training and comms threads, in this process) and a real synchronizer behind
its HTTP server on loopback share one in-memory store; one learner's store injects faults through
the real store interface.
"""

from __future__ import annotations

import asyncio
import json
import threading
import uuid

from diloco_async.codec import wire
from diloco_async.config.schema import load_config
from diloco_async.learner import Learner, LearnerSlot, SyncEndpoint
from diloco_async.policy.fragments import FragmentPlan
from diloco_async.protocol.auth import learner_token
from diloco_async.storage import keys
from diloco_async.storage.faults import FaultyStore
from diloco_async.storage.retry import RetryPolicy
from diloco_async.storage.store import ObjectStore
from diloco_async.sync import Synchronizer, make_app

from polling import await_until

TOKEN = "fault-token"


def config(**extra):
    overrides = [
        "model.n_layer=1", "model.d_model=16", "model.n_head=2", "model.context=16", "learners.count=3",
        "learners.batch_size=4", "learners.storage_timeout_s=1.0", "learners.checkpoint_every_s=0",
        "learners.heartbeat_s=0.1", "synchronizer.num_fragments=1", "synchronizer.sync_every=8",
        "synchronizer.min_quorum=2", "synchronizer.grace_initial_s=0.2", "synchronizer.grace_cap_s=0.5",
        "synchronizer.heartbeat_timeout_s=30", "synchronizer.checkpoint_every_s=1000", "budget.wall_s=600",
    ]
    return load_config(None, overrides + [f"{k}={v}" for k, v in extra.items()])


async def serve_in_process(sync: Synchronizer, token: str):
    """Serve ``sync`` on a free loopback port and start its actor: (HTTP runner, URL, actor task)."""
    from aiohttp import web

    runner = web.AppRunner(make_app(sync, token))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    return runner, url, asyncio.create_task(sync.run())


async def stop_in_process(sync: Synchronizer, runner, actor, learners: list, threads: list) -> None:
    """Stop the run (final checkpoint, logs written), then the learners, then the HTTP server."""
    await sync.request("stop", "test over")
    await asyncio.wait_for(actor, 60)
    for learner in learners:
        learner.stop_event.set()
    for t in threads:
        await asyncio.to_thread(t.join, 20)
    await runner.cleanup()


async def run_cluster(cfg, stores: dict[str, ObjectStore], until) -> Synchronizer:
    """Start the synchronizer and one learner per store; stop when ``until(status)`` holds on the
    synchronizer's status; return the final status (the run stopped, its logs written)."""
    store = next(iter(stores.values()))
    sync = Synchronizer(cfg, ObjectStore(store.url), "frun")
    await asyncio.to_thread(sync.publish_initial)
    runner, url, actor = await serve_in_process(sync, TOKEN)
    learners = [Learner(LearnerSlot(lid, i), SyncEndpoint(url, learner_token(TOKEN, "frun", lid), give_up_after_s=30),
                        st) for i, (lid, st) in enumerate(stores.items())]
    threads = [threading.Thread(target=learner.run, daemon=True) for learner in learners]
    for t in threads:
        t.start()
    try:
        async def reached() -> bool:
            return until(sync.status())

        await await_until(reached, 60, "the test's condition on the synchronizer's status", interval_s=0.05)
    finally:
        await stop_in_process(sync, runner, actor, learners, threads)
    return sync.status()


def stored_metrics(store: ObjectStore, status: dict) -> list[dict]:
    """The run's metric points as the synchronizer wrote them to the store at its stop."""
    body = store.get_unverified(keys.metrics_log_key("frun", status["epoch"])).decode()
    return [json.loads(line) for line in body.splitlines() if line.strip()]


async def test_hung_upload_times_out_and_rounds_close_on_quorum_plus_grace():
    mem = f"memory://faults-{uuid.uuid4().hex}"
    hung = FaultyStore(ObjectStore(mem, policy=RetryPolicy(timeout_s=1.0, retries=0)))
    hung.faults.hang("put", times=1000)  # every upload of learner c blocks
    hung.faults.hang("begin", times=1000)
    stores = {"a": ObjectStore(mem), "b": ObjectStore(mem), "c": hung}
    try:
        st = await run_cluster(config(), stores, lambda s: s["versions"][0] >= 4)
    finally:
        hung.faults.release()
    assert st["versions"][0] >= 4
    assert st["learners"]["c"]["contributions"] == {}  # nothing announced, nothing merged
    assert hung.faults.injected["hang"] >= 1
    assert st["contributions_rejected"] == 0
    # every merge closed on a quorum of the two healthy learners
    quorums = [m["value"] for m in stored_metrics(ObjectStore(mem), st) if m["key"] == "sync/quorum_size"]
    assert len(quorums) >= 4 and set(quorums) == {2.0}
    # no object of learner c was ever published
    assert not [k for k in ObjectStore(mem).list(keys.contributions_prefix("frun")) if "/c-" in k]


async def test_exception_mid_upload_publishes_and_announces_nothing():
    mem = f"memory://faults-{uuid.uuid4().hex}"
    torn = FaultyStore(ObjectStore(mem, policy=RetryPolicy(retries=0)))
    torn.faults.tear(after_nbytes=64)  # learner c's first upload dies after 64 bytes
    stores = {"a": ObjectStore(mem), "b": ObjectStore(mem), "c": torn}
    st = await run_cluster(config(**{"synchronizer.min_quorum": 1}), stores,
                           lambda s: s["learners"].get("c", {}).get("contributions", {}).get("merged", 0) >= 2)
    assert torn.faults.injected["tear"] == 1
    assert st["contributions_rejected"] == 0  # nothing partial was ever announced
    store = ObjectStore(mem)
    plan = FragmentPlan.from_json(store.get_json(keys.plan_key("frun"))["plan"])
    shapes = {spec.name: spec.shape for spec in plan.fragments[0]}
    contributions = store.list(keys.contributions_prefix("frun"))
    assert contributions
    for key in contributions:  # every published contribution is whole
        wire.decode_from_bytes(store.get_unverified(key), "bf16", shapes)


def test_learner_that_cannot_reach_the_synchronizer_exits_3_after_give_up():
    """The comms give up after ``give_up_after_s`` without an answer and name why; the join wait
    (``max_wait_join_s``, which ends with no such reason) is not what ended the run."""
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    learner = Learner(LearnerSlot("lonely", 0), SyncEndpoint(url, TOKEN, give_up_after_s=0.5),
                      ObjectStore(f"memory://lonely-{uuid.uuid4().hex}"))
    assert learner.run(max_wait_join_s=30) == 3
    fatal = learner.shared.fatal or ""
    assert fatal.startswith("ProtocolError: synchronizer unreachable for"), fatal
