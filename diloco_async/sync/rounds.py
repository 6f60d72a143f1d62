"""The rounds of the synchronizer actor (DESIGN §3, steps 2-7): schedule and open them, admit and verify
contributions (the table's base :class:`~diloco_async.sync.contributions.ContributionDesk`), close them on
quorum and grace, merge and publish, apply the result. :class:`RoundTable` is the
actor's component that owns the rounds and runs them on the actor's task only; decisions are
:mod:`diloco_async.policy.rounds`'s, blocking work :mod:`diloco_async.sync.work`'s."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING

from diloco_async.policy.fragments import fragment_offset
from diloco_async.policy.rounds import (
    GraceDecision,
    RoundStage,
    RoundState,
    global_step,
    grace_window,
    round_due_step,
    schedule_rounds,
    schedule_shift,
    stuck_round_reason,
)
from diloco_async.policy.schedules import OuterSchedule
from diloco_async.protocol.messages import RoundOpen, VersionInfo
from diloco_async.runtime.heap import release_free_memory
from diloco_async.sync import work
from diloco_async.sync.contributions import ContributionDesk
from diloco_async.sync.guard import UpdateGuard
from diloco_async.sync.late import LateDesk
from diloco_async.sync.logs import BoundedMap
from diloco_async.sync.slices import SliceDesk
from diloco_async.sync.state import FragmentState, Merged, Round

if TYPE_CHECKING:
    from diloco_async.sync.context import ActorContext
    from diloco_async.sync.fragment_book import FragmentBook
    from diloco_async.sync.learners import LearnerRegistry
    from diloco_async.sync.lifecycle import Lifecycle
    from diloco_async.sync.reporting import Reporter
    from diloco_async.sync.state import Broadcaster

__all__ = ["RoundTable", "SETTLED_CAP"]

log = logging.getLogger("diloco.synchronizer")

#: (learner, fragment, round) keys of closed rounds remembered to answer a replay ``duplicate``; older: ``late``
SETTLED_CAP = 4096


class RoundTable(ContributionDesk):
    """The rounds of the fragments in a :class:`~diloco_async.sync.fragment_book.FragmentBook`, and
    the state they need: the open rounds and their contributions, the due rounds waiting for a slot,
    the settled announcements, the merge and verify slots, the global step and the schedule's
    shift; it holds the update guard's memory (:class:`~diloco_async.sync.guard.UpdateGuard`).

    Reads the learner registry and the lifecycle; changes the book's fragments through its methods,
    credits the learners' ledgers, counts and logs through the reporter, pushes round and version
    events. Runs on the actor's task; blocking work goes to threads (:mod:`~diloco_async.sync.work`)
    and comes back to the actor's inbox as :class:`Verified` and :class:`Merged`.

    Args:
        ctx: the actor's context (config, store, clock, inbox, spawn).
        book, registry, report, push, life: the actor's components this one works with.
        settled_cap: (learner, fragment, round) keys of closed rounds remembered.
    """

    def __init__(self, ctx: ActorContext, book: FragmentBook, registry: LearnerRegistry, report: Reporter,
                 push: Broadcaster, life: Lifecycle, settled_cap: int = SETTLED_CAP) -> None:
        self.slices = SliceDesk(None, ctx.clock, report)  # the actor's own with data.slices (DESIGN §5.2)
        self.ctx, self.sc = ctx, ctx.sc
        self.book, self.registry, self.report, self.push, self.life = book, registry, report, push, life
        self.rounds: dict[tuple[int, int], Round] = {}
        self.late = LateDesk(self.sc.fold_late, progress_kept=ctx.cfg.learners.adopt == "rebase")  # DESIGN §3.5
        self.waiting: list[tuple[int, int]] = []  # due rounds waiting for a free slot
        self.settled: BoundedMap[tuple[str, int, int], str] = BoundedMap(settled_cap)  # -> the entry's key
        one = ctx.cfg.run.schedule == "replay"  # a replay verifies and merges one at a time, in order (DESIGN §3.2)
        self.merge_slots, self.verify_slots = (asyncio.Semaphore(1 if one else n)  # worker threads at once
                                               for n in (self.sc.merges_in_flight, self.sc.verifies_in_flight))
        self.g: int | None = None  # the global step
        self.schedule_shift_steps = 0  # added to g by the schedule after it ran out of reach (policy.schedule_shift)
        self.guard = UpdateGuard(ctx.cfg.guard, book, report)  # the update guard's memory
        self.outer_schedule = OuterSchedule.from_config(ctx.cfg)  # η of each fragment's outer steps

    def opens_for(self, learner_id: str) -> tuple[tuple[int, int, int], ...]:
        """The rounds open (or in their grace window) that ``learner_id`` has not announced to, as
        ``(fragment, round_n, version)``, by fragment and round."""
        return tuple((p, n, self.book[p].version) for (p, n), rnd in sorted(self.rounds.items())
                     if rnd.state.stage in (RoundStage.OPEN, RoundStage.GRACE) and learner_id not in rnd.state.entries)

    # -- open ---------------------------------------------------------------------------------

    def open_round(self, f: FragmentState, n: int, now: float) -> None:
        """Open round n of fragment f and tell every learner (the one place a round opens)."""
        self.book.begin_round(f, n)
        self.rounds[(f.p, n)] = rnd = Round(RoundState(f.p, n, now, self.sc.min_quorum))
        self.report.counters["rounds_opened"] += 1
        self._admit_parked(f, rnd, now)
        self.push.publish({"type": "round_open", **RoundOpen(fragment=f.p, round_n=n, version=f.version).model_dump()})
        log.info("round open: fragment %d round %d (g=%s, live=%d)", f.p, n, self.g, len(self.registry.live()))

    def schedule(self, now: float) -> None:
        """While running: move the global step and open the rounds it makes due."""
        if not self.life.running:
            return
        g = global_step([i.step for i in self.registry.live()], self.sc.min_quorum)
        if g is None:
            return
        if g != self.g:
            self.g = g
            self.report.metric("sync/global_step", g, g)
        H, num = self.sc.sync_every, self.book.plan.num_fragments
        # judged only on steps reported to this process: after a resume, the restored steps are the
        # checkpoint's and lag the versions kept since, which would look like a schedule out of reach
        current = self.registry.all_live_reported()
        due = [round_due_step(fragment_offset(f.p, num, H), f.next_round, H) for f in self.book]
        shift, why = (schedule_shift(g=g, shift=self.schedule_shift_steps, sync_every=H, next_due=due) if current
                      else (self.schedule_shift_steps, None))
        if why is not None:
            self.schedule_shift_steps = shift
            self.report.count("schedule_shifts")
            log.warning("schedule out of reach of the live learners: %s", why)
        decision = schedule_rounds(g=g + shift, next_rounds={f.p: f.next_round for f in self.book},
                                   busy={f.p for f in self.book if f.busy}, waiting=self.waiting,
                                   free_slots=self.sc.max_open_rounds - len(self.rounds),
                                   sync_every=self.sc.sync_every, num_fragments=num,
                                   awaited=self.late.awaited({f.p: f.next_round for f in self.book}))
        self.waiting = list(decision.waiting)
        for p, n in decision.open_now:
            self.open_round(self.book[p], n, now)

    def open_last_rounds(self, now: float, until_s: float) -> list[str]:
        """A last round of every fragment that has none in flight (the drain before a stop). Each
        waits for every live learner until ``until_s`` (the drain's end), not a grace window, and
        takes ``synchronizer.drain_lookahead`` of the momentum look-ahead (docs/end-of-run.md)."""
        self.waiting.clear()
        opened = []
        for f in self.book:
            if not f.busy:
                opened.append(f"p{f.p} r{f.next_round}")
                self.open_round(f, f.next_round, now)
                self.rounds[(f.p, f.next_round - 1)].drain_until_s = until_s
        return opened

    # -- quorum, grace, merge -----------------------------------------------------------------

    def progress_rounds(self, now: float) -> None:
        live_ids = self.registry.live_ids()
        for (p, n), rnd in list(self.rounds.items()):
            st = rnd.state
            if st.stage is RoundStage.OPEN and not self._progress_open(rnd, now):
                continue
            if st.stage is RoundStage.GRACE:
                why = st.should_merge(now, live_ids)
                if why is None and rnd.drain_until_s is not None and self.life.stopped:  # nobody contributes now
                    why = "stopped during the drain"
                if why is not None:
                    st.start_merge()
                    quorum_wait = (st.quorum_s or now) - st.opened_s
                    if len(st.verified) == 1 and len(live_ids) > 1:
                        log.info("fragment %d round %d: quorum of one (%s)", p, n, why)
                    self.ctx.spawn(self._merge_task(self.book[p], rnd, quorum_wait))

    def _progress_open(self, rnd: Round, now: float) -> bool:
        """An open round: start its grace window once the quorum is met; abandon it at a stop.
        Returns False when the round is gone."""
        st = rnd.state
        p, n = st.fragment, st.round_n
        if st.quorum_met():
            quorum_wait = now - st.opened_s
            if rnd.drain_until_s is not None:  # the run's last merge of p: every learner's progress, not a quorum's
                decision = GraceDecision(max(0.0, rnd.drain_until_s - now), "a drain's last round")
            elif self.sc.grace_enabled:
                decision = grace_window(
                    step_time_s=self.registry.slowest_step_s(), quorum_wait_s=quorum_wait,
                    sync_time_s=self.book[p].sync_ema.value, tau=self.sc.max_open_rounds,
                    gamma=self.sc.grace_gamma, cap_s=self.sc.grace_cap_s, initial_s=self.sc.grace_initial_s)
            else:
                decision = GraceDecision(0.0, "grace window disabled")
            st.start_grace(now, decision)
            log.debug("fragment %d round %d quorum %d/%d after %.3fs; grace %.3fs (%s)", p, n,
                      len(st.verified), st.min_quorum, quorum_wait, decision.grace_s, decision.reason)
        elif self.life.stopped:
            self._abandon(rnd, "at_stop", f"quorum {len(st.verified)}/{st.min_quorum}")
            return False
        elif self._abandon_if_stuck(rnd, now):
            return False
        elif now - rnd.last_wait_log_s >= 10.0 and now - st.opened_s >= 10.0:
            rnd.last_wait_log_s = now
            log.info("fragment %d round %d waiting for quorum (%d/%d)", p, n, len(st.verified), st.min_quorum)
        return True

    def _abandon(self, rnd: Round, reason: str, detail: str) -> None:
        """Take an open round out (counted by reason); its contributions are not merged."""
        st = rnd.state
        st.abandon()
        self.rounds.pop((st.fragment, st.round_n))
        self.book.end_round(self.book[st.fragment])
        for lid, entry in st.entries.items():
            self.settled[(lid, st.fragment, st.round_n)] = entry.key
        for lid, contrib in rnd.contributions.items():  # accepted, never merged
            self._decided(lid, st.fragment, st.round_n, "abandoned", f"{reason}: {detail}" if detail else reason,
                          contrib.ann)
        self.report.abandon(reason)
        log.info("fragment %d round %d abandoned (%s): %s", st.fragment, st.round_n, reason, detail)

    def _abandon_if_stuck(self, rnd: Round, now: float) -> bool:
        """A round that cannot reach its quorum from the live learners (see stuck_round_reason) is
        abandoned and, when the live learners can make a quorum, reopened at once. True: abandoned."""
        st, live = rnd.state, self.registry.live_ids()
        if st.quorum_reachable(live):
            st.unreachable_since_s = None
        elif st.unreachable_since_s is None:
            st.unreachable_since_s = now
        why = stuck_round_reason(now_s=now, opened_s=st.opened_s, unreachable_since_s=st.unreachable_since_s,
                                 timeout_s=self.ctx.cfg.guard.round_timeout_s, enough_live=len(live) >= st.min_quorum,
                                 unreachable_wait_s=self.sc.heartbeat_timeout_s)
        if why is None:
            return False
        code, _, detail = why.partition(": ")
        self._abandon(rnd, code, detail)
        f = self.book[st.fragment]
        if self.life.running and len(live) >= self.sc.min_quorum and len(self.rounds) < self.sc.max_open_rounds:
            self.open_round(f, f.next_round, now)
        return True

    async def _merge_task(self, f: FragmentState, rnd: Round, quorum_wait_s: float) -> None:
        # Announcements admitted before the merge started are awaited (bounded by the fetch timeout).
        if rnd.state.pending_count:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(rnd.none_pending.wait(), self.sc.storage_timeout_s + 1.0)
        n = rnd.state.round_n
        try:
            contribs = [c for c in rnd.contributions.values() if c.delta is not None]  # the thread's own list
            async with self.merge_slots:
                directions = self.guard.direction_check(f.p)
                self.book.set_outer_lr(f, self.outer_schedule, self.registry.tokens_processed())
                lookahead = 1.0 if rnd.drain_until_s is None else self.sc.drain_lookahead
                result = await asyncio.to_thread(work.merge_and_publish, self.ctx.store, self.ctx.run_id, f, n,
                                                 contribs, self.sc.merge, directions=directions,
                                                 publish=work.PublishSettings(self.ctx.lease_epoch, self.sc.download,
                                                                              lookahead))
            result.quorum_wait_s = quorum_wait_s
        except Exception as err:
            log.exception("merge of fragment %d round %d failed", f.p, n)
            result = Merged(f.p, n, False, f"{type(err).__name__}: {err}")
        await self.ctx.inbox.put(result)

    def on_merged(self, res: Merged) -> None:
        f = self.book[res.fragment]
        rnd = self.rounds.pop((res.fragment, res.round_n))
        self.book.end_round(f)
        for lid, entry in rnd.state.entries.items():
            self.settled[(lid, res.fragment, res.round_n)] = entry.key
        dropped = dict(res.dropped)
        if not res.ok:
            rnd.state.abandon()
            log.error("fragment %d round %d abandoned: %s (version stays %d)", f.p, res.round_n, res.reason, f.version)
            self.report.abandon("merge_failed")
            code = "lease_lost" if res.reason.startswith(("LeaseLost", "LeaseExpired")) else "merge_failed"
            for lid in rnd.contributions:  # counted, never lost silently
                why = dropped.get(lid, res.reason)
                self._reject(lid, _dropped_code(why, code), why.removeprefix("direction_outlier: "), f.p,
                             res.round_n, rnd.contributions[lid].ann)
            return
        for lid, why in dropped.items():  # left out so that the others could merge
            self._reject(lid, _dropped_code(why, "merge_failed"), why.removeprefix("direction_outlier: "), f.p,
                         res.round_n, rnd.contributions[lid].ann)
        self.guard.record_merge(res, {lid: rnd.contributions[lid].ann.c_tokens for lid in res.merged})
        weak = [lid for lid in res.merged if res.factors.get(lid, 1.0) < 1.0]
        for lid in [x for x in weak if res.factors[x] <= 0.0]:  # merged with no weight: it moved nothing
            self.registry.ledgers[lid].count("zero_weight")
        if weak:
            self.report.counters["contributions_downweighted"] += len(weak)
            log.info("fragment %d round %d: merged with less weight for %s (direction factors %s)", f.p, res.round_n,
                     weak, {lid: round(res.factors[lid], 3) for lid in weak})
        rnd.state.finish()
        self._adopt_merge(f, res, rnd)
        self.report.merged_round(f, res, rnd, self.registry, self.ctx.clock())

    def _adopt_merge(self, f: FragmentState, res: Merged, rnd: Round) -> None:
        """The new version becomes the fragment's value; learners are told; ledgers credited."""
        self.book.adopt(f, res, self.sc.max_staleness)
        f.optimizer.pool.trim()  # the shared merge pool's budget; then the heap (issue 17 item 3)
        release_free_memory()
        f.sync_ema.update(res.seconds)
        self.push.publish({"type": "version", **VersionInfo(
            fragment=f.p, version=f.version, key=res.ref.key, nbytes=res.ref.nbytes, sha256=res.ref.sha256,
            compact=f.compact).model_dump()})
        self.report.counters["merges"] += 1
        self.report.counters["contributions_merged"] += len(res.merged)
        # its direction factor (DESIGN §10) scales what reached the model; factor 0: not a useful update id
        factor = {lid: min(1.0, max(0.0, res.factors.get(lid, 1.0))) for lid in res.merged}
        self.report.merged(self.ctx.clock(), {
            "t": time.time(), "fragment": f.p, "round": res.round_n, "version": f.version, "sha256": res.ref.sha256,
            "update_ids": [rnd.contributions[lid].ann.update_id for lid in res.merged if factor[lid] > 0],
            "contributions": [rnd.contributions[lid].merge_record(
                factor[lid], res.cosines.get(lid), self.slices.lease_epochs(rnd.contributions[lid].ann.slices))
                for lid in res.merged]})
        for lid in res.merged:
            ann, w = rnd.contributions[lid].ann, factor[lid]
            self.registry.ledgers[lid].credit_merge(ann.c_tokens, ann.compute_s, f.share, w)
            self._decided(lid, f.p, res.round_n, "merged" if w > 0 else "zero_weight",
                          "" if w > 0 else "direction factor 0", ann)


def _dropped_code(why: str, default: str) -> str:
    """The rejection code of a contribution left out of a merge for reason ``why``."""
    return "direction_outlier" if why.startswith("direction_outlier: ") else default
