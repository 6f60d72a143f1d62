"""The API fuzz against a live synchronizer process on loopback (issue 14, "What it must show").

:func:`run_api_fuzz` starts a real synchronizer (``python -m diloco_async.server`` through
:class:`~diloco_async.run.RunProcesses`, a ``file://`` store, a small model), three honest
:class:`~diloco_async.chaos.scripted.ScriptedLearners` that keep rounds merging and, optionally,
a :class:`~diloco_async.chaos.scripted.Poisoner`. After a warm-up it sends ``requests`` requests
drawn by :class:`~diloco_async.chaos.fuzz.RequestGenerator` from ``concurrency`` workers, then
checks that the process is alive and answers, that honest rounds still merge, reads every
published version back and compares the synchronizer's RSS (psutil) with its RSS after warm-up.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import numpy as np
import psutil
from yarl import URL

from diloco_async.chaos.fuzz import FuzzRequest, RequestGenerator
from diloco_async.chaos.scripted import Poisoner, ScriptedLearners, published_extremes
from diloco_async.chaos.slow_clients import SlowClients
from diloco_async.config.resolved import with_fields
from diloco_async.config.schema import Config
from diloco_async.policy.fragments import FragmentPlan
from diloco_async.protocol.auth import learner_token
from diloco_async.protocol.client import SyncClient
from diloco_async.run import RunProcesses

__all__ = ["FuzzResult", "run_api_fuzz", "send_request", "fuzz_config", "NO_ANSWER", "CLIENT_REFUSED"]

log = logging.getLogger("diloco.chaos.fuzz")

NO_ANSWER = 0
"""Status recorded for a request the synchronizer did not answer (refused, reset, timed out)."""
CLIENT_REFUSED = -1
"""Status recorded for a request the HTTP client itself refused to send (e.g. a header it cannot encode)."""

HONEST = ["honest-0", "honest-1", "honest-2"]
FUZZ_IDS = [f"fuzz-{i}" for i in range(6)]
POISONER = "poisoner-0"


def fuzz_config(workdir: Path) -> Config:
    """The run the fuzz targets: a tiny model, 2 fragments, H = 4, K = 2, short timeouts; 10
    learner slots, so the honest learners, the poisoner and the fuzz's own ids fit under a learner
    cap (the fuzz also sends other ids: those may be refused)."""
    return with_fields(Config(), {
        "run.store": f"file://{workdir}/store", "run.workdir": f"{workdir}/runs", "model.n_layer": 1,
        "model.d_model": 16, "model.n_head": 2, "model.context": 8, "learners.count": 10,
        "synchronizer.num_fragments": 2, "synchronizer.sync_every": 4, "synchronizer.min_quorum": 2,
        "synchronizer.grace_initial_s": 0.2, "synchronizer.grace_cap_s": 0.5,
        "synchronizer.heartbeat_timeout_s": 3.0, "synchronizer.checkpoint_every_s": 100000.0,
        "synchronizer.drain_s": 0.0, "budget.wall_s": 3600.0, "budget.tokens": 1_000_000_000_000_000})


@dataclass
class FuzzResult:
    """What one fuzz run measured (statuses: HTTP codes, :data:`NO_ANSWER`, :data:`CLIENT_REFUSED`)."""

    requests: int = 0
    elapsed_s: float = 0.0
    by_status: Counter = field(default_factory=Counter)
    by_kind: dict[str, Counter] = field(default_factory=lambda: defaultdict(Counter))
    examples_5xx: list[str] = field(default_factory=list)
    examples_no_answer: list[str] = field(default_factory=list)
    alive: bool = False
    health_ok: bool = False
    rss_warm_bytes: int = 0
    rss_end_bytes: int = 0
    merges_during: int = 0
    merge_after_s: float | None = None  # seconds until every fragment merged again after the fuzz
    published_read: int = 0
    published_non_finite: int = 0
    published_max_abs: float = 0.0
    honest_acks: Counter = field(default_factory=Counter)
    poison_acks: Counter = field(default_factory=Counter)
    rejected_by_reason: dict = field(default_factory=dict)  # the synchronizer's counters at the end
    log_tracebacks: int = 0  # tracebacks in the synchronizer's log
    hb_p99_quiet_ms: float = float("nan")  # honest heartbeats' p99 latency before any fuzz
    hb_p99_fuzz_ms: float = float("nan")  # and during the fuzz
    slow_clients: int = 0
    slow_limit_s: float = 0.0
    slow_closed_s: float | None = None  # until the server closed every slow client (None: not within the limit)
    sync_log: str = ""

    @property
    def count_5xx(self) -> int:
        return sum(n for s, n in self.by_status.items() if s >= 500)

    @property
    def impersonations_accepted(self) -> int:
        """Requests whose body names a learner other than the token's holder, answered 2xx."""
        return sum(n for kind, statuses in self.by_kind.items() if kind.endswith("/impersonation")
                   for status, n in statuses.items() if 200 <= status < 300)

    @property
    def rss_growth(self) -> float:
        """RSS at the end over RSS after warm-up, minus one (0.05 = 5 % growth)."""
        return self.rss_end_bytes / max(self.rss_warm_bytes, 1) - 1.0

    def bars(self, min_requests: int, merge_within_s: float = 30.0) -> list[tuple[str, float, str, bool]]:
        """``(figure, value, goal, ok)`` rows of the fuzz's bars."""
        after = self.merge_after_s
        return [
            ("requests sent", self.requests, f">= {min_requests}", self.requests >= min_requests),
            ("responses 5xx", self.count_5xx, "== 0", self.count_5xx == 0),
            ("requests not answered (refused, reset, timeout)", self.by_status[NO_ANSWER], "== 0",
             self.by_status[NO_ANSWER] == 0),
            ("synchronizer alive and /health answers", float(self.alive and self.health_ok), "== 1",
             self.alive and self.health_ok),
            ("seconds until every fragment merged again after the fuzz", -1.0 if after is None else after,
             f"<= {merge_within_s:g}", after is not None and after <= merge_within_s),
            ("synchronizer RSS growth after warm-up (%)", 100 * self.rss_growth, "< 10", self.rss_growth < 0.10),
            ("published versions with a non-finite value", self.published_non_finite, "== 0",
             self.published_non_finite == 0 and self.published_read > 0),
            ("largest |value| in a published version", self.published_max_abs, "<= 100",
             self.published_max_abs <= 100.0),
            ("requests acting as another learner answered 2xx", self.impersonations_accepted, "== 0",
             self.impersonations_accepted == 0),
            ("tracebacks in the synchronizer's log", self.log_tracebacks, "== 0", self.log_tracebacks == 0),
            ("honest heartbeat p99 latency before the fuzz (ms)", self.hb_p99_quiet_ms, "shown", True),
            ("honest heartbeat p99 latency during the fuzz (ms)", self.hb_p99_fuzz_ms, "shown", True),
        ] + ([(f"seconds until the server closed {self.slow_clients} stalled connections",
               -1.0 if self.slow_closed_s is None else self.slow_closed_s, f"<= {self.slow_limit_s:g}",
               self.slow_closed_s is not None)] if self.slow_clients else [])


