"""Goodput definitions (DESIGN §7, paper §5.1). Pure: no I/O, no clock.

One definition shared by the real runs (synchronizer ledger), the chaos harness and the simulator:

* compute goodput = useful learner-seconds / provisioned learner-seconds;
* token goodput   = tokens merged / tokens processed;
* uptime          = share of wall time in which the global model advanced, where a gap between
  two merges longer than ``max_gap_s`` counts as down for the part beyond ``max_gap_s``.

A learner-second is *useful* when it was spent on inner steps whose contribution was merged.
Every other provisioned learner-second is *badput*, and the synchronizer's ledger splits it by
cause (:data:`BADPUT_CAUSES`): compute goodput + the badput fractions = 1.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "BADPUT_CAUSES",
    "Goodputs",
    "LearnerLedger",
    "MergeGaps",
    "compute_goodput",
    "token_goodput",
    "uptime",
]


#: Causes of badput, each a share of the provisioned learner-seconds that was not useful (DESIGN §7):
#: ``down`` (silent and came back as a new process, or still silent), ``starting`` (a slot's first
#: process, from its start to its join), ``restarting`` (the same for every later process),
#: ``stalled`` (silent and came back as the same process: frozen), ``blocked`` (waiting on the
#: synchronizer or on peers, as the learner reports it), ``thrown_away`` (compute of contributions
#: that were announced and not merged: late or rejected) and ``other``: the rest (compute not yet
#: announced or never announced, e.g. lost in a crash, and communication, adoption, idle time).
BADPUT_CAUSES = ("down", "starting", "restarting", "stalled", "blocked", "thrown_away", "other")
OBSERVED_CAUSES = BADPUT_CAUSES[:-1]
"""The causes the ledger counts seconds of; ``other`` is what remains."""


def compute_goodput(useful_s: float, provisioned_s: float) -> float:
    """Useful over provisioned learner-seconds, in [0, 1]; 0 when nothing was provisioned.

    Raises:
        ValueError: a negative input, or ``useful_s`` larger than ``provisioned_s`` by more than
            rounding (1e-9 relative).
    """
    if useful_s < 0 or provisioned_s < 0:
        raise ValueError(f"seconds must be >= 0, got useful={useful_s}, provisioned={provisioned_s}")
    if provisioned_s == 0:
        return 0.0
    if useful_s > provisioned_s * (1 + 1e-9):
        raise ValueError(f"useful_s={useful_s} exceeds provisioned_s={provisioned_s}")
    return min(1.0, useful_s / provisioned_s)


def token_goodput(tokens_merged: float, tokens_processed: float) -> float:
    """Tokens merged over tokens processed, in [0, 1]; 0 when nothing was processed."""
    if tokens_merged < 0 or tokens_processed < 0:
        raise ValueError(f"tokens must be >= 0, got {tokens_merged}, {tokens_processed}")
    if tokens_processed == 0:
        return 0.0
    return min(1.0, tokens_merged / tokens_processed)


def uptime(merge_times_s: Iterable[float], start_s: float, end_s: float, max_gap_s: float) -> float:
    """Share of ``[start_s, end_s]`` in which the global model advanced (DESIGN §7).

    Every gap between consecutive events (start, each merge, end) longer than ``max_gap_s``
    contributes its excess over ``max_gap_s`` as downtime. Times are seconds on one clock.

    Raises:
        ValueError: ``end_s < start_s`` or ``max_gap_s < 0``.
    """
    if end_s < start_s:
        raise ValueError(f"end_s={end_s} is before start_s={start_s}")
    if max_gap_s < 0:
        raise ValueError(f"max_gap_s must be >= 0, got {max_gap_s}")
    span = end_s - start_s
    if span == 0:
        return 1.0
    points = [start_s] + sorted(t for t in merge_times_s if start_s <= t <= end_s) + [end_s]
    down = sum(max(0.0, b - a - max_gap_s) for a, b in zip(points, points[1:], strict=False))
    return max(0.0, 1.0 - down / span)


@dataclass
class MergeGaps:
    """The merge times that :func:`uptime` needs, kept in memory that grows with outages only.

    A gap between merges no longer than ``min_gap_s`` never counts as down when uptime is asked
    with ``max_gap_s >= min_gap_s``, so only the first and last merge and the longer gaps are
    kept. :meth:`uptime` then equals ``uptime(all merge times, ...)`` bit for bit.

    Args:
        start_s: start of the window (s, the clock of the merge times).
        min_gap_s: gaps up to this long are not kept (s, ≥ 0).
    """

    start_s: float
    min_gap_s: float
    first_s: float | None = None
    last_s: float | None = None
    long_gaps: list[tuple[float, float]] = field(default_factory=list)

    def record(self, t_s: float) -> None:
        """A merge at ``t_s`` (non-decreasing, ≥ ``start_s``)."""
        if self.first_s is None:
            self.first_s = t_s
        elif t_s - self.last_s > self.min_gap_s:
            self.long_gaps.append((self.last_s, t_s))
        self.last_s = t_s

    def uptime(self, end_s: float, max_gap_s: float) -> float:
        """As :func:`uptime` over every recorded merge.

        Raises:
            ValueError: ``max_gap_s < min_gap_s``, or as :func:`uptime`.
        """
        if max_gap_s < self.min_gap_s:
            raise ValueError(f"max_gap_s={max_gap_s} is below the kept gaps' bound {self.min_gap_s}")
        if end_s < self.start_s:
            raise ValueError(f"end_s={end_s} is before start_s={self.start_s}")
        span = end_s - self.start_s
        if span == 0:
            return 1.0
        if self.first_s is None:
            gaps = [(self.start_s, end_s)]
        else:
            gaps = [(self.start_s, self.first_s), *self.long_gaps, (self.last_s, end_s)]
        down = sum(max(0.0, b - a - max_gap_s) for a, b in gaps)
        return max(0.0, 1.0 - down / span)


class Goodputs:
    """Compute and token goodput of one learner, as properties; mixed into the per-learner records
    (``LearnerLedger`` here, ``timeline.LearnerAccount``) that have ``useful_s``,
    ``provisioned_s`` (seconds), ``tokens_merged`` and ``tokens_processed``. Merged work above
    what was processed (float rounding of fragment shares) is clamped."""

    useful_s: float
    provisioned_s: float
    tokens_merged: float
    tokens_processed: int

    @property
    def compute_goodput(self) -> float:
        return compute_goodput(min(self.useful_s, self.provisioned_s), self.provisioned_s)

    @property
    def token_goodput(self) -> float:
        return token_goodput(min(self.tokens_merged, self.tokens_processed), self.tokens_processed)


@dataclass
class LearnerLedger(Goodputs):
    """Per-learner accounting kept by the synchronizer.

    ``useful_s`` and ``tokens_merged`` grow when a contribution is merged, by the compute seconds
    and tokens it covers times the fragment's share of the parameters (a step updates every
    fragment, so each fragment owns its numel share of the step). ``provisioned_s`` is set from
    the learner's process start to the end of the run (or now), including any time it was down.
    """

    provisioned_s: float = 0.0
    useful_s: float = 0.0
    tokens_processed: int = 0
    tokens_merged: float = 0.0
    contributions: dict[str, int] = field(default_factory=dict)
    badput_s: dict[str, float] = field(default_factory=dict)
    """Seconds of each observed badput cause (:data:`OBSERVED_CAUSES`)."""

    def count(self, outcome: str) -> None:
        self.contributions[outcome] = self.contributions.get(outcome, 0) + 1

    def add_badput(self, cause: str, seconds: float) -> None:
        """``seconds`` (≥ 0; less is ignored) more of ``cause``.

        Raises:
            ValueError: ``cause`` is not one of :data:`OBSERVED_CAUSES`.
        """
        if cause not in OBSERVED_CAUSES:
            raise ValueError(f"unknown badput cause {cause!r}; known: {OBSERVED_CAUSES}")
        if seconds > 0:
            self.badput_s[cause] = self.badput_s.get(cause, 0.0) + float(seconds)

    def credit_merge(self, c_tokens: float, compute_s: float, share: float, factor: float = 1.0) -> None:
        """A merged contribution of ``c_tokens`` tokens and ``compute_s`` seconds to a fragment of
        ``share`` of the parameters, merged with direction factor ``factor`` (DESIGN §10; clamped to
        [0, 1]): that part of it counts as useful and merged, the rest as ``thrown_away`` badput (a
        contribution merged at factor 0 moved nothing). Counted as ``merged``."""
        w = min(1.0, max(0.0, float(factor)))
        self.count("merged")
        self.useful_s += compute_s * share * w
        self.tokens_merged += c_tokens * share * w
        self.add_badput("thrown_away", compute_s * share * (1.0 - w))

    def to_json(self) -> dict:
        return {
            "provisioned_s": self.provisioned_s,
            "useful_s": self.useful_s,
            "tokens_processed": self.tokens_processed,
            "tokens_merged": self.tokens_merged,
            "contributions": dict(self.contributions),
            "badput_s": dict(self.badput_s),
        }

    @classmethod
    def from_json(cls, d: Mapping) -> LearnerLedger:
        return cls(
            provisioned_s=float(d["provisioned_s"]),
            useful_s=float(d["useful_s"]),
            tokens_processed=int(d["tokens_processed"]),
            tokens_merged=float(d["tokens_merged"]),
            contributions=dict(d.get("contributions", {})),
            badput_s={k: float(v) for k, v in d.get("badput_s", {}).items() if k in OBSERVED_CAUSES},
        )


def badput_fractions(useful_s: float, provisioned_s: float, cause_s: Mapping[str, float]) -> dict[str, float]:
    """Share of ``provisioned_s`` lost to each cause of :data:`BADPUT_CAUSES` (all of them, 0 when
    absent); with ``compute_goodput(useful_s, provisioned_s)`` they sum to 1.

    The observed causes (``cause_s``, seconds) are measured apart and may overlap a little (a
    learner blocked while the synchronizer already counts it silent); when they and ``useful_s``
    exceed ``provisioned_s`` they are scaled down together to fit. ``other`` is what is left.
    All 0 when nothing was provisioned.

    Raises:
        ValueError: a negative input or an unknown cause.
    """
    unknown = set(cause_s) - set(OBSERVED_CAUSES)
    if unknown:
        raise ValueError(f"unknown badput causes {sorted(unknown)}; known: {OBSERVED_CAUSES}")
    if useful_s < 0 or provisioned_s < 0 or any(v < 0 for v in cause_s.values()):
        raise ValueError(f"seconds must be >= 0, got useful={useful_s}, provisioned={provisioned_s}, {dict(cause_s)}")
    out = dict.fromkeys(BADPUT_CAUSES, 0.0)
    if provisioned_s == 0:
        return out
    good = compute_goodput(min(useful_s, provisioned_s), provisioned_s)
    observed = {k: cause_s.get(k, 0.0) / provisioned_s for k in OBSERVED_CAUSES}
    room = 1.0 - good
    total = sum(observed.values())
    scale = room / total if total > room else 1.0
    for k, v in observed.items():
        out[k] = v * scale
    out["other"] = max(0.0, room - sum(out[k] for k in OBSERVED_CAUSES))
    return out


def totals(ledgers: Mapping[str, LearnerLedger],
           silent_s: Mapping[str, float] | None = None) -> dict[str, Any]:
    """Run-wide compute and token goodput over all learners' ledgers, the seconds they add up
    (``useful_s``, ``provisioned_s``, ``tokens_*``) and the badput by cause: ``badput_s`` (seconds
    per observed cause) and ``badput`` (:func:`badput_fractions`). ``silent_s``: learner id ->
    seconds it has been silent so far and not yet judged (counted as ``down`` until it is)."""
    useful = sum(min(led.useful_s, led.provisioned_s) for led in ledgers.values())
    prov = sum(led.provisioned_s for led in ledgers.values())
    merged = sum(min(led.tokens_merged, led.tokens_processed) for led in ledgers.values())
    processed = sum(led.tokens_processed for led in ledgers.values())
    cause_s = dict.fromkeys(OBSERVED_CAUSES, 0.0)
    for led in ledgers.values():
        for k, v in led.badput_s.items():
            cause_s[k] += v
    for lid, secs in (silent_s or {}).items():
        if lid in ledgers:
            cause_s["down"] += max(0.0, secs)
    return {
        "compute_goodput": compute_goodput(useful, prov),
        "token_goodput": token_goodput(merged, processed),
        "useful_s": useful,
        "provisioned_s": prov,
        "tokens_merged": merged,
        "tokens_processed": processed,
        "badput_s": cause_s,
        "badput": badput_fractions(useful, prov, cause_s),
    }


__all__.append("totals")


def window_goodput(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float | None]:
    """Compute and token goodput over the window between two :func:`totals` (rolling goodput):
    the useful over the provisioned learner-seconds, and the merged over the processed tokens,
    that came in between. None for a figure whose denominator did not grow (nothing to judge by)."""
    d = {k: after[k] - before[k] for k in ("useful_s", "provisioned_s", "tokens_merged", "tokens_processed")}
    compute = compute_goodput(max(0.0, min(d["useful_s"], d["provisioned_s"])), d["provisioned_s"]) \
        if d["provisioned_s"] > 0 else None
    token = token_goodput(max(0.0, d["tokens_merged"]), d["tokens_processed"]) if d["tokens_processed"] > 0 else None
    return {"compute_goodput": compute, "token_goodput": token}


__all__.append("window_goodput")
