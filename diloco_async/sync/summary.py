"""The run summary and the live status, read from the synchronizer's state (DESIGN §7).

:func:`summary` gives the run figures (goodput, merges, rejections by reason, versions, bytes);
:func:`status` adds the open rounds, the last merges, heartbeat ages, budget and phase for ``GET /status``.
Both run on the actor's task and only read the components they are given (never the actor).
"""

from __future__ import annotations

import time
from collections import Counter

from diloco_async.metrics.goodput import totals
from diloco_async.sync.context import ActorContext
from diloco_async.sync.fragment_book import FragmentBook
from diloco_async.sync.learners import LearnerRegistry
from diloco_async.sync.lifecycle import Lifecycle
from diloco_async.sync.reporting import UPTIME_MIN_GAP_S, Reporter
from diloco_async.sync.rounds import RoundTable
from diloco_async.sync.slices import SliceDesk
from diloco_async.sync.state import CheckpointBook
from diloco_async.sync.wire_bytes import per_token

__all__ = ["summary", "status", "with_checkpoint_outcome", "uptime_max_gap_s", "RECENT_MERGES"]

#: merges listed in /status (``recent_merges``): a round is open for a fraction of a second, so the
#: open rounds alone are mostly empty between two polls of ``status --watch``
RECENT_MERGES = 6


def uptime_max_gap_s(registry: LearnerRegistry, sync_every: int, fragments: int) -> float:
    """The longest gap between merges that still counts as up (s): four rounds' worth of the
    slowest learner's steps per fragment (``fragments``: those merged here), at least
    :data:`UPTIME_MIN_GAP_S`."""
    slowest = registry.slowest_step_s() or 1.0
    return max(4 * slowest * sync_every / max(1, fragments), UPTIME_MIN_GAP_S)


def _net_summary(reg: LearnerRegistry) -> dict:
    """Bytes per token up and down, and the bytes by fragment, for the summary and /status."""
    tokens = reg.tokens_processed()
    up = sum(b["up"] for b in reg.wire.by_fragment.values())
    down = sum(b["down"] for b in reg.wire.by_fragment.values())
    return {"bytes_up_per_token": per_token(up, tokens), "bytes_down_per_token": per_token(down, tokens),
            "bytes_by_fragment": reg.wire.fragments_json(tokens)}


def _learner_net(reg: LearnerRegistry, lid: str) -> dict:
    """A learner's bytes (per token) and whether its link keeps up (``link_bound``, with the figures)."""
    i = reg.learners[lid]
    need, budget = i.link_s_per_fragment, i.link_budget_s
    return {**reg.wire.learner_json(lid, reg.ledgers[lid].tokens_processed), "link_s_per_fragment": need,
            "link_budget_s": budget, "link_bound": need is not None and budget is not None and need > budget}


def _learner_pace(reg: LearnerRegistry, lid: str) -> dict:
    """A learner's pace as measured from its heartbeats (steps/s over its whole measurement; seconds
    per step, recent) and the rate bound it is held to (steps/s, and where that comes from)."""
    meter, bound = reg.learners[lid].meter, reg.pace_bound(lid)
    return {"measured_steps_per_s": meter.steps_per_s(), "measured_step_time_s": meter.step_time_s(),
            "pace_bound_steps_per_s": bound.steps_per_s if bound is not None else None,
            "pace_bound": bound.reason if bound is not None else None}


