"""Replayable asynchrony (issue 44 item 2; DESIGN §3.2): a seeded model of each learner's inner-step
time, a virtual clock, and the release rule of a conservative discrete-event schedule.

With ``run.schedule = "replay"`` the synchronizer's actor is the scheduler: each learner's step
boundary is an event at the virtual time its seeded step times add up to (:class:`VirtualSteps`), and
the actor applies the events in (virtual time, learner id) order (:class:`ReplayScheduler`), an event
at time t only once every other learner's next event is known to come later in that order. Real
compute time never enters a decision, so two runs of one seed and recipe take the same decisions.

Pure: no I/O, no wall clock; the virtual clock is a value the actor sets (:class:`VirtualClock`).
"""

from __future__ import annotations

import hashlib
import math
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from diloco_async.config.replay import JITTER_CLIP, SPEED_CLIP_SIGMAS

__all__ = ["VirtualClock", "VirtualSteps", "VirtualTimeline", "ReplayScheduler", "Release", "learner_index",
           "JITTER_CLIP", "SPEED_CLIP_SIGMAS"]

T = TypeVar("T")


class VirtualClock:
    """The replay's clock: seconds of virtual time, moved forward only by :meth:`advance`; an
    instance is a ``clock()`` callable like ``time.monotonic``."""

    def __init__(self, start_s: float = 0.0) -> None:
        self.now_s = float(start_s)

    def __call__(self) -> float:
        return self.now_s

    def advance(self, to_s: float) -> None:
        """Move to ``to_s``.

        Raises:
            ValueError: ``to_s`` is before now (virtual time never goes back).
        """
        if to_s < self.now_s:
            raise ValueError(f"virtual time goes forward only: now {self.now_s!r} s, asked for {to_s!r} s")
        self.now_s = float(to_s)


def learner_index(learner_id: str) -> int | None:
    """The index ``i`` of a learner named ``learner-{i}`` (how runs name their learners), else None."""
    m = re.fullmatch(r"learner-(\d+)", learner_id)
    return int(m.group(1)) if m else None


