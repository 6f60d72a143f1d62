"""Sharded learner groups (``learners.parallelism = "fsdp"``, DESIGN §3.1) against the real synchronizer.

* a synchronizer process, scripted learners over HTTP and a ``file://`` store: a contribution
  announced as two shard objects is reassembled and merged; one whose shard object was deleted,
  or corrupted, before the merge is refused with its reason (``missing_shard``, ``shard_digest``),
  counted in ``/status``, and the round merges the good one; a shard object under another
  learner's prefix is refused at the edge (403);
* a run of 2 learners x 2 FSDP2 ranks (torchrun, gloo) through ``RunProcesses``: every
  contribution travels as one shard object per rank, versions are published, the learners'
  loss falls; SIGKILL of rank 0 of one learner and, separately, of rank 1 of the other restarts
  each group as the learner's next incarnation, which rejoins, and merges go on.
"""

from __future__ import annotations

import asyncio
import os
import signal
import uuid

import pytest
import torch
from test_integration import tiny_recipe
from test_learner_groups import ranks_of
from test_resume import TOKEN, SyncProcess

from diloco_async.config.schema import load_config
from diloco_async.learner.fsdp import local_rows
from diloco_async.learner.fsdp_outer import shard_payload
from diloco_async.learner.sharded_client import ShardedSyncClient
from diloco_async.protocol.auth import learner_token
from diloco_async.protocol.client import ProtocolError, call_blocking, fetch_status
from diloco_async.protocol.messages import ShardObject, shard_list_digest
from diloco_async.run import RunProcesses
from diloco_async.storage import keys
from diloco_async.storage.store import ObjectStore

from polling import await_until, wait_until

RUN = "fsdp-refused"


def put_shards(store: ObjectStore, lid: str, shapes: dict[str, tuple[int, ...]], value: float,
               round_n: int) -> list[ShardObject]:
    nonce = uuid.uuid4().hex[:12]
    out = []
    for rank in range(2):
        rows = local_rows(shapes, rank, 2)
        delta = {n: torch.full((b - a, *shapes[n][1:]), value) for n, (a, b) in rows.items()}
        data = shard_payload(delta, rows, "fp32", {"learner": lid, "rank": str(rank), "world": "2"})
        ref = store.put(keys.contribution_shard_key(RUN, 0, round_n, lid, nonce, rank, 2), data)
        out.append(ShardObject(key=ref.key, nbytes=ref.nbytes, sha256=ref.sha256))
    return out


async def contribute(url: str, store: ObjectStore, lid: str, spoil) -> dict:
    """Learner ``lid``, scripted: join, wait for an open round of fragment 0 (round 1 is due at
    step 4; a round whose contributions were all refused is abandoned and the next one opens),
    put its two shard objects, ``spoil(shards)`` (delete or change one, or nothing), announce them."""
    async with ShardedSyncClient([url], learner_token(TOKEN, RUN, lid)) as client:
        jr = await client.join({"learner_id": lid, "incarnation": 0})
        shapes = {s["name"]: tuple(s["shape"]) for s in jr["plan"]["fragments"][0]}

        async def round_open():
            hb = await client.heartbeat({"learner_id": lid, "step": 4})  # round 1 of fragment 0 is due at step 4
            return next((r for r in hb["open_rounds"] if r["fragment"] == 0), None)
        r = await await_until(round_open, 60, "a round of fragment 0 to open", 0.05)
        shards = put_shards(store, lid, shapes, 0.01, r["round_n"])
        spoil(shards)
        return await client.announce({
            "learner_id": lid, "fragment": 0, "round_n": r["round_n"], "base_version": r["version"], "c_steps": 4,
            "c_tokens": 128, "compute_s": 0.1, "key": shards[0].key, "nbytes": sum(s.nbytes for s in shards),
            "sha256": shard_list_digest(shards), "codec": "fp32", "update_id": uuid.uuid4().hex[:12],
            "shards": [s.model_dump() for s in shards]})


async def announce_anothers_shard(url: str, victim_key: str) -> None:
    """Learner ``thief`` announces a sharded contribution whose shard 1 is another learner's object."""
    async with ShardedSyncClient([url], learner_token(TOKEN, RUN, "thief")) as client:
        await client.join({"learner_id": "thief", "incarnation": 0})
        own = keys.contribution_shard_key(RUN, 0, 2, "thief", "beef", 0, 2)
        shards = [ShardObject(key=own, nbytes=1, sha256="0" * 64), ShardObject(key=victim_key, nbytes=1,
                                                                             sha256="0" * 64)]
        with pytest.raises(ProtocolError, match="not under its own contribution prefix"):
            await client.announce({
                "learner_id": "thief", "fragment": 0, "round_n": 2, "base_version": 1, "c_steps": 4,
                "c_tokens": 128, "compute_s": 0.1, "key": own, "nbytes": 2, "sha256": shard_list_digest(shards),
                "codec": "fp32", "update_id": "steal", "shards": [s.model_dump() for s in shards]})


