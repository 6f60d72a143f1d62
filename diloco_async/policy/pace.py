"""Pace limits (issue 14, items 3-4): how fast a learner's reported progress can plausibly grow.

A learner reports its local step, step time and tokens processed in heartbeats, and c_steps and
c_tokens with each contribution. None of it can be verified, but all of it is bounded by wall
time: in ``dt`` seconds a learner cannot take more than ``burst_steps + max_steps_per_s · dt``
inner steps, nor process more than ``max_tokens_per_step`` tokens per step. The synchronizer
accepts a report up to that bound and counts what it clamped (a clamped heartbeat still proves
liveness; the rest of its progress is credited at the next heartbeats, so an honest learner
loses nothing); a contribution beyond it is rejected.

Pure: plain values in (times in seconds on any clock), decisions with reasons out.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from diloco_async.config.schema import Config

__all__ = ["PaceLimits", "bounded_advance", "implausible_contribution", "clamp_step_times"]


@dataclass(frozen=True)
class PaceLimits:
    """The fastest plausible learner: ``max_steps_per_s`` (steps/s), ``burst_steps`` at once,
    ``max_tokens_per_step`` (tokens)."""

    max_steps_per_s: float
    burst_steps: int
    max_tokens_per_step: int

    @classmethod
    def from_config(cls, cfg: Config) -> PaceLimits:
        """The ``[guard]`` limits; ``max_tokens_per_step`` unset is 2 · ranks · batch_size · context with the
        largest per-learner batch size (a step of a learner of ``ranks`` processes trains on that many tokens;
        the weight c_tokens²/c_steps of a learner that claims the most is then at most 4 times an honest
        one's)."""
        g = cfg.guard
        lc = cfg.learners
        batch = max(lc.batch_size) if isinstance(lc.batch_size, list) else lc.batch_size
        per_step = g.max_tokens_per_step or 2 * lc.ranks_per_learner * batch * cfg.model.context
        return cls(g.max_steps_per_s, g.burst_steps, per_step)

    def steps_within(self, dt_s: float) -> int:
        """Most inner steps in ``dt_s`` seconds (a negative ``dt_s`` counts as 0)."""
        return self.burst_steps + math.floor(max(dt_s, 0.0) * self.max_steps_per_s)

    def tokens_within(self, dt_s: float) -> int:
        """Most tokens processed in ``dt_s`` seconds."""
        return self.steps_within(dt_s) * self.max_tokens_per_step


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
                             limits: PaceLimits) -> str | None:
    """Why a contribution's counters are impossible, as ``"<code>: <detail>"``, or None.

    ``implausible_tokens``: more than ``max_tokens_per_step`` tokens per inner step.
    ``implausible_steps``: more inner steps than the learner's last reported (bounded) step plus
    what it can have done in ``since_anchor_s`` seconds: since the synchronizer received the
    message before that heartbeat (the learner composed the heartbeat after that one was
    answered, so its step was reached no earlier; counting from the heartbeat's own receipt
    made a heartbeat late in transit shrink an honest learner's allowance).
    """
    if c_tokens > c_steps * limits.max_tokens_per_step:
        return (f"implausible_tokens: c_tokens {c_tokens} > c_steps {c_steps} x {limits.max_tokens_per_step} "
                "tokens per step")
    most = learner_step + limits.steps_within(since_anchor_s)
    if c_steps > most:
        return (f"implausible_steps: c_steps {c_steps} > step {learner_step} + what {since_anchor_s:.1f}s "
                f"allow = {most}")
    return None


def clamp_step_times(times: Sequence[float], *, max_s: float, multiple: float) -> list[float]:
    """Reported step times (s) of the live learners, each clamped to at most ``max_s`` and to
    ``multiple`` times their lower median, so one learner cannot stretch the grace window
    (paper Eq. 3 uses the slowest learner's step time) beyond what its peers make plausible."""
    if not times:
        return []
    cap = min(max_s, multiple * statistics.median_low(times))
    return [min(t, cap) for t in times]