def summary(ctx: ActorContext, *, book: FragmentBook, table: RoundTable, registry: LearnerRegistry,
            report: Reporter, checkpoints: CheckpointBook, life: Lifecycle, slices: SliceDesk | None = None) -> dict:
    """Run figures: goodput (DESIGN §7), merges, rejections by reason, versions, bytes (and the peak
    bytes per second over 1 s windows, :mod:`diloco_async.sync.traffic`); with ``data.slices``, the
    slice ledger's accounting (tokens trained, thrown away, re-queued, slices never reached, epoch;
    :meth:`~diloco_async.policy.slices.SliceLedger.figures`)."""
    now = ctx.clock()
    rep, reg, c = report, registry, report.counters
    reg.flush_provisioned()
    max_gap = uptime_max_gap_s(reg, ctx.sc.sync_every, len(book))
    return {
        "run_id": ctx.run_id,
        "epoch": ctx.epoch,
        "resumed_from": checkpoints.resumed_from,
        "stop_reason": life.stop_reason,
        "wall_s": now - ctx.started_s,
        **totals(reg.ledgers, reg.silent_s(now)),
        "uptime": rep.merge_gaps.uptime(now, max_gap),
        "uptime_max_gap_s": max_gap,
        "merges": c["merges"],
        "contributions_merged": c["contributions_merged"],
        "contributions_late": c["contributions_late"], "contributions_folded": c["contributions_folded"],
        "contributions_rejected": c["contributions_rejected"],
        "rejected_by_reason": {**rep.rejected_by_reason, **{k: v for k, v in rep.edge_rejections.items() if v}},
        "bad_requests": dict(rep.bad_requests),
        "actor_errors": c["actor_errors"],
        "rounds_abandoned": c["rounds_abandoned"],
        "rounds_abandoned_by_reason": dict(rep.abandoned_by_reason),
        "clamped_by_reason": dict(rep.clamped_by_reason),
        "contributions_clipped": c["contributions_clipped"],
        "contributions_downweighted": c["contributions_downweighted"],
        "verifications_dropped": c["verifications_dropped"],
        "duplicates": c["duplicates"],
        "versions": book.versions(),
        # contributions learners gave up announcing (synchronizer shards: DESIGN §2.2): of this synchronizer's
        # fragments, and of every fragment as the learners' heartbeats tell it
        "contributions_undeliverable": reg.undeliverable.total({f.p for f in book}),
        "undeliverable_by_fragment": reg.undeliverable.by_fragment(),
        "outer_lr": {f.p: f.optimizer.lr for f in book},  # η of each fragment's last outer step
        "bytes_in": c["bytes_in"],
        "bytes_out": c["bytes_out"],
        **rep.traffic.figures(),  # since this process started (a resumed run starts them again)
        **_net_summary(reg),
        "checkpoints": c["checkpoints"],
        "last_checkpoint_seq": checkpoints.last_seq,
        # garbage collection: objects deleted, and versions left for live learners' reads (policy/catchup.py)
        "gc_deleted_objects": c["gc_deleted_objects"],
        "gc_kept_for_reads": c["gc_kept_for_reads"],
        "global_step": table.g,
        **(slices.figures() if slices is not None else {}),
        "refused_by_mode": {k: v for k, v in rep.edge_by_mode.items() if v},  # edge refusals and 400s
        "learners": {lid: {"live": i.live, "step": i.step, "incarnation": i.incarnation,
                           "network_mode": i.network_mode,
                           **reg.ledgers[lid].to_json(),
                           "compute_goodput": reg.ledgers[lid].compute_goodput,
                           "token_goodput": reg.ledgers[lid].token_goodput, **_learner_net(reg, lid),
                           "undeliverable": reg.undeliverable.learner_total(lid),
                           **_learner_pace(reg, lid)}
                     for lid, i in reg.learners.items()},
    }


def with_checkpoint_outcome(figures: dict, counters: Counter[str], checkpoints: CheckpointBook) -> dict:
    """``figures`` (a :func:`summary` taken when the final checkpoint began) with that checkpoint's
    outcome: ``checkpoints`` (of ``counters``) and ``last_checkpoint_seq`` as they are now."""
    return {**figures, "checkpoints": counters["checkpoints"], "last_checkpoint_seq": checkpoints.last_seq}


def _recent_merges(report: Reporter, count: int) -> list[dict]:
    """The last ``count`` merges, newest first, from the merge log's tail in memory: fragment,
    round, the version it made, the merged learners and its age (s, wall clock: the log's ``t``)."""
    log = report.merge_log
    n = min(count, log.in_memory)
    now_unix = time.time()
    return [{"fragment": m["fragment"], "round": m["round"], "version": m["version"],
             "learners": [c["learner"] for c in m.get("contributions", [])], "age_s": max(0.0, now_unix - m["t"])}
            for m in reversed(log.read(len(log) - n, n) or [])]


def status(figures: dict, ctx: ActorContext, *, table: RoundTable, registry: LearnerRegistry, report: Reporter,
           life: Lifecycle, finished: bool) -> dict:
    """``figures`` (a :func:`summary` taken now, changed in place and returned) plus the open rounds
    (announced, verified, rejected and pending learners, seconds open), the last
    :data:`RECENT_MERGES` merges (``recent_merges``), each learner's seconds since its last message
    (``heartbeat_age_s``), the budget, the lifecycle phase, whether the run's final summary is fixed
    (``finished``) and the number of metric points so far."""
    s = figures
    now = ctx.clock()
    rounds = []
    for (p, n), r in sorted(table.rounds.items()):
        entries = r.state.entries
        rounds.append({"fragment": p, "round": n, "stage": r.state.stage.value, "open_s": now - r.state.opened_s,
                       "announced": sorted(entries), "verified": r.state.verified,
                       "rejected": sorted(lid for lid, e in entries.items() if e.verified is False),
                       "pending": sorted(r.state.pending), "late": list(r.state.late)})
    s["rounds"] = rounds
    s["recent_merges"] = _recent_merges(report, RECENT_MERGES)
    for lid, info in registry.learners.items():  # seconds since each learner was last heard from
        s["learners"][lid]["heartbeat_age_s"] = max(0.0, now - info.last_seen_s)
    budget = ctx.cfg.budget
    s["budget"] = {"tokens": budget.tokens, "max_steps": budget.max_steps, "wall_s": budget.wall_s}
    s["stopping"] = life.stop_reason
    s["phase"] = life.phase.value
    s["finished"] = finished
    s["metrics_total"] = len(report.metrics)
    return s
