"""Checkpoints of the running synchronizer: when one is due, writing it in a thread, answering
``POST /checkpoint``, and collecting garbage behind it (DESIGN §5).

:class:`~diloco_async.sync.state.CheckpointBook` is the bookkeeping (plain values, the actor's clock);
:class:`Checkpointer` is the actor's component that owns it, starts checkpoints and takes their outcome.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from diloco_async.runtime.heap import release_free_memory
from diloco_async.storage.checkpoint import write_checkpoint
from diloco_async.storage.gc import GcReport, ShardScope, collect_garbage
from diloco_async.storage.run_checkpoints import named_checkpoint, write_run_manifest
from diloco_async.storage.store import ObjectStore
from diloco_async.sync.state import CheckpointBook, CheckpointDone

if TYPE_CHECKING:
    import torch

    from diloco_async.sync.context import ActorContext
    from diloco_async.sync.reporting import Reporter

__all__ = ["Checkpointer"]

log = logging.getLogger("diloco.synchronizer")

#: upload parts of a checkpoint in flight at once: the writer holds this many parts plus one
#: (16 MiB each by default) on top of the outer state. The store's default (4 in flight) held
#: 80 MiB and, with the heap's retention across the pool's threads, up to 3x the model at 25M
#: parameters in the synchronizer's peaks (issue 17 item 3); a checkpoint runs in the background,
#: so its upload speed matters less than the process's size.
CHECKPOINT_PARTS_IN_FLIGHT = 1


def _write_and_trim(store: ObjectStore, run_id: str, seq: int, tensors: dict, manifest: dict) -> None:
    """Write checkpoint ``seq`` (parts bounded by :data:`CHECKPOINT_PARTS_IN_FLIGHT`; each tensor
    let go once written, so one that a merge replaced meanwhile is freed then), then hand the
    freed upload buffers back to the system."""
    try:
        write_checkpoint(store, run_id, seq, tensors, manifest, max_concurrency=CHECKPOINT_PARTS_IN_FLIGHT,
                         consume=True)
    finally:
        release_free_memory()


def _collect(ctx: ActorContext, keep_versions: dict[int, set[int]]) -> GcReport | None:
    """One garbage collection (blocking): behind the newest verified checkpoint, or with several
    shards behind the checkpoint of this shard that the newest run checkpoint names, in the run's
    versions and contributions of this shard's fragments (diloco_async/storage/gc.py); None while no run
    checkpoint names one (nothing to collect behind)."""
    sc = ctx.sc
    scope = None
    if sc.shards > 1:
        behind = named_checkpoint(ctx.store, ctx.run_id, ctx.shard)
        if behind is None:
            return None
        scope = ShardScope(ctx.run_id, behind)
    return collect_garbage(ctx.store, ctx.owner_id, keep_checkpoints=sc.keep_checkpoints,
                           orphan_age_s=sc.orphan_age_s, keep_versions=keep_versions, shard=scope)


class Checkpointer:
    """The run's checkpoints as the actor takes them: owns the :class:`CheckpointBook` (sequence
    numbers, what is in flight, who waits, when the periodic one is due, where this process
    resumed from), starts a checkpoint of ``payload()`` in a thread and takes its outcome.

    Args:
        ctx: the actor's context (store, run id, clock, inbox, spawn).
        report: the reporter (counts ``checkpoints``, ``checkpoints_failed``, ``gc_*``).
        payload: the (tensors, manifest) of a checkpoint of the state now
            (:func:`~diloco_async.sync.persistence.checkpoint_payload`), on the actor's task.
        gc_keep: fragment -> the versions a garbage collection starting now must leave (the live
            learners' read leases, :class:`~diloco_async.policy.catchup.ReadLeases`), on the actor's task.
    """

    def __init__(self, ctx: ActorContext, report: Reporter, payload: Callable[[], tuple[dict[str, torch.Tensor], dict]],
                 gc_keep: Callable[[], dict[int, set[int]]]) -> None:
        self.ctx, self.sc = ctx, ctx.sc
        self.report = report
        self.payload, self.gc_keep = payload, gc_keep
        self.book = CheckpointBook(ctx.started_s)

    def request(self, reply: asyncio.Future) -> None:
        """``POST /checkpoint``: ``reply`` is answered when the next checkpoint is written (one is
        started unless one is in flight)."""
        self.book.waiters.append(reply)
        if not self.book.in_flight:
            self.start()

    def start_if_due(self, now: float) -> None:
        """The periodic checkpoint, every ``synchronizer.checkpoint_every_s`` with a merge since the last."""
        if self.book.due(now, self.report.counters["merges"], self.sc.checkpoint_every_s):
            self.start()

    def start(self) -> None:
        seq = self.book.begin(self.ctx.clock(), self.report.counters["merges"])
        tensors, manifest = self.payload()

        async def write() -> None:
            try:
                await asyncio.to_thread(_write_and_trim, self.ctx.store, self.ctx.owner_id, seq, tensors, manifest)
                if self.sc.shards > 1:  # publish, then mark: the run checkpoint naming it comes last
                    await self._write_run_manifest(seq)
                await self.ctx.inbox.put(CheckpointDone(seq, True, "written"))
            except Exception as err:
                await self.ctx.inbox.put(CheckpointDone(seq, False, f"{type(err).__name__}: {err}"))

        self.ctx.spawn(write())

    async def _write_run_manifest(self, seq: int) -> None:
        """With several shards, the run checkpoint naming this shard's checkpoint ``seq`` and each
        other shard's newest (diloco_async/storage/run_checkpoints.py). A failure is counted
        (``run_checkpoints_failed``) and logged; the shard's own checkpoint stands (a resume of this
        shard alone reads it; the next checkpoint writes a run checkpoint again)."""
        try:
            run_seq = await asyncio.to_thread(write_run_manifest, self.ctx.store, self.ctx.run_id, self.sc.shards)
        except Exception as err:
            self.report.counters["run_checkpoints_failed"] += 1
            log.warning("run checkpoint naming shard %d's checkpoint %d failed: %s: %s", self.ctx.shard, seq,
                        type(err).__name__, err)
            return
        if run_seq is None:
            log.info("checkpoint %d of shard %d: no run checkpoint yet (another shard has none)", seq, self.ctx.shard)
        else:
            self.report.counters["run_checkpoints"] += 1
            log.info("run checkpoint %d names shard %d's checkpoint %d", run_seq, self.ctx.shard, seq)

    def on_done(self, msg: CheckpointDone) -> None:
        for fut in self.book.done(msg):
            if not fut.done():
                fut.set_result({"seq": msg.seq, "ok": msg.ok, "reason": msg.reason})
        if not msg.ok:
            self.report.counters["checkpoints_failed"] += 1
            log.error("checkpoint %d failed: %s", msg.seq, msg.reason)
            return
        self.report.counters["checkpoints"] += 1
        log.info("checkpoint %d written", msg.seq)
        self.report.metric("sync/checkpoints", self.report.counters["checkpoints"])
        if self.sc.keep_checkpoints and not self.book.gc_in_flight:
            self.book.gc_in_flight = True
            # the versions live learners may still be reading, taken now: a learner told of a version
            # later reads one at least as new as those its leases name (policy/catchup.py)
            self.ctx.spawn(self._collect_garbage(self.gc_keep()))

    async def _collect_garbage(self, keep_versions: dict[int, set[int]]) -> None:
        """Delete contributions, versions and checkpoints that no resume can need (diloco_async/storage/gc.py),
        but not ``keep_versions`` (fragment -> versions: the learners' read leases)."""
        try:
            done = await asyncio.to_thread(_collect, self.ctx, keep_versions)
            if done is None:
                return
            self.report.counters["gc_deleted_objects"] += done.objects
            self.report.counters["gc_deleted_bytes"] += done.nbytes
            self.report.counters["gc_kept_for_reads"] += done.kept_for_reads
            self.report.metric("storage/gc_deleted_bytes", self.report.counters["gc_deleted_bytes"])
        except Exception as err:  # collection is an optimisation: count, log, go on
            self.report.counters["gc_failures"] += 1
            log.warning("garbage collection failed: %s: %s", type(err).__name__, err)
        finally:
            self.book.gc_in_flight = False
