"""Pace limits (issue 14, items 3-4; issue 47): how fast a learner's reported progress can plausibly
grow, calibrated to what the synchronizer measured that learner doing.

A learner reports its local step and tokens processed in heartbeats, and c_steps and c_tokens with
each contribution. None of it can be verified, but all of it is bounded by wall time: in ``dt``
seconds a learner cannot take more than ``burst_steps + r · dt`` inner steps, nor process more
than ``max_tokens_per_step`` tokens per step, however many messages it sends (the burst is a
token bucket, :class:`PaceBurst`: a message spends it and the rate refills it, it does not renew
per message). The rate bound ``r`` is this learner's own:

* ``initial_steps_per_s`` until the synchronizer has heard the learner stepping for ``warmup_s``
  seconds (its pace is not measured yet);
* then ``max(floor_steps_per_s, tolerance · m)``, with ``m`` its measured pace: the steps the
  synchronizer credited it divided by the seconds it heard it, since its first heartbeat that
  advanced its step (:class:`PaceMeter`).

The measurement counts *credited* steps (after the clamp), so a sudden jump is clamped (and a
contribution claiming it refused) before it can raise the bound; the bound follows a learner
that speeds up by less than ``tolerance`` over its whole history so far. The synchronizer accepts a
report up to the bound and counts what it clamped (a clamped heartbeat still proves liveness;
the rest of its progress is credited at the next heartbeats, so an honest learner loses nothing);
a contribution beyond it is rejected.

The same measurement gives the step time of the grace window (paper Eq. 3): seconds heard per
step credited, over roughly the last :data:`RECENT_S` seconds (:meth:`PaceMeter.step_time_s`),
clamped against the live learners' lower median (:func:`clamp_step_times`). A learner's
self-reported step time plays no part in it.

Pure: plain values in (times in seconds on any clock), decisions with reasons out.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from diloco_async.config.schema import Config

__all__ = ["RECENT_S", "CREDIT_S", "PaceMeter", "PaceBurst", "PaceLimits", "PaceBound", "bounded_advance",
           "implausible_contribution", "clamp_step_times"]

#: time constant (s) of a learner's recent pace, the step time of the grace window: long enough
#: to span many heartbeats (0.25 s each by default), short enough to follow a learner that slowed down
RECENT_S = 30.0

#: seconds of credit a :class:`PaceMeter` holds: a heartbeat that comes late (its steps arrive with
#: the next one, after a short interval) is measured in full when it is at most this late
CREDIT_S = 2.0


@dataclass
class PaceMeter:
    """One learner's pace as the synchronizer measured it from its heartbeats.

    The measurement starts at the first heartbeat that advanced the learner's step (start-up and
    model loading before it do not count). Each later heartbeat adds the seconds since the
    previous one and the steps credited to it (after the pace clamp), drawn from a credit that
    refills at a given rate (:meth:`PaceLimits.credit_rate`) and holds :data:`CREDIT_S` seconds of
    it: the heartbeat's own bound is wider (a burst, a window over two heartbeat periods), and
    measured in full, what a heartbeat may claim would raise the bound again at every heartbeat.
    The first heartbeat after the learner was lost (:meth:`silence`) adds nothing (its silence is
    no measure of its pace).

    Attributes:
        started: a heartbeat advanced the step; the measurement runs.
        silent: the learner was lost since its last heartbeat; the next one is not measured.
        credit: steps that may still be credited.
        steps, heard_s: credited steps and seconds heard since the start (the pace bound's
            measurement: a long memory, so it rises slowly).
        recent_steps, recent_heard_s: the same, each decayed by ``exp(-dt / RECENT_S)`` (the grace
            window's step time: follows a learner that slowed down within about ``RECENT_S``), taken
            only at a heartbeat that was credited steps: the seconds of the heartbeats before it that
            advanced nothing wait in ``stalled_s`` until then, so a learner that stops stepping (a
            stall, or a learner heartbeating without training) does not raise its step time, and with
            it the grace window, while it stalls; once it steps again its step time counts them.
        stalled_s: seconds heard since the last credited heartbeat, not yet in the recent figures.
    """

    started: bool = False
    silent: bool = False
    credit: float = 0.0
    steps: float = 0.0
    heard_s: float = 0.0
    recent_steps: float = 0.0
    recent_heard_s: float = 0.0
    stalled_s: float = 0.0

    def rejoined(self) -> PaceMeter:
        """The meter of the slot's next incarnation: the same measurement, its first heartbeat not
        measured (the restart's gap is no measure of its pace), so a learner that rejoins keeps the
        bound it earned rather than going back to the initial one (issue 47)."""
        nxt = replace(self)
        nxt.silence()
        return nxt

    def silence(self) -> None:
        """The learner was lost (or the synchronizer restarted): its next heartbeat is not measured."""
        self.silent = True

    def record(self, advance: int, interval_s: float, credit_steps_per_s: float) -> None:
        """A heartbeat: its step advanced by ``advance`` (≥ 0, after the clamp) ``interval_s``
        seconds after the previous message; the credit refills at ``credit_steps_per_s`` first."""
        if self.silent:
            self.silent = False
            return
        if not self.started:
            self.started = advance > 0
            return
        interval_s = max(interval_s, 0.0)
        self.credit = min(self.credit + credit_steps_per_s * interval_s, credit_steps_per_s * CREDIT_S)
        credited = min(float(max(advance, 0)), self.credit)
        self.credit -= credited
        self.steps += credited
        self.heard_s += interval_s
        if credited <= 0:
            self.stalled_s += interval_s
            return
        since_s, self.stalled_s = self.stalled_s + interval_s, 0.0
        decay = math.exp(-since_s / RECENT_S)
        self.recent_steps = self.recent_steps * decay + credited
        self.recent_heard_s = self.recent_heard_s * decay + since_s

    def steps_per_s(self) -> float | None:
        """The measured pace (steps/s) over the whole measurement; None before any second was heard."""
        return self.steps / self.heard_s if self.heard_s > 0 else None

    def step_time_s(self) -> float | None:
        """Seconds per step over about the last ``RECENT_S`` seconds; None before a step was measured."""
        return self.recent_heard_s / self.recent_steps if self.recent_steps > 0 else None

    def to_json(self) -> dict:
        """What a checkpoint keeps (the recent part starts again from the whole measurement)."""
        return {"started": self.started, "steps": self.steps, "heard_s": self.heard_s}

    @classmethod
    def from_json(cls, d: Mapping | None) -> PaceMeter:
        """A meter from :meth:`to_json` (a checkpoint without one: a meter that has not started)."""
        if not d:
            return cls()
        steps, heard_s = float(d.get("steps", 0.0)), float(d.get("heard_s", 0.0))
        return cls(started=bool(d.get("started", False)), steps=steps, heard_s=heard_s, recent_steps=steps,
                   recent_heard_s=heard_s)


@dataclass
class PaceBurst:
    """What is left of one learner's burst, in steps and in tokens (None: all of it, as at a join).

    A token bucket of at most ``burst_steps`` (tokens: times ``max_tokens_per_step``) that the rate
    bound refills and each message spends, so the burst does not renew per message: a learner that
    sent a heartbeat every millisecond, each allowed ``burst_steps`` on top of the rate, had 64,000
    steps/s credited. A message's allowance is what is left plus ``r`` × its window, which starts at
    the receipt of the message before the last one that advanced the counter (why:
    :func:`implausible_contribution`); consecutive windows overlap by the interval the next window
    counts again, so what a message leaves is its unused allowance less ``r`` × that overlap, at
    most the burst (:meth:`PaceBound.left_after`; it may be negative). Over any run of messages a
    learner is so credited at most ``burst_steps + r · T`` steps, ``T`` the seconds their windows
    cover (from the start of the first one's window to the last one's receipt) and ``r`` the
    highest bound meanwhile; an honest learner at up to ``r`` loses nothing (the steps it reports
    in that run were taken within those seconds).
    """

    steps: float | None = None
    tokens: float | None = None

    def rejoined(self) -> PaceBurst:
        """The burst of a new incarnation of the learner (its window starts at its join): what was
        left, no more (a rejoin does not refill it), no debt (its new window counts nothing again)."""
        return PaceBurst(*(None if left is None else max(left, 0.0) for left in (self.steps, self.tokens)))

    def to_json(self) -> dict:
        """What a checkpoint keeps."""
        return {"steps": self.steps, "tokens": self.tokens}

    @classmethod
    def from_json(cls, d: Mapping | None) -> PaceBurst:
        """A burst from :meth:`to_json` (a checkpoint without one: full)."""
        d = d or {}
        return cls(*(None if d.get(k) is None else float(d[k]) for k in ("steps", "tokens")))


@dataclass(frozen=True)
class PaceBound:
    """The most one learner can have done: what is left of its burst (``steps_left``, at most
    ``burst_steps``; None: all of it) plus ``steps_per_s`` (steps/s) times the seconds of its
    window, ``max_tokens_per_step`` tokens a step (``tokens_left``: its burst of tokens left);
    ``reason`` says where the rate comes from."""

    steps_per_s: float
    burst_steps: int
    max_tokens_per_step: int
    reason: str
    steps_left: float | None = None
    tokens_left: float | None = None

    def steps_within(self, dt_s: float) -> int:
        """Most inner steps in ``dt_s`` seconds (a negative ``dt_s`` counts as 0), at least 0."""
        return max(0, math.floor(self.burst_left() + max(dt_s, 0.0) * self.steps_per_s))

    def tokens_within(self, dt_s: float) -> int:
        """Most tokens processed in ``dt_s`` seconds, at least 0."""
        rate = self.steps_per_s * self.max_tokens_per_step
        return max(0, math.floor(self.burst_left(tokens=True) + max(dt_s, 0.0) * rate))

    def left_after(self, window_s: float, credited: int, recounted_s: float, *, tokens: bool = False) -> float:
        """What a message leaves of the burst (steps, or tokens with ``tokens``; :class:`PaceBurst`):
        what was left plus the rate × its window of ``window_s`` seconds, less what was ``credited``
        to it and less the rate × ``recounted_s``, the seconds of that window that the next window
        counts again; at most the burst. At least ``-rate × recounted_s`` when ``credited`` is at
        most the message's allowance."""
        per_step = self.max_tokens_per_step if tokens else 1
        refill = self.steps_per_s * per_step * max(window_s - max(recounted_s, 0.0), 0.0)
        return min(float(self.burst_steps * per_step), self.burst_left(tokens=tokens) + refill - max(credited, 0))

    def burst_left(self, *, tokens: bool = False) -> float:
        """Steps (or tokens) of the burst left; negative: the part of the last window that the
        next window counts again was used (:class:`PaceBurst`)."""
        per_step = self.max_tokens_per_step if tokens else 1
        left = self.tokens_left if tokens else self.steps_left
        return self.burst_steps * per_step if left is None else min(left, self.burst_steps * per_step)


@dataclass(frozen=True)
class PaceLimits:
    """The pace policy: ``initial_steps_per_s`` before a learner's pace is measured (for its first
    ``warmup_s`` seconds heard stepping), then ``tolerance`` × its measured steps/s, at least
    ``floor_steps_per_s``; ``burst_steps`` at once; ``max_tokens_per_step`` (tokens). The
    measurement credits at most ``growth`` × the measured pace (:meth:`credit_rate`).

    Raises:
        ValueError: a rate or the warm-up not positive, a tolerance or growth under 1, a negative burst.
    """

    initial_steps_per_s: float
    tolerance: float
    floor_steps_per_s: float
    warmup_s: float
    burst_steps: int
    max_tokens_per_step: int
    growth: float = 1.25

    def __post_init__(self) -> None:
        if min(self.initial_steps_per_s, self.floor_steps_per_s, self.warmup_s) <= 0:
            raise ValueError(f"pace rates and warm-up must be > 0, got initial {self.initial_steps_per_s}, "
                             f"floor {self.floor_steps_per_s}, warm-up {self.warmup_s}s")
        if min(self.tolerance, self.growth) < 1 or self.burst_steps < 0:
            raise ValueError(f"pace tolerance and growth must be >= 1 and burst >= 0, got {self.tolerance}, "
                             f"{self.growth}, {self.burst_steps}")

    @classmethod
    def from_config(cls, cfg: Config) -> PaceLimits:
        """The ``[guard]`` limits; ``max_tokens_per_step`` unset is 2 · ranks · grad_accum_steps · batch_size ·
        context with the largest per-learner batch size (a step of a learner of ``ranks`` processes trains on
        that many tokens; the weight c_tokens²/c_steps of a learner that claims the most is then at most 4
        times an honest one's)."""
        g = cfg.guard
        lc = cfg.learners
        batch = max(lc.batch_size) if isinstance(lc.batch_size, list) else lc.batch_size
        per_step = g.max_tokens_per_step or 2 * lc.ranks_per_learner * lc.grad_accum_steps * batch * cfg.model.context
        return cls(g.pace_initial_steps_per_s, g.pace_tolerance, g.pace_floor_steps_per_s, g.pace_warmup_s,
                   g.burst_steps, per_step, g.pace_growth)

    def _measured(self, meter: PaceMeter | None) -> float | None:
        """The measured pace (steps/s) once the warm-up is over, else None."""
        return meter.steps_per_s() if meter is not None and meter.heard_s >= self.warmup_s else None

    def credit_rate(self, meter: PaceMeter | None) -> float:
        """Steps/s the measurement of a learner with ``meter`` may credit: ``initial_steps_per_s`` in
        its warm-up, then ``growth`` × its measured pace, at least the floor. The measured pace of a
        learner that claims the most it may at every heartbeat so grows only as (time)^(growth - 1):
        its bound about doubles each time its measured seconds are multiplied by 16 (growth 1.25),
        while an honest learner that speeds up is measured at its new pace within seconds (and
        ``tolerance`` covers the speed-up meanwhile)."""
        measured = self._measured(meter)
        if measured is None:
            return self.initial_steps_per_s
        return max(self.floor_steps_per_s, self.growth * measured)

    def bound(self, meter: PaceMeter | None, burst: PaceBurst | None = None) -> PaceBound:
        """The bound of a learner with ``meter`` (None: nothing measured, as in its warm-up) and
        ``burst`` left (None: all of it)."""
        measured = self._measured(meter)
        if measured is None:
            rate, why = self.initial_steps_per_s, "initial, pace not measured yet"
        elif self.tolerance * measured >= self.floor_steps_per_s:
            rate, why = self.tolerance * measured, f"{self.tolerance:g} x measured {measured:.1f} steps/s"
        else:
            rate, why = self.floor_steps_per_s, f"floor; measured {measured:.1f} steps/s"
        burst = burst or PaceBurst()
        return PaceBound(rate, self.burst_steps, self.max_tokens_per_step, why, burst.steps, burst.tokens)


def bounded_advance(prev: int, reported: int, allowance: int) -> tuple[int, bool]:
    """A cumulative counter's new value: ``reported``, but at most ``prev + allowance``.

    Returns:
        (the value to keep, whether ``reported`` was clamped). A ``reported`` below ``prev`` is
        kept as it is (a counter may restart; the caller decides what a decrease means).
    """
    limit = prev + allowance
    if reported > limit:
        return limit, True
    return reported, False


def implausible_contribution(*, c_steps: int, c_tokens: int, learner_step: int, since_anchor_s: float,
                             bound: PaceBound) -> str | None:
    """Why a contribution's counters are impossible, as ``"<code>: <detail>"``, or None.

    ``implausible_tokens``: more than ``max_tokens_per_step`` tokens per inner step.
    ``implausible_steps``: more inner steps than the learner's last reported (bounded) step plus
    what it can have done in ``since_anchor_s`` seconds at its rate bound, plus what is left of its
    burst (``bound.steps_left``: the same allowance as a heartbeat received now; an announcement
    spends nothing, it only reads it): since the synchronizer received the message before that
    heartbeat (the learner composed the heartbeat after that one was answered, so its step was
    reached no earlier; counting from the heartbeat's own receipt made a heartbeat late in transit
    shrink an honest learner's allowance).
    """
    if c_tokens > c_steps * bound.max_tokens_per_step:
        return (f"implausible_tokens: c_tokens {c_tokens} > c_steps {c_steps} x {bound.max_tokens_per_step} "
                "tokens per step")
    most = learner_step + bound.steps_within(since_anchor_s)
    if c_steps > most:
        return (f"implausible_steps: c_steps {c_steps} > step {learner_step} + burst left {bound.burst_left():.0f} "
                f"+ what {since_anchor_s:.1f}s allow at {bound.steps_per_s:.0f} steps/s ({bound.reason}) = {most}")
    return None


def clamp_step_times(times: Sequence[float], *, max_s: float, multiple: float) -> list[float]:
    """Measured step times (s) of the live learners (:meth:`PaceMeter.step_time_s`), each clamped
    to at most ``max_s`` and to ``multiple`` times their lower median, so one learner cannot stretch
    the grace window (paper Eq. 3 uses the slowest learner's step time) beyond what its peers make
    plausible."""
    if not times:
        return []
    cap = min(max_s, multiple * statistics.median_low(times))
    return [min(t, cap) for t in times]
