"""The replay gate: the synchronizer actor as the scheduler of a replayed run (issue 44 item 2;
DESIGN §3.2).

With ``run.schedule = "replay"`` a learner sends each of its step boundaries as a heartbeat that
carries ``replay_announcements`` (the contributions it uploaded since its last boundary) and waits for
the answer. :class:`ReplayGate`, a component of the actor and run on its task only, holds those
requests and applies them one at a time in (virtual time, learner id) order
(:class:`~diloco_async.policy.replay.ReplayScheduler`); the virtual time of a learner's boundary is
its seeded step times' sum (:class:`~diloco_async.policy.replay.VirtualTimeline`), never what it
measured. Between two events the actor is *quiet*: every admitted contribution verified, no merge
running (a replay verifies and merges one at a time, in the order asked). Only then does the gate run
the clock-driven pass (liveness, budget, schedule, quorum and grace, drain, stop) at the virtual
time, answer the event just applied (the versions published up to its time and the rounds open to
the learner), move the virtual clock to the next grace or drain deadline or the next event, and apply
that. Ordinary heartbeats only say the learner is there; announcements outside a boundary are refused.

Wall time enters one place: a learner silent for ``replay.stall_timeout_s`` (it died) stops the run,
logged and counted (``replay_stalls``); it never changes what a replay computes.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from diloco_async.policy.replay import ReplayScheduler, VirtualClock, VirtualSteps, VirtualTimeline
from diloco_async.policy.rounds import RoundStage
from diloco_async.protocol.messages import AnnouncementAck, Heartbeat, HeartbeatResponse
from diloco_async.storage import keys
from diloco_async.sync.errors import Refused

if TYPE_CHECKING:
    from diloco_async.config.schema import Config
    from diloco_async.sync.learners import LearnerRegistry
    from diloco_async.sync.reporting import Reporter
    from diloco_async.sync.state import Merged, Request

__all__ = ["ReplayGate", "ReplayHooks", "quiet_rounds", "replay_deadlines", "REPLAY_ORDER"]

log = logging.getLogger("diloco.synchronizer")

REPLAY_ORDER = "replay_order"
"""Reason: a request that a replayed run cannot take in virtual-time order (an announcement outside a
step boundary, a boundary before the learner's last one)."""


@dataclasses.dataclass(frozen=True)
class ReplayHooks:
    """What the gate calls of the actor and its components (each runs on the actor's task).

    Args:
        register: the actor's heartbeat handler (applies a boundary's heartbeat: step, tokens, liveness).
        announce: the round table's announcement handler (admits one contribution; may raise).
        answer: the heartbeat reply for ``(learner_id, stop)`` now (open rounds, versions, run tokens).
        timed_parts: the actor's clock-driven pass, run at the virtual time given.
        deadlines: the virtual times at which the pass decides something without a learner event (the
            grace windows' and the drain's ends).
        quiet: every admitted contribution settled and no merge running.
        stopped: the learners are (being) told to stop.
        stop: begin the run's stop with a reason (a stall).
    """

    register: Callable[[Heartbeat], Any]
    announce: Callable[[Any], AnnouncementAck]
    answer: Callable[[str, bool], HeartbeatResponse]
    timed_parts: Callable[[float], None]
    deadlines: Callable[[], Iterable[float]]
    quiet: Callable[[], bool]
    stopped: Callable[[], bool]
    stop: Callable[[str], None]


def quiet_rounds(rounds: Iterable[Any]) -> bool:
    """No round of ``rounds`` (:class:`~diloco_async.sync.state.Round`) has a contribution being verified
    or a merge running."""
    return not any(r.state.pending_count or r.state.stage is RoundStage.MERGING for r in rounds)


def replay_deadlines(rounds: Iterable[Any], draining: bool, drain_until_s: float) -> list[float]:
    """The virtual times at which the clock-driven pass decides without a learner event: the grace windows'
    ends of ``rounds`` (:class:`~diloco_async.sync.state.Round`) and, while ``draining``, the drain's end."""
    ends = [r.state.deadline_s for r in rounds if r.state.deadline_s is not None]
    return [*ends, drain_until_s] if draining else ends


@dataclasses.dataclass
class _Applied:
    """An event applied and not answered yet: its requests (a resend joins them), step, time and acks."""

    requests: list[Request]
    step: int
    t_s: float
    acks: list[AnnouncementAck]


class ReplayGate:
    """Holds the learners' step boundaries and applies them in virtual-time order (see the module doc).

    Args:
        cfg: the run's config (``run.seed``, ``learners.count``, ``[replay]``, ``faults.speed_factors``,
            ``faults.step_jitter``).
        clock: the actor's clock, virtual: the gate is the one that moves it.
        ids: the run's id (contribution keys) and the synchronizer's epoch (in the answers to ordinary heartbeats).
        hooks: what the gate calls of the actor (:class:`ReplayHooks`).
        registry, report: the learner registry (incarnations, who was told to stop) and the reporter (counts).
        wall: a monotonic wall clock, for the stall timeout only.
    """

    def __init__(self, cfg: Config, clock: VirtualClock, ids: tuple[str, str], hooks: ReplayHooks, *,
                 registry: LearnerRegistry, report: Reporter, wall: Callable[[], float] = time.monotonic) -> None:
        self.cfg, self.clock, self.hooks = cfg, clock, hooks
        self.run_id, self.epoch = ids
        self.registry, self.report, self._wall = registry, report, wall
        self.scheduler: ReplayScheduler[list[Request]] = ReplayScheduler(cfg.learners.count)
        self.timelines: dict[str, VirtualTimeline] = {}
        self.applied: _Applied | None = None
        self.last_answer: dict[str, tuple[int, HeartbeatResponse]] = {}  # learner -> (step, reply): resends
        self.events = 0  #: step boundaries applied
        self._progress_wall_s = wall()

    # -- requests (from the actor's _on_request) ----------------------------------------------

    def joined(self, learner_id: str, start_step: int) -> None:
        """A learner joined at local step ``start_step``: its first boundary comes at that step's time. A
        rejoin (a restart) is let in, counted (``replay_rejoins``) and logged: restarts are not replayed yet."""
        if learner_id in self.timelines:
            self.report.count("replay_rejoins")
            self.last_answer.pop(learner_id, None)
            log.warning("replay: learner %s joined again (a restart): restarts are not replayed yet, so this run is "
                        "no longer a replay of its seed", learner_id)
        else:
            r, f = self.cfg.replay, self.cfg.faults
            steps = VirtualSteps(self.cfg.run.seed, learner_id, r.step_s, tuple(f.speed_factors), f.step_jitter,
                                 r.speed_spread)
            self.timelines[learner_id] = VirtualTimeline(steps, start_step, self.clock())
        self.scheduler.join(learner_id, self.timelines[learner_id].at(max(start_step, 0)))

    def request(self, msg: Request) -> None:
        """A learner's heartbeat or announcement in a replayed run; answered now or when released."""
        if msg.kind == "announce":
            msg.reply.set_exception(self._refusal("announce outside a step boundary: with run.schedule='replay' "
                                                  "contributions ride on the next boundary's heartbeat"))
            return
        hb: Heartbeat = msg.body
        info = self.registry.get(hb.learner_id)
        if info is None or info.incarnation != hb.incarnation or hb.learner_id not in self.timelines:
            msg.reply.set_result(HeartbeatResponse(open_rounds=[], versions=[], known=False, epoch=self.epoch))
            return
        if hb.replay_announcements is None:  # an ordinary heartbeat: the learner is there, nothing more
            msg.reply.set_result(HeartbeatResponse(open_rounds=[], versions=[], epoch=self.epoch))
            return
        self._hold(msg, hb)

    def _hold(self, msg: Request, hb: Heartbeat) -> None:
        lid = hb.learner_id
        last = self.last_answer.get(lid)
        if last is not None and last[0] == hb.step:  # the answer was lost: the same one again
            msg.reply.set_result(last[1])
            return
        if self.applied is not None and self.applied.requests[0].body.learner_id == lid:
            self.applied.requests.append(msg)
            return
        held = self.scheduler.held(lid)
        if held is not None:  # sent again while held: both are answered
            self.scheduler.replace(lid, [*held, msg])
            return
        try:
            self.scheduler.hold(lid, self.timelines[lid].at(hb.step), [msg])
        except ValueError as err:
            msg.reply.set_exception(self._refusal(str(err)))

    def _refusal(self, detail: str) -> Exception:
        self.report.reject(REPLAY_ORDER)
        log.warning("replay: request refused: %s", detail)
        return Refused(REPLAY_ORDER, detail)

    def merged(self, msg: Merged) -> Merged:
        """A merge's result as the replay sees it: merges take no virtual time (its wall seconds would
        move the adaptive grace window, paper Eq. 3)."""
        return dataclasses.replace(msg, seconds=0.0)

    # -- the pump (from the actor's clock-driven pass) ----------------------------------------

    def pump(self, _now: float) -> None:
        """Apply and answer what is safe now, in virtual-time order, until the actor must wait (a
        verification or a merge running, or a learner's next boundary not in yet)."""
        while self.hooks.quiet():
            now = self.clock()
            self.hooks.timed_parts(now)
            if not self.hooks.quiet():
                return
            if self.applied is not None:
                self._answer_applied()
                continue
            horizon = self.scheduler.horizon_s()
            due = min((d for d in self.hooks.deadlines() if now < d <= horizon), default=None)
            if due is not None:  # a grace window or the drain ends before any learner event can come
                self.clock.advance(due)
                continue
            rel = self.scheduler.next_release()
            if rel is None:
                self._check_stall()
                return
            self.clock.advance(max(now, rel.t_s))
            self._apply(rel.learner_id, rel.payload)

    def _apply(self, lid: str, requests: list[Request]) -> None:
        hb: Heartbeat = requests[-1].body
        timeline = self.timelines[lid]
        step_s = timeline.steps.duration_s(max(hb.step - 1, 0))  # the virtual time of its last step, not the real
        self.hooks.register(hb.model_copy(update={"step_time_s": step_s, "replay_announcements": None}))
        acks = [self._one_announcement(lid, ann) for ann in hb.replay_announcements or ()]
        self.scheduler.release(lid, timeline.at(hb.step + 1))
        self.applied = _Applied(requests, hb.step, self.clock(), acks)
        self.events += 1
        self._progress_wall_s = self._wall()

    def _one_announcement(self, lid: str, ann: Any) -> AnnouncementAck:
        foreign = [k for k in ann.object_keys() if keys.contribution_learner(self.run_id, k) != lid]
        if ann.learner_id != lid or foreign:  # the edge's check of POST /announce, for announcements it never saw
            self.report.reject("forbidden")
            log.warning("replay: learner=%s announced as %s, keys %s not under its own prefix: forbidden", lid,
                        ann.learner_id, [k[:200] for k in foreign])
            return AnnouncementAck(status="rejected", reason=f"forbidden: learner {lid} may announce only its own "
                                   "contributions under its own prefix")
        try:
            return self.hooks.announce(ann)
        except Exception as err:  # a refusal or a failure of one announcement: counted; the others go on
            reason = getattr(err, "reason", "handler_error")
            self.report.reject(reason)
            log.warning("replay: announcement of learner=%s fragment=%d round=%d failed: %s", lid, ann.fragment,
                        ann.round_n, err)
            return AnnouncementAck(status="rejected", reason=f"{reason}: {err}")

    def _answer_applied(self) -> None:
        applied, self.applied = self.applied, None
        assert applied is not None
        lid = applied.requests[0].body.learner_id
        stop = self.hooks.stopped()
        reply = self.hooks.answer(lid, stop).model_copy(update={"acks": applied.acks, "virtual_s": applied.t_s})
        info = self.registry.get(lid)
        if info is not None:
            info.stop_sent = info.stop_sent or stop
        if stop:
            self.scheduler.leave(lid)
        self.last_answer[lid] = (applied.step, reply)
        for msg in applied.requests:
            if not msg.reply.done():
                msg.reply.set_result(reply)

    def _check_stall(self) -> None:
        waiting = self.scheduler.waiting_for()
        silent_s = self._wall() - self._progress_wall_s
        if not waiting or silent_s < self.cfg.replay.stall_timeout_s or self.hooks.stopped():
            return
        self.report.count("replay_stalls")
        log.error("replay stalled: learners %s sent no step boundary for %.0f s of wall time (replay.stall_timeout_s="
                  "%.0f); they leave the replay and the run stops", waiting, silent_s, self.cfg.replay.stall_timeout_s)
        for lid in waiting:
            self.scheduler.leave(lid)
            if (info := self.registry.get(lid)) is not None:
                info.stop_sent = True  # nobody to tell: it left the replay (the stop does not wait for it)
        self._progress_wall_s = self._wall()
        self.hooks.stop(f"replay stalled: {', '.join(waiting)} silent for {silent_s:.0f}s")
