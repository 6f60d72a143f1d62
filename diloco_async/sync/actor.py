"""The synchronizer actor: one asyncio task owns all global state (DESIGN §2-§4).

HTTP handlers (:mod:`diloco_async.sync.http`) only validate and enqueue typed messages; the actor handles
each message without awaiting, so every state change is atomic. Blocking work (fetch and verify, merge and
publish, checkpoints) runs in ``asyncio.to_thread`` and posts its result back to the inbox. After each batch
of at most :data:`BATCH_MAX` queued messages, and at least every 50 ms, :meth:`Synchronizer._advance` moves
the clock-driven part: liveness, leases, budgets, due rounds, quorum and grace, checkpoints and the
:class:`~diloco_async.sync.lifecycle.Phase`; the parts that look at every live learner run once the inbox
is empty or every :data:`~diloco_async.sync.sweeps.SWEEP_S` (issue 17; DESIGN §2.1). With
``run.schedule = "replay"`` the clock is virtual and :class:`~diloco_async.sync.replay_gate.ReplayGate`
runs that part between the learners' step boundaries, in virtual-time order (DESIGN §3.2).

The state lives in components, each the one owner of its part (docs/architecture.md): fragment book, round
table, learner registry, read leases, slice desk, reporter, checkpointer, fence, lifecycle, stop sequence;
what they share and none changes is the :class:`~diloco_async.sync.context.ActorContext`."""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from diloco_async.config.schema import Config, config_hash
from diloco_async.metrics.goodput import LearnerLedger
from diloco_async.policy.catchup import ReadLeases
from diloco_async.policy.pace import PaceLimits
from diloco_async.policy.replay import VirtualClock
from diloco_async.policy.rounds import budget_stop_reason
from diloco_async.policy.shards import check_shard, fragments_of
from diloco_async.protocol.messages import Heartbeat, HeartbeatResponse, JoinRequest, JoinResponse
from diloco_async.runtime.heap import release_free_memory
from diloco_async.storage.checkpoint import Checkpoint
from diloco_async.storage.store import ObjectStore
from diloco_async.sync import persistence, summary
from diloco_async.sync.checkpoints import Checkpointer
from diloco_async.sync.context import ActorContext
from diloco_async.sync.errors import HandlerError, Refused, Stopped
from diloco_async.sync.fragment_book import FragmentBook
from diloco_async.sync.learners import LearnerRegistry
from diloco_async.sync.lease import Fence, Lease
from diloco_async.sync.lifecycle import Lifecycle, Phase
from diloco_async.sync.logs import JsonLinesLog, RateLimitedLog
from diloco_async.sync.replay_gate import ReplayGate, ReplayHooks, quiet_rounds, replay_deadlines
from diloco_async.sync.reporting import MERGES_TAIL, METRICS_TAIL, Reporter
from diloco_async.sync.rounds import SETTLED_CAP, RoundTable
from diloco_async.sync.slices import SliceDesk
from diloco_async.sync.snapshot import StatusBoard
from diloco_async.sync.state import (
    Broadcaster,
    CheckpointDone,
    FinalWritten,
    Merged,
    Request,
    Verified,
    initial_state,
)
from diloco_async.sync.stopping import StopSequence
from diloco_async.sync.sweeps import SWEEP_MIN_S, SweepTimer
from diloco_async.sync.version_infos import HeartbeatReplies, VersionInfos

__all__ = ["Synchronizer", "HandlerError", "Refused", "Stopped", "LEARNER_CAP", "BATCH_MAX"]

log = logging.getLogger("diloco.synchronizer")

BATCH_MAX = 32
"""Messages handled at most per pass of the actor: those already queued, one after the other, then the
clock-driven part once for all (issue 17: a pass per message cost more than a heartbeat at 1,000 learners)."""
LEARNER_CAP = "learner_cap"
"""Reason: a join of a new learner id beyond ``synchronizer.max_learners``."""


