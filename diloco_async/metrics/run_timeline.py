"""The goodput timeline of an ordinary training run, rebuilt from what the processes recorded.

Every learner process appends its own records (``diloco_async.metrics.timeline.Recorder``: start, ready,
steps, contributions, blocked time, stop) and the synchronizer names the update ids of every
merge (``merges.jsonl`` in the store). From those alone this module rebuilds each slot's
timeline: ``starting`` from the slot's first process's start to its first step (``restarting``
for every later process), ``down`` from the last record
of a process that did not stop cleanly to the start of the next one, the steps with the share that
was merged. The chaos harness knows the exact fault times and builds its own; this is the view
for runs without a fault driver (``train``, ``resume``). ``diloco_async.flows.timeline_report`` draws it.
"""

from __future__ import annotations

import json

from diloco_async.config.schema import Config
from diloco_async.metrics.timeline import Interval, Timeline, diloco_timeline_steps
from diloco_async.models import build_run_model, plan_of
from diloco_async.storage import keys
from diloco_async.storage.store import ObjectStore

__all__ = ["fragment_shares", "read_contributions", "read_merges", "rounds_table", "timeline_from_records"]


def fragment_shares(cfg: Config) -> list[float]:
    """Numel share of each fragment of the recipe's model (sums to 1)."""
    plan = plan_of(build_run_model(cfg), cfg.synchronizer.num_fragments, cfg.synchronizer.fragmentation)
    return [plan.numel_fraction(p) for p in range(plan.num_fragments)]


def read_merges(store: ObjectStore, run_id: str, epoch: str) -> list[dict]:
    """The synchronizer's merge records of one epoch ([] if it wrote none)."""
    try:
        body = store.get_unverified(keys.merge_log_key(run_id, epoch)).decode()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in body.splitlines() if line.strip()]


def read_contributions(store: ObjectStore, run_id: str, epoch: str) -> list[dict]:
    """The synchronizer's contribution records of one epoch (``contributions.jsonl``: what became
    of each contribution it decided on; [] if it wrote none, e.g. killed before its summary)."""
    try:
        body = store.get_unverified(keys.contribution_log_key(run_id, epoch)).decode()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in body.splitlines() if line.strip()]


def rounds_table(contributions: list[dict], merges: list[dict]) -> list[dict]:
    """One row per (fragment, round), in that order: the version the round published and when
    (unix s; None when it published none), how many contributions met each fate, and the
    contributions themselves (learner, fate, reason, c_tokens, c_steps, compute_s, staleness_versions).

    Args:
        contributions: :func:`read_contributions` records.
        merges: :func:`read_merges` records.
    """
    merged = {(int(m["fragment"]), int(m["round"])): m for m in merges}
    rows: dict[tuple[int, int], dict] = {}
    for c in contributions:
        key = (int(c["fragment"]), int(c["round"]))
        row = rows.setdefault(key, {"fragment": key[0], "round": key[1], "version": None, "merged_t": None,
                                    "fates": {}, "contributions": []})
        row["fates"][c["fate"]] = row["fates"].get(c["fate"], 0) + 1
        row["contributions"].append({k: c.get(k) for k in ("learner", "fate", "reason", "c_tokens", "c_steps",
                                                            "compute_s", "staleness_versions")})
    for key, m in merged.items():
        row = rows.setdefault(key, {"fragment": key[0], "round": key[1], "version": None, "merged_t": None,
                                    "fates": {}, "contributions": []})
        row["version"], row["merged_t"] = int(m["version"]), float(m["t"])
    return [rows[k] for k in sorted(rows)]


def timeline_from_records(records: dict[str, list[dict]], merges: list[dict], shares: list[float],
                          end_s: float | None = None) -> Timeline:
    """A :class:`Timeline` of learner slots from their own records and the merge records.

    Args:
        records: learner id -> its records, in file order (unix times).
        merges: ``merges.jsonl`` records (``t``, ``update_ids``).
        shares: numel share per fragment.
        end_s: end of the window (default: the last record or merge).

    Raises:
        ValueError: no records at all.
    """
    times = [float(r.get("t1", r["t"])) for recs in records.values() for r in recs] + [float(m["t"]) for m in merges]
    starts = [float(r["t"]) for recs in records.values() for r in recs if r["kind"] == "start"]
    if not times or not starts:
        raise ValueError("no timeline records")
    start_s, end = min(starts), end_s if end_s is not None else max(times)
    merged = {u for m in merges for u in m["update_ids"]}
    tl = Timeline(sorted(records), start_s, end, merges_s=[float(m["t"]) for m in merges])
    for lid, recs in records.items():
        tl.steps += diloco_timeline_steps(lid, recs, merged, shares)
        by_inc: dict[int, list[dict]] = {}
        for r in recs:
            by_inc.setdefault(int(r["inc"]), []).append(r)
        incs = sorted(by_inc)
        for j, inc in enumerate(incs):
            rs = by_inc[inc]
            t_start = next((float(r["t"]) for r in rs if r["kind"] == "start"), float(rs[0].get("t0", rs[0]["t"])))
            t_ready = next((float(r["t"]) for r in rs if r["kind"] == "ready"), None)
            t_last = max(float(r.get("t1", r["t"])) for r in rs)
            tl.intervals.append(Interval(lid, "starting" if j == 0 else "restarting", t_start,
                                         max(t_start, t_ready if t_ready else t_last)))
            tl.intervals += [Interval(lid, "blocked", float(r["t0"]), float(r["t1"]))
                             for r in rs if r["kind"] == "blocked"]
            clean = any(r["kind"] == "stopped" for r in rs)
            if not clean and j + 1 < len(incs):
                nxt = by_inc[incs[j + 1]]
                t_next = next((float(r["t"]) for r in nxt if r["kind"] == "start"), None)
                if t_next is not None and t_next > t_last:
                    tl.intervals.append(Interval(lid, "down", t_last, t_next))
        first = min(float(r["t"]) for r in recs if r["kind"] == "start") if any(
            r["kind"] == "start" for r in recs) else start_s
        if first > start_s:  # the slot's first process started late: not provisioned before
            tl.intervals.append(Interval(lid, "down", start_s, first))
    return tl
