"""Round policies of the synchronizer: schedule, minimum quorum and adaptive grace window
(DESIGN §3 and §4.3, paper §3.2 and Eq. 3). Pure: times are passed in (seconds on any clock),
so tests run on a fake clock in milliseconds.

Every decision returns what to do *and* why.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Iterable, Optional

__all__ = [
    "GraceDecision",
    "grace_window",
    "global_step",
    "round_due_step",
    "RoundStage",
    "Admission",
    "RoundState",
    "Ema",
]


@dataclass(frozen=True)
class GraceDecision:
    """How long to wait after the quorum, in seconds, and why."""

    grace_s: float
    reason: str


def grace_window(
    *,
    step_time_s: Optional[float],
    quorum_wait_s: float,
    sync_time_s: Optional[float],
    tau: int,
    gamma: float,
    cap_s: Optional[float],
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


def global_step(local_steps: Iterable[int], min_quorum: int) -> Optional[int]:
    """The synchronizer's global step g: the K-th largest local step among live learners
    (DESIGN §3.2); None while fewer than K learners are live."""
    steps = sorted(local_steps, reverse=True)
    if len(steps) < min_quorum:
        return None
    return steps[min_quorum - 1]


def round_due_step(offset: int, round_n: int, sync_every: int) -> int:
    """Global step at which round ``round_n`` (>= 1) of a fragment with ``offset`` becomes due."""
    if round_n < 1:
        raise ValueError(f"rounds are numbered from 1, got {round_n}")
    return offset + round_n * sync_every


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
    """Outcome of an announcement: ``status`` is accepted, duplicate, late or rejected."""

    status: str
    reason: str


@dataclass
class _Entry:
    key: str
    at_s: float
    verified: Optional[bool] = None  # None: fetching; True: valid; False: rejected


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
    quorum_s: Optional[float] = None
    deadline_s: Optional[float] = None
    grace: Optional[GraceDecision] = None
    entries: dict[str, _Entry] = field(default_factory=dict)
    late: list[str] = field(default_factory=list)

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

    def announce(self, learner: str, key: str, now_s: float) -> Admission:
        """Register an announcement. Idempotent: the same (learner, key) again is a duplicate."""
        if self.stage in (RoundStage.MERGING, RoundStage.DONE, RoundStage.ABANDONED):
            self.late.append(learner)
            return Admission("late", f"round p{self.fragment} r{self.round_n} is {self.stage.value}")
        prev = self.entries.get(learner)
        if prev is not None:
            if prev.key == key:
                return Admission("duplicate", "already announced; acknowledged once")
            return Admission("rejected", "duplicate_learner: a different contribution for this round")
        self.entries[learner] = _Entry(key=key, at_s=now_s)
        return Admission("accepted", f"{len(self.entries)} announced")

    def settle(self, learner: str, ok: bool) -> None:
        """Record the verification outcome of a learner's contribution."""
        entry = self.entries.get(learner)
        if entry is not None:
            entry.verified = ok

    def quorum_met(self) -> bool:
        return len(self.verified) >= self.min_quorum

    def start_grace(self, now_s: float, decision: GraceDecision) -> None:
        """Quorum reached at ``now_s``: wait ``decision.grace_s`` more."""
        self._move(RoundStage.GRACE)
        self.quorum_s = now_s
        self.grace = decision
        self.deadline_s = now_s + decision.grace_s

    def should_merge(self, now_s: float, live_learners: Iterable[str]) -> Optional[str]:
        """In the grace stage: the reason to merge now, or None to keep waiting."""
        if self.stage is not RoundStage.GRACE:
            return None
        live = set(live_learners)
        if live and live <= {lid for lid, e in self.entries.items() if e.verified is not None}:
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
        self.value: Optional[float] = None

    def update(self, sample: float) -> float:
        self.value = sample if self.value is None else self.alpha * sample + (1 - self.alpha) * self.value
        return self.value
