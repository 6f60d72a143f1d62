"""What one method achieved under a chaos scenario: goodput from its timeline (DESIGN §7) and the
held-out loss of its global model at equal wall time and at equal tokens (DESIGN §8).

Goodput is measured from the moment every slot's first process was up (or had failed): the
initial start-up is the same for every method and not part of the comparison; every restart
after a failure is.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from diloco_async.config.schema import Config
from diloco_async.metrics.evaluation import heldout_loss
from diloco_async.metrics.timeline import Accounting, Timeline, account
from diloco_async.models.transformer import ByteGPT

__all__ = ["Snapshot", "Measurement", "goodput_window_start", "uptime_max_gap_s", "initial_model", "eval_curve",
           "eval_at", "measure", "learner_shares", "processed_shares", "step_stats", "speed_weighted_goodput"]

#: one point of a loss curve: (seconds since the first snapshot, tokens in the model, loss in nats/byte)
CurvePoint = tuple[float, float, float]


@dataclass
class Snapshot:
    """The global model at unix time ``t`` with ``tokens`` tokens in it; ``load()`` builds it."""

    t: float
    tokens: float
    load: Callable[[], ByteGPT]


@dataclass
class Measurement:
    """Goodput and loss of one method's run.

    Attributes:
        accounting: goodput accounting over ``[window_start_s, end]``.
        window_start_s: where the goodput window starts (unix s; the timeline itself starts at
            the first launch).
        curve: held-out loss of every snapshot, Θ^0 first (:data:`CurvePoint`).
        eval_loss_equal_time, eval_loss_equal_tokens: see :func:`eval_at`.
    """

    accounting: Accounting
    window_start_s: float
    curve: list[CurvePoint]
    eval_loss_equal_time: float
    eval_loss_equal_tokens: float | None


def goodput_window_start(tl: Timeline) -> float:
    """The end of the latest first start-up (``starting`` or ``restarting`` interval) over the
    slots (every slot's first process up or dead), clipped to ``[tl.start_s, tl.end_s]``."""
    first_up = [min((iv for iv in tl.intervals if iv.learner == lid and iv.state in ("starting", "restarting")),
                    key=lambda iv: iv.t0, default=None) for lid in tl.learners]
    return min(tl.end_s, max([tl.start_s] + [iv.t1 for iv in first_up if iv is not None]))


def uptime_max_gap_s(tl: Timeline, cfg: Config) -> float:
    """Merge gap beyond which the run counts as down: 4 typical rounds of one fragment (upper median
    step seconds × H / P), at least 5 s."""
    step_s = [st.t1 - st.t0 for st in tl.steps]
    typical = statistics.median_high(step_s) if step_s else 1.0
    return max(5.0, 4 * typical * cfg.synchronizer.sync_every / max(1, cfg.synchronizer.num_fragments))


def initial_model(cfg: Config) -> ByteGPT:
    """Θ^0 of the recipe: the same for every method."""
    from diloco_async.sync import initial_parameters

    model = ByteGPT(cfg.model)
    model.load_state_dict(initial_parameters(cfg)[0], strict=False)
    return model


def eval_curve(snaps: Sequence[Snapshot], batches) -> list[CurvePoint]:
    """Held-out loss (nats/byte) of every snapshot: ``(seconds since the first, tokens, loss)``."""
    t0 = snaps[0].t
    return [(s.t - t0, s.tokens, heldout_loss(s.load(), batches)) for s in snaps]


def eval_at(curve: Sequence[CurvePoint], eval_tokens: int) -> tuple[float, float | None]:
    """Loss of the last snapshot (equal wall time) and at ``eval_tokens`` tokens, linearly
    interpolated in tokens between the two snapshots around it (None if never reached)."""
    final = curve[-1][2]
    idx = next((i for i, c in enumerate(curve) if c[1] >= eval_tokens), None)
    if idx is None:
        return final, None
    if idx == 0 or curve[idx][1] == curve[idx - 1][1]:
        return final, curve[idx][2]
    (_, ta, la), (_, tb, lb) = curve[idx - 1], curve[idx]
    w = (eval_tokens - ta) / (tb - ta)
    return final, (1 - w) * la + w * lb


def measure(tl: Timeline, snaps: Sequence[Snapshot], cfg: Config, batches, eval_tokens: int) -> Measurement:
    """Goodput of ``tl`` from :func:`goodput_window_start`, and the loss curve of Θ^0 (at the
    window's start, no tokens) followed by the ``snaps`` taken from then on."""
    window = dataclasses.replace(tl, start_s=goodput_window_start(tl))
    acc = account(window, uptime_max_gap_s(window, cfg))
    # Θ^0 at the window's start is the curve's origin: a snapshot from before every learner was
    # up (a checkpoint taken during start-up) would sit at a negative time before it
    later = [s for s in snaps if s.t >= window.start_s]
    curve = eval_curve([Snapshot(window.start_s, 0.0, lambda: initial_model(cfg)), *later], batches)
    eq_time, eq_tokens = eval_at(curve, eval_tokens)
    return Measurement(acc, window.start_s, curve, eq_time, eq_tokens)


def learner_shares(speeds: Sequence[float], up_s: Sequence[float], ledgers: Mapping[str, Mapping],
                   skipped: Mapping[int, str] | None = None,
                   step_stats: Sequence[tuple[float | None, float]] | None = None) -> list[dict]:
    """Each slot's merged share of the tokens against its share of the compute (issue 47).

    Args:
        speeds: speed factor of every slot (index order, in (0, 1]).
        up_s: seconds each slot's learner was up (not down, not skipped) over the run.
        ledgers: learner id ``learner-i`` -> the synchronizer's ledger of it (``tokens_merged``,
            ``tokens_processed``, ``contributions``: :func:`~diloco_async.chaos.targets.read_summary_ledgers`);
            a slot without one merged and processed nothing.
        skipped: slot -> why its learner never ran (its ``up_s`` is taken as 0).
        step_stats: per slot (:func:`step_stats`), the tokens per second *inside* its inner steps
            (emulated delay included; None: it never stepped), the rate its hardware as emulated on
            this host computes at, and the seconds it spent inside steps while up.

    Returns:
        One dict per slot: ``slot``, ``speed``, ``up_s``, ``compute_share`` (speed x up_s over the sum
        over slots), ``tokens_merged``, ``tokens_processed``, ``merged_share`` (tokens_merged over the
        sum; None when nothing was merged), ``merged_over_compute`` (merged_share / compute_share; None
        when either is None or the compute share is 0), ``processed_share`` (tokens_processed over
        the sum: the share of the compute the learner actually did, every step being of the same
        token count), ``merged_over_processed`` (merged_share / processed_share, None as above),
        ``contributions`` (by outcome), ``skipped`` (the reason, or None); with ``step_stats`` also
        ``capacity_tokens`` (up_s x its step rate: what it could have processed had it never waited
        between steps), ``capacity_share`` (over the sum), ``merged_over_capacity`` (merged_share /
        capacity_share: issue 47's bar; a learner stalled between steps reads low), ``capacity_over_compute``
        (capacity_share / compute_share: how far the emulated speed on a shared host is from the
        nominal one) and ``stepping_over_up`` (the share of its time up it spent inside steps); each
        None where undefined.

    Raises:
        ValueError: ``speeds`` and ``up_s`` (or ``step_stats``) differ in length, or one is negative.
    """
    skipped = dict(skipped or {})
    if len(speeds) != len(up_s):
        raise ValueError(f"{len(speeds)} speeds but {len(up_s)} up-times")
    if any(s < 0 for s in speeds) or any(u < 0 for u in up_s):
        raise ValueError(f"speeds and up-times must be >= 0, got {list(speeds)}, {list(up_s)}")
    ups = [0.0 if i in skipped else float(u) for i, u in enumerate(up_s)]
    compute = [float(s) * u for s, u in zip(speeds, ups, strict=True)]
    led = [ledgers.get(f"learner-{i}", {}) for i in range(len(speeds))]
    merged = [float(x.get("tokens_merged", 0.0)) for x in led]
    total_c, total_m = sum(compute), sum(merged)
    rows = []
    for i, speed in enumerate(speeds):
        c_share = compute[i] / total_c if total_c > 0 else 0.0
        m_share = merged[i] / total_m if total_m > 0 else None
        rows.append({"slot": i, "speed": float(speed), "up_s": ups[i], "compute_share": c_share,
                     "tokens_merged": merged[i], "tokens_processed": float(led[i].get("tokens_processed", 0.0)),
                     "merged_share": m_share,
                     "merged_over_compute": m_share / c_share if m_share is not None and c_share > 0 else None,
                     "contributions": dict(led[i].get("contributions", {})), "skipped": skipped.get(i)})
    for row, share in zip(rows, processed_shares(rows), strict=True):
        row["processed_share"] = share
        row["merged_over_processed"] = (row["merged_share"] / share
                                        if row["merged_share"] is not None and share else None)
    if step_stats is not None:
        _add_capacity(rows, step_stats)
    return rows


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _add_capacity(rows: list[dict], stats: Sequence[tuple[float | None, float]]) -> None:
    """The ``capacity_*`` fields and ``stepping_over_up`` of :func:`learner_shares`, in place."""
    if len(stats) != len(rows):
        raise ValueError(f"{len(rows)} slots but {len(stats)} step rates")
    if any((r is not None and r < 0) or sec < 0 for r, sec in stats):
        raise ValueError(f"step rates and seconds must be >= 0, got {list(stats)}")
    capacity = [row["up_s"] * (rate or 0.0) for row, (rate, _) in zip(rows, stats, strict=True)]
    total = sum(capacity)
    for row, cap, (_, stepping_s) in zip(rows, capacity, stats, strict=True):
        c_share = cap / total if total > 0 else 0.0
        row.update(capacity_tokens=cap, capacity_share=c_share,
                   merged_over_capacity=_ratio(row["merged_share"], c_share),
                   capacity_over_compute=_ratio(c_share, row["compute_share"]),
                   stepping_over_up=_ratio(stepping_s, row["up_s"]))


def step_stats(tl: Timeline, slots: int) -> list[tuple[float | None, float]]:
    """Per slot ``slot-i`` of ``tl``: the tokens its inner steps processed over the seconds they
    ran, both inside the timeline's window and outside the slot's ``down``/``stalled`` intervals
    (a frozen process does not compute; a step cut by the window counts in proportion), an emulated
    slowdown's sleep included (None for a slot that never stepped there); and those seconds."""
    frozen: dict[str, list[tuple[float, float]]] = {}
    for iv in tl.intervals:
        if iv.state in ("down", "stalled"):
            frozen.setdefault(iv.learner, []).append((iv.t0, iv.t1))
    tokens, seconds = [0.0] * slots, [0.0] * slots
    for st in tl.steps:
        i = int(st.learner.rsplit("-", 1)[1]) if st.learner.startswith("slot-") else -1
        t0, t1 = max(st.t0, tl.start_s), min(st.t1, tl.end_s)
        if not 0 <= i < slots or t1 <= t0:
            continue
        tokens[i] += st.tokens * ((t1 - t0) / (st.t1 - st.t0) if st.t1 > st.t0 else 1.0)
        seconds[i] += max(0.0, t1 - t0 - sum(max(0.0, min(t1, f1) - max(t0, f0))
                                             for f0, f1 in frozen.get(st.learner, [])))
    return [(t / s if s > 0 else None, s) for t, s in zip(tokens, seconds, strict=True)]


def processed_shares(rows: Sequence[Mapping]) -> list[float]:
    """Each slot's share of the tokens processed (``tokens_processed`` of the rows of
    :func:`learner_shares`, in order): the share of the compute each learner actually did. With
    emulated speeds on a shared host a slowed learner may get less than its nominal speed x time
    up (it sleeps a multiple of its measured step time and runs at a lower priority); this share
    counts what it did. All 0.0 when nothing was processed."""
    processed = [float(r.get("tokens_processed") or 0.0) for r in rows]
    total = sum(processed)
    return [x / total if total > 0 else 0.0 for x in processed]


def speed_weighted_goodput(acc: Accounting, speeds: Mapping[str, float]) -> float:
    """Compute goodput counted in compute actually available: useful compute seconds x the slot's
    speed factor over provisioned, not-down seconds x its speed factor, summed over the slots of
    ``acc`` (``speeds``: slot name ``slot-i`` -> factor; 1.0 when absent). With every speed 1 and no
    slot down, this is ``acc.compute_goodput``. 0.0 when nothing was available."""
    useful = avail = 0.0
    for lid, a in acc.learners.items():
        s = float(speeds.get(lid, 1.0))
        useful += s * a.useful_s
        avail += s * max(0.0, a.provisioned_s - a.down_s)
    return min(1.0, useful / avail) if avail > 0 else 0.0
