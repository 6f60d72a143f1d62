"""How the synchronizer actor stops (the lifecycle of :mod:`~diloco_async.sync.lifecycle`):
drain, tell the learners, final checkpoint, summary, finish.

:class:`StopSequence` is the actor's component that runs the stop, on the actor's task only.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from diloco_async.sync import reporting, summary
from diloco_async.sync.lifecycle import Phase
from diloco_async.sync.state import FinalWritten

if TYPE_CHECKING:
    from diloco_async.sync.checkpoints import Checkpointer
    from diloco_async.sync.context import ActorContext
    from diloco_async.sync.learners import LearnerRegistry
    from diloco_async.sync.lifecycle import Lifecycle
    from diloco_async.sync.reporting import Reporter
    from diloco_async.sync.rounds import RoundTable
    from diloco_async.sync.state import Broadcaster

__all__ = ["StopSequence", "FINISH_WAIT_S"]

log = logging.getLogger("diloco.synchronizer")

FINISH_WAIT_S = 15.0
"""After the final write, how long (s) to wait for every learner to hear "stop"."""


class StopSequence:
    """The stop of the run, on the actor's task: drain (a last round of every fragment, at most
    ``synchronizer.drain_s``), tell the learners, final checkpoint, summary, finish. Moves the
    :class:`~diloco_async.sync.lifecycle.Lifecycle` along it and owns the drain's deadline, the
    figures taken with the final checkpoint and the final summary.

    Args:
        ctx: the actor's context.
        life, table, registry, checkpoints, report, push: the actor's components the stop works with.
        summary: the run figures now (:func:`~diloco_async.sync.summary.summary`).
    """

    def __init__(self, ctx: ActorContext, life: Lifecycle, table: RoundTable, registry: LearnerRegistry,
                 checkpoints: Checkpointer, report: Reporter, push: Broadcaster,
                 summary: Callable[[], dict]) -> None:
        self.ctx, self.sc = ctx, ctx.sc
        self.life, self.table, self.registry, self.checkpoints = life, table, registry, checkpoints
        self.report, self.push, self.summary = report, push, summary
        self.drain_until_s = 0.0  # clock seconds
        self.final_figures: dict = {}  # the summary taken with the final checkpoint
        self.final_summary: dict | None = None  # with that checkpoint's outcome: what the run returns

    def check_drain(self, now: float) -> None:
        if self.life.phase is Phase.DRAINING and (not self.table.rounds or now >= self.drain_until_s):
            log.info("drain finished (%s)", "every last round closed" if not self.table.rounds else "timeout")
            self.begin(self.life.drain_reason)

    def begin(self, reason: str) -> None:
        """Stop: first drain (a last round of every fragment, at most ``drain_s``), then tell the
        learners to stop, close the open rounds, write the final checkpoint and the summary."""
        now = self.ctx.clock()
        if self.life.running and self.sc.drain_s > 0 and self.registry.live():
            self.life.move(Phase.DRAINING)
            self.life.drain_reason = reason
            self.drain_until_s = now + self.sc.drain_s
            opened = self.table.open_last_rounds(now, self.drain_until_s)
            log.info("stopping (%s): draining, last rounds %s, at most %.0fs", reason, ", ".join(opened) or "-",
                     self.sc.drain_s)
            return
        self.life.move(Phase.STOPPING)
        self.life.stop_reason, self.life.stop_since_s = reason, now
        log.info("stopping: %s", reason)
        self.push.publish({"type": "stop", "reason": reason})
        self.table.waiting.clear()

    def progress(self, now: float) -> None:
        """STOPPING -> final checkpoint -> summary written -> every learner told -> FINISHED."""
        book = self.checkpoints.book
        if not self.life.stopped or self.table.rounds or book.in_flight or book.gc_in_flight:
            return
        phase = self.life.phase
        if phase is Phase.STOPPING:
            self.life.move(Phase.FINAL_CHECKPOINT)
            self.table.abandon_parked("at_stop")  # waiting for a round that will not open (DESIGN §3.5)
            self.table.slices.sweep(self.table.rounds, True, self.registry)  # every lease ends (DESIGN §5.2)
            # the summary's figures are taken in the same step as the final checkpoint's, so a resume
            # continues every counter from the value the summary reports (learners still heard from
            # while the checkpoint is written count in neither)
            self.final_figures = self.summary()
            self.checkpoints.start()
        elif phase is Phase.FINAL_CHECKPOINT:
            self.life.move(Phase.WRITING_SUMMARY)
            self.final_summary = summary.with_checkpoint_outcome(self.final_figures, self.report.counters, book)
            self.registry.flush_provisioned()
            self.report.goodput_series(self.registry.ledgers, self.final_summary["uptime"],
                                       self.registry.silent_s(now), per_learner=True)
            self.report.seal()  # the spill files are complete: nothing more goes to the store
            self.ctx.spawn(self._write_final())
        elif phase is Phase.FINISHING and (self.registry.everyone_told_to_stop()
                                           or now - (self.life.stop_since_s or now) > FINISH_WAIT_S):
            self.life.move(Phase.FINISHED)

    def final_written(self) -> None:
        """The final metrics, summary and logs are in the store (or failed to get there): FINISHING."""
        self.life.move(Phase.FINISHING)

    async def _write_final(self) -> None:
        ok = True
        try:
            await asyncio.to_thread(reporting.write_final, self.ctx.store, self.ctx.owner_id, self.ctx.epoch,
                                    self.final_summary, self.report)
        except Exception as err:
            log.error("could not write the final summary: %s", err)
            ok = False
        await self.ctx.inbox.put(FinalWritten(ok))
