"""Learning-rate schedules over the run's global progress (issue 44 item 5). Pure: no I/O.

DESIGN §3 "The inner learning rate follows the run" and §4.5d.

The progress variable is the run's, not a process's: ``p = run tokens / budget.tokens``, clamped
to [0, 1], where the run tokens are the tokens processed by all learners as the synchronizer counts
them for its token budget (the count it stops on, so ``p`` reaches 1 when the run ends). A
learner is told them (:func:`told_tokens`: rounded down to 0.1% of the budget, so heartbeat
replies stay shared) in its join answer and in every heartbeat answer, so a learner that joins
late or restarts is at the run's point on the inner schedule, not at its start. The synchronizer
takes each fragment's outer learning rate at the same progress when that fragment merges; the
count is in its checkpoints (the learners' ledgers), so a resume continues the schedule.

Not the tokens *merged*: a contribution counts only the steps since the learner last adopted the
fragment (overwrite adoption drops the rest), so the merged tokens end well short of the budget (27%
of it in a two-learner tiny run where adoption lags many steps), and a schedule over them would
never decay.

``torch.optim.lr_scheduler`` counts its own ``step()`` calls: a step count is what must *not*
drive these schedules (a restarted learner's count is its own, and merges per fragment depend on
the quorum and the machine's load), so they are plain functions of the progress. The shapes are
the usual ones:

* ``cosine``: ``m(p) = f + (1 − f)·½(1 + cos(π·p))``, from 1 to the final fraction ``f``;
* ``wsd`` (warmup-stable-decay, Hu et al. 2024, "MiniCPM"): ``m = 1`` until ``p = 1 − d``, then
  linear to ``f`` at ``p = 1`` (``d``: the decay fraction of the budget);
* outer ``linear_warmup``: ``m(p) = min(1, p / w)`` over the first fraction ``w`` of the budget.

The inner learning rate also keeps its linear warm-up over the learner's own first
``warmup_steps`` steps (a fresh AdamW state needs it; a restarted slot continues its step count,
and a late joiner starts at the global step, so neither warms up again), multiplied by ``m(p)``.
``constant`` is that warm-up alone, bit for bit the learning rate of before the schedules.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from diloco_async.config.schema import Config

__all__ = ["INNER_SCHEDULES", "OUTER_SCHEDULES", "progress", "told_tokens", "warmup_lr", "cosine_multiplier",
           "wsd_multiplier",
           "linear_warmup_multiplier", "InnerSchedule", "OuterSchedule"]

INNER_SCHEDULES = ("constant", "cosine", "wsd")
"""Names of ``learners.lr_schedule``."""
OUTER_SCHEDULES = ("constant", "linear_warmup", "cosine")
"""Names of ``synchronizer.outer_lr_schedule``."""


def progress(run_tokens: float, budget_tokens: int | None) -> float:
    """The run's progress ``run_tokens / budget_tokens`` in [0, 1]; 0 without a token budget.

    Raises:
        ValueError: ``run_tokens`` negative or not finite.
    """
    if not (math.isfinite(run_tokens) and run_tokens >= 0):
        raise ValueError(f"run tokens must be finite and >= 0, got {run_tokens}")
    if not budget_tokens:
        return 0.0
    return min(1.0, run_tokens / budget_tokens)


#: the run tokens a learner is told move in steps of this share of budget.tokens
TOLD_STEP_OF_BUDGET = 1000


def told_tokens(tokens_processed: int, budget_tokens: int | None) -> int:
    """The run tokens a learner is told: ``tokens_processed`` rounded down to a multiple of
    ``budget_tokens // 1000`` (at least 1), or 0 without a token budget (nothing follows it then).
    The schedules move by at most 0.1% of their span between two values told."""
    if not budget_tokens:
        return 0
    step = max(1, budget_tokens // TOLD_STEP_OF_BUDGET)
    return tokens_processed // step * step


def warmup_lr(base_lr: float, step: int, warmup_steps: int) -> float:
    """Inner learning rate of the step that follows ``step`` done steps: linear warm-up over
    ``warmup_steps``, ``base_lr * min(1, (step + 1) / max(1, warmup_steps))``. A restarted learner
    continues its step count, so it does not warm up a second time."""
    return base_lr * min(1.0, (step + 1) / max(1, warmup_steps))


def cosine_multiplier(p: float, final_fraction: float) -> float:
    """``f + (1 − f)·½(1 + cos(π·p))``: 1 at ``p = 0``, ``(1 + f)/2`` at ½, ``f`` at 1 (p clamped to [0, 1])."""
    p = min(1.0, max(0.0, p))
    return final_fraction + (1.0 - final_fraction) * 0.5 * (1.0 + math.cos(math.pi * p))


def wsd_multiplier(p: float, decay_fraction: float, final_fraction: float) -> float:
    """Warmup-stable-decay's stable and decay parts: 1 until ``p = 1 − decay_fraction``, then
    linear down to ``final_fraction`` at ``p = 1``.

    Raises:
        ValueError: ``decay_fraction`` outside (0, 1].
    """
    if not 0.0 < decay_fraction <= 1.0:
        raise ValueError(f"wsd decay fraction must be in (0, 1], got {decay_fraction}")
    p = min(1.0, max(0.0, p))
    start = 1.0 - decay_fraction
    if p <= start:
        return 1.0
    return 1.0 - (1.0 - final_fraction) * (p - start) / decay_fraction


def linear_warmup_multiplier(p: float, warmup_fraction: float) -> float:
    """``min(1, p / warmup_fraction)`` (p clamped to [0, 1]).

    Raises:
        ValueError: ``warmup_fraction`` outside (0, 1].
    """
    if not 0.0 < warmup_fraction <= 1.0:
        raise ValueError(f"warm-up fraction must be in (0, 1], got {warmup_fraction}")
    return min(1.0, max(0.0, p) / warmup_fraction)


@dataclass(frozen=True)
class InnerSchedule:
    """The inner learning rate of a run (``learners.lr``, ``warmup_steps``, ``lr_schedule``,
    ``lr_decay_fraction``, ``lr_final_fraction``; ``budget.tokens`` the horizon)."""

    kind: str
    base_lr: float
    warmup_steps: int
    budget_tokens: int | None = None
    decay_fraction: float = 0.2
    final_fraction: float = 0.1

    @classmethod
    def from_config(cls, cfg: Config) -> InnerSchedule:
        lc = cfg.learners
        return cls(lc.lr_schedule, lc.lr, lc.warmup_steps, cfg.budget.tokens, lc.lr_decay_fraction,
                   lc.lr_final_fraction)

    def multiplier(self, run_tokens: float) -> float:
        """The schedule's factor at the run's progress (1 for ``constant``).

        Raises:
            ValueError: an unknown schedule, or ``run_tokens`` negative or not finite.
        """
        p = progress(run_tokens, self.budget_tokens)
        if self.kind == "constant":
            return 1.0
        if self.kind == "cosine":
            return cosine_multiplier(p, self.final_fraction)
        if self.kind == "wsd":
            return wsd_multiplier(p, self.decay_fraction, self.final_fraction)
        raise ValueError(f"unknown learners.lr_schedule {self.kind!r}; known: {', '.join(INNER_SCHEDULES)}")

    def lr(self, step: int, run_tokens: float = 0.0) -> float:
        """The learning rate of the step after ``step`` done steps, at ``run_tokens`` tokens processed
        by the run: the warm-up times :meth:`multiplier` (``constant``: the warm-up alone, unchanged)."""
        warm = warmup_lr(self.base_lr, step, self.warmup_steps)
        return warm if self.kind == "constant" else warm * self.multiplier(run_tokens)


@dataclass(frozen=True)
class OuterSchedule:
    """The outer learning rate η of one fragment's steps (``synchronizer.outer_lr``,
    ``outer_lr_schedule``, ``outer_lr_warmup_fraction``, ``outer_lr_final_fraction``;
    ``budget.tokens`` the horizon)."""

    kind: str
    base_lr: float
    budget_tokens: int | None = None
    warmup_fraction: float = 0.1
    final_fraction: float = 0.1

    @classmethod
    def from_config(cls, cfg: Config) -> OuterSchedule:
        sc = cfg.synchronizer
        return cls(sc.outer_lr_schedule, sc.outer_lr, cfg.budget.tokens, sc.outer_lr_warmup_fraction,
                   sc.outer_lr_final_fraction)

    def lr(self, run_tokens: float) -> float:
        """η of an outer step taken when the run has processed ``run_tokens`` tokens (always > 0:
        ``constant`` gives ``outer_lr`` itself).

        Raises:
            ValueError: an unknown schedule, or ``run_tokens`` negative or not finite.
        """
        p = progress(run_tokens, self.budget_tokens)
        if self.kind == "constant":
            return self.base_lr
        if self.kind == "linear_warmup":
            m = linear_warmup_multiplier(p, self.warmup_fraction)
        elif self.kind == "cosine":
            m = cosine_multiplier(p, self.final_fraction)
        else:
            raise ValueError(f"unknown synchronizer.outer_lr_schedule {self.kind!r}; known: "
                             f"{', '.join(OUTER_SCHEDULES)}")
        return self.base_lr * max(m, 1e-6)  # the optimizer takes η > 0 (a warm-up's first merge may come at p = 0)
