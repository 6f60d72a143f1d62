"""How the synchronizer actor stops (the lifecycle of :mod:`~diloco_async.sync.lifecycle`):
drain, tell the learners, final checkpoint, summary, finish.

:class:`Stopping` is the part of :class:`~diloco_async.sync.actor.Synchronizer` that runs the
stop; it works on the actor's state and runs on the actor's task only (split out of the actor,
issue 17).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from diloco_async.sync import reporting, summary
from diloco_async.sync.lifecycle import Phase
from diloco_async.sync.state import FinalWritten

__all__ = ["Stopping", "FINISH_WAIT_S"]

log = logging.getLogger("diloco.synchronizer")

FINISH_WAIT_S = 15.0
"""After the final write, how long (s) to wait for every learner to hear "stop"."""


class Stopping:
    """The stop of the run; mixed into the actor, which owns the state it uses."""

    # the actor's state (see Synchronizer)
    life: Any
    sc: Any
    ctx: Any
    table: Any
    registry: Any
    push: Any
    checkpoints: Any
    report: Any
    inbox: asyncio.Queue
    finished: asyncio.Event
    final_summary: dict | None
    _final_figures: dict
    _drain_until_s: float

    def _check_drain(self, now: float) -> None:
        if self.life.phase is Phase.DRAINING and (not self.table.rounds or now >= self._drain_until_s):
            log.info("drain finished (%s)", "every last round closed" if not self.table.rounds else "timeout")
            self._begin_stop(self.life.drain_reason)

    def _begin_stop(self, reason: str) -> None:
        """Stop: first drain (a last round of every fragment, at most ``drain_s``), then tell the
        learners to stop, close the open rounds, write the final checkpoint and the summary."""
        now = self.ctx.clock()
        if self.life.running and self.sc.drain_s > 0 and self.registry.live():
            self.life.move(Phase.DRAINING)
            self.life.drain_reason = reason
            self._drain_until_s = now + self.sc.drain_s
            opened = self.table.open_last_rounds(now)
            log.info("stopping (%s): draining, last rounds %s, at most %.0fs", reason, ", ".join(opened) or "-",
                     self.sc.drain_s)
            return
        self.life.move(Phase.STOPPING)
        self.life.stop_reason, self.life.stop_since_s = reason, now
        log.info("stopping: %s", reason)
        self.push.publish({"type": "stop", "reason": reason})
        self.table.waiting.clear()

    def _progress_stop(self, now: float) -> None:
        """STOPPING -> final checkpoint -> summary written -> every learner told -> FINISHED."""
        book = self.checkpoints.book
        if not self.life.stopped or self.table.rounds or book.in_flight or book.gc_in_flight:
            return
        phase = self.life.phase
        if phase is Phase.STOPPING:
            self.life.move(Phase.FINAL_CHECKPOINT)
            # the summary's figures are taken in the same step as the final checkpoint's, so a resume
            # continues every counter from the value the summary reports (learners still heard from
            # while the checkpoint is written count in neither)
            self._final_figures = self.summary()
            self.checkpoints.start()
        elif phase is Phase.FINAL_CHECKPOINT:
            self.life.move(Phase.WRITING_SUMMARY)
            self.final_summary = summary.with_checkpoint_outcome(self._final_figures, self)
            self.report.goodput_series(self.ledgers, self.final_summary["uptime"],
                                       self.registry.silent_s(now), per_learner=True)
            self.report.seal()  # the spill files are complete: nothing more goes to the store
            self._spawn(self._write_final())
        elif phase is Phase.FINISHING and (self.registry.everyone_told_to_stop()
                                           or now - (self.life.stop_since_s or now) > FINISH_WAIT_S):
            self.life.move(Phase.FINISHED)
            self.finished.set()

    async def _write_final(self) -> None:
        ok = True
        try:
            await asyncio.to_thread(reporting.write_final, self.ctx.store, self.ctx.run_id, self.ctx.epoch,
                                    self.final_summary, self.report)
        except Exception as err:
            log.error("could not write the final summary: %s", err)
            ok = False
        await self.inbox.put(FinalWritten(ok))
