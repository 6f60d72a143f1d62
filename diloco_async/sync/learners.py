"""The synchronizer's learner registry: who joined, who is live, their steps and goodput ledgers.

Owned by the actor. Times are seconds on the actor's (injectable) clock.

Work per message is O(1) or O(log N) in the number of learners (issue 17): liveness is a heap of
last-heard times (:meth:`LearnerRegistry.mark_lost` looks only at the learners whose timeout may
have passed), the tokens processed are a running total, the live learners a cached tuple rebuilt
only when one comes or goes, and the provisioned seconds of the ledgers are stamped with a time
(:meth:`LearnerRegistry.mark_provisioned`) and written into every ledger only when the ledgers are
read (:meth:`LearnerRegistry.flush_provisioned`).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from diloco_async.metrics.goodput import LearnerLedger
from diloco_async.policy.pace import PaceBound, PaceBurst, PaceLimits, PaceMeter, bounded_advance, clamp_step_times
from diloco_async.protocol.messages import Heartbeat, JoinRequest
from diloco_async.sync.undeliverable import Undeliverable
from diloco_async.sync.wire_bytes import WireBytes

__all__ = ["LearnerInfo", "LearnerRegistry"]

log = logging.getLogger("diloco.synchronizer")


@dataclass
class LearnerInfo:
    """One learner slot as the synchronizer sees it (the current incarnation)."""

    learner_id: str
    incarnation: int
    started_s: float  # when the slot was first provisioned
    last_seen_s: float
    live: bool = True
    step: int = 0
    # from when the advance beyond ``step`` is counted: the receipt of the message before the
    # heartbeat that reported ``step`` (that heartbeat was composed after it was answered)
    anchor_s: float = 0.0
    meter: PaceMeter = field(default_factory=PaceMeter)  # its pace, measured from its heartbeats
    burst: PaceBurst = field(default_factory=PaceBurst)  # what is left of its burst (a token bucket)
    tokens_seen: int = 0  # tokens_total reported by the current incarnation
    bytes_down_seen: int = 0
    blocked_seen_s: float = 0.0  # blocked_s reported by the current incarnation
    link_s_per_fragment: float | None = None  # network seconds of one fragment's sync, as it reports
    link_budget_s: float | None = None  # seconds of its H/P inner steps
    stop_sent: bool = False
    network_mode: str = "direct"  # how it reaches this synchronizer (network.mode), as its join came
    reported: bool = False  # sent a heartbeat to this synchronizer process (a restored step may be stale)
    watched: bool = field(default=False, repr=False, compare=False)  # has an entry in the liveness heap

    def to_json(self, now_s: float) -> dict:
        """What a checkpoint written at ``now_s`` keeps of this slot."""
        return {"incarnation": self.incarnation, "step": self.step, "tokens_seen": self.tokens_seen,
                "bytes_down_seen": self.bytes_down_seen, "anchor_age_s": max(0.0, now_s - self.anchor_s),
                "pace": self.meter.to_json(), "pace_burst": self.burst.to_json()}


class LearnerRegistry:
    """Learners by id, with their goodput ledgers (DESIGN §7).

    Args:
        pace: the pace limits a heartbeat's step and tokens_total are held to (None: unbounded),
            each learner's calibrated by its :class:`~diloco_async.policy.pace.PaceMeter`.
        max_step_time_s, step_time_multiple: the clamp of the measured step times of the grace
            window (:func:`~diloco_async.policy.pace.clamp_step_times`).
    """

    def __init__(self, pace: PaceLimits | None = None, max_step_time_s: float = math.inf,
                 step_time_multiple: float = math.inf) -> None:
        self.learners: dict[str, LearnerInfo] = {}
        self.ledgers: dict[str, LearnerLedger] = {}
        self.pace = pace
        self.max_step_time_s = max_step_time_s
        self.step_time_multiple = step_time_multiple
        # (last_seen_s when pushed, tie-breaker, info): one entry per live learner; the key is at most
        # the learner's last_seen_s (it only grows), so the heap's top is the first that may be lost
        self._heard: list[tuple[float, int, LearnerInfo]] = []
        self._ties = itertools.count()
        self._live: tuple[LearnerInfo, ...] | None = None  # None: rebuild at the next live()
        self._live_ids: tuple[str, ...] | None = None  # of the cached live tuple (None: rebuild)
        self._all_reported: bool | None = None  # every live learner reported (None: look again)
        self._tokens_processed = 0  # the sum of the ledgers' tokens_processed
        self._provisioned_at_s: float | None = None  # the time the provisioned seconds run to
        self._provisioned_flushed = True
        self.wire = WireBytes()  # bytes on the wire by direction, learner and fragment
        self.undeliverable = Undeliverable()  # contributions learners gave up announcing (shards)

    def __contains__(self, learner_id: object) -> bool:
        return learner_id in self.learners

    def get(self, learner_id: str) -> LearnerInfo | None:
        return self.learners.get(learner_id)

    def live(self) -> tuple[LearnerInfo, ...]:
        """The live learners in join order (a cached tuple, rebuilt after a learner came or went)."""
        if self._live is None:
            self._live = tuple(i for i in self.learners.values() if i.live)
            self._live_ids = self._all_reported = None
        return self._live

    def live_ids(self) -> tuple[str, ...]:
        """The ids of :meth:`live` (cached with it)."""
        live = self.live()
        if self._live_ids is None:
            self._live_ids = tuple(i.learner_id for i in live)
        return self._live_ids

    def all_live_reported(self) -> bool:
        """Has every live learner sent a heartbeat to this process (:attr:`LearnerInfo.reported`)?
        Cached: looked at again only after a learner came, went or reported for the first time."""
        live = self.live()
        if self._all_reported is None:
            self._all_reported = all(i.reported for i in live)
        return self._all_reported

    def _watch(self, info: LearnerInfo) -> None:
        """Put a live learner into the liveness heap (once)."""
        if not info.watched:
            info.watched = True
            heapq.heappush(self._heard, (info.last_seen_s, next(self._ties), info))

    def slowest_step_s(self) -> float | None:
        """Step time (s) of the slowest live learner, as the synchronizer measured it from its heartbeats
        (:meth:`~diloco_async.policy.pace.PaceMeter.step_time_s`; a self-reported step time plays no part),
        or None until more than half of the live learners were measured (while one learner alone, or a
        minority, is measured, its figures would set the lower median themselves: the initial grace
        holds instead); each clamped by :func:`~diloco_async.policy.pace.clamp_step_times` to a
        multiple of the live learners' lower median. O(N)."""
        live = self.live()
        times = [t for i in live if (t := i.meter.step_time_s()) is not None]
        if 2 * len(times) <= len(live):
            return None
        clamped = clamp_step_times(times, max_s=self.max_step_time_s, multiple=self.step_time_multiple)
        return max(clamped) if clamped else None

    def pace_bound(self, learner_id: str) -> PaceBound | None:
        """The pace bound of a known learner, calibrated by what was measured of it (None: unbounded)."""
        info = self.learners.get(learner_id)
        if self.pace is None or info is None:
            return None
        return self.pace.bound(info.meter, info.burst)

    def join(self, req: JoinRequest, now_s: float, global_step: int | None) -> int:
        """Register a (re)joining learner; returns the local step it continues from.

        A new incarnation continues at the global step at least: behind it, it would hold the
        schedule back once the learners ahead are gone. Its slot keeps its first start time.

        Badput (DESIGN §7): a new slot's process start to now is ``starting``; a new incarnation's
        is ``restarting``, and the time from the old one's last message to the new one's start
        ``down``; the same incarnation joining again after it fell silent was ``stalled``.
        """
        info = self.learners.get(req.learner_id)
        start_step = info.step if info is not None else 0
        if info is None or req.incarnation != info.incarnation:
            start_step = max(start_step, global_step or 0)
            started = now_s - req.uptime_s
            led = self.ledgers.setdefault(req.learner_id, LearnerLedger())
            if info is not None:
                started = info.started_s  # the slot was provisioned since its first start
                log.info("learner %s rejoined (incarnation %d -> %d) at step %d", req.learner_id, info.incarnation,
                         req.incarnation, start_step)
                process_start_s = max(now_s - req.uptime_s, info.last_seen_s)
                led.add_badput("down", process_start_s - info.last_seen_s)
                led.add_badput("restarting", now_s - process_start_s)
            else:
                led.add_badput("starting", req.uptime_s)
            # a rejoin refills no burst and keeps the slot's measured pace (the restart's gap is not
            # measured): a new incarnation does not go back to the initial bound
            info = self.learners[req.learner_id] = LearnerInfo(
                req.learner_id, req.incarnation, started, now_s, step=start_step, anchor_s=now_s,
                burst=info.burst.rejoined() if info is not None else PaceBurst(),
                meter=info.meter.rejoined() if info is not None else PaceMeter())
        else:
            if not info.live:
                self.ledgers[req.learner_id].add_badput("stalled", now_s - info.last_seen_s)
            info.last_seen_s = now_s
            info.live = True
        info.network_mode = req.network_mode
        self._live = None
        self._watch(info)
        return start_step

    def heartbeat(self, hb: Heartbeat, now_s: float) -> tuple[bool, int, list[str]]:
        """Record a heartbeat of a known learner: (was it lost before, new bytes it downloaded,
        what was clamped: ``implausible_steps`` and/or ``implausible_tokens``).

        The step and tokens_total may grow only as fast as the learner's pace bound allows since the
        message before the last heartbeat (``anchor_s``: the learner composes each heartbeat after
        the previous answer, so a heartbeat late in transit does not make an honest learner look
        fast), plus what is left of its burst (:class:`~diloco_async.policy.pace.PaceBurst`, which
        no message renews); beyond that they are clamped (the rest is credited by later heartbeats). A step
        not above the last one (an older heartbeat delivered late, or the same one resent)
        changes neither. The step credited, and the seconds since the previous heartbeat, feed the
        learner's :class:`~diloco_async.policy.pace.PaceMeter` (which calibrates its bound). The
        reported blocked seconds count as ``blocked`` badput, at most the seconds since the last
        heartbeat; the silence of a learner that was lost and is back as the same incarnation
        counts as ``stalled``.
        """
        info = self.learners[hb.learner_id]
        was_lost = not info.live
        if not info.reported:
            info.reported, self._all_reported = True, None
        dt_s = now_s - info.last_seen_s
        self._badput_since_last(info, hb, dt_s, was_lost)
        clamped = []
        step, over = hb.step, False
        paced_s = now_s - info.anchor_s
        bound = self.pace_bound(hb.learner_id)
        if bound is not None and hb.step > info.step:
            step, over = bounded_advance(info.step, hb.step, bound.steps_within(paced_s))
            info.burst.steps = bound.left_after(paced_s, step - info.step, dt_s)  # the next window: from last_seen_s
        if over:
            clamped.append("implausible_steps")
        advance = 0
        if hb.step > info.step:  # a copy of the last heartbeat (resent over HTTP) moves nothing
            advance = step - info.step
            info.step, info.anchor_s = step, info.last_seen_s
        info.meter.record(advance, dt_s, self.pace.credit_rate(info.meter) if self.pace is not None else math.inf)
        info.live, info.last_seen_s = True, now_s
        if was_lost:
            self._live = None
        self._watch(info)
        if hb.tokens_total >= info.tokens_seen:
            tokens, over = hb.tokens_total, False
            if bound is not None:
                tokens, over = bounded_advance(info.tokens_seen, hb.tokens_total, bound.tokens_within(paced_s))
                info.burst.tokens = bound.left_after(paced_s, tokens - info.tokens_seen, now_s - info.anchor_s,
                                                     tokens=True)
            if over:
                clamped.append("implausible_tokens")
            self.ledgers[hb.learner_id].tokens_processed += tokens - info.tokens_seen
            self._tokens_processed += tokens - info.tokens_seen
            info.tokens_seen = tokens
        info.link_s_per_fragment, info.link_budget_s = hb.link_s_per_fragment, hb.link_budget_s
        self.wire.heartbeat(hb.learner_id, hb.incarnation, hb.bytes_down_by_fragment)
        self.undeliverable.heartbeat(hb.learner_id, hb.incarnation, hb.undeliverable_by_fragment)
        bytes_down = 0
        if hb.bytes_down >= info.bytes_down_seen:
            bytes_down = hb.bytes_down - info.bytes_down_seen
            info.bytes_down_seen = hb.bytes_down
        return was_lost, bytes_down, clamped

    def _badput_since_last(self, info: LearnerInfo, hb: Heartbeat, dt_s: float, was_lost: bool) -> None:
        """The badput a heartbeat reports or reveals: ``stalled`` for the silence of a learner that
        was lost, ``blocked`` for the reported blocked seconds (at most ``dt_s``)."""
        led = self.ledgers[hb.learner_id]
        if was_lost:
            led.add_badput("stalled", dt_s)
        if hb.blocked_s >= info.blocked_seen_s:
            led.add_badput("blocked", min(hb.blocked_s - info.blocked_seen_s, max(0.0, dt_s)))
            info.blocked_seen_s = hb.blocked_s

    def mark_lost(self, now_s: float, timeout_s: float) -> list[LearnerInfo]:
        """Mark learners silent for more than ``timeout_s`` as not live; returns them (longest
        silent first). O(1) when nobody's timeout passed, else O(log N) per learner looked at."""
        lost = []
        heard = self._heard
        while heard and now_s - heard[0][0] > timeout_s:
            _, _, info = heapq.heappop(heard)
            info.watched = False
            if not info.live or self.learners.get(info.learner_id) is not info:
                continue  # lost already, or replaced by a new incarnation (which has its own entry)
            if now_s - info.last_seen_s > timeout_s:
                info.live = False
                info.meter.silence()
                lost.append(info)
            else:  # heard from since it was pushed: back in, at its newest time
                self._watch(info)
        if lost:
            self._live = None
        return lost

    def silent_s(self, now_s: float) -> dict[str, float]:
        """Seconds each learner that is not live has been silent (not yet judged down or stalled)."""
        return {lid: max(0.0, now_s - i.last_seen_s) for lid, i in self.learners.items() if not i.live}

    def update_provisioned(self, now_s: float) -> None:
        """Provisioned seconds run from a slot's first start to ``now_s``, down time included
        (written into every ledger at once; O(N))."""
        self.mark_provisioned(now_s)
        self.flush_provisioned()

    def mark_provisioned(self, now_s: float) -> None:
        """The provisioned seconds run to ``now_s`` from now on (O(1); written into the ledgers by
        :meth:`flush_provisioned`, which whoever reads the ledgers calls first)."""
        self._provisioned_at_s, self._provisioned_flushed = now_s, False

    def flush_provisioned(self) -> None:
        """Write the provisioned seconds as of the last :meth:`mark_provisioned` into every ledger
        (O(N) when something was marked since the last flush, else O(1))."""
        if self._provisioned_flushed or self._provisioned_at_s is None:
            return
        now_s = self._provisioned_at_s
        for lid, info in self.learners.items():
            self.ledgers[lid].provisioned_s = now_s - info.started_s
        self._provisioned_flushed = True

    def tokens_processed(self) -> int:
        """Tokens processed by every learner (the sum of the ledgers'; a running total, O(1))."""
        return self._tokens_processed

    def everyone_told_to_stop(self) -> bool:
        return all(i.stop_sent or not i.live for i in self.learners.values())

    def to_manifest(self, now_s: float) -> tuple[dict, dict]:
        """(ledgers, learners) as a checkpoint manifest written at ``now_s`` keeps them."""
        self.flush_provisioned()
        return ({lid: led.to_json() for lid, led in self.ledgers.items()},
                {lid: i.to_json(now_s) for lid, i in self.learners.items()})

    def restore(self, ledgers: Mapping[str, Mapping], learners: Mapping[str, Mapping], now_s: float,
                checkpoint_age_s: float = 0.0) -> None:
        """Take the registry of a checkpoint written ``checkpoint_age_s`` seconds ago: every learner
        is not live until it heartbeats again; the pace allowance of its next heartbeat counts from
        where it counted when the checkpoint was written, not from now (the learners trained on
        while no synchronizer ran), with the burst it had left, and its pace bound is calibrated by the
        pace measured until then."""
        self.ledgers = {lid: LearnerLedger.from_json(d) for lid, d in ledgers.items()}
        self.learners = {}
        self._heard, self._live = [], None
        self._tokens_processed = sum(led.tokens_processed for led in self.ledgers.values())
        self._provisioned_at_s, self._provisioned_flushed = None, True
        for lid, d in learners.items():
            info = self.learners[lid] = LearnerInfo(
                lid, int(d["incarnation"]), now_s - self.ledgers[lid].provisioned_s, now_s, live=False,
                step=int(d["step"]), tokens_seen=int(d.get("tokens_seen", 0)),
                bytes_down_seen=int(d.get("bytes_down_seen", 0)), meter=PaceMeter.from_json(d.get("pace")),
                burst=PaceBurst.from_json(d.get("pace_burst")),
                anchor_s=now_s - max(0.0, checkpoint_age_s) - float(d.get("anchor_age_s", 0.0)))
            info.meter.silence()  # the gap since the checkpoint is no measure of its pace
