"""One run seen as one: the figures of ``synchronizer.shards`` > 1 synchronizer shards as the run's
(issue 40 item 3; DESIGN §2.2). Pure: plain dicts in, a dict out; no I/O, no clock.

Every shard hears every learner's heartbeats and owns a disjoint set of fragments, so a figure
is either *seen by every shard* (the same learner-seconds, tokens processed, global step and
bytes learners downloaded, up to one heartbeat of timing: the largest is taken) or *owned by one
shard* (merges, merged tokens and compute, contributions and their outcomes, bytes fetched,
thrown-away seconds: summed). :func:`aggregate_status` applies that rule to the ``GET /status``
documents (or the ``summary.json`` files) of the shards and adds a row per shard (``shards``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from diloco_async.metrics.goodput import OBSERVED_CAUSES, LearnerLedger, badput_fractions, totals

__all__ = ["aggregate_status", "aggregate_learner", "OWNED_COUNTS", "OWNED_BADPUT"]

OWNED_COUNTS = ("merges", "contributions_merged", "contributions_late", "contributions_folded",
                "contributions_rejected", "actor_errors", "rounds_abandoned", "contributions_clipped",
                "contributions_downweighted", "verifications_dropped", "duplicates", "bytes_in", "checkpoints",
                "gc_deleted_objects", "gc_kept_for_reads", "metrics_total")
"""Counts each shard keeps of its own fragments or requests: the run's is their sum."""
OWNED_BY_REASON = ("rejected_by_reason", "bad_requests", "rounds_abandoned_by_reason", "clamped_by_reason")
"""Counts by reason, summed reason by reason."""
OWNED_BADPUT = ("thrown_away",)
"""Badput causes a shard charges per fragment (a contribution's compute times its fragment's share):
summed. The others (down, starting, restarting, stalled, blocked) are learner events every shard sees:
the largest is taken."""
_SEEN_MAX = ("wall_s", "global_step", "uptime_max_gap_s", "bytes_out")


def _counts(rows: Sequence[Mapping[str, Any]], key: str) -> dict[str, int]:
    total: Counter[str] = Counter()
    for row in rows:
        total.update(row.get(key) or {})
    return dict(total)


