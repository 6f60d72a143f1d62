"""Round policies of the synchronizer: schedule, minimum quorum and adaptive grace window
(DESIGN §3 and §4.3, paper §3.2 and Eq. 3). Pure: times are passed in (seconds on any clock),
so tests run on a fake clock in milliseconds.

Every decision returns what to do *and* why.
"""

from __future__ import annotations

import enum
import heapq
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from diloco_async.config.schema import BudgetConfig
from diloco_async.policy.fragments import fragment_offset

__all__ = ["budget_spent_at_checkpoint", "GraceDecision", "grace_window", "global_step", "round_due_step",
           "ScheduleDecision", "schedule_rounds", "schedule_shift", "stuck_round_reason", "budget_stop_reason",
           "RoundStage", "Admission", "RoundState", "Ema"]

DUPLICATE_REASON = "already announced; acknowledged once, merged at most once"


@dataclass(frozen=True)
class GraceDecision:
    """How long to wait after the quorum, in seconds, and why."""

    grace_s: float
    reason: str


def grace_window(
    *,
    step_time_s: float | None,
    quorum_wait_s: float,
    sync_time_s: float | None,
    tau: int,
    gamma: float,
    cap_s: float | None,
    initial_s: float,
) -> GraceDecision:
    """Adaptive grace window, paper Eq. 3 (DESIGN §4.3).

    grace = clamp(gamma · (tau·xi_step − xi_quorum − xi_sync), 0, cap), where xi_step is the EMA
    step time of the slowest live learner (s), xi_quorum the time this round waited for its
    quorum (s) and xi_sync the EMA time of fetch + merge + publish of this fragment (s). The cap
    defaults to one xi_step. Before any step-time estimate exists the configured initial grace is
    used (still capped when a cap is given).

    Raises:
        ValueError: negative times, tau < 1 or gamma outside (0, 1].
    """
    if tau < 1:
        raise ValueError(f"tau must be >= 1, got {tau}")
    if not 0 < gamma <= 1:
        raise ValueError(f"gamma must be in (0, 1], got {gamma}")
    if quorum_wait_s < 0 or initial_s < 0 or (cap_s is not None and cap_s < 0):
        raise ValueError("times must be >= 0")
    if step_time_s is None:
        grace = initial_s if cap_s is None else min(initial_s, cap_s)
        return GraceDecision(grace, f"initial grace {grace:.3f}s (no step-time estimate yet)")
    sync = sync_time_s or 0.0
    cap = step_time_s if cap_s is None else cap_s
    slack = tau * step_time_s - quorum_wait_s - sync
    raw = gamma * slack
    grace = min(max(raw, 0.0), cap)
    if raw <= 0:
        why = f"no slack: {tau}x{step_time_s:.3f}s step - {quorum_wait_s:.3f}s quorum - {sync:.3f}s sync <= 0"
    elif raw > cap:
        why = f"capped at {cap:.3f}s (slack x gamma = {raw:.3f}s)"
    else:
        why = f"gamma x slack = {gamma} x {slack:.3f}s"
    return GraceDecision(grace, why)


def global_step(local_steps: Iterable[int], min_quorum: int) -> int | None:
    """The synchronizer's global step g: the K-th largest local step among live learners
    (DESIGN §3.2); None while fewer than K learners are live."""
    steps = heapq.nlargest(min_quorum, local_steps)  # O(N log K): called on every sweep of the actor
    if len(steps) < min_quorum:
        return None
    return steps[min_quorum - 1]


def round_due_step(offset: int, round_n: int, sync_every: int) -> int:
    """Global step at which round ``round_n`` (>= 1) of a fragment with ``offset`` becomes due."""
    if round_n < 1:
        raise ValueError(f"rounds are numbered from 1, got {round_n}")
    return offset + round_n * sync_every


@dataclass(frozen=True)
class ScheduleDecision:
    """Rounds to open now and rounds still waiting for a free slot, each ``(fragment, round)``
    in due order, and why."""

    open_now: tuple[tuple[int, int], ...]
    waiting: tuple[tuple[int, int], ...]
    reason: str


