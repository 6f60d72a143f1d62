"""The contributions half of the synchronizer's round table (DESIGN §3, steps 3-4): admit an
announcement into its round (or the round a late one joins, DESIGN §3.5), fetch and check it on a
thread, and record what became of each contribution (merged, late, rejected, abandoned).

:class:`ContributionDesk` is a base of :class:`~diloco_async.sync.rounds.RoundTable`, on the actor's
task only; it reads and writes the table's rounds. Decisions are
:mod:`diloco_async.policy.admission`'s and :mod:`diloco_async.policy.pace`'s.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from typing import TYPE_CHECKING

from diloco_async.codec import wire
from diloco_async.policy.admission import AnnouncementRules, FragmentFacts, admit_announcement
from diloco_async.policy.pace import implausible_contribution
from diloco_async.policy.rounds import DUPLICATE_REASON, RoundStage, RoundState
from diloco_async.policy.shards import shard_of
from diloco_async.protocol.messages import Announcement, AnnouncementAck
from diloco_async.storage import keys
from diloco_async.sync import work
from diloco_async.sync.slices import NOT_HELD
from diloco_async.sync.state import Contribution, FragmentState, Round, Verified

if TYPE_CHECKING:
    from diloco_async.config.schema import SynchronizerConfig
    from diloco_async.sync.context import ActorContext
    from diloco_async.sync.fragment_book import FragmentBook
    from diloco_async.sync.guard import UpdateGuard
    from diloco_async.sync.late import LateDesk
    from diloco_async.sync.learners import LearnerRegistry
    from diloco_async.sync.lifecycle import Lifecycle
    from diloco_async.sync.logs import BoundedMap
    from diloco_async.sync.reporting import Reporter
    from diloco_async.sync.slices import SliceDesk

__all__ = ["ContributionDesk"]

log = logging.getLogger("diloco.synchronizer")


class ContributionDesk:
    """Announcements, verifications and fates of contributions (see the module docstring); the
    attributes are the :class:`~diloco_async.sync.rounds.RoundTable`'s."""

    ctx: ActorContext
    sc: SynchronizerConfig
    book: FragmentBook
    registry: LearnerRegistry
    report: Reporter
    rounds: dict[tuple[int, int], Round]
    settled: BoundedMap[tuple[str, int, int], str]
    slices: SliceDesk
    late: LateDesk
    life: Lifecycle
    guard: UpdateGuard
    verify_slots: asyncio.Semaphore

    def on_announce(self, ann: Announcement) -> AnnouncementAck:
        lid, p, n = ann.learner_id, ann.fragment, ann.round_n
        f = self.book.get(p)
        if f is None and 0 <= p < self.book.plan.num_fragments:  # a fragment of the plan that another shard owns
            owner, shards = shard_of(p, self.sc.shards), self.sc.shards
            return self._reject(lid, "bad_fragment", f"fragment {p} belongs to synchronizer shard {owner}, not to "
                                f"this shard {self.ctx.shard} (synchronizer.shards={shards})", p, n, ann)
        ann, why = self.slices.check_announcement(ann)  # slices held (refused if not), c_tokens within them
        if why is not None:
            return self._reject(lid, NOT_HELD, why, p, n, ann)
        if (joined := self.late.joined_round(ann, self.settled.get((lid, p, n)))) is not None:
            self.report.count("duplicates")  # a retry of one that joined a later round: it learns which
            return AnnouncementAck(status="duplicate", reason=DUPLICATE_REASON, round_n=joined)
        announced, announced_n, rnd = ann, n, self.rounds.get((p, n))
        merging = rnd is not None and rnd.state.stage is RoundStage.MERGING
        joins = self.late.joins(ann, f, rnd, self.rounds, self.settled.get((lid, p, n)),  # DESIGN §3.5
                                may_wait=self.life.running)
        if joins is not None:
            ann, n, rnd = ann.model_copy(update={"round_n": joins}), joins, self.rounds.get((p, joins))
        info = self.registry.get(lid)
        if (rnd is not None or joins is not None) and (why := self._implausible(ann, rnd)) is not None:
            code, _, detail = why.partition(": ")
            return (self._late(announced, f"round p{p} r{announced_n} is closed; round {n} refused it: {why}")
                    if n != announced_n else self._reject(lid, code, detail, p, n, ann))
        parked = rnd is None and joins is not None  # it waits for round n, which opens next
        adm = admit_announcement(
            ann, now_s=self.ctx.clock(), learner_known=lid in self.registry,
            fragment=self._facts(f, after_merge=parked and merging),
            round_state=RoundState(p, n, self.ctx.clock(), 1) if parked else rnd.state if rnd else None,
            settled_key=self.settled.get((lid, p, n)), rules=self._rules(p, announced_n))
        if adm.status == "rejected" and n != announced_n:  # it stays late, and round n is left alone
            return self._late(announced, f"round p{p} r{announced_n} is closed; round {n} refused it: {adm.reason}")
        if adm.status == "rejected":
            return self._reject(lid, adm.code, adm.reason.partition(": ")[2], p, n, ann)
        if adm.status == "duplicate":
            self.report.count("duplicates")
            log.info("duplicate announcement learner=%s fragment=%d round=%d: not merged again", lid, p, n)
            return AnnouncementAck(status="duplicate", reason=adm.reason)
        if adm.status == "late":
            return self._late(ann, adm.reason)
        # its first step = the learner's last reported step - c_steps (a lagging heartbeat only
        # makes this earlier, so more lenient, never stricter)
        first_step = (info.step if info is not None else 0) - ann.c_steps
        contrib = Contribution(ann, lr_warmup=first_step < self.ctx.cfg.learners.warmup_steps)
        if parked:
            self.late.park(contrib)
        else:
            self._admitted(f, rnd, contrib)
        if n == announced_n:
            self.late.answered(lid, p, late=False)
            return AnnouncementAck(status="accepted", reason=adm.reason)
        self.report.count("contributions_folded")
        self.settled[(lid, p, announced_n)] = ann.key  # a replay of it is a duplicate, never folded twice
        self.late.joined[(lid, p, announced_n)] = n
        log.info("late contribution learner=%s fragment=%d round=%d %s round %d", lid, p, announced_n,
                 "waits for" if parked else "joins", n)
        return AnnouncementAck(status="accepted", reason=f"{adm.reason}; round {announced_n} had closed",
                               round_n=n)

    def _implausible(self, ann: Announcement, rnd: Round | None) -> str | None:
        """The pace guard's refusal of ``ann`` into ``rnd`` (None: a round it waits for), or None
        (DESIGN §10): only for a learner with no entry there yet, and a known pace."""
        info, bound = self.registry.get(ann.learner_id), self.registry.pace_bound(ann.learner_id)
        if info is None or bound is None or ann.learner_id in (rnd.state.entries if rnd else ()):
            return None
        return implausible_contribution(c_steps=ann.c_steps, c_tokens=ann.c_tokens, learner_step=info.step,
                                        since_anchor_s=self.ctx.clock() - info.anchor_s, bound=bound)

    def _facts(self, f: FragmentState | None, after_merge: bool) -> FragmentFacts | None:
        """What admission needs of ``f``; ``after_merge``: as it will be once its round merging now has
        published (a contribution waiting for the next round is checked against the bases kept then)."""
        if f is None:
            return None
        facts = f.facts()
        if after_merge:
            oldest = facts.version + 1 - self.sc.max_staleness
            facts = replace(facts, kept_versions=frozenset(v for v in facts.kept_versions if v >= oldest))
        return facts

    def _admitted(self, f: FragmentState, rnd: Round, contrib: Contribution) -> None:
        """``contrib`` is in ``rnd``: fetched and checked on a thread (:meth:`_verify`)."""
        rnd.contributions[contrib.ann.learner_id] = contrib
        rnd.none_pending.clear()
        self.ctx.spawn(self._verify(f, contrib.ann))

    def _admit_parked(self, f: FragmentState, rnd: Round, now: float) -> None:
        """The contributions waiting for ``rnd`` (just opened) are admitted into it, checked again (a
        base version collected meanwhile, say); one refused now is counted as rejected. Those that
        waited for an earlier round of the fragment, which the schedule skipped, are abandoned (their
        objects lie under a round that garbage collection may already have taken)."""
        p, n = rnd.state.fragment, rnd.state.round_n
        waiting, skipped = self.late.take(p, n)
        for c in skipped:
            self._decided(c.ann.learner_id, p, c.ann.round_n, "abandoned",
                          f"round {c.ann.round_n} was skipped (round {n} opened)", c.ann)
        for contrib in waiting:
            ann = contrib.ann
            adm = admit_announcement(ann, now_s=now, learner_known=ann.learner_id in self.registry,
                                     fragment=f.facts(), round_state=rnd.state, settled_key=None,
                                     rules=self._rules(p, n - 1))
            if adm.status == "accepted":
                self._admitted(f, rnd, contrib)
            else:
                self._reject(ann.learner_id, adm.code or adm.status, adm.reason.partition(": ")[2], p, n, ann)

    def abandon_parked(self, reason: str) -> None:
        """The contributions still waiting for a round that will not open (the run stopped: none is
        parked after the stop, so the final accounting sees each): abandoned."""
        for c in self.late.take_all():
            self._decided(c.ann.learner_id, c.ann.fragment, c.ann.round_n, "abandoned",
                          f"{reason}: round {c.ann.round_n} never opened", c.ann)

    def _rules(self, p: int, announced_n: int) -> AnnouncementRules:
        """What admission checks of a contribution announced to round ``announced_n`` of ``p``."""
        return AnnouncementRules(keys.contribution_round_prefix(self.ctx.run_id, p, announced_n) + "/", wire.CODECS,
                                 self.sc.max_staleness)

    def _late(self, ann: Announcement, reason: str) -> AnnouncementAck:
        """Answer ``ann`` late (its round closed), counted and charged as thrown away."""
        self.registry.ledgers[ann.learner_id].count("late")
        self.report.count("contributions_late")
        self.late.answered(ann.learner_id, ann.fragment, late=True)
        self._decided(ann.learner_id, ann.fragment, ann.round_n, "late", reason, ann)
        return AnnouncementAck(status="late", reason=reason)

    def _decided(self, learner: str, p: int, n: int, fate: str, reason: str = "",
                 ann: Announcement | None = None) -> None:
        """What became of one contribution: a record of the per-round log (:meth:`Reporter.fate`)
        and, for one announced and not merged (late, rejected, abandoned), its compute seconds
        times the fragment's share as ``thrown_away`` badput (DESIGN §7). ``staleness_versions``:
        versions of the fragment published after the contribution's base and before the decision."""
        f = self.book.get(p)
        rec: dict = {"t": time.time(), "fragment": p, "round": n, "learner": learner, "fate": fate, "reason": reason}
        if ann is not None:
            published = f.version - (1 if fate in ("merged", "zero_weight") else 0) if f is not None else None
            rec.update(c_tokens=ann.c_tokens, c_steps=ann.c_steps, compute_s=ann.compute_s,
                       base_version=ann.base_version,
                       staleness_versions=None if published is None else max(0, published - ann.base_version))
            if fate in ("late", "rejected", "abandoned") and f is not None and learner in self.registry.ledgers:
                self.registry.ledgers[learner].add_badput("thrown_away", ann.compute_s * f.share)
        self.report.fate(rec)
        if fate == "merged" and ann is not None:  # zero weight: not trained (its slices return with the lease)
            self.slices.merged(learner, ann.slices)

    def _reject(self, learner: str, reason: str, detail: str, p: int = -1, n: int = -1,
                ann: Announcement | None = None) -> AnnouncementAck:
        self._decided(learner, p, n, "rejected", f"{reason}: {detail}" if detail else reason, ann)
        if (rnd := self.rounds.get((p, n))) is not None and ann is not None and learner in self.registry:
            rnd.state.refuse(learner, ann.key, self.ctx.clock())  # not admitted: the quorum stops waiting for it
        if learner in self.registry.ledgers:
            self.registry.ledgers[learner].count("rejected")
        log.warning("rejected contribution learner=%s fragment=%d round=%d: %s (%s)", learner, p, n, reason, detail)
        self.report.reject(reason)
        return AnnouncementAck(status="rejected", reason=f"{reason}: {detail}")

    async def _verify(self, f: FragmentState, ann: Announcement) -> None:
        delta, norms, norms32, reason = None, {}, {}, "ok"
        try:
            async with self.verify_slots:  # the timeout bounds the fetch, not the wait for a slot
                delta, norms, norms32 = await asyncio.wait_for(asyncio.to_thread(
                    work.fetch_contribution, self.ctx.store, ann, f.shapes, wire.DEFAULT_BLOCK_SIZE),
                    timeout=self.sc.storage_timeout_s)
        except Exception as err:  # storage errors and bad payloads: counted, never fatal
            reason = work.rejection_reason(err, ann.key, self.sc.storage_timeout_s)
        await self.ctx.inbox.put(Verified(f.p, ann.round_n, ann.learner_id, delta, reason, ann.nbytes, norms, norms32))

    def on_verified(self, msg: Verified) -> None:
        rnd = self.rounds.get((msg.fragment, msg.round_n))
        if rnd is None:  # its round was abandoned (at a stop, a timeout) before the fetch finished
            self.report.count("verifications_dropped")
            log.info("verification of learner=%s fragment=%d round=%d dropped: the round is gone", msg.learner,
                     msg.fragment, msg.round_n)
            return
        if msg.delta is not None:
            msg = self.guard.screen(msg, rnd)
        if msg.delta is None:
            reason, _, detail = msg.reason.partition(": ")
            contrib = rnd.contributions.get(msg.learner)
            self._reject(msg.learner, reason, detail, msg.fragment, msg.round_n, contrib.ann if contrib else None)
            rnd.state.settle(msg.learner, False)
            rnd.contributions.pop(msg.learner, None)
        else:
            self.report.add_bytes_in(msg.nbytes)  # logged with each merge
            self.registry.wire.up(msg.learner, msg.fragment, msg.nbytes)
            contrib = rnd.contributions.get(msg.learner)
            if contrib is not None:
                contrib.delta, contrib.norms = msg.delta, msg.norms32
            rnd.state.settle(msg.learner, True)
        if not rnd.state.pending_count:
            rnd.none_pending.set()
