"""Checkpoints of the running synchronizer: when one is due, writing it in a thread, answering
``POST /checkpoint``, and collecting garbage behind it (DESIGN §5).

:class:`~diloco_async.sync.state.CheckpointBook` is the bookkeeping (plain values, the actor's clock);
:class:`Checkpointing` is the part of the actor that starts checkpoints and takes their outcome.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from diloco_async.config.schema import SynchronizerConfig
from diloco_async.runtime.heap import release_free_memory
from diloco_async.sync.persistence import checkpoint_payload
from diloco_async.sync.state import CheckpointBook, CheckpointDone
from storage.checkpoint import write_checkpoint
from storage.gc import collect_garbage
from storage.store import ObjectStore

if TYPE_CHECKING:
    from diloco_async.policy.catchup import ReadLeases
    from diloco_async.sync.context import ActorContext
    from diloco_async.sync.fragment_book import FragmentBook
    from diloco_async.sync.learners import LearnerRegistry
    from diloco_async.sync.reporting import Reporter

__all__ = ["Checkpointing"]

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


class Checkpointing:
    """Starts checkpoints and takes their outcome; mixed into the actor, which owns these."""

    sc: SynchronizerConfig
    ctx: ActorContext
    inbox: asyncio.Queue
    report: Reporter
    checkpoints: CheckpointBook
    read_leases: ReadLeases
    registry: LearnerRegistry
    book: FragmentBook

    def _spawn(self, coro) -> None:  # provided by the actor
        raise NotImplementedError

    def _start_checkpoint(self) -> None:
        seq = self.checkpoints.begin(self.ctx.clock(), self.report.counters["merges"])
        tensors, manifest = checkpoint_payload(self)

        async def write() -> None:
            try:
                await asyncio.to_thread(_write_and_trim, self.ctx.store, self.ctx.run_id, seq, tensors, manifest)
                await self.inbox.put(CheckpointDone(seq, True, "written"))
            except Exception as err:
                await self.inbox.put(CheckpointDone(seq, False, f"{type(err).__name__}: {err}"))

        self._spawn(write())

    def _on_checkpoint_done(self, msg: CheckpointDone) -> None:
        for fut in self.checkpoints.done(msg):
            if not fut.done():
                fut.set_result({"seq": msg.seq, "ok": msg.ok, "reason": msg.reason})
        if not msg.ok:
            self.report.counters["checkpoints_failed"] += 1
            log.error("checkpoint %d failed: %s", msg.seq, msg.reason)
            return
        self.report.counters["checkpoints"] += 1
        log.info("checkpoint %d written", msg.seq)
        self.report.metric("sync/checkpoints", self.report.counters["checkpoints"])
        if self.sc.keep_checkpoints and not self.checkpoints.gc_in_flight:
            self.checkpoints.gc_in_flight = True
            # the versions live learners may still be reading, taken now: a learner told of a version
            # later reads one at least as new as those its leases name (policy/catchup.py)
            keep = self.read_leases.keep(self.registry.live_ids(), self.book.versions())
            self._spawn(self._collect_garbage(keep))

    async def _collect_garbage(self, keep_versions: dict[int, set[int]]) -> None:
        """Delete contributions, versions and checkpoints that no resume can need (storage/gc.py),
        but not ``keep_versions`` (fragment -> versions: the learners' read leases)."""
        try:
            done = await asyncio.to_thread(collect_garbage, self.ctx.store, self.ctx.run_id,
                                             keep_checkpoints=self.sc.keep_checkpoints,
                                             orphan_age_s=self.sc.orphan_age_s, keep_versions=keep_versions)
            self.report.counters["gc_deleted_objects"] += done.objects
            self.report.counters["gc_deleted_bytes"] += done.nbytes
            self.report.counters["gc_kept_for_reads"] += done.kept_for_reads
            self.report.metric("storage/gc_deleted_bytes", self.report.counters["gc_deleted_bytes"])
        except Exception as err:  # collection is an optimisation: count, log, go on
            self.report.counters["gc_failures"] += 1
            log.warning("garbage collection failed: %s: %s", type(err).__name__, err)
        finally:
            self.checkpoints.gc_in_flight = False