async def send_request(session: aiohttp.ClientSession, base: str, req: FuzzRequest, timeout_s: float = 10.0) -> int:
    """Send one fuzz request; returns the HTTP status (101 for an accepted WebSocket), or
    :data:`NO_ANSWER` / :data:`CLIENT_REFUSED`."""
    url = URL(base + req.path, encoded=True)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    try:
        if req.method == "WS":
            return await _send_ws(session, url, req, timeout_s)
        async with session.request(req.method, url, data=req.body, headers=req.headers, timeout=timeout) as resp:
            await resp.read()
            return resp.status
    except (ValueError, UnicodeEncodeError, aiohttp.InvalidURL):
        return CLIENT_REFUSED
    except (aiohttp.ClientError, TimeoutError, OSError):
        return NO_ANSWER


async def _send_ws(session: aiohttp.ClientSession, url: URL, req: FuzzRequest, timeout_s: float) -> int:
    try:
        async with session.ws_connect(url, headers=req.headers, timeout=aiohttp.ClientWSTimeout(ws_close=timeout_s),
                                      heartbeat=None) as ws:
            if req.body is not None:
                await ws.send_bytes(req.body)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(ws.receive(), 0.05)
            return 101
    except aiohttp.WSServerHandshakeError as err:
        return err.status


