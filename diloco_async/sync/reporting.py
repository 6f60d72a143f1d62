"""What the synchronizer reports: counters, the metric stream, the merge log, the run summary and
the live status (DESIGN §7); the run summary and the status are built by
:mod:`diloco_async.sync.summary` from the actor's components.

Metric points are ``{"key", "value", "step", "timestamp_ms"}`` with units in the key
(``sync/grace_s``, ``net/bytes_in``); ``GET /metrics?since=N`` serves them by number and the
flow forwards them to MLflow. Merge records are ``{"t", "fragment", "round", "version", "sha256",
"update_ids", "contributions"}`` (unix seconds; the sha256 of the version published; ``update_ids``: the
contributions that moved the model, direction factor above 0, DESIGN §10). Contribution
records (:meth:`Reporter.fate`) say what became of every contribution the synchronizer decided on:
``{"t", "fragment", "round", "learner", "fate", "reason", "c_tokens", "c_steps", "compute_s", "base_version",
"staleness_versions"}``. The logs keep
a bounded tail in memory and spill to local disk; at the end of the run they go to the store as
``metrics.jsonl``, ``merges.jsonl`` and ``contributions.jsonl`` of the epoch.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
from collections import Counter
from collections.abc import Callable, Collection, Coroutine
from json.encoder import encode_basestring_ascii as _json_str
from typing import TYPE_CHECKING, Any

from diloco_async.metrics.goodput import MergeGaps, totals, window_goodput
from diloco_async.storage import keys
from diloco_async.storage.store import ObjectStore
from diloco_async.sync.logs import JsonLinesLog
from diloco_async.sync.traffic import TrafficPeaks

if TYPE_CHECKING:
    from diloco_async.sync.learners import LearnerRegistry
    from diloco_async.sync.state import FragmentState, Merged, Round

__all__ = ["Reporter", "write_final", "METRICS_TAIL", "MERGES_TAIL", "UPTIME_MIN_GAP_S", "METRICS_BATCH"]

log = logging.getLogger("diloco.synchronizer")

METRICS_TAIL = 10_000
"""Metric points kept in memory (about 150 bytes each: ~1.5 MB; a run of 4 learners makes about 60 a
second, the flow pulls every 2 s); older ones are read from the spill file."""
MERGES_TAIL = 1_000
"""Merge records kept in memory; all of them are in the spill file."""
NET_ALL_LEARNERS_S = 30.0
"""Seconds (actor's clock) between two merges that write every learner's ``net/learner/...``
points; the merges between write those of their own learners only."""
METRICS_BATCH = 5_000
"""Most metric points one ``GET /metrics`` answer carries."""
UPTIME_MIN_GAP_S = 5.0
"""Lower bound of the uptime gap (s): shorter gaps between merges never count as down."""


class Reporter:
    """Counters, rejection reasons, the metric stream and the merge log of one synchronizer.

    Args:
        started_s: the actor's start on its clock (s).
        name: names the spill files (e.g. the run id).
        spill_dir: folder of the spill files (default: the temporary folder).
        metrics_tail, merges_tail: records of each log kept in memory.
        clock: keyword-only; monotonic seconds of the traffic peaks' 1 s windows.
    """

    def __init__(self, started_s: float, name: str, spill_dir: str | os.PathLike | None = None,
                 metrics_tail: int = METRICS_TAIL, merges_tail: int = MERGES_TAIL, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.counters: Counter[str] = Counter()
        self._net_all_s = -math.inf  # when net() last wrote every learner's points
        self.traffic = TrafficPeaks(clock)  # peak bytes per second of this process's traffic
        self.rejected_by_reason: Counter[str] = Counter()
        self.bad_requests: Counter[str] = Counter()  # requests answered 400, by reason (a bounded set)
        self.clamped_by_reason: Counter[str] = Counter()  # heartbeat figures held to the pace limits
        self.abandoned_by_reason: Counter[str] = Counter()  # rounds abandoned, by reason
        # requests refused at the HTTP edge before the actor (unauthenticated, forbidden, body_timeout);
        # written only by the edge (diloco_async.sync.gate), read here for the status and summary
        self.edge_rejections: Counter[str] = Counter()
        self.edge_by_mode: Counter[str] = Counter()  # the same refusals and the 400s, by network mode
        self.metrics = JsonLinesLog(metrics_tail, prefix=f"diloco-sync-{name}-metrics-", spill_dir=spill_dir)
        self.merge_log = JsonLinesLog(merges_tail, prefix=f"diloco-sync-{name}-merges-", spill_dir=spill_dir)
        self.fates = JsonLinesLog(merges_tail, prefix=f"diloco-sync-{name}-contributions-", spill_dir=spill_dir)
        self.merge_gaps = MergeGaps(started_s, UPTIME_MIN_GAP_S)
        self._goodput_before: dict | None = None  # totals at the last goodput_series point
        self._badput_seen: set[str] = set()  # badput causes logged so far (then logged at every point)
        self._goodput_merges, self._goodput_at_s = 0, started_s  # merges and time of the last goodput point

    def metric(self, key: str, value: float, step: int | None = None) -> None:
        """One metric point; ``step`` defaults to the number of merges so far. A non-finite value
        is logged as null (the stream is standard JSON)."""
        value = float(value)
        # the line json.dumps writes for this dict, formatted directly: a metric point is logged for
        # every heartbeat (several) and every learner at each merge, ~3x faster this way (issue 17)
        self.metrics.append_line(
            f'{{"key": {_json_str(key)}, "value": {float.__repr__(value) if math.isfinite(value) else "null"}, '
            f'"step": {int(self.counters["merges"] if step is None else step)}, '
            f'"timestamp_ms": {int(time.time() * 1000)}}}')

    def add_bytes_in(self, nbytes: int) -> None:
        """Count bytes of a verified contribution (``bytes_in``) and credit its window."""
        self.counters["bytes_in"] += nbytes
        self.traffic.add_in(nbytes)

    def add_bytes_out(self, nbytes: int) -> None:
        """Count bytes learners downloaded (``bytes_out``) and credit their window."""
        self.counters["bytes_out"] += nbytes
        self.traffic.add_out(nbytes)
    def merged_round(self, f: FragmentState, res: Merged, rnd: Round, registry: LearnerRegistry, now_s: float) -> None:
        """The metric points and the log line of round ``res.round_n`` of fragment ``f``, merged and published."""
        c = self.counters
        grace_s = rnd.state.grace.grace_s if rnd.state.grace else 0.0
        staleness = [f.version - 1 - rnd.contributions[lid].ann.base_version for lid in res.merged]
        for key, value in (("merges", c["merges"]), ("quorum_size", len(res.merged)), ("grace_s", grace_s),
                           ("quorum_wait_s", res.quorum_wait_s), ("merge_s", res.seconds)):
            self.metric(f"sync/{key}", value)
        merged_cosines = [res.cosines[lid] for lid in res.merged if res.cosines.get(lid) is not None]
        if merged_cosines:  # the least agreement of a merged outer gradient with the rest of its round
            self.metric("sync/direction_cosine_min", min(merged_cosines))
        for key in ("contributions_merged", "contributions_late", "contributions_folded", "contributions_rejected"):
            self.metric(f"sync/{key}", c[key])
        self.metric("sync/live_learners", len(registry.live()))
        self.net(registry, res.merged, now_s)
        self.metric("sync/staleness_versions", sum(staleness) / len(staleness))
        self.metric(f"sync/fragment/{f.p}/version", f.version)
        log.info("fragment %d round %d merged %d (%s) -> version %d; grace %.3fs; %d late",
                 f.p, res.round_n, len(res.merged), ",".join(res.merged), f.version, grace_s, len(rnd.state.late))

    def net(self, reg: LearnerRegistry, merged: Collection[str] | None = None, now_s: float = 0.0) -> None:
        """The ``net/...`` metric points: cumulative bytes in and out, and bytes per token up and
        down for the run, each fragment and each learner (:class:`~diloco_async.sync.wire_bytes.WireBytes`).
        With ``merged`` (the learners of a merge), the learners' points are only theirs, except
        once every :data:`NET_ALL_LEARNERS_S` (``now_s`` on the actor's clock): a point for every
        learner at every merge was thousands of lines per merge at 1,000 learners (issue 17)."""
        self.metric("net/bytes_out", self.counters["bytes_out"])
        self.metric("net/bytes_in", self.counters["bytes_in"])
        if merged is None or now_s - self._net_all_s >= NET_ALL_LEARNERS_S:
            merged, self._net_all_s = None, now_s
        learner_tokens = {lid: led.tokens_processed for lid, led in reg.ledgers.items()}
        for name, value in reg.wire.metrics(reg.tokens_processed(), learner_tokens, merged).items():
            self.metric(name, value)

    def count(self, name: str) -> int:
        """Add one to counter ``name`` and log it as the metric ``sync/<name>``; returns the count."""
        self.counters[name] += 1
        self.metric(f"sync/{name}", self.counters[name])
        return self.counters[name]

    def clamp(self, reason: str) -> bool:
        """Count one clamped heartbeat figure; True when it is worth a log line (1st, 2nd, 4th, ...)."""
        self.clamped_by_reason[reason] += 1
        n = self.clamped_by_reason[reason]
        self.metric(f"sync/clamped/{reason}", n)
        return n & (n - 1) == 0

    def abandon(self, reason: str) -> None:
        """Count one abandoned round under ``reason`` (``merge_failed``, ``at_stop``, ``round_timeout``, ...)."""
        self.abandoned_by_reason[reason] += 1
        self.count("rounds_abandoned")

    def reject(self, reason: str) -> None:
        """Count one rejected contribution under ``reason``."""
        self.counters["contributions_rejected"] += 1
        self.rejected_by_reason[reason] += 1
        self.metric("sync/contributions_rejected", self.counters["contributions_rejected"])
        self.metric(f"sync/rejected/{reason}", self.rejected_by_reason[reason])

    def answer_metrics(self, since: int, reply: asyncio.Future,
                       spawn: Callable[[Coroutine[Any, Any, None]], None]) -> None:
        """Answer ``reply`` with metric points from number ``since`` on (at most
        :data:`METRICS_BATCH`); points older than the in-memory tail are read from the spill file
        in a worker thread started with ``spawn``. Runs on the actor's task."""
        since, stream = max(0, since), self.metrics
        total = len(stream)
        batch = stream.read(since, METRICS_BATCH)
        if batch is not None:
            reply.set_result({"next": since + len(batch), "total": total, "metrics": batch})
            return
        stream.flush()

        async def from_disk() -> None:
            try:
                rows = await asyncio.to_thread(stream.read_spilled, since, METRICS_BATCH, total)
            except Exception as err:  # the spill file is gone (end of run) or unreadable
                log.warning("metrics since %d unavailable: %s", since, err)
                rows = []
            if not reply.done():
                reply.set_result({"next": since + len(rows), "total": total, "metrics": rows})

        spawn(from_disk())

    def merged(self, now_s: float, record: dict) -> None:
        """Record a merge at ``now_s`` (actor clock) and its merge-log ``record``."""
        self.merge_gaps.record(now_s)
        self.merge_log.append(record)

    def fate(self, record: dict) -> None:
        """Record what became of one contribution (a contribution record, see the module doc)."""
        self.fates.append(record)

    def goodput_point_due(self, now_s: float, every_s: float) -> bool:
        """A point of the goodput time series is due at ``now_s`` (actor's clock): a merge since the
        last point and ``every_s`` passed. True marks the point taken."""
        merges = self.counters["merges"]
        if merges > self._goodput_merges and now_s - self._goodput_at_s >= every_s:
            self._goodput_merges, self._goodput_at_s = merges, now_s
            return True
        return False

    def goodput_series(self, ledgers: dict, uptime: float, silent_s: dict[str, float] | None = None,
                       per_learner: bool = False) -> None:
        """One point of the goodput time series (step: merges so far): cumulative compute and
        token goodput (``goodput/compute``, ``goodput/token``, the same figures as the summary's), the
        tokens all learners processed (``sync/tokens_processed``),
        the same over the window since the last point (``goodput/compute_rolling``,
        ``goodput/token_rolling``), the uptime so far, and the cumulative badput by cause
        (``badput/<cause>``, shares of the provisioned learner-seconds; with ``goodput/compute``
        they sum to 1; a cause is logged from its first non-zero share on; ``silent_s`` as
        :func:`~diloco_async.metrics.goodput.totals`). ``per_learner``: also each learner's
        ``learner/<id>/compute_goodput`` and ``token_goodput`` (at the end)."""
        tot = totals(ledgers, silent_s)
        self.metric("goodput/compute", tot["compute_goodput"])
        self.metric("goodput/token", tot["token_goodput"])
        self.metric("goodput/uptime", uptime)
        self.metric("sync/tokens_processed", tot["tokens_processed"])  # a sharded run logs the same key
        for cause, share in tot["badput"].items():  # a cause that never occurred is no series of zeros
            if share > 0 or cause in self._badput_seen:
                self._badput_seen.add(cause)
                self.metric(f"badput/{cause}", share)
        if per_learner:
            for lid, led in ledgers.items():
                self.metric(f"learner/{lid}/compute_goodput", led.compute_goodput)
                self.metric(f"learner/{lid}/token_goodput", led.token_goodput)
        if self._goodput_before is not None:
            for name, value in window_goodput(self._goodput_before, tot).items():
                if value is not None:
                    self.metric(f"goodput/{name.removesuffix('_goodput')}_rolling", value)
        self._goodput_before = tot

    def seal(self) -> None:
        """The spill files hold everything so far and may be uploaded (:func:`write_final`)."""
        self.metrics.seal()
        self.merge_log.seal()
        self.fates.seal()

    def close(self) -> None:
        self.metrics.close()
        self.merge_log.close()
        self.fates.close()


def write_final(store: ObjectStore, run_id: str, epoch: str, final_summary: dict, rep: Reporter) -> None:
    """Put the epoch's ``metrics.jsonl``, ``summary.json``, ``merges.jsonl`` and
    ``contributions.jsonl`` (blocking; the reporter's logs sealed first, on the actor's task).

    Raises:
        OSError, FileExistsError, TimeoutError: the store did not take one of them.
    """
    store.put_from_file(keys.metrics_log_key(run_id, epoch), rep.metrics.source)
    store.put_json(keys.summary_key(run_id, epoch), final_summary)
    store.put_from_file(keys.merge_log_key(run_id, epoch), rep.merge_log.source)
    store.put_from_file(keys.contribution_log_key(run_id, epoch), rep.fates.source)