def aggregate_learner(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One learner's figures over the shards that know it (each a ``learners[id]`` entry of a
    shard's status or summary, at least one).

    Seen by every shard (largest): ``provisioned_s``, ``tokens_processed``, ``step``,
    ``incarnation``, ``bytes_down``, the badput causes but ``thrown_away``; owned (summed):
    ``useful_s``, ``tokens_merged``, ``contributions`` by outcome, ``bytes_up``, ``thrown_away``.
    ``live``: any shard hears it; ``heartbeat_age_s``: the freshest. Goodputs are recomputed from
    the aggregated seconds and tokens; pace and link figures are the first shard's.

    Raises:
        ValueError: ``rows`` is empty.
    """
    if not rows:
        raise ValueError("aggregate_learner needs the learner's entry of at least one shard")
    out = dict(rows[0])
    led = LearnerLedger(
        provisioned_s=max(float(r.get("provisioned_s", 0.0)) for r in rows),
        useful_s=sum(float(r.get("useful_s", 0.0)) for r in rows),
        tokens_processed=max(int(r.get("tokens_processed", 0)) for r in rows),
        tokens_merged=sum(float(r.get("tokens_merged", 0.0)) for r in rows),
        contributions=_counts(rows, "contributions"),
        badput_s={c: (sum if c in OWNED_BADPUT else max)(float((r.get("badput_s") or {}).get(c, 0.0)) for r in rows)
                  for c in OBSERVED_CAUSES})
    out.update(led.to_json(), compute_goodput=led.compute_goodput, token_goodput=led.token_goodput,
               live=any(r.get("live") for r in rows), step=max(int(r.get("step", 0)) for r in rows),
               incarnation=max(int(r.get("incarnation", 0)) for r in rows),
               undeliverable=max(int(r.get("undeliverable", 0)) for r in rows))
    if any("bytes_up" in r for r in rows):
        up, down = sum(int(r.get("bytes_up", 0)) for r in rows), max(int(r.get("bytes_down", 0)) for r in rows)
        tokens = led.tokens_processed
        out.update(bytes_up=up, bytes_down=down, bytes_up_per_token=up / tokens if tokens else None,
                   bytes_down_per_token=down / tokens if tokens else None)
    ages = [r["heartbeat_age_s"] for r in rows if r.get("heartbeat_age_s") is not None]
    if ages:
        out["heartbeat_age_s"] = min(ages)
    return out


def _bytes_by_fragment(docs: Sequence[Mapping[str, Any]], tokens: int) -> dict[str, dict]:
    """Per fragment: bytes up from its owner (the others count none), bytes down as the largest any
    shard heard of (learners report their downloads of every fragment to every shard)."""
    out: dict[str, dict] = {}
    for doc in docs:
        for p, b in (doc.get("bytes_by_fragment") or {}).items():
            cur = out.setdefault(p, {"bytes_up": 0, "bytes_down": 0})
            cur["bytes_up"] += int(b.get("bytes_up", 0))
            cur["bytes_down"] = max(cur["bytes_down"], int(b.get("bytes_down", 0)))
    for b in out.values():
        b["bytes_up_per_token"] = b["bytes_up"] / tokens if tokens else None
        b["bytes_down_per_token"] = b["bytes_down"] / tokens if tokens else None
    return dict(sorted(out.items(), key=lambda kv: int(kv[0])))


def _shard_row(i: int, doc: Mapping[str, Any] | None, url: str | None) -> dict[str, Any]:
    row: dict[str, Any] = {"shard": i, "url": url, "reachable": doc is not None}
    if doc is not None:
        row.update({k: doc.get(k) for k in ("epoch", "phase", "stop_reason", "merges", "versions", "wall_s", "uptime",
                                            "tokens_processed", "contributions_merged", "contributions_late",
                                            "contributions_undeliverable", "bytes_in", "last_checkpoint_seq",
                                            "resumed_from", "finished")})
    return row


def _uptime(docs: Sequence[Mapping[str, Any]]) -> float | None:
    """The share of the run's time its fragments advanced: each shard's uptime weighted by the
    fragments it owns (a shard that is down stops only its own)."""
    weights = [(float(d["uptime"]), max(1, len(d.get("versions") or {}))) for d in docs if d.get("uptime") is not None]
    total = sum(w for _, w in weights)
    return sum(u * w for u, w in weights) / total if total else None


def _learners(docs: Sequence[Mapping[str, Any]]) -> dict[str, dict]:
    by_id: dict[str, list[Mapping[str, Any]]] = {}
    for doc in docs:
        for lid, row in (doc.get("learners") or {}).items():
            by_id.setdefault(lid, []).append(row)
    return {lid: aggregate_learner(rows) for lid, rows in sorted(by_id.items())}


def _run_totals(docs: Sequence[Mapping[str, Any]], learners: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """Goodput and badput over the aggregated learners (:func:`~diloco_async.metrics.goodput.totals`),
    plus the ``down`` seconds of learners a shard judged silent but had not charged to a ledger yet
    (its run figure less its learners' ledgers; the largest over shards)."""
    out = totals({lid: LearnerLedger.from_json(row) for lid, row in learners.items()})
    silent = 0.0
    for doc in docs:
        rows = (doc.get("learners") or {}).values()
        charged = sum(float((row.get("badput_s") or {}).get("down", 0.0)) for row in rows)
        silent = max(silent, float((doc.get("badput_s") or {}).get("down", 0.0)) - charged)
    if silent > 0:
        out["badput_s"]["down"] += silent
        out["badput"] = badput_fractions(out["useful_s"], out["provisioned_s"], out["badput_s"])
    return out


def aggregate_status(per_shard: Sequence[Mapping[str, Any] | None],
                     urls: Sequence[str] | None = None) -> dict[str, Any]:
    """The run's status (or summary) from its shards' ``GET /status`` documents (or
    ``summary.json`` files), in shard order; None for a shard that did not answer.

    One shard: its document as it is (``synchronizer.shards = 1`` reads exactly as before).
    Several: every figure of a shard's document, aggregated by the rule of the module doc:
    goodputs and badput by cause recomputed over the aggregated learners; counts summed
    (:data:`OWNED_COUNTS`, :data:`OWNED_BY_REASON`); ``versions``, ``bytes_by_fragment`` and the
    open ``rounds`` joined (the shards' fragments are disjoint); ``recent_merges`` the newest of
    all; wall time, global step and bytes out the largest; ``uptime`` weighted by fragments
    (:func:`_uptime`); ``stop_reason``/``stopping`` the first shard's that has one; ``finished``
    when every shard is; ``epoch`` the shards' epochs joined with ``+``; ``phase`` the common
    phase, or the shards' phases joined with ``/`` while they differ. ``shards``: one row per shard
    (``reachable``, epoch, phase, merges, versions, tokens, late, stop reason, last checkpoint).

    Raises:
        ValueError: no shard answered, or ``urls`` does not give one URL per shard.
    """
    if urls is not None and len(urls) != len(per_shard):
        raise ValueError(f"{len(urls)} shard URL(s) for {len(per_shard)} shard document(s)")
    docs = [d for d in per_shard if d is not None]
    if not docs:
        raise ValueError(f"none of the {len(per_shard)} synchronizer shard(s) answered")
    if len(per_shard) == 1:
        return dict(docs[0])
    out: dict[str, Any] = dict(docs[0])
    learners = _learners(docs)
    out.update(_run_totals(docs, learners))
    out["learners"] = learners
    _add_counts(docs, out)
    _add_bytes(docs, out)
    _add_state(docs, per_shard, out)
    out["shards"] = [_shard_row(i, d, urls[i] if urls else None) for i, d in enumerate(per_shard)]
    for row in out["shards"]:  # a shard's undeliverable: those of its fragments, as any shard heard of them
        if row["reachable"]:
            row["contributions_undeliverable"] = sum(out["undeliverable_by_fragment"].get(p, 0)
                                                     for p in row.get("versions") or {})
    return out


def _add_counts(docs: Sequence[Mapping[str, Any]], out: dict[str, Any]) -> None:
    """The owned counts summed, what every shard sees the largest, the versions joined."""
    for key in OWNED_COUNTS:
        if any(key in d for d in docs):
            out[key] = sum(int(d.get(key) or 0) for d in docs)
    for key in OWNED_BY_REASON:
        if any(key in d for d in docs):
            out[key] = _counts(docs, key)
    for key in _SEEN_MAX:
        if any(d.get(key) is not None for d in docs):
            out[key] = max(d[key] for d in docs if d.get(key) is not None)
    out["versions"] = dict(sorted({p: v for d in docs for p, v in (d.get("versions") or {}).items()}.items(),
                                  key=lambda kv: int(kv[0])))
    if any("outer_lr" in d for d in docs):  # η of each fragment's last outer step: each shard's own fragments
        out["outer_lr"] = {p: lr for d in docs for p, lr in (d.get("outer_lr") or {}).items()}
    # learners tell every shard what they could not deliver, so the largest any shard heard of, fragment
    # by fragment (the owner may be the shard they cannot reach)
    undeliverable: dict[str, int] = {}
    for d in docs:
        for p, n in (d.get("undeliverable_by_fragment") or {}).items():
            undeliverable[p] = max(undeliverable.get(p, 0), int(n))
    out["undeliverable_by_fragment"] = dict(sorted(undeliverable.items(), key=lambda kv: int(kv[0])))
    out["contributions_undeliverable"] = sum(undeliverable.values())


def _add_bytes(docs: Sequence[Mapping[str, Any]], out: dict[str, Any]) -> None:
    """Bytes by fragment (:func:`_bytes_by_fragment`), per token of the run, and the peaks summed
    (an upper bound: the shards' busiest seconds need not coincide)."""
    tokens = int(out.get("tokens_processed") or 0)
    out["bytes_by_fragment"] = _bytes_by_fragment(docs, tokens)
    up = sum(b["bytes_up"] for b in out["bytes_by_fragment"].values())
    down = sum(b["bytes_down"] for b in out["bytes_by_fragment"].values())
    out["bytes_up_per_token"] = up / tokens if tokens else None
    out["bytes_down_per_token"] = down / tokens if tokens else None
    for key in ("peak_bytes_in_per_s", "peak_bytes_out_per_s", "peak_bytes_per_s"):
        if any(key in d for d in docs):
            out[key] = sum(float(d.get(key) or 0.0) for d in docs)


def _add_state(docs: Sequence[Mapping[str, Any]], per_shard: Sequence[Mapping[str, Any] | None],
               out: dict[str, Any]) -> None:
    """Uptime, epochs, stop reason, phase, whether finished, open rounds and the newest merges."""
    out["uptime"] = _uptime(docs)
    out["epoch"] = "+".join(str(d.get("epoch")) if d else "?" for d in per_shard)
    out["stop_reason"] = next((d["stop_reason"] for d in docs if d.get("stop_reason")), None)
    if "stopping" in out:
        out["stopping"] = next((d["stopping"] for d in docs if d.get("stopping")), None)
    if "finished" in out:
        out["finished"] = len(docs) == len(per_shard) and all(bool(d.get("finished")) for d in docs)
    phases = [str(d.get("phase")) for d in docs if d.get("phase") is not None]
    if phases:
        out["phase"] = phases[0] if len(set(phases)) == 1 else "/".join(phases)
    if "rounds" in out:
        out["rounds"] = sorted((r for d in docs for r in d.get("rounds") or []),
                               key=lambda r: (r["fragment"], r["round"]))
    if "recent_merges" in out:
        merges = sorted((m for d in docs for m in d.get("recent_merges") or []), key=lambda m: m["age_s"])
        out["recent_merges"] = merges[:max(len(d.get("recent_merges") or []) for d in docs)]


LEARNER_FIGURES = ("train_loss", "tokens_per_s", "step_time_s", "link_s_per_fragment", "alive")
"""``learner/{id}/{figure}`` points every shard logs from the same heartbeats: taken from shard 0 only."""


def shard_points(shard: int, points: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Shard ``shard``'s metric points as the run logs them with several shards: a learner's
    heartbeat figures (:data:`LEARNER_FIGURES`) as they are from shard 0 and dropped from the
    others (every shard logs the same heartbeats); every other point renamed
    ``shard/{shard}/{key}`` (its merges, goodput share, bytes: the run's own come from
    :func:`run_points`)."""
    out = []
    for pt in points:
        parts = str(pt["key"]).split("/")
        if len(parts) == 3 and parts[0] == "learner" and parts[2] in LEARNER_FIGURES:
            if shard == 0:
                out.append(dict(pt))
            continue
        out.append({**pt, "key": f"shard/{shard}/{pt['key']}"})
    return out


def run_points(run: Mapping[str, Any], timestamp_ms: int) -> list[dict[str, Any]]:
    """The run's goodput, badput by cause, merges, tokens and bytes per token as metric points
    (the names one synchronizer logs them under), from an :func:`aggregate_status`; step: the
    run's merges. A badput cause at 0 is left out (no series of zeros for what never occurred)."""
    step = int(run.get("merges") or 0)
    figures = {"goodput/compute": run.get("compute_goodput"), "goodput/token": run.get("token_goodput"),
               "goodput/uptime": run.get("uptime"), "sync/merges": step,
               "sync/tokens_processed": run.get("tokens_processed"),
               "net/bytes_up_per_token": run.get("bytes_up_per_token"),
               "net/bytes_down_per_token": run.get("bytes_down_per_token"),
               **{f"badput/{cause}": share for cause, share in (run.get("badput") or {}).items() if share}}
    return [{"key": k, "value": float(v), "step": step, "timestamp_ms": timestamp_ms}
            for k, v in figures.items() if v is not None]


__all__ += ["shard_points", "run_points", "LEARNER_FIGURES"]