async def _fuzz(url: str, gen: RequestGenerator, count: int, concurrency: int, deadline: float,
                result: FuzzResult) -> None:
    sent = 0

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal sent
        while sent < count and time.monotonic() < deadline:
            sent += 1
            req = gen.next()
            status = await send_request(session, url, req)
            result.requests += 1
            result.by_status[status] += 1
            result.by_kind[req.kind][status] += 1
            body = req.body or b""
            if status >= 500 and len(result.examples_5xx) < 20:
                result.examples_5xx.append(f"{status} {req.method} {req.path[:80]} {req.kind} {body[:120]!r}")
            if status == NO_ANSWER and len(result.examples_no_answer) < 20:
                result.examples_no_answer.append(f"{req.method} {req.path[:80]} {req.kind} {len(body)} bytes")

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))


async def _merges(client: SyncClient) -> dict[str, int]:
    try:
        return {k: int(v) for k, v in (await client.status())["versions"].items()}
    except (aiohttp.ClientError, TimeoutError, OSError):
        return {}


async def _wait_merges(client: SyncClient, since: dict[str, int], timeout_s: float) -> float | None:
    """Seconds until every fragment's version passed ``since``; None if not within ``timeout_s``."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        now = await _merges(client)
        if now and all(now.get(k, 0) > v for k, v in since.items()):
            return time.monotonic() - t0
        await asyncio.sleep(0.2)
    return None


def _rss(pid: int) -> int:
    try:
        return psutil.Process(pid).memory_info().rss
    except psutil.Error:
        return 0


def _p99_ms(latencies, start: float, end: float) -> float:
    """The 99th percentile (numpy's ``higher``: the ``ceil(0.99 (n - 1))``-th of the sorted, from
    0) of the latencies (s) of the ``(t, latency)`` pairs with ``start <= t < end``, in ms; NaN when
    none."""
    inside = [s for t, s in latencies if start <= t < end]
    return 1000 * float(np.quantile(inside, 0.99, method="higher")) if inside else float("nan")


async def _phases(run: RunProcesses, client: SyncClient, gen: RequestGenerator, honest: ScriptedLearners,
                  opts: dict, result: FuzzResult) -> None:
    """Quiet baseline, warm-up fuzz, fuzz (with slow clients), then the checks."""
    pid, url = run.sync.pid, URL(str(run.sync_url))
    start, t_quiet = await _merges(client), time.monotonic()
    if await _wait_merges(client, start, 60.0) is None:
        raise RuntimeError(f"no honest merge within 60 s before the fuzz; see {run.sync.log_path}")
    opts["start_poisoner"]()
    deadline = time.monotonic() + opts["time_limit_s"]
    warm = max(1, opts["requests"] // 10)
    t_fuzz = time.monotonic()
    await _fuzz(str(run.sync_url), gen, warm, opts["concurrency"], deadline, result)
    result.rss_warm_bytes = _rss(pid)
    slow = SlowClients(url.host or "127.0.0.1", url.port or 80, opts["slow_clients"], gen.headers_for)
    slow.open()
    before, t0 = await _merges(client), time.monotonic()
    await _fuzz(str(run.sync_url), gen, opts["requests"] - warm, opts["concurrency"], deadline, result)
    result.elapsed_s = time.monotonic() - t0
    result.hb_p99_quiet_ms = _p99_ms(honest.latencies, t_quiet, t_fuzz)
    result.hb_p99_fuzz_ms = _p99_ms(honest.latencies, t_fuzz, time.monotonic())
    after = await _merges(client)
    result.merges_during = sum(after.values()) - sum(before.values())
    result.merge_after_s = await _wait_merges(client, after, 30.0)
    if opts["slow_clients"]:
        result.slow_closed_s = await slow.wait_closed(opts["slow_limit_s"])
    result.rss_end_bytes = _rss(pid)
    result.alive = psutil.pid_exists(pid) and run.sync.poll() is None
    with contextlib.suppress(aiohttp.ClientError, TimeoutError, OSError):
        result.health_ok = (await client.health())["ok"] is True
        result.rejected_by_reason = (await client.status()).get("rejected_by_reason", {})


async def _drive(run: RunProcesses, seed: int, poison: bool, opts: dict, result: FuzzResult) -> FragmentPlan:
    url = str(run.sync_url)
    stop = asyncio.Event()
    honest = ScriptedLearners(url, run.run_id, run.token, run.store, HONEST, steps_per_beat=4)
    tasks = [asyncio.create_task(honest.run(stop))]
    poisoner = Poisoner(url, run.run_id, run.token, run.store, POISONER, seed=seed) if poison else None
    if poisoner is not None:
        opts["start_poisoner"] = lambda: tasks.append(asyncio.create_task(poisoner.run(stop)))
    else:
        opts["start_poisoner"] = lambda: None
    gen = RequestGenerator(seed, run.run_id, FUZZ_IDS, HONEST,
                           lambda lid: SyncClient(url, learner_token(run.token, run.run_id, lid or "")
                                                  if lid else run.token).auth_headers())
    try:
        async with SyncClient(url, None) as client:
            await _phases(run, client, gen, honest, opts, result)
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
    result.honest_acks = honest.acks
    result.poison_acks = poisoner.acks if poisoner is not None else Counter()
    return honest.plan


def run_api_fuzz(requests: int, seed: int, workdir: str | os.PathLike, concurrency: int = 8,
                 time_limit_s: float = 600.0, poison: bool = True, slow_clients: int = 0,
                 slow_limit_s: float = 90.0) -> FuzzResult:
    """Fuzz a live synchronizer with ``requests`` requests (fewer if ``time_limit_s`` passes first),
    with ``slow_clients`` stalled connections open meanwhile (:class:`SlowClients`; how long the
    server takes to close them is measured up to ``slow_limit_s``).

    Raises:
        RuntimeError: the synchronizer did not start, or honest rounds did not merge before the fuzz.
    """
    workdir = Path(workdir).resolve()
    run = RunProcesses(fuzz_config(workdir))
    result = FuzzResult(slow_clients=slow_clients, slow_limit_s=slow_limit_s)
    try:
        run.start_synchronizer()
        result.sync_log = str(run.sync.log_path)
        opts = {"requests": requests, "concurrency": concurrency, "time_limit_s": time_limit_s,
                "slow_clients": slow_clients, "slow_limit_s": slow_limit_s}
        plan = asyncio.run(_drive(run, seed, poison, opts, result))
        if plan is not None:
            result.published_read, result.published_non_finite, result.published_max_abs = published_extremes(
                run.store, run.run_id, plan)
    finally:
        if run.sync is not None and run.sync.poll() is None:
            os.kill(run.sync.pid, signal.SIGTERM)
            with contextlib.suppress(Exception):
                run.sync.wait(timeout=15)
        run.stop_all()
    with contextlib.suppress(OSError):
        result.log_tracebacks = Path(result.sync_log).read_text(errors="replace").count("Traceback (most recent")
    return result