def test_a_contribution_with_a_missing_or_corrupt_shard_is_refused_and_counted(tmp_path):
    store_url = f"file://{tmp_path}/store"
    store = ObjectStore(store_url)
    sync = SyncProcess(tmp_path, store_url, ["--run-id", RUN, "--set", "learners.count=3",
                                             "--set", "synchronizer.min_quorum=1"])

    def delete_one(shards):
        store.delete(shards[1].key)

    def corrupt_one(shards):
        path = os.path.join(str(tmp_path), "store", shards[0].key)
        with open(path, "r+b") as fh:
            fh.seek(shards[0].nbytes - 4)
            fh.write(b"\x7f\x7f\x7f\x7f")

    try:
        for lid, spoil in (("missing", delete_one), ("corrupt", corrupt_one)):
            ack = asyncio.run(contribute(sync.url, store, lid, spoil))
            assert ack["status"] == "accepted", ack  # admitted: the shards are read and checked next
        wait_until(lambda: sum(sync.status()["rejected_by_reason"].values()) >= 2, 60, "both refusals")
        st = sync.status()
        assert st["rejected_by_reason"] == {"missing_shard": 1, "shard_digest": 1}, st["rejected_by_reason"]
        assert st["versions"] == {"0": 0} and st["merges"] == 0  # nothing of them was merged
        ack = asyncio.run(contribute(sync.url, store, "good", lambda shards: None))
        assert ack["status"] == "accepted", ack
        wait_until(lambda: sync.status()["versions"] == {"0": 1}, 60, "the good sharded contribution's merge")
        assert sync.status()["rejected_by_reason"] == {"missing_shard": 1, "shard_digest": 1}
        # a shard object under another learner's prefix is refused at the edge (403), as a whole key is
        asyncio.run(announce_anothers_shard(sync.url, keys.contribution_shard_key(RUN, 0, 1, "good", "x", 1, 2)))
        assert sync.status()["rejected_by_reason"].get("forbidden") == 1
    finally:
        sync.stop()
    log = open(sync.log.name).read()
    assert "missing_shard" in log and "shard 1 of 2" in log and "learner=missing" in log


def fsdp_overrides(tmp_path) -> list[str]:
    return [f'run.workdir="{tmp_path}/runs"', "learners.batch_size=4", "learners.nproc_per_learner=2",
            'learners.parallelism="fsdp"', "learners.checkpoint_every_s=0", "learners.restart_delay_s=0.5",
            "learners.heartbeat_s=0.1", "learners.group_timeout_s=60", "synchronizer.num_fragments=2",
            "synchronizer.sync_every=8", "synchronizer.heartbeat_timeout_s=5.0", "learners.codec=\"bf16\""]