def _unit_random(*parts: object) -> random.Random:
    """A :class:`random.Random` seeded by ``parts`` alone (sha256 of their text: the same in every
    process, whatever PYTHONHASHSEED is)."""
    digest = hashlib.sha256("/".join(str(p) for p in parts).encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


@dataclass(frozen=True)
class VirtualSteps:
    """The seeded inner-step times of one learner, in virtual seconds.

    Step ``k`` (the step that takes the learner from local step k to k + 1) lasts
    ``step_s / speed × (1 + min(|N(0, jitter)|, JITTER_CLIP · jitter))``, the noise drawn from
    (seed, learner, k) alone, so any process computes the same value. ``speed`` is
    ``speed_factors[i]`` for learner ``learner-{i}`` when listed (the chaos scenarios' emulated
    hardware speeds, ``faults.speed_factors``), else a seeded lognormal ``exp(N(0, speed_spread))``
    clipped at :data:`SPEED_CLIP_SIGMAS` spreads (1.0 when ``speed_spread`` is 0).

    Args:
        seed: the run's seed (``run.seed``).
        learner_id: the learner.
        step_s: nominal seconds of one inner step at speed 1 (``replay.step_s``), > 0.
        speed_factors: per learner index, in (0, 1] (``faults.speed_factors``).
        jitter: relative per-step noise (``faults.step_jitter``), >= 0.
        speed_spread: sigma of the lognormal speed of learners not in ``speed_factors``, >= 0.

    Raises:
        ValueError: ``step_s`` not > 0, ``jitter`` or ``speed_spread`` negative (the value is named).
    """

    seed: int
    learner_id: str
    step_s: float
    speed_factors: Sequence[float] = ()
    jitter: float = 0.0
    speed_spread: float = 0.0

    def __post_init__(self) -> None:
        if not (self.step_s > 0 and math.isfinite(self.step_s)):
            raise ValueError(f"replay step time must be a finite number > 0 s, got {self.step_s!r}")
        if not self.jitter >= 0 or not self.speed_spread >= 0:
            raise ValueError(f"replay jitter and speed spread must be >= 0, got {self.jitter!r} and "
                             f"{self.speed_spread!r}")

    @property
    def speed(self) -> float:
        """This learner's speed (1.0: nominal)."""
        i = learner_index(self.learner_id)
        if i is not None and i < len(self.speed_factors):
            return float(self.speed_factors[i])
        if self.speed_spread == 0:
            return 1.0
        z = _unit_random(self.seed, "speed", self.learner_id).gauss(0.0, 1.0)
        return math.exp(self.speed_spread * max(-SPEED_CLIP_SIGMAS, min(SPEED_CLIP_SIGMAS, z)))

    def duration_s(self, step: int) -> float:
        """Virtual seconds of inner step ``step`` (from local step ``step`` to ``step + 1``)."""
        noise = 0.0
        if self.jitter > 0:
            noise = min(abs(_unit_random(self.seed, "step", self.learner_id, step).gauss(0.0, self.jitter)),
                        JITTER_CLIP * self.jitter)
        return self.step_s / self.speed * (1.0 + noise)

    def slowest_s(self) -> float:
        """The longest any step of this learner can last (virtual seconds)."""
        return self.step_s / self.speed * (1.0 + JITTER_CLIP * self.jitter)


@dataclass(frozen=True)
class Release(Generic[T]):
    """An event the scheduler releases: learner ``learner_id``'s at virtual time ``t_s``, with its payload."""

    t_s: float
    learner_id: str
    payload: T


class ReplayScheduler(Generic[T]):
    """The release rule of the replay (conservative discrete-event scheduling, one event pending per
    learner at most).

    Each learner is *pending* (its next event is held: :meth:`hold`) or *running* (it computes; its
    next event will come at a known virtual time, its *bound*, at the earliest). Events are totally
    ordered by (virtual time, learner id); :meth:`next_release` gives the first pending event once no
    learner can still send one that comes before it: every other learner is pending with a later
    event or running with a later bound, and every one of ``expected`` learners has been heard of.
    A learner that leaves (:meth:`leave`) holds nothing back any more.

    Args:
        expected: how many learners the run has (``learners.count``); nothing is released before
            that many are known (a learner not yet joined could send an event at time 0).

    Raises:
        ValueError: ``expected`` < 1.
    """

    def __init__(self, expected: int) -> None:
        if expected < 1:
            raise ValueError(f"a replay needs at least one learner, got expected={expected!r}")
        self.expected = expected
        self._bound: dict[str, float] = {}  # running learner -> virtual time of its next event, at the earliest
        self._pending: dict[str, tuple[float, T]] = {}
        self._left: set[str] = set()

    def join(self, learner_id: str, first_t_s: float = 0.0) -> None:
        """A learner is known; its first event comes at ``first_t_s`` at the earliest (a rejoin keeps
        the larger bound)."""
        self._left.discard(learner_id)
        if learner_id not in self._pending:
            self._bound[learner_id] = max(first_t_s, self._bound.get(learner_id, first_t_s))

    def hold(self, learner_id: str, t_s: float, payload: T) -> None:
        """Hold learner ``learner_id``'s next event, at virtual time ``t_s``.

        Raises:
            ValueError: the learner is unknown, already has an event held, or ``t_s`` comes before
                its bound (the event would change the past); the message names the values.
        """
        if learner_id in self._pending:
            held_s = self._pending[learner_id][0]
            raise ValueError(f"learner {learner_id!r} already has an event held at t={held_s!r} s")
        bound = self._bound.get(learner_id)
        if bound is None:
            raise ValueError(f"learner {learner_id!r} is not known to the replay (joined: {sorted(self._bound)})")
        if t_s < bound:
            raise ValueError(f"learner {learner_id!r} sent an event at t={t_s!r} s, before its bound {bound!r} s")
        del self._bound[learner_id]
        self._pending[learner_id] = (t_s, payload)

    def held(self, learner_id: str) -> T | None:
        """The payload of ``learner_id``'s held event, if any."""
        held = self._pending.get(learner_id)
        return held[1] if held is not None else None

    def replace(self, learner_id: str, payload: T) -> bool:
        """Swap the payload of ``learner_id``'s held event (a request sent again); False: none held."""
        if learner_id not in self._pending:
            return False
        self._pending[learner_id] = (self._pending[learner_id][0], payload)
        return True

    def leave(self, learner_id: str) -> T | None:
        """``learner_id`` sends no more events; returns the payload it had held, if any."""
        self._bound.pop(learner_id, None)
        self._left.add(learner_id)
        held = self._pending.pop(learner_id, None)
        return held[1] if held is not None else None

    def next_release(self) -> Release[T] | None:
        """The first pending event in (time, learner id) order, if nothing can come before it; else None."""
        if not self._pending or len(self._bound) + len(self._pending) + len(self._left) < self.expected:
            return None
        lid, (t_s, payload) = min(self._pending.items(), key=lambda kv: (kv[1][0], kv[0]))
        if any((bound, other) < (t_s, lid) for other, bound in self._bound.items()):
            return None
        return Release(t_s, lid, payload)

    def release(self, learner_id: str, next_t_s: float) -> None:
        """Take ``learner_id``'s event out (applied); its next event comes at ``next_t_s`` at the earliest.

        Raises:
            ValueError: nothing held for ``learner_id``, or ``next_t_s`` before the event released.
        """
        if learner_id not in self._pending:
            raise ValueError(f"learner {learner_id!r} has no event held to release")
        t_s, _ = self._pending.pop(learner_id)
        if next_t_s < t_s:
            raise ValueError(f"learner {learner_id!r}: next event at {next_t_s!r} s is before this one at {t_s!r} s")
        self._bound[learner_id] = next_t_s

    def horizon_s(self) -> float:
        """The earliest virtual time at which a learner event can still come (0 while a learner is
        missing; infinity when every learner has left)."""
        if len(self._bound) + len(self._pending) + len(self._left) < self.expected:
            return 0.0
        return min([*self._bound.values(), *(t for t, _ in self._pending.values())], default=math.inf)

    def waiting_for(self) -> list[str]:
        """The running learners the replay waits for: those whose next event could come before the
        first one held; with none held, the one whose next event comes first."""
        first = min(((t, lid) for lid, (t, _) in self._pending.items()), default=None)
        if first is None:
            nxt = min(((bound, lid) for lid, bound in self._bound.items()), default=None)
            return [] if nxt is None else [nxt[1]]
        return sorted(other for other, bound in self._bound.items() if (bound, other) < first)

    def pending_ids(self) -> list[str]:
        return sorted(self._pending)


class VirtualTimeline:
    """The virtual time of each step boundary of one learner: boundary ``k`` (before inner step k,
    local step k done) at the sum of the durations of steps ``start``..k-1, from ``start_s``
    (:class:`VirtualSteps`); computed forward once, so asking boundary after boundary is O(1) each."""

    def __init__(self, steps: VirtualSteps, start_step: int = 0, start_s: float = 0.0) -> None:
        self.steps = steps
        self._step, self._t_s = start_step, start_s
        self._start = (start_step, start_s)

    def at(self, step: int) -> float:
        """Virtual seconds of boundary ``step``.

        Raises:
            ValueError: ``step`` before the timeline's start (the message names both).
        """
        if step < self._start[0]:
            raise ValueError(f"step {step!r} comes before this learner's first replayed step {self._start[0]!r}")
        if step < self._step:
            self._step, self._t_s = self._start
        while self._step < step:
            self._t_s += self.steps.duration_s(self._step)
            self._step += 1
        return self._t_s