def _learner_of(body: Any) -> str:
    return str(getattr(body, "learner_id", "-"))


@dataclass(frozen=True)
class MemoryTails:
    """Records kept in memory, the rest spilled to disk: metric points, merge records, settled announcements."""

    metrics: int = METRICS_TAIL
    merges: int = MERGES_TAIL
    settled: int = SETTLED_CAP


class Synchronizer:
    """The synchronizer of one run: the actor over its components (see the module doc).

    Args:
        cfg, run_id: the validated config; this run's id.
        store: the object store; the run lives under ``{store}/{run_id}/``.
        clock: monotonic clock in seconds (injectable for tests).
        spill_dir: folder of the metric and merge spill files (default: the temporary folder).
        tails: the records kept in memory (:class:`MemoryTails`).
        lease: this process's lease on the run (:mod:`~diloco_async.sync.lease`), checked before every write and
            delete; a lost one ends :meth:`run` with :class:`~diloco_async.sync.lease.LeaseLost`. None: no fencing.
        shard: this synchronizer's shard (DESIGN §2.2): its book holds :func:`~diloco_async.policy.shards.fragments_of`
            it; its lease, checkpoints and epochs lie under :attr:`~diloco_async.sync.context.ActorContext.owner_id`.

    Raises:
        ValueError: ``shard`` outside ``[0, synchronizer.shards)``.
    """

    def __init__(self, cfg: Config, store: ObjectStore, run_id: str,
                 clock: Callable[[], float] = time.monotonic, *, spill_dir: str | os.PathLike | None = None,
                 tails: MemoryTails = MemoryTails(), lease: Lease | None = None, shard: int = 0) -> None:
        check_shard(shard, cfg.synchronizer.shards)
        clock = VirtualClock() if cfg.run.schedule == "replay" else clock  # replay: the gate moves it (DESIGN §3.2)
        self.fence = Fence(store, lease)
        self.inbox: asyncio.Queue = asyncio.Queue()
        self._tasks: set[asyncio.Task] = set()
        self.ctx = ActorContext(cfg, run_id, epoch=uuid.uuid4().hex[:12], store=self.fence.store,
                                lease_epoch=self.fence.lease_epoch, clock=clock, started_s=clock(),
                                inbox=self.inbox, spawn=self._spawn, shard=shard)
        self.stopped = False  # set when run() returns: request() then raises Stopped at once
        self.push = Broadcaster()
        self.registry = LearnerRegistry(PaceLimits.from_config(cfg),  # calibrated per learner by the registry
                                        cfg.guard.max_step_time_s, cfg.guard.step_time_multiple)
        self.read_leases = ReadLeases(cfg.synchronizer.read_lease_versions)  # versions gc keeps for the learners' reads
        self.life = Lifecycle()
        self.report = Reporter(self.ctx.started_s, run_id, spill_dir, tails.metrics, tails.merges, clock=clock)
        self.board = StatusBoard()  # what GET /status and /health serve, published by the actor
        self.refusals = RateLimitedLog(log)
        params, plan = initial_state(cfg)  # the trainable parameters only (with LoRA: the adapter)
        self.book = FragmentBook.build(plan, params, cfg.synchronizer, self.ctx.store,
                                       fragments_of(shard, cfg.synchronizer.shards, plan.num_fragments))
        del params  # each fragment's optimizer holds its own copy of Θ^0
        release_free_memory()  # Θ^0 and the model it came from are freed: their heap pages go back (issue 17)
        self.table = RoundTable(self.ctx, self.book, self.registry, self.report, self.push, self.life, tails.settled)
        self.slices = self.table.slices = SliceDesk.build(cfg, clock, self.report)  # the slice ledger's one owner
        self.checkpoints = Checkpointer(self.ctx, self.report, partial(
            persistence.checkpoint_payload, self.ctx, book=self.book, table=self.table, registry=self.registry,
            report=self.report, slices=self.slices), gc_keep=self._versions_being_read)
        self.stop_sequence = StopSequence(self.ctx, self.life, self.table, self.registry, self.checkpoints,
                                          self.report, self.push, self.summary)
        self._sweeps = SweepTimer()
        self._replies = HeartbeatReplies(VersionInfos(), self.registry.tokens_processed, cfg.budget.tokens)
        self.part_times: dict[str, float] = {}  #: longest run (s) of each part (a message by kind) since read
        self.gate = None if not isinstance(clock, VirtualClock) else ReplayGate(
            cfg, clock, (run_id, self.ctx.epoch), ReplayHooks(
                self._on_heartbeat, self.table.on_announce, self._reply, self._replay_pass, lambda: replay_deadlines(
                    self.table.rounds.values(), self.life.phase is Phase.DRAINING, self.stop_sequence.drain_until_s),
                lambda: quiet_rounds(self.table.rounds.values()), lambda: self.life.stopped, self.stop_sequence.begin),
            registry=self.registry, report=self.report)

    # -- read-only views (tests and tools read these; the actor writes them) ------------------

    @property
    def run_id(self) -> str:
        return self.ctx.run_id

    @property
    def epoch(self) -> str:
        """This process's epoch (changes at every (re)start: learners reset their round state)."""
        return self.ctx.epoch

    @property
    def rejected_by_reason(self) -> Counter[str]:
        return self.report.rejected_by_reason

    @property
    def metrics(self) -> JsonLinesLog:
        return self.report.metrics

    @property
    def ledgers(self) -> dict[str, LearnerLedger]:
        self.registry.flush_provisioned()
        return self.registry.ledgers

    @property
    def stop_reason(self) -> str | None:
        return self.life.stop_reason

    @property
    def final_summary(self) -> dict | None:
        """The summary the run ends with (None until the final checkpoint's outcome is known)."""
        return self.stop_sequence.final_summary

    # -- start-up, reports --------------------------------------------------------------------

    def publish_initial(self) -> None:
        """Write plan.json, config.json and version 0 of every fragment (blocking; call once)."""
        persistence.publish_initial(self.ctx, self.book)

    def restore(self, ckpt: Checkpoint) -> None:
        """Continue from a verified checkpoint of this run; see :func:`persistence.restore`."""
        persistence.restore(ckpt, self.ctx, book=self.book, table=self.table, registry=self.registry,
                            report=self.report, checkpoints=self.checkpoints.book, slices=self.slices)

    def summary(self) -> dict:
        """Run figures: goodput (DESIGN §7), merges, rejections by reason, versions, bytes."""
        return summary.summary(self.ctx, book=self.book, table=self.table, registry=self.registry, report=self.report,
                               checkpoints=self.checkpoints.book, life=self.life, slices=self.slices)

    def status(self) -> dict:
        """The summary, open rounds and lifecycle phase (``GET /status``)."""
        return summary.status(self.summary(), self.ctx, table=self.table, registry=self.registry,
                              report=self.report, life=self.life, finished=self.final_summary is not None)

    # -- the actor loop -----------------------------------------------------------------------

    async def run(self) -> dict:
        """Run until the budget is spent and the final checkpoint is written; returns the summary.
        Raises LeaseLost: another synchronizer took the run's lease; nothing was published since."""
        try:
            while not self.life.ended:
                # asyncio.timeout, not wait_for: on Python 3.11 a cancel that lands as wait_for's inner
                # get() finishes is swallowed (CPython gh-86296), and a cancelled actor then loops for good
                try:
                    async with asyncio.timeout(SWEEP_MIN_S if self._sweeps.pending else 0.05):
                        msg = await self.inbox.get()
                except TimeoutError:
                    msg = None
                if msg is not None:
                    self._guarded(self._dispatch, msg)
                    for _ in range(BATCH_MAX - 1):  # those queued meanwhile, before one clock-driven pass
                        if self.inbox.empty():
                            break
                        self._guarded(self._dispatch, self.inbox.get_nowait())
                self._advance()
                self.board.tick(self.life.phase.value)  # O(1): /health; /status is built when asked
                if (self.board.wanted() and self.board.due()) or self.life.ended:
                    self._guarded(self._publish_status, None)
        finally:
            self._refuse_what_is_left()
            self.board.close()
            for t in list(self._tasks):
                t.cancel()
            if self._tasks:
                await asyncio.gather(*self._tasks, return_exceptions=True)
            self.close()
        if self.life.phase is Phase.FENCED:
            self.fence.raise_lost()
        assert self.stop_sequence.final_summary is not None
        return self.stop_sequence.final_summary

    def close(self) -> None:
        """Close and delete the spill files (the in-memory tails stay readable)."""
        self.report.close()

    def _refuse_what_is_left(self) -> None:
        """From now on every request is answered :class:`Stopped`, those already queued included: a
        handler waiting on a reply that never comes held the HTTP server's shutdown for its 60 s."""
        self.stopped = True
        while not self.inbox.empty():
            msg = self.inbox.get_nowait()
            if isinstance(msg, Request) and not msg.reply.done():
                msg.reply.set_exception(Stopped(msg.kind))

    async def request(self, kind: str, body: Any) -> Any:
        """Enqueue a request for the actor and wait for its reply (used by the HTTP handlers).

        Raises:
            Stopped: the actor has stopped (checked before the request is queued; one queued when
                it stops gets the same answer).
            Refused, HandlerError: the actor refused the request, or raised handling it.
        """
        if self.stopped:
            raise Stopped(kind)
        fut = asyncio.get_running_loop().create_future()
        await self.inbox.put(Request(kind, body, fut))
        return await fut

    def _publish_status(self, _arg: Any) -> None:
        t0 = time.perf_counter()
        self.board.publish(self.status(), time.perf_counter() - t0)

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _dispatch(self, msg: Any) -> None:
        if isinstance(msg, Request):
            self._on_request(msg)
        elif isinstance(msg, Verified):
            self.table.on_verified(msg)
        elif isinstance(msg, Merged):
            self.table.on_merged(msg if self.gate is None else self.gate.merged(msg))
        elif isinstance(msg, CheckpointDone):
            self.checkpoints.on_done(msg)
        elif isinstance(msg, FinalWritten):
            self.stop_sequence.final_written()

    def _on_request(self, msg: Request) -> None:
        if msg.reply.cancelled():
            return
        if msg.kind == "checkpoint":  # answered when the checkpoint is written
            self.checkpoints.request(msg.reply)
            return
        if msg.kind == "metrics":
            self.report.answer_metrics(int(msg.body), msg.reply, self._spawn)
            return
        if self.gate is not None and msg.kind in ("heartbeat", "announce"):  # replay: in virtual-time order
            self.gate.request(msg)
            return
        handler = {"join": self._on_join, "heartbeat": self._on_heartbeat, "announce": self.table.on_announce,
                   "status": lambda _body: self.status(), "stop": self._on_stop,
                   "lease": lambda body: self.slices.on_lease(body, self.registry, self.life.running)}[msg.kind]
        try:
            msg.reply.set_result(handler(msg.body))
        except Refused as err:
            self.rejected_by_reason[err.reason] += 1
            self.refusals.note(err.reason, f"{msg.kind} of learner={_learner_of(msg.body)} refused: {err.detail} "
                                           f"({self.rejected_by_reason[err.reason]} so far)")
            msg.reply.set_exception(err)
        except Exception as err:  # an error while handling one message must not kill the actor
            self.rejected_by_reason["handler_error"] += 1
            self.report.counters["requests_rejected"] += 1
            log.exception("%s of learner=%s failed: handler_error", msg.kind, _learner_of(msg.body))
            msg.reply.set_exception(HandlerError(f"{msg.kind} failed: {type(err).__name__}"))

    def _guarded(self, part: Callable[[Any], None], arg: Any) -> None:
        """Run one part of the actor's work; an exception is counted (``actor_errors``) and logged
        (the first time, then at powers of two), and the actor goes on."""
        t0 = time.perf_counter()
        try:
            part(arg)
        except Exception as err:
            if isinstance(arg, Request) and not arg.reply.done():  # its sender must not wait forever
                arg.reply.set_exception(HandlerError(f"{arg.kind} failed: {type(err).__name__}"))
            self.report.counters["actor_errors"] += 1
            n = self.report.counters["actor_errors"]
            if n & (n - 1) == 0:  # a part that fails at every pass logs log2(n) times, not n
                self.report.metric("sync/actor_errors", n)
                log.exception("actor error in %s (%d so far); the run goes on", getattr(part, "__name__", "?"), n)
        finally:  # the slowest run of each part, for the loop watch
            name = (getattr(arg, "kind", None) or type(arg).__name__) if part == self._dispatch else part.__name__
            self.part_times[name] = max(time.perf_counter() - t0, self.part_times.get(name, 0.0))

    def count_bad_request(self, reason: str = "invalid") -> None:
        """Called by the HTTP layer for a request that does not validate (it logs it); ``reason``
        comes from a bounded set (``json_too_deep``, ``field:step``, ...)."""
        self.rejected_by_reason["bad_request"] += 1
        self.report.bad_requests[reason] += 1

    # -- learner messages ---------------------------------------------------------------------

    def _on_join(self, req: JoinRequest) -> JoinResponse:
        cap = self.ctx.sc.max_learners
        if req.learner_id not in self.registry and len(self.registry.learners) >= cap:
            raise Refused(LEARNER_CAP, f"the run already has {len(self.registry.learners)} learners "
                                       f"(synchronizer.max_learners={cap})")
        start_step = self.registry.join(req, self.ctx.clock(), self.table.g)
        if self.gate is not None:
            self.gate.joined(req.learner_id, start_step)
        self.read_leases.joined(req.learner_id, self.book.versions())  # told below
        log.info("learner %s joined (incarnation %d)", req.learner_id, req.incarnation)
        self.report.metric(f"learner/{req.learner_id}/alive", 1.0)
        cfg = self.ctx.cfg
        return JoinResponse(run_id=self.ctx.run_id, config=cfg.public_dict(), config_hash=config_hash(cfg),
                            plan=self.book.plan.to_json(), schema_hash=self.book.plan.schema_hash,
                            versions=self._replies.versions(self.book), epoch=self.ctx.epoch, start_step=start_step,
                            shard=self.ctx.shard, shards=self.ctx.sc.shards, run_tokens=self._replies.run_tokens())

    def _on_heartbeat(self, hb: Heartbeat) -> HeartbeatResponse:
        lid = hb.learner_id
        info = self.registry.get(lid)
        stop = self.life.stopped
        if info is None or info.incarnation != hb.incarnation:
            return HeartbeatResponse(open_rounds=[], versions=[], stop=stop, known=False, epoch=self.ctx.epoch)
        was_lost, bytes_down, clamped = self.registry.heartbeat(hb, self.ctx.clock())
        self.read_leases.heartbeat(lid, hb.known_versions, hb.fetching_versions)
        for reason in clamped:
            if self.report.clamp(reason):
                log.warning("heartbeat of learner=%s clamped (%s): step %d, tokens_total %d grow faster than the "
                            "learner's pace bound allows; %d so far", lid, reason, hb.step, hb.tokens_total,
                            self.report.clamped_by_reason[reason])
        if was_lost:
            log.info("learner %s is back", lid)
            self.report.metric(f"learner/{lid}/alive", 1.0)
        self.report.add_bytes_out(bytes_down)
        for key, value in (("train_loss", hb.train_loss), ("tokens_per_s", hb.tokens_per_s),
                           ("step_time_s", hb.step_time_s), ("link_s_per_fragment", hb.link_s_per_fragment)):
            if value is not None:
                self.report.metric(f"learner/{lid}/{key}", value, hb.step)
        info.stop_sent = info.stop_sent or stop
        return self._reply(lid, stop)

    def _reply(self, learner_id: str, stop: bool) -> HeartbeatResponse:
        opens = () if stop else self.table.opens_for(learner_id)
        return self._replies(self.book, opens, stop, self.ctx.epoch)  # shared by learners in the same state

    def _on_stop(self, reason: str) -> bool:
        if not self.life.stopped:  # a second stop while draining stops at once
            self.stop_sequence.begin(str(reason))
        return True

    # -- the clock-driven part ----------------------------------------------------------------

    def _advance(self) -> None:
        """One pass of the clock-driven part; each part is guarded on its own (:meth:`_guarded`)."""
        now = self.ctx.clock()
        self._guarded(self._check_lease, now)
        if self.life.phase is Phase.FENCED:
            return
        if self.gate is not None:  # replay: the gate runs the pass at virtual times (_replay_pass)
            self._guarded(self.gate.pump, now)
            return
        swept = (self.table.schedule, self.table.progress_rounds) if self._sweeps.due(now, self.inbox.empty()) else ()
        stop = self.stop_sequence
        for part in (self._liveness, self._check_budget, *swept, stop.check_drain, self._checkpoint_if_due,
                     self._goodput_series, stop.progress):
            self._guarded(part, now)

    def _replay_pass(self, now: float) -> None:
        """The clock-driven pass of a replay, at the virtual time ``now`` (no periodic checkpoints)."""
        stop = self.stop_sequence
        for part in (self._liveness, self._check_budget, self.table.schedule, self.table.progress_rounds,
                     stop.check_drain, self._goodput_series, stop.progress):
            self._guarded(part, now)

    def _versions_being_read(self) -> dict[int, set[int]]:
        """Fragment -> the versions live learners may still be reading (their read leases)."""
        return self.read_leases.keep(self.registry.live_ids(), self.book.versions())

    def _check_lease(self, now: float) -> None:
        self.fence.check(self.life, self.report.counters)  # a lost lease: FENCED, and the loop ends

    def _goodput_series(self, now: float) -> None:
        """A point of the goodput time series every ``tracking.goodput_series_s`` while merges go on."""
        if self.report.goodput_point_due(now, self.ctx.cfg.tracking.goodput_series_s):
            max_gap_s = summary.uptime_max_gap_s(self.registry, self.ctx.sc.sync_every, len(self.book))
            uptime = self.report.merge_gaps.uptime(now, max_gap_s)
            self.report.goodput_series(self.ledgers, uptime, self.registry.silent_s(now))

    def _liveness(self, now: float) -> None:
        for info in self.registry.mark_lost(now, self.ctx.sc.heartbeat_timeout_s):
            log.warning("learner %s lost (silent for %.1fs)", info.learner_id, now - info.last_seen_s)
            self.report.metric(f"learner/{info.learner_id}/alive", 0.0)
            self.report.metric("sync/live_learners", len(self.registry.live()))
        self.slices.sweep(self.table.rounds, self.life.stopped, self.registry, self.table.late.waiting_contributions())
        self.registry.mark_provisioned(now)  # O(1): the ledgers' readers flush it

    def _check_budget(self, now: float) -> None:
        if self.life.running:
            reason = budget_stop_reason(self.ctx.cfg.budget, tokens=self.registry.tokens_processed(), g=self.table.g,
                                        elapsed_s=now - self.ctx.started_s)
            if reason is not None:
                self.stop_sequence.begin(reason)

    def _checkpoint_if_due(self, now: float) -> None:
        if self.life.running:
            self.checkpoints.start_if_due(now)