def test_two_fsdp_learners_train_end_to_end_and_a_killed_rank_restarts_its_group(tmp_path):
    recipe = tiny_recipe(tmp_path, learners=2, wall_s=900)
    cfg = load_config(recipe, fsdp_overrides(tmp_path))
    run = RunProcesses(cfg)
    try:
        url = run.start_synchronizer()
        handles = {i: run.start_learner(i) for i in range(2)}

        def versions() -> int:
            run.supervise()
            return min(fetch_status(url)["versions"].values())

        wait_until(lambda: versions() >= 3, 600, "three versions of every fragment from the two FSDP groups",
                   interval_s=0.5)
        st = fetch_status(url)
        assert sorted(st["learners"]) == ["learner-0", "learner-1"]  # one learner per group
        names = store_keys(cfg.run.store, run.run_id)
        for lid in ("learner-0", "learner-1"):
            mine = [k for k in names if f"/{lid}-" in k]
            assert any(".rank000of002." in k for k in mine) and any(".rank001of002." in k for k in mine), mine[:6]
            assert all(".rank00" in k for k in mine), [k for k in mine if ".rank00" not in k][:3]  # never whole
        ranks = wait_until(lambda: ranks_of(handles[1]) if len(ranks_of(handles[1])) == 2 else None, 30, "ranks")
        at_kill = versions()
        ranks[0].send_signal(signal.SIGKILL)  # rank 0 of learner-1: the rank that speaks for its group
        wait_until(lambda: run.supervise() or run.supervisor.restarts, 90, "the group to be restarted")
        assert run.supervisor.restarts[0].index == 1 and run.supervisor.restarts[0].incarnation == 1
        assert versions() >= at_kill

        def rejoined() -> bool:  # the new incarnation's group joined and trains (learner-0 merged on meanwhile)
            run.supervise()
            me = fetch_status(url)["learners"]["learner-1"]
            return me["incarnation"] == 1 and me["live"] and me["step"] > 0
        wait_until(rejoined, 300, "learner-1's restarted group to rejoin and train", interval_s=0.5)
        assert sorted(ranks_of(run.learners["learner-1"])) == [0, 1]
        at_rejoin = versions()
        wait_until(lambda: versions() >= at_rejoin + 2, 600, "merges to go on after the restart", interval_s=0.5)
        others = wait_until(lambda: ranks_of(handles[0]) if len(ranks_of(handles[0])) == 2 else None, 30, "ranks")
        others[1].send_signal(signal.SIGKILL)  # rank 1 of learner-0, separately: a rank that only trains

        def second_rejoined() -> bool:
            run.supervise()
            me = fetch_status(url)["learners"]["learner-0"]
            return me["incarnation"] == 1 and me["live"] and me["step"] > 0
        wait_until(second_rejoined, 300, "learner-0's restarted group to rejoin and train", interval_s=0.5)
        assert [(r.index, r.incarnation) for r in run.supervisor.restarts] == [(1, 1), (0, 1)]
        at_second = versions()
        wait_until(lambda: versions() >= at_second + 2, 600, "merges after the second restart", interval_s=0.5)
        points = call_blocking(url, run.token, "metrics", 0)["metrics"]
    finally:
        if run.sync is not None:
            run.sync.signal_group(signal.SIGTERM)
        run.finished_cleanly = False
        run.stop_all()
    for lid in ("learner-0", "learner-1"):  # the mean train loss of each heartbeat window, by the learner's step
        seen = [p["value"] for p in sorted((p for p in points if p["key"] == f"learner/{lid}/train_loss"),
                                           key=lambda p: p["timestamp_ms"]) if p["value"] is not None]
        assert len(seen) >= 6, (lid, seen)
        first, last = sum(seen[:3]) / 3, sum(seen[-3:]) / 3
        assert last < first - 0.1, (lid, seen)
    log_text = (run.workdir / "logs" / "learner-1.log").read_text()
    assert "rank 1" in log_text and "2 rank(s)" in log_text


def store_keys(store_url: str, run_id: str) -> list[str]:
    return ObjectStore(store_url).list(keys.contributions_prefix(run_id))


def test_a_killed_fsdp_group_restarts_from_its_dcp_inner_state(tmp_path):
    """One learner of 2 FSDP2 ranks saves its inner state every second (DCP, one writer per rank);
    SIGKILL of its rank 1 restarts the group, which restores that state (a step past 0) rather
    than starting from the published versions alone, and trains on."""
    recipe = tiny_recipe(tmp_path, learners=1, wall_s=900)
    cfg = load_config(recipe, [*fsdp_overrides(tmp_path), "learners.checkpoint_every_s=1.0"])
    run = RunProcesses(cfg)
    logs = run.workdir / "logs"

    def log_text() -> str:
        return "".join(p.read_text() for p in sorted(logs.glob("learner-0*.log")))
    try:
        url = run.start_synchronizer()
        handle = run.start_learner(0)
        wait_until(lambda: run.supervise() or "saved its sharded inner state as checkpoint" in log_text(), 600,
                   "a sharded inner state", interval_s=0.5)
        prefix = keys.learner_prefix(run.run_id, "learner-0")
        saved = ObjectStore(cfg.run.store).list(prefix)
        assert any(k.endswith("/dcp/__0_0.distcp") for k in saved) and any(k.endswith("/dcp/__1_0.distcp")
                                                                           for k in saved), saved
        ranks = wait_until(lambda: ranks_of(handle) if len(ranks_of(handle)) == 2 else None, 30, "ranks")
        ranks[1].send_signal(signal.SIGKILL)
        wait_until(lambda: run.supervise() or run.supervisor.restarts, 90, "the group to be restarted")

        def restored_and_trains() -> bool:
            run.supervise()
            me = fetch_status(url)["learners"].get("learner-0", {})
            return ("restored its sharded inner state from checkpoint" in log_text() and me.get("incarnation") == 1
                    and me.get("live") and me.get("step", 0) > 0)
        wait_until(restored_and_trains, 300, "the restarted group to restore its state and train", interval_s=0.5)
    finally:
        if run.sync is not None:
            run.sync.signal_group(signal.SIGTERM)
        run.finished_cleanly = False
        run.stop_all()
    text = log_text()
    restored_step = int(text.split("restored its sharded inner state from checkpoint ")[1].split("(step ")[1]
                        .split(",")[0])
    assert restored_step > 0  # continued from the saved state, not from step 0
    for rank in (0, 1):
        assert f"rank {rank} restored sharded inner state" in text