def schedule_rounds(
    *,
    g: int,
    next_rounds: Sequence[int] | Mapping[int, int],
    busy: Collection[int],
    waiting: Sequence[tuple[int, int]],
    free_slots: int,
    sync_every: int,
    num_fragments: int | None = None,
    awaited: Collection[int] = (),
) -> ScheduleDecision:
    """Which rounds become due at global step ``g`` and which of them open now (DESIGN §3.2).

    Fragment p (offset o_p = floor(p·H/P), P = ``len(next_rounds)``) has its round
    ``next_rounds[p]`` due when g ≥ o_p + n·H. A fragment with a round in flight (``busy``) or
    already ``waiting`` is skipped. When the learners ran ahead (slow merges, a resume) the newest
    due round is queued instead of every missed one, except for a fragment in ``awaited``: late
    contributions wait for its next round (DESIGN §3.5), which is queued (or a waiting one renumbered)
    under that number, so that they join it instead of being abandoned with a skipped round. Due
    rounds are ordered by due step, then fragment, and the first ``free_slots`` open (τ =
    ``synchronizer.max_open_rounds`` less the rounds open now).

    Args:
        g: the global step (:func:`global_step`).
        next_rounds: per fragment, the number of its next round (≥ 1); a mapping fragment -> next
            round when the synchronizer (a shard, DESIGN §2.2) schedules only some of the fragments.
        busy: fragments with a round open or merging.
        waiting: rounds already due and waiting for a free slot.
        free_slots: rounds that may open now (τ less the rounds open; 0 or less: none).
        sync_every: H, inner steps between two rounds of one fragment.
        num_fragments: P of the offsets (None: ``len(next_rounds)``).
        awaited: fragments whose next round has late contributions waiting for it.
    """
    num = len(next_rounds) if num_fragments is None else num_fragments
    rounds = dict(next_rounds.items() if isinstance(next_rounds, Mapping) else enumerate(next_rounds))
    queue = [(p, rounds[p]) if p in awaited and p in rounds else (p, m) for p, m in waiting]
    queued = {p for p, _ in queue}
    newly = 0
    for p, n in rounds.items():
        off = fragment_offset(p, num, sync_every)
        if p not in busy and p not in queued and g >= round_due_step(off, n, sync_every):
            queue.append((p, n if p in awaited else max(n, (g - off) // sync_every)))
            newly += 1
    queue.sort(key=lambda pn: (round_due_step(fragment_offset(pn[0], num, sync_every), pn[1], sync_every), pn[0]))
    free = max(0, free_slots)
    open_now, rest = tuple(queue[:free]), tuple(queue[free:])
    reason = f"g={g}: {newly} newly due, {len(open_now)} opened, {len(rest)} waiting ({free} free slots before)"
    return ScheduleDecision(open_now, rest, reason)


def schedule_shift(*, g: int, shift: int, next_due: Sequence[int], sync_every: int) -> tuple[int, str | None]:
    """Keep the schedule within reach of the live learners (issue 14, defect 7).

    The schedule runs on ``g + shift``. When the earliest next due step (``next_due``, one per
    fragment) lies more than 2·H past it — the global step fell back, e.g. after a learner that
    ran ahead (or lied) stopped counting — the shift grows so that it lies H past it. The shift
    never decreases, so round numbers stay increasing.

    Returns:
        (the shift in steps, why it changed or None).
    """
    if not next_due:
        return shift, None
    lead = min(next_due) - (g + shift)
    if lead <= 2 * sync_every:
        return shift, None
    new = min(next_due) - sync_every - g
    return new, f"next round due {lead} steps past g={g} (+{shift}); schedule shifted by {new - shift} steps"


def stuck_round_reason(*, now_s: float, opened_s: float, unreachable_since_s: float | None, timeout_s: float,
                       unreachable_wait_s: float, enough_live: bool = False) -> str | None:
    """Why an open round without quorum should be abandoned (and reopened), or None.

    ``quorum_unreachable`` once its live learners could not make the quorum for
    ``unreachable_wait_s`` (s) in a row, the time a lost learner has to come back; at once when
    ``enough_live`` (the live learners are at least the quorum, so only the contributions already
    rejected stand in the way: a rejected learner cannot announce again in this round, and waiting
    would only hold back the round that replaces it while the other fragments move on);
    ``round_timeout`` once it has been open ``timeout_s`` (s).
    """
    if unreachable_since_s is not None and enough_live:
        return "quorum_unreachable: rejected contributions leave too few live learners to make the quorum"
    if unreachable_since_s is not None and now_s - unreachable_since_s >= unreachable_wait_s:
        return f"quorum_unreachable: the live learners cannot make the quorum since {now_s - unreachable_since_s:.1f}s"
    if now_s - opened_s >= timeout_s:
        return f"round_timeout: open {now_s - opened_s:.1f}s without quorum"
    return None


def budget_stop_reason(budget: BudgetConfig, *, tokens: int, g: int | None, elapsed_s: float) -> str | None:
    """Why the run's budget is spent (tokens processed, global step g, wall seconds), or None.

    Tokens are checked first, then steps, then wall time; the reason names the figure.
    """
    if budget.tokens is not None and tokens >= budget.tokens:
        return f"token budget reached ({tokens} >= {budget.tokens})"
    if budget.max_steps is not None and g is not None and g >= budget.max_steps:
        return f"step budget reached (g = {g})"
    if budget.wall_s is not None and elapsed_s >= budget.wall_s:
        return f"wall-time budget reached ({elapsed_s:.0f}s)"
    return None


def budget_spent_at_checkpoint(budget: BudgetConfig, manifest: Mapping) -> str | None:
    """Why a run resumed from a checkpoint ``manifest`` would stop at once, with the override that
    extends it; None while tokens or steps remain. Wall time counts per synchronizer lifetime, so it
    is never spent at a checkpoint."""
    tokens = sum(int(led["tokens_processed"]) for led in manifest.get("ledgers", {}).values())
    g = manifest.get("global_step")
    if budget.tokens is not None and tokens >= budget.tokens:
        return (f"token budget reached ({tokens} >= {budget.tokens}); extend it with "
                f"--set budget.tokens=<more than {tokens}>")
    if budget.max_steps is not None and g is not None and int(g) >= budget.max_steps:
        return f"step budget reached (g = {g}); extend it with --set budget.max_steps=<more than {g}>"
    return None


class RoundStage(enum.Enum):
    OPEN = "open"  # collecting, quorum not met
    GRACE = "grace"  # quorum met, waiting the grace window
    MERGING = "merging"  # fetch/merge/publish running; later announcements are late
    DONE = "done"
    ABANDONED = "abandoned"


_ALLOWED = {
    RoundStage.OPEN: {RoundStage.GRACE, RoundStage.ABANDONED},
    RoundStage.GRACE: {RoundStage.MERGING, RoundStage.ABANDONED},
    RoundStage.MERGING: {RoundStage.DONE, RoundStage.ABANDONED},
    RoundStage.DONE: set(),
    RoundStage.ABANDONED: set(),
}


@dataclass(frozen=True)
class Admission:
    """Outcome of an announcement: ``status`` is accepted, duplicate, late or rejected.

    A rejection's ``reason`` reads ``"<code>: <detail>"``; the code is what gets counted.
    """

    status: str
    reason: str

    @property
    def code(self) -> str:
        """The counted reason of a rejection (``too_stale``, ``bad_key``, ...); "" otherwise."""
        return self.reason.partition(": ")[0] if self.status == "rejected" else ""


@dataclass
class _Entry:
    key: str
    at_s: float
    verified: bool | None = None  # None: fetching; True: valid; False: rejected


@dataclass
class RoundState:
    """One round (fragment ``p``, number ``n``): minimum quorum, then the grace window.

    Quorum counts distinct learners whose contributions passed verification (size, digest,
    shape, finiteness); a contribution that fails does not count, so a bad one cannot complete
    a quorum. Announcements once the merge has started are *late*.
    """

    fragment: int
    round_n: int
    opened_s: float
    min_quorum: int
    stage: RoundStage = RoundStage.OPEN
    quorum_s: float | None = None
    deadline_s: float | None = None
    grace: GraceDecision | None = None
    entries: dict[str, _Entry] = field(default_factory=dict)
    late: list[str] = field(default_factory=list)
    unreachable_since_s: float | None = None  # since when the live learners cannot make the quorum
    # entries by verification state (None: pending), kept by announce and settle: O(1) checks
    counts: dict[bool | None, int] = field(default_factory=lambda: {None: 0, True: 0, False: 0})

    def _move(self, to: RoundStage) -> None:
        if to not in _ALLOWED[self.stage]:
            raise RuntimeError(f"round p{self.fragment} r{self.round_n}: {self.stage.value} -> {to.value} not allowed")
        self.stage = to

    @property
    def verified(self) -> list[str]:
        return [lid for lid, e in self.entries.items() if e.verified]

    @property
    def pending(self) -> list[str]:
        return [lid for lid, e in self.entries.items() if e.verified is None]

    @property
    def pending_count(self) -> int:
        """Announced contributions whose verification has not finished (O(1))."""
        return self.counts[None]

    def announce(self, learner: str, key: str, now_s: float) -> Admission:
        """Register an announcement. Idempotent: the same (learner, key) again is a duplicate."""
        if self.stage in (RoundStage.MERGING, RoundStage.DONE, RoundStage.ABANDONED):
            self.late.append(learner)
            return Admission("late", f"round p{self.fragment} r{self.round_n} is {self.stage.value}")
        prev = self.entries.get(learner)
        if prev is not None:
            if prev.key == key:
                return Admission("duplicate", DUPLICATE_REASON)
            return Admission("rejected", "duplicate_learner: a different contribution for this round")
        self.entries[learner] = _Entry(key=key, at_s=now_s)
        self.counts[None] += 1
        return Admission("accepted", f"{len(self.entries)} announced")

    def settle(self, learner: str, ok: bool) -> None:
        """Record the verification outcome of a learner's contribution."""
        entry = self.entries.get(learner)
        if entry is not None:
            self.counts[entry.verified] -= 1
            entry.verified = bool(ok)
            self.counts[entry.verified] += 1

    def refuse(self, learner: str, key: str, now_s: float) -> None:
        """A learner's announcement refused before admission counts as a failed contribution: it
        will not announce again in this round, so the quorum no longer waits for it."""
        if self.stage in (RoundStage.OPEN, RoundStage.GRACE) and learner not in self.entries:
            self.announce(learner, key, now_s)
            self.settle(learner, False)

    def quorum_met(self) -> bool:
        return self.counts[True] >= self.min_quorum

    def quorum_reachable(self, live_learners: Iterable[str]) -> bool:
        """Whether the verified, the pending and the live learners not yet heard from can still
        make the quorum (a rejected learner cannot announce again); reads ``live_learners`` (distinct) until it is."""
        possible = len(self.entries) - self.counts[False]
        if possible >= self.min_quorum:
            return True
        for lid in live_learners:
            if lid not in self.entries:
                possible += 1
                if possible >= self.min_quorum:
                    return True
        return False

    def start_grace(self, now_s: float, decision: GraceDecision) -> None:
        """Quorum reached at ``now_s``: wait ``decision.grace_s`` more."""
        self._move(RoundStage.GRACE)
        self.quorum_s = now_s
        self.grace = decision
        self.deadline_s = now_s + decision.grace_s

    def should_merge(self, now_s: float, live_learners: Iterable[str]) -> str | None:
        """In the grace stage: the reason to merge now, or None to keep waiting."""
        if self.stage is not RoundStage.GRACE:
            return None
        live, entries = tuple(live_learners), self.entries  # distinct ids; stops at the first unsettled one
        if live and all(lid in entries and entries[lid].verified is not None for lid in live):
            return f"all {len(live)} live learners announced"
        assert self.deadline_s is not None
        if now_s >= self.deadline_s:
            return f"grace window of {self.grace.grace_s:.3f}s elapsed; quorum {len(self.verified)}/{self.min_quorum}"
        return None

    def start_merge(self) -> None:
        self._move(RoundStage.MERGING)

    def finish(self) -> None:
        self._move(RoundStage.DONE)

    def abandon(self) -> None:
        self._move(RoundStage.ABANDONED)


class Ema:
    """Exponential moving average of a duration (s); ``value`` is None before the first sample."""

    def __init__(self, alpha: float) -> None:
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.alpha = alpha
        self.value: float | None = None

    def update(self, sample: float) -> float:
        self.value = sample if self.value is None else self.alpha * sample + (1 - self.alpha) * self.value
        return self.value
