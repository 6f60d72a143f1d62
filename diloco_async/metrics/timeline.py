"""Per-learner timelines and the goodput accounting built on them (DESIGN §7, paper §5.1).

A :class:`Timeline` holds, for every learner slot of one run, what it was doing when:

* *state intervals*: ``down`` (process dead, waiting for its machine), ``starting`` (the slot's
  first process started, not yet stepping: imports, join, downloads), ``restarting`` (the same for
  every later process of the slot, after a failure), ``stalled`` (frozen, e.g. SIGSTOP) and
  ``blocked`` (waiting on the synchronizer or on peers);
* *steps*: one inner step each, with its tokens and the share of it that ended up in the global
  model (``useful`` in [0, 1]: 1 = merged, 0 = thrown away, a fraction when only some fragments
  of the step were merged);
* *merge times* of the global model.

:func:`account` turns it into compute goodput, token goodput and uptime per learner and in total,
using the definitions of :mod:`diloco_async.metrics.goodput`. Every slot is provisioned for the whole run,
so time spent down counts against goodput. All times are seconds on one clock (unix time for
real runs). Pure: no I/O. :class:`Recorder` appends the learner-side records to a JSON-lines
file; ``diloco_async.flows.timeline_report.plot_timeline`` draws a timeline.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from diloco_async.metrics.goodput import Goodputs, compute_goodput, token_goodput, uptime

__all__ = ["STATES", "Interval", "Step", "Timeline", "LearnerAccount", "Accounting", "account",
           "availability", "Recorder", "read_records", "diloco_timeline_steps"]

#: States a slot can be in besides stepping. Time in none of them and in no step is overhead
#: (communication, adoption, idle waiting between steps).
STATES = ("down", "starting", "restarting", "stalled", "blocked")


@dataclass(frozen=True)
class Interval:
    """``learner`` was in ``state`` (one of :data:`STATES`) from ``t0`` to ``t1`` seconds."""

    learner: str
    state: str
    t0: float
    t1: float

    def __post_init__(self) -> None:
        if self.state not in STATES:
            raise ValueError(f"unknown state {self.state!r}; known: {STATES}")
        if self.t1 < self.t0:
            raise ValueError(f"interval ends ({self.t1}) before it starts ({self.t0})")


@dataclass(frozen=True)
class Step:
    """One inner step of ``learner`` from ``t0`` to ``t1`` seconds.

    Args:
        tokens: tokens the step processed.
        useful: share of the step that reached the global model, in [0, 1].
        wait_s: seconds inside the step not spent computing (e.g. an all-reduce waiting for peers);
            counted as blocked, never as useful.
    """

    learner: str
    t0: float
    t1: float
    tokens: int
    useful: float = 1.0
    wait_s: float = 0.0

    def __post_init__(self) -> None:
        if self.t1 < self.t0:
            raise ValueError(f"step ends ({self.t1}) before it starts ({self.t0})")
        if not 0.0 <= self.useful <= 1.0 + 1e-9:
            raise ValueError(f"useful must be in [0, 1], got {self.useful}")
        if self.wait_s < 0 or self.tokens < 0:
            raise ValueError(f"wait_s and tokens must be >= 0, got {self.wait_s}, {self.tokens}")


@dataclass
class Timeline:
    """Everything :func:`account` (and the plot) need about one run of one method."""

    learners: list[str]
    start_s: float
    end_s: float
    intervals: list[Interval] = field(default_factory=list)
    steps: list[Step] = field(default_factory=list)
    merges_s: list[float] = field(default_factory=list)


@dataclass
class LearnerAccount(Goodputs):
    """Seconds by state and tokens of one slot; goodputs as properties."""

    provisioned_s: float
    useful_s: float = 0.0
    thrown_away_s: float = 0.0
    down_s: float = 0.0
    starting_s: float = 0.0
    restarting_s: float = 0.0
    stalled_s: float = 0.0
    blocked_s: float = 0.0
    tokens_processed: int = 0
    tokens_merged: float = 0.0

    @property
    def overhead_s(self) -> float:
        """Provisioned time in no state and no step computation (comms, adoption, idle)."""
        busy = (self.useful_s + self.thrown_away_s + self.down_s + self.starting_s + self.restarting_s
                + self.stalled_s + self.blocked_s)
        return max(0.0, self.provisioned_s - busy)

    @property
    def availability(self) -> float:
        """Share of the provisioned time the slot was not down."""
        return 0.0 if self.provisioned_s == 0 else max(0.0, 1.0 - self.down_s / self.provisioned_s)

    def to_json(self) -> dict:
        return {**{k: getattr(self, k) for k in ("provisioned_s", "useful_s", "thrown_away_s", "down_s",
                                                   "starting_s", "restarting_s", "stalled_s", "blocked_s",
                                                   "tokens_processed",
                                                   "tokens_merged")},
                "overhead_s": self.overhead_s, "compute_goodput": self.compute_goodput,
                "token_goodput": self.token_goodput, "availability": self.availability}


@dataclass
class Accounting:
    """Per-learner accounts and the run totals of one timeline."""

    learners: dict[str, LearnerAccount]
    uptime: float
    wall_s: float

    def _sum(self, name: str) -> float:
        return sum(getattr(a, name) for a in self.learners.values())

    @property
    def compute_goodput(self) -> float:
        return compute_goodput(min(self._sum("useful_s"), self._sum("provisioned_s")), self._sum("provisioned_s"))

    @property
    def token_goodput(self) -> float:
        return token_goodput(min(self._sum("tokens_merged"), self._sum("tokens_processed")),
                             self._sum("tokens_processed"))

    @property
    def availability(self) -> float:
        """Mean availability of the slots: the compute goodput no method can beat."""
        accts = list(self.learners.values())
        return sum(a.availability for a in accts) / len(accts) if accts else 0.0

    def to_json(self) -> dict:
        return {"compute_goodput": self.compute_goodput, "token_goodput": self.token_goodput,
                "uptime": self.uptime, "availability": self.availability, "wall_s": self.wall_s,
                "useful_s": self._sum("useful_s"), "provisioned_s": self._sum("provisioned_s"),
                "tokens_processed": self._sum("tokens_processed"), "tokens_merged": self._sum("tokens_merged"),
                "learners": {k: a.to_json() for k, a in self.learners.items()}}


def _overlap(a0: float, a1: float, b0: float, b1: float) -> float:
    return max(0.0, min(a1, b1) - max(a0, b0))


def account(tl: Timeline, max_gap_s: float) -> Accounting:
    """Compute goodput, token goodput and uptime of ``tl`` (DESIGN §7).

    * provisioned = ``end_s - start_s`` for every slot;
    * useful = Σ over steps of (compute seconds) × ``useful``, where a step's compute seconds are
      its duration minus ``wait_s`` minus any overlap with the slot's ``down``/``stalled``
      intervals; the rest of a step's compute is *thrown away*;
    * tokens merged = Σ tokens × ``useful``;
    * uptime: merge gaps longer than ``max_gap_s`` count as down beyond ``max_gap_s``.

    Everything is clipped to ``[start_s, end_s]``.

    Raises:
        ValueError: ``end_s < start_s``, or an interval or step names a learner not in
            ``tl.learners``.
    """
    if tl.end_s < tl.start_s:
        raise ValueError(f"end_s={tl.end_s} is before start_s={tl.start_s}")
    span = tl.end_s - tl.start_s
    accts = {lid: LearnerAccount(provisioned_s=span) for lid in tl.learners}
    frozen: dict[str, list[tuple[float, float]]] = {lid: [] for lid in tl.learners}
    for iv in tl.intervals:
        if iv.learner not in accts:
            raise ValueError(f"interval of unknown learner {iv.learner!r}")
        secs = _overlap(iv.t0, iv.t1, tl.start_s, tl.end_s)
        a = accts[iv.learner]
        setattr(a, f"{iv.state}_s", getattr(a, f"{iv.state}_s") + secs)
        if iv.state in ("down", "stalled"):
            frozen[iv.learner].append((iv.t0, iv.t1))
    for st in tl.steps:
        if st.learner not in accts:
            raise ValueError(f"step of unknown learner {st.learner!r}")
        t0, t1 = max(st.t0, tl.start_s), min(st.t1, tl.end_s)
        if t1 <= t0:
            continue
        share = (t1 - t0) / (st.t1 - st.t0) if st.t1 > st.t0 else 1.0
        frozen_s = sum(_overlap(t0, t1, f0, f1) for f0, f1 in frozen[st.learner])
        wait = min(st.wait_s * share, t1 - t0 - frozen_s)
        compute = max(0.0, t1 - t0 - frozen_s - wait)
        a = accts[st.learner]
        a.blocked_s += max(0.0, wait)
        a.useful_s += compute * st.useful
        a.thrown_away_s += compute * (1.0 - st.useful)
        a.tokens_processed += st.tokens
        a.tokens_merged += st.tokens * st.useful
    up = uptime(tl.merges_s, tl.start_s, tl.end_s, max_gap_s)
    return Accounting(learners=accts, uptime=up, wall_s=span)


def availability(down: Mapping[str, Sequence[tuple[float, float]]], start_s: float, end_s: float) -> float:
    """Mean share of ``[start_s, end_s]`` in which each slot was not down (its down intervals
    given as ``(t0, t1)`` pairs, possibly overlapping the window's ends)."""
    if end_s <= start_s or not down:
        return 1.0
    span = end_s - start_s
    shares = [1.0 - sum(_overlap(a, b, start_s, end_s) for a, b in ivs) / span for ivs in down.values()]
    return sum(shares) / len(shares)


class Recorder:
    """Appends timeline records (one JSON object per line, ``t*`` fields in unix seconds) to a
    file; thread-safe; every line is flushed so a SIGKILL loses at most the line being written.
    A recorder without a path records nothing."""

    def __init__(self, path: str | os.PathLike | None, **fixed: object) -> None:
        self.fixed = fixed
        self._lock = threading.Lock()
        self._fh = None
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self._fh = open(path, "a", buffering=1)

    def record(self, kind: str, **fields: object) -> None:
        if self._fh is None:
            return
        fields.setdefault("t", time.time())
        line = json.dumps({"kind": kind, **self.fixed, **fields})
        with self._lock:
            self._fh.write(line + "\n")

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


def read_records(path: str | os.PathLike) -> list[dict]:
    """Records of a :class:`Recorder` file; a last line cut by a crash is skipped."""
    out = []
    try:
        with open(path) as fh:
            for line in fh:
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
    except FileNotFoundError:
        return []
    return out


def diloco_timeline_steps(learner: str, records: Iterable[dict], merged_update_ids: set[str],
                          fragment_shares: Sequence[float]) -> list[Step]:
    """Steps of one DiLoCo learner with the share of each that was merged.

    ``records`` are the learner's own (kinds ``ready``, ``step``, ``contribution``; each with its
    incarnation ``inc``). Incarnation j numbers its steps from its ``ready`` record's ``step``
    (exclusive); its inner state may have been restored at step ``restored`` (default: ``step``),
    so the progress it starts from is that of the earlier incarnations' steps up to ``restored``.
    A contribution of fragment p with update id u carries the ``c_steps`` steps up to
    ``last_step``: the newest of them run by this incarnation, the rest restored ones. When u was
    merged, each of those steps gains ``fragment_shares[p]`` of usefulness.
    """
    recs = list(records)
    starts: dict[int, int] = {}
    restored: dict[int, int] = {}
    steps: dict[tuple[int, int], dict] = {}
    for r in recs:
        if r["kind"] == "ready":
            starts[int(r["inc"])] = int(r["step"])
            restored[int(r["inc"])] = int(r.get("restored", r["step"]))
        elif r["kind"] == "step":
            steps[(int(r["inc"]), int(r["step"]))] = r
    incs = sorted(starts)

    def previous(j: int) -> int | None:
        earlier = [i for i in incs if i < j]
        return earlier[-1] if earlier else None

    def owner(s: int, j: int | None) -> int | None:
        """The incarnation whose step s is part of incarnation j's progress (None: not part)."""
        while j is not None:
            if s > starts[j]:
                return j if (j, s) in steps else None
            if s > restored[j]:
                return None  # numbered past by a restart, never run on this lineage
            j = previous(j)
        return None

    useful: dict[tuple[int, int], float] = {}
    for r in recs:
        if r["kind"] != "contribution" or r["update_id"] not in merged_update_ids:
            continue
        j, last, c = int(r["inc"]), int(r["last_step"]), int(r["c_steps"])
        if j not in starts:
            continue
        share = float(fragment_shares[int(r["fragment"])])
        first_new = max(starts[j], last - c)
        covered = [(j, s) for s in range(first_new + 1, last + 1) if (j, s) in steps]
        n_old = c - (last - first_new)
        covered += [(o, s) for s in range(restored[j] - n_old + 1, restored[j] + 1)
                    if (o := owner(s, previous(j))) is not None]
        for key in covered:
            useful[key] = useful.get(key, 0.0) + share
    return [Step(learner, float(r["t0"]), float(r["t1"]), int(r["tokens"]), min(1.0, useful.get(k, 0.0)))
            for k, r in sorted(steps.items(), key=lambda kv: kv[1]["t0"])]
