"""The budget stop of a run with several synchronizer shards: one decision, every shard stops
(issue 40 item 3; DESIGN §2.2).

Every shard hears every learner's heartbeats, so each computes the same tokens processed and
global step, up to one heartbeat of timing, and wall time from its own start. The first shard
whose budget check fires publishes the *run's stop* in the store, ``{run_id}/stops/{budget}.json``
(exclusive create; ``budget`` a digest of the ``[budget]`` section, so a resume that extends the
budget is not stopped by the old marker): ``{"shard", "reason", "tokens_processed", "global_step",
"budget"}``. :class:`RunStop` (one task per shard process) publishes it as soon as its shard is
stopping on a budget, and otherwise polls for it: a running shard that finds it stops with the
deciding shard's reason (``... (the run's stop, decided by synchronizer shard i)``). So the run
stops once, for one reason, whichever shard saw the budget first, and a shard whose learners
stopped talking to it (they stop on the first shard's ``stop``) does not wait for a budget it can
no longer see. Signal stops are each shard's own (the launcher signals every shard).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import time
from typing import TYPE_CHECKING

from diloco_async.config.schema import BudgetConfig
from diloco_async.sync.actor import Stopped
from diloco_async.sync.lifecycle import Phase

if TYPE_CHECKING:
    from diloco_async.sync.actor import Synchronizer

__all__ = ["RunStop", "stop_marker_key", "is_budget_reason", "POLL_S"]

log = logging.getLogger("diloco.synchronizer")

POLL_S = 0.25
"""How often (s) a shard looks for the run's stop, and for its own budget stop to publish."""
RUN_STOP_SUFFIX = "the run's stop, decided by synchronizer shard"


def stop_marker_key(run_id: str, budget: BudgetConfig) -> str:
    """``{run_id}/stops/{digest of the budget}.json``."""
    tag = hashlib.sha256(json.dumps(budget.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()[:12]
    return f"{run_id}/stops/{tag}.json"


def is_budget_reason(reason: str | None) -> bool:
    """Is ``reason`` a budget stop this shard decided (not a signal, nor the run's stop it followed)?"""
    return bool(reason) and "budget reached" in str(reason) and RUN_STOP_SUFFIX not in str(reason)


class RunStop:
    """The run's stop for one shard (see the module doc); reads the actor's lifecycle and asks it to
    stop through its inbox (``sync.request("stop", ...)``), as a signal does.

    Args:
        sync: this shard's actor. poll_s: see :data:`POLL_S`.
    """

    def __init__(self, sync: Synchronizer, poll_s: float = POLL_S) -> None:
        self.sync, self.poll_s = sync, poll_s
        self.ctx = sync.ctx
        self.key = stop_marker_key(self.ctx.run_id, self.ctx.cfg.budget)
        self.published = False
        self.followed = False

    def own_budget_reason(self) -> str | None:
        """The budget reason this shard is stopping (or draining) for, if it decided one."""
        life = self.sync.life
        reason = life.drain_reason if life.phase is Phase.DRAINING else life.stop_reason if life.stopped else None
        return reason if is_budget_reason(reason) and not self.followed else None

    def publish(self, reason: str) -> None:
        """Publish the run's stop (blocking; once; a marker another shard wrote first is kept)."""
        if self.published:
            return
        reg = self.sync.registry
        doc = {"shard": self.ctx.shard, "reason": reason, "tokens_processed": reg.tokens_processed(),
               "global_step": self.sync.table.g, "budget": self.ctx.cfg.budget.model_dump(mode="json"),
               "written_unix_s": time.time()}
        try:
            self.ctx.store.put_json(self.key, doc)
            log.info("shard %d published the run's stop (%s) at %s", self.ctx.shard, reason, self.key)
        except FileExistsError:
            log.info("shard %d stops on its budget (%s); the run's stop was published already", self.ctx.shard,
                     reason)
        self.published = True

    def marker(self) -> dict | None:
        """The run's stop published by another shard, or None (blocking)."""
        try:
            doc = self.ctx.store.get_json(self.key)
        except FileNotFoundError:
            return None
        return doc if int(doc.get("shard", -1)) != self.ctx.shard else None

    async def run(self) -> None:
        """Until the actor stops: publish this shard's budget stop, or follow the run's."""
        while not self.sync.stopped:
            await asyncio.sleep(self.poll_s)
            try:
                await self.step()
            except Exception as err:  # the store may fail now and then: counted, logged; the next poll tries again
                counters = self.sync.report.counters
                counters["run_stop_errors"] += 1
                if counters["run_stop_errors"] & (counters["run_stop_errors"] - 1) == 0:
                    log.warning("run stop of shard %d: %s: %s (%d so far)", self.ctx.shard, type(err).__name__, err,
                                counters["run_stop_errors"])

    async def finish(self) -> None:
        """After the actor stopped: publish its budget stop if it stopped between two polls."""
        reason = self.own_budget_reason()
        if reason is not None:
            await asyncio.to_thread(self.publish, reason)

    async def step(self) -> None:
        """One poll (see :meth:`run`)."""
        reason = self.own_budget_reason()
        if reason is not None:
            await asyncio.to_thread(self.publish, reason)
            return
        if self.followed or not self.sync.life.running:
            return
        doc = await asyncio.to_thread(self.marker)
        if doc is not None and self.sync.life.running:
            self.followed = True
            log.info("shard %d follows the run's stop: %s", self.ctx.shard, doc["reason"])
            with contextlib.suppress(Stopped):  # the actor stopped meanwhile: nothing left to stop
                await self.sync.request("stop", f"{doc['reason']} ({RUN_STOP_SUFFIX} {doc['shard']})")
