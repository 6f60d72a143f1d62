"""Leases through a synchronizer actor in this process (DESIGN §5.2): a lease request reaches the
slice desk, an announcement naming another learner's slice is refused and counted, one claiming too
many tokens is admitted clamped, a lapsed learner's leases come back, and the summary, the status
and the checkpoint carry the ledger. (Real processes: tests/system/test_slice_leases.py.)"""

from __future__ import annotations

import asyncio
import uuid

import pytest

from diloco_async.config.schema import load_config
from diloco_async.protocol.messages import Announcement, JoinRequest, LeaseRequest
from diloco_async.storage import keys
from diloco_async.storage.store import ObjectStore
from diloco_async.sync import Synchronizer, persistence
from diloco_async.sync import slices as sync_slices
from diloco_async.sync.state import Request


class Clock:
    t = 1000.0

    def __call__(self) -> float:
        return self.t


def _ask(sync: Synchronizer, kind: str, body) -> object:
    fut = asyncio.get_running_loop().create_future()
    sync._on_request(Request(kind, body, fut))  # the actor's routing of one message
    return fut.result()


def test_leases_through_the_actor(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = load_config(None, ["model.n_layer=1", "model.d_model=16", "model.n_head=2", "model.context=8",
                             "learners.batch_size=4", "synchronizer.num_fragments=2", "budget.wall_s=600",
                             "data.slices=true", "data.slice_tokens=64", "learners.checkpoint_every_s=0",
                             "synchronizer.heartbeat_timeout_s=5"])
    monkeypatch.setattr(sync_slices, "training_tokens", lambda _cfg: 10 * 64 + 1)  # the corpus is not under test
    clock = Clock()

    async def main() -> None:
        sync = Synchronizer(cfg, ObjectStore(f"memory://slices-{uuid.uuid4().hex}"), "run1", clock=clock)
        try:
            sync.publish_initial()
            for lid in ("a", "b"):
                sync._on_join(JoinRequest(learner_id=lid, uptime_s=1.0))
            got_a = _ask(sync, "lease", LeaseRequest(learner_id="a", want=2))
            got_b = _ask(sync, "lease", LeaseRequest(learner_id="b", want=1))
            assert [s[0] for s in got_a.slices] == [0, 1] and [s[0] for s in got_b.slices] == [2]
            assert got_a.slices[1] == (1, 64, 64)
            sync.table.open_round(sync.book[0], 1, clock())

            def ann(lid: str, slices: list[int], c_tokens: int) -> Announcement:
                return Announcement(learner_id=lid, fragment=0, round_n=1, base_version=0, c_steps=2,
                                    c_tokens=c_tokens, compute_s=0.1,
                                    key=f"{keys.contribution_round_prefix('run1', 0, 1)}/{lid}/x", nbytes=10,
                                    sha256="0" * 64, codec="fp32", update_id=f"u-{lid}", slices=slices)
            refused = _ask(sync, "announce", ann("a", [0, 2], 64))
            assert refused.status == "rejected" and refused.reason == "slices_not_held: slices [2] are not leased to a"
            assert sync.rejected_by_reason["slices_not_held"] == 1
            admitted = _ask(sync, "announce", ann("b", [2], 10_000))
            assert admitted.status == "accepted"
            assert sync.table.rounds[(0, 1)].contributions["b"].ann.c_tokens == 64  # clamped to its one slice
            assert sync.summary()["clamped_by_reason"]["c_tokens_over_slices"] == 1
            clock.t += 60.0  # both silent past heartbeat_timeout_s: lost
            sync._liveness(clock())
            figures = sync.summary()
            # a's leases came back; b's slice waits for its contribution still in round (0, 1)
            assert figures["slices_requeued"] == 2 and figures["slices_leased_now"] == 1
            assert sync.status()["slices_requeued"] == 2
            _tensors, manifest = persistence.checkpoint_payload(sync.ctx, book=sync.book, table=sync.table,
                                                                registry=sync.registry, report=sync.report,
                                                                slices=sync.slices)
            assert manifest["slices"]["n_slices"] == 10 and "2" in manifest["slices"]["leases"]
        finally:
            for task in list(sync._tasks):
                task.cancel()
            await asyncio.gather(*sync._tasks, return_exceptions=True)
            sync.close()

    asyncio.run(main())


def test_without_leases_a_checkpoint_and_a_summary_are_as_before() -> None:
    cfg = load_config(None, ["model.n_layer=1", "model.d_model=16", "model.n_head=2", "model.context=8",
                             "synchronizer.num_fragments=2", "budget.wall_s=600"])
    sync = Synchronizer(cfg, ObjectStore(f"memory://plain-{uuid.uuid4().hex}"), "run1")
    try:
        sync.publish_initial()
        _tensors, manifest = persistence.checkpoint_payload(sync.ctx, book=sync.book, table=sync.table,
                                                            registry=sync.registry, report=sync.report,
                                                            slices=sync.slices)
        assert "slices" not in manifest and "tokens_trained" not in sync.summary()
    finally:
        sync.close()
