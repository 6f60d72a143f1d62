"""Load on one synchronizer: N simulated learners speaking the real protocol on loopback (issue 17).

A real synchronizer process (``python -m diloco_async.sync``, a tiny model of two fragments, a
``file://`` store under ``/dev/shm``) and, in this process, N asyncio learners. Each learner joins
with its own token, holds the WebSocket push channel (``GET /ws``), heartbeats every
``heartbeat_s`` (its step grows at ``STEPS_PER_S``, so the schedule opens rounds), and, when it
hears of an open round (pushed ``round_open`` or a heartbeat's ``open_rounds``) and its last
announcement is at least ``announce_s`` old, writes a real contribution object (fp32, the
fragment's shapes, about 1.5 KiB) into the store and announces it (``POST /announce``). The
synchronizer fetches, verifies and merges it for real.

Rates, and why:

* 256 learners heartbeat every 0.25 s (the learner's default ``learners.heartbeat_s``; the load
  of the issue's measurement on main); 1,000 learners every 1 s (1,000 heartbeats/s, what one
  Python load generator sustains on a core of the 2-core machine next to the synchronizer).
* Each learner announces at most every 8 s (256) or 10 s (1,000): 32 and 100 announcements/s,
  each a real object read and hashed by the synchronizer; with real models a learner contributes
  a fragment every ``sync_every / num_fragments`` inner steps, seconds to minutes apart.
* Synchronizer: ``heartbeat_timeout_s=5`` (the default), ``min_quorum=4``, grace 0.2 s (capped
  at 0.5 s), ``sync_every=40`` over 2 fragments (at 10 steps/s a round every ~2 s, each pushed
  twice to every WebSocket: ``round_open`` and ``version``), ``max_learners`` = N, no budget but
  the wall clock. Announcements that arrive after their round merged are answered ``late``
  (answered, so not dropped).

Figures printed besides the bars: p50s, the generator's loop lag (large when the machine is
shared: then the latencies are the machine's, not the synchronizer's), both processes' CPU, and
the synchronizer's CPU per request answered, which contention changes little. With
``--baseline-tree DIR`` the same load runs first on the synchronizer of another source tree
(an export of main) for context.

Every request sent is counted, and every answer: a request without a 200 answer, or a
WebSocket closed before the end, counts as dropped. Latency is measured from send to answer on
the load generator's clock, after a warm-up; the generator's own event-loop lag is measured and
printed too. The baseline measured in the same run is ``GET /health`` (served from the status
snapshot without the actor): the floor of the HTTP layer and both event loops under that load.

Bars: 1,000 learners: announce p99 < 50 ms, heartbeat p99 < 50 ms, none dropped; 256 learners:
both p99 < 20 ms. ``quick``: 32 learners for 5 s (a test runs it).

Usage: python -m benchmarks.sync_load [--quick] [--learners N --seconds S]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import multiprocessing
import os
import random
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import psutil
import torch

from benchmarks.bars import Bar, print_bars
from diloco_async import codec as wire
from diloco_async.auth import learner_token
from diloco_async.client import TOKEN_ENV
from diloco_async.fragments import FragmentPlan
from storage import keys
from storage.store import ObjectStore

__all__ = ["LoadSpec", "LoadResult", "run_load", "bars", "main"]

RUN_ID = "load"
STEPS_PER_S = 10.0  # each simulated learner's inner steps per second
ANNOUNCE_JITTER_S = 0.3  # a learner announces up to this long after it heard of a round (its last steps)
GOAL_P99_MS_1000 = 50.0
GOAL_P99_MS_256 = 20.0


@dataclass(frozen=True)
class LoadSpec:
    """One load: ``learners`` learners, ``heartbeat_s`` and ``announce_s`` (s) apart, measured for
    ``seconds`` after ``warmup_s``."""

    learners: int
    heartbeat_s: float
    announce_s: float
    seconds: float
    warmup_s: float = 5.0
    generators: int = 2  # load generator processes the learners are spread over


@dataclass
class LoadResult:
    """Latencies (s) measured after the warm-up, and counts over the whole run."""

    spec: LoadSpec
    heartbeat_s: list[float] = field(default_factory=list)
    announce_s: list[float] = field(default_factory=list)
    health_s: list[float] = field(default_factory=list)
    sent: dict[str, int] = field(default_factory=dict)
    answered: dict[str, int] = field(default_factory=dict)
    acks: dict[str, int] = field(default_factory=dict)
    pushed: int = 0
    pushed_by_type: dict[str, int] = field(default_factory=dict)
    ws_lost: int = 0
    errors: list[str] = field(default_factory=list)
    loop_lag_max_s: float = 0.0
    cpu_s: dict[str, float] = field(default_factory=dict)  # CPU seconds over the measured window
    loop_lag_by_process: list[float] = field(default_factory=list)  # each generator's max loop lag (s)
    cpu_by_generator_s: list[float] = field(default_factory=list)
    sync_watch: dict = field(default_factory=dict)  # the synchronizer's loop watch over the window
    window_s: tuple[float, float] = (0.0, 0.0)  # the measured window (time.monotonic())

    @property
    def dropped(self) -> int:
        return sum(self.sent.values()) - sum(self.answered.values()) + self.ws_lost


def percentile_ms(values: list[float], q: float) -> float | None:
    """The ``q``-quantile (0..1, nearest rank) of ``values`` (s), in ms; None when empty."""
    if not values:
        return None
    s = sorted(values)
    return 1000.0 * s[min(len(s) - 1, max(0, int(round(q * len(s))) - 1))]


def _config_args(spec: LoadSpec, store_url: str) -> list[str]:
    sets = [
        "model.n_layer=1", "model.d_model=16", "model.n_head=2", "model.context=8", "model.vocab_size=64",
        f"learners.count={spec.learners}", "synchronizer.num_fragments=2", "synchronizer.sync_every=40",
        "synchronizer.min_quorum=4", "synchronizer.grace_initial_s=0.2", "synchronizer.grace_cap_s=0.5",
        "synchronizer.heartbeat_timeout_s=5", "synchronizer.checkpoint_every_s=100000",
        f"synchronizer.max_learners={spec.learners}", "synchronizer.drain_s=0", "synchronizer.port=0",
        "synchronizer.host=127.0.0.1", "synchronizer.max_staleness=8", "budget.wall_s=100000",
        f"run.store={store_url}",
    ]
    out = []
    for s in sets:
        out += ["--set", s]
    return out


class _Learner:
    """One simulated learner: join, WebSocket, heartbeats, announcements."""

    def __init__(self, lid: str, token: str, url: str, session: aiohttp.ClientSession, store: ObjectStore,
                 plans: dict, spec: LoadSpec, res: LoadResult, measure_from: list[float],
                 stop: asyncio.Event, rng: random.Random) -> None:
        self.lid, self.url, self.session, self.store, self.plans = lid, url, session, store, plans
        self.headers = {"Authorization": f"Bearer {token}"}
        self.spec, self.res, self.measure_from, self.stop, self.rng = spec, res, measure_from, stop, rng
        self.versions: dict[int, int] = {}
        self.started = time.monotonic()
        self.last_announce = time.monotonic() - rng.uniform(0, spec.announce_s)
        self.announced: set[tuple[int, int]] = set()
        self.tasks: set[asyncio.Task] = set()
        self.payloads: dict[int, bytes] = plans.setdefault("payloads", {})  # type: ignore[assignment]

    def step(self) -> int:
        return int((time.monotonic() - self.started) * STEPS_PER_S)

    async def post(self, kind: str, path: str, body: dict) -> dict | None:
        self.res.sent[kind] = self.res.sent.get(kind, 0) + 1
        t0 = time.monotonic()
        try:
            async with self.session.post(f"{self.url}{path}", json=body, headers=self.headers,
                                         timeout=aiohttp.ClientTimeout(total=30)) as resp:
                doc = await resp.json()
                if resp.status != 200:
                    self.res.errors.append(f"{path}: HTTP {resp.status} {str(doc)[:200]}")
                    return None
        except (aiohttp.ClientError, TimeoutError, OSError) as err:
            self.res.errors.append(f"{path}: {type(err).__name__}: {err}")
            return None
        t1 = time.monotonic()
        self.res.answered[kind] = self.res.answered.get(kind, 0) + 1
        if t0 >= self.measure_from[0]:
            (self.res.heartbeat_s if kind == "heartbeat" else self.res.announce_s if kind == "announce"
             else []).append(t1 - t0)
        return doc

    def _round_heard(self, p: int, n: int, version: int) -> None:
        now = time.monotonic()
        if (p, n) in self.announced or now - self.last_announce < self.spec.announce_s or self.stop.is_set():
            return
        self.announced.add((p, n))
        self.last_announce = now
        task = asyncio.get_running_loop().create_task(self.announce(p, n, version))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def announce(self, p: int, n: int, version: int) -> None:
        await asyncio.sleep(self.rng.uniform(0.0, ANNOUNCE_JITTER_S))
        data = self.payloads.get(p)
        if data is None:  # one payload per fragment for every learner: the generator's CPU goes to the protocol
            delta = {s.name: torch.full(s.shape, 1e-3) for s in self.plans["plan"].fragments[p]}
            data = self.payloads[p] = wire.encode_to_bytes(delta, "fp32", {})
        key = keys.contribution_key(RUN_ID, p, n, self.lid, uuid.uuid4().hex[:8])
        ref = await asyncio.to_thread(self.store.put, key, data)
        c_steps = 4
        body = {"learner_id": self.lid, "fragment": p, "round_n": n, "base_version": version, "c_steps": c_steps,
                "c_tokens": c_steps * 8, "compute_s": c_steps / STEPS_PER_S, "key": ref.key, "nbytes": ref.nbytes,
                "sha256": ref.sha256, "codec": "fp32", "update_id": uuid.uuid4().hex[:12]}
        ack = await self.post("announce", "/announce", body)
        if ack is not None:
            self.res.acks[ack["status"]] = self.res.acks.get(ack["status"], 0) + 1

    async def websocket(self, ready: asyncio.Event) -> None:
        try:
            async with self.session.ws_connect(f"{self.url}/ws?learner_id={self.lid}", headers=self.headers,
                                               heartbeat=None, timeout=aiohttp.ClientWSTimeout(ws_receive=None)) as ws:
                ready.set()
                async for msg in ws:
                    if msg.type != aiohttp.WSMsgType.TEXT:
                        break
                    ev = json.loads(msg.data)
                    self.res.pushed += 1
                    kind = str(ev.get("type"))
                    self.res.pushed_by_type[kind] = self.res.pushed_by_type.get(kind, 0) + 1
                    if ev.get("type") == "round_open":
                        self._round_heard(ev["fragment"], ev["round_n"], ev["version"])
                    elif ev.get("type") == "version":
                        self.versions[ev["fragment"]] = ev["version"]
        except (aiohttp.ClientError, OSError, TimeoutError) as err:
            self.res.errors.append(f"/ws: {type(err).__name__}: {err}")
        finally:
            ready.set()
            if not self.stop.is_set():
                self.res.ws_lost += 1

    async def run(self) -> None:
        joined = await self.post("join", "/join", {"learner_id": self.lid, "uptime_s": 1.0})
        if joined is None:
            return
        if "plan" not in self.plans:
            self.plans["plan"] = FragmentPlan.from_json(joined["plan"])
        for v in joined["versions"]:
            self.versions[v["fragment"]] = v["version"]
        ready = asyncio.Event()
        ws = asyncio.get_running_loop().create_task(self.websocket(ready))
        await ready.wait()
        await asyncio.sleep(self.rng.uniform(0, self.spec.heartbeat_s))
        period = self.spec.heartbeat_s
        next_t = time.monotonic()
        while not self.stop.is_set():
            step = self.step()
            hb = await self.post("heartbeat", "/heartbeat", {
                "learner_id": self.lid, "step": step, "step_time_s": 1.0 / STEPS_PER_S, "tokens_total": step * 8,
                "uptime_s": time.monotonic() - self.started + 1.0, "train_loss": 3.0, "tokens_per_s": 80.0,
                "base_versions": {str(k): v for k, v in self.versions.items()}})
            if hb is not None:
                for r in hb["open_rounds"]:
                    self._round_heard(r["fragment"], r["round_n"], r["version"])
            next_t += period
            await asyncio.sleep(max(0.0, next_t - time.monotonic()))
        if self.tasks:
            await asyncio.gather(*self.tasks, return_exceptions=True)
        ws.cancel()
        await asyncio.gather(ws, return_exceptions=True)


async def _probe_health(url: str, session: aiohttp.ClientSession, res: LoadResult, measure_from: list[float],
                        stop: asyncio.Event) -> None:
    """``GET /health`` 20 times a second: the baseline latency of the same server and loops."""
    while not stop.is_set():
        t0 = time.monotonic()
        res.sent["health"] = res.sent.get("health", 0) + 1
        try:
            async with session.get(f"{url}/health", timeout=aiohttp.ClientTimeout(total=30)) as resp:
                await resp.read()
                res.answered["health"] = res.answered.get("health", 0) + 1
        except (aiohttp.ClientError, TimeoutError, OSError) as err:
            res.errors.append(f"/health: {type(err).__name__}: {err}")
        if t0 >= measure_from[0]:
            res.health_s.append(time.monotonic() - t0)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.05)


async def _loop_lag(res: LoadResult, measure_from: list[float], stop: asyncio.Event) -> None:
    """The load generator's own event-loop lag (s): how late a 10 ms sleep wakes up."""
    while not stop.is_set():
        t0 = time.monotonic()
        await asyncio.sleep(0.01)
        if t0 >= measure_from[0]:
            res.loop_lag_max_s = max(res.loop_lag_max_s, time.monotonic() - t0 - 0.01)


async def _drive(spec: LoadSpec, url: str, secret: str, store: ObjectStore, shard: int, shards: int,
                 t_go: float) -> LoadResult:
    """Learners ``shard``, ``shard + shards``, ... of the load, from ``t_go`` (``time.monotonic()``,
    one clock for every process of the machine) to the end of the measured window."""
    res = LoadResult(spec)
    gc.collect()
    gc.freeze()  # what was imported and built so far is never traversed again: no long pauses
    gc.disable()  # the generator is not under test: no collection pauses its clock (enabled again after)
    stop = asyncio.Event()
    measure_from = [float("inf")]
    rng = random.Random(17)
    plans: dict = {}  # "plan": the run's FragmentPlan, "payloads": fragment -> encoded contribution
    seeds = [rng.random() for _ in range(spec.learners)]  # the same learners however many processes
    mine = range(shard, spec.learners, shards)
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=connector) as session:
        learners = [_Learner(f"l{i:04d}", learner_token(secret, RUN_ID, f"l{i:04d}"), url, session, store, plans,
                             spec, res, measure_from, stop, random.Random(seeds[i])) for i in mine]
        await asyncio.sleep(max(0.0, t_go - time.monotonic()))
        tasks = []
        for i, lr in enumerate(learners):  # joins spread over about a second
            tasks.append(asyncio.get_running_loop().create_task(lr.run()))
            if i % 50 == 49:
                await asyncio.sleep(0.05 * shards)
        side = [asyncio.get_running_loop().create_task(_loop_lag(res, measure_from, stop))]
        if shard == 0:
            side.append(asyncio.get_running_loop().create_task(_probe_health(url, session, res, measure_from, stop)))
        await asyncio.sleep(max(0.0, t_go + spec.warmup_s - time.monotonic()))
        measure_from[0] = time.monotonic()
        await asyncio.sleep(max(0.0, t_go + spec.warmup_s + spec.seconds - time.monotonic()))
        stop.set()
        await asyncio.gather(*tasks, *side, return_exceptions=True)
    gc.enable()
    gc.unfreeze()
    gc.collect()
    res.loop_lag_by_process = [res.loop_lag_max_s]
    return res


def _generator(spec: LoadSpec, url: str, secret: str, store_url: str, shard: int, shards: int, conn) -> None:
    """One load generator process: says it is ready, waits for the start time, drives its learners and
    sends back its :class:`LoadResult` (``conn``: its end of a pipe)."""
    conn.send("ready")
    t_go = conn.recv()
    try:
        conn.send(asyncio.run(_drive(spec, url, secret, ObjectStore(store_url), shard, shards, t_go)))
    except BaseException as err:  # the parent reports it
        conn.send(f"{type(err).__name__}: {err}")
    conn.close()


def _merge(spec: LoadSpec, parts: list[LoadResult]) -> LoadResult:
    out = LoadResult(spec)
    for r in parts:
        out.heartbeat_s += r.heartbeat_s
        out.announce_s += r.announce_s
        out.health_s += r.health_s
        for mine, theirs in ((out.sent, r.sent), (out.answered, r.answered), (out.acks, r.acks),
                             (out.pushed_by_type, r.pushed_by_type)):
            for k, v in theirs.items():
                mine[k] = mine.get(k, 0) + v
        out.pushed += r.pushed
        out.ws_lost += r.ws_lost
        out.errors += r.errors
        out.loop_lag_by_process += r.loop_lag_by_process
    out.loop_lag_max_s = max(out.loop_lag_by_process, default=0.0)
    return out


def _run_generators(spec: LoadSpec, url: str, secret: str, store_url: str, sync_pid: int) -> LoadResult:
    """Spread the learners over ``spec.generators`` processes; measure every process's CPU over the window."""
    ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no state of this one is shared
    procs, conns = [], []
    for shard in range(spec.generators):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_generator, args=(spec, url, secret, store_url, shard, spec.generators, child),
                           daemon=True)
        proc.start()
        child.close()
        procs.append(proc)
        conns.append(parent)
    try:
        for c in conns:
            if not c.poll(120) or c.recv() != "ready":
                raise RuntimeError("a load generator process did not start")
        t_go = time.monotonic() + 0.2
        for c in conns:
            c.send(t_go)
        gens, sync = [psutil.Process(p.pid) for p in procs], psutil.Process(sync_pid)
        time.sleep(max(0.0, t_go + spec.warmup_s - time.monotonic()))
        cpu0 = [sum(p.cpu_times()[:2]) for p in gens], sum(sync.cpu_times()[:2])
        time.sleep(max(0.0, t_go + spec.warmup_s + spec.seconds - time.monotonic()))
        cpu1 = [sum(p.cpu_times()[:2]) for p in gens], sum(sync.cpu_times()[:2])
        parts = []
        for c in conns:
            if not c.poll(120):
                raise RuntimeError("a load generator process did not finish")
            got = c.recv()
            if isinstance(got, str):
                raise RuntimeError(f"a load generator process failed: {got}")
            parts.append(got)
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    res = _merge(spec, parts)
    res.cpu_s = {"load generators": sum(b - a for a, b in zip(cpu0[0], cpu1[0], strict=True)),
                 "synchronizer": cpu1[1] - cpu0[1]}
    res.cpu_by_generator_s = [b - a for a, b in zip(cpu0[0], cpu1[0], strict=True)]
    res.window_s = (t_go + spec.warmup_s, t_go + spec.warmup_s + spec.seconds)
    return res


def _sync_watch(log_text: str, t0: float, t1: float) -> dict:
    """The synchronizer's own ``loop watch`` lines (:class:`diloco_async.sync.process.LoopWatch`) of
    the window ``[t0, t1]`` (``time.monotonic()``): its loop lag, collections and slowest actor part."""
    out: dict = {"lag_max_ms": 0.0, "lag_over_20ms": 0, "ticks": 0, "gc": {}, "slow": ("-", 0.0), "lines": 0}
    for line in log_text.splitlines():
        at = line.find("loop watch mono=")
        if at < 0 or "stalled" in line:  # a stall's warning repeats the figures so far: not a period
            continue
        fields = dict(f.split("=", 1) for f in line[at + len("loop watch "):].split() if "=" in f)
        mono = float(fields["mono"])
        if not t0 + 1.0 <= mono <= t1 + 0.5:  # a line covers the second before it
            continue
        out["lines"] += 1
        out["lag_max_ms"] = max(out["lag_max_ms"], float(fields["lag_max_ms"]))
        out["lag_over_20ms"] += int(fields["lag_over_20ms"])
        out["ticks"] += int(fields["ticks"])
        if fields["gc"] != "-":
            for item in fields["gc"].split(","):
                gen, rest = item.split(":")
                n, mx, tot = (float(x) for x in rest.split("/"))
                row = out["gc"].setdefault(int(gen), [0, 0.0, 0.0])
                row[0] += int(n)
                row[1] = max(row[1], mx)
                row[2] += tot
        part, _, ms = fields["slow"].rpartition(":")
        if float(ms) > out["slow"][1]:
            out["slow"] = (part, float(ms))
    return out


def run_load(spec: LoadSpec, source_dir: str | None = None) -> LoadResult:
    """Start a synchronizer process, put ``spec``'s load on it from ``spec.generators`` processes,
    stop it; the measured result. ``source_dir``: run the synchronizer from that source tree
    instead (e.g. an export of main, for its figures as context).

    Raises:
        RuntimeError: the synchronizer did not start within 60 s (its log is in the message), or a
            load generator process failed.
    """
    root = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    work = Path(tempfile.mkdtemp(prefix="sync-load-", dir=root))
    store_url = f"file://{work / 'store'}"
    secret = secrets.token_hex(32)
    ready = work / "ready.json"
    log_path = work / "sync.log"
    env = {**os.environ, TOKEN_ENV: secret, "PYTHONUNBUFFERED": "1", "PYTHONDONTWRITEBYTECODE": "1",
           "DILOCO_LOOP_WATCH_S": "1"}
    if source_dir:
        env["PYTHONPATH"] = source_dir
    profile = os.environ.get("SYNC_LOAD_PROFILE")  # a path: the synchronizer runs under cProfile
    cmd = [sys.executable, *(["-m", "cProfile", "-o", profile] if profile else []), "-m", "diloco_async.sync",
           "--run-id", RUN_ID, "--ready-file", str(ready),
           *_config_args(spec, store_url)]
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env, cwd=source_dir)
    try:
        t0 = time.monotonic()
        while not ready.exists():
            if proc.poll() is not None or time.monotonic() - t0 > 60:
                raise RuntimeError(f"the synchronizer did not start: {log_path.read_text()[-2000:]}")
            time.sleep(0.05)
        url = json.loads(ready.read_text())["url"]
        res = _run_generators(spec, url, secret, store_url, proc.pid)
        res.sync_watch = _sync_watch(log_path.read_text(errors="replace"), *res.window_s)
        if os.environ.get("SYNC_LOAD_LOG"):  # a path: keep a copy of the synchronizer's log there
            shutil.copyfile(log_path, os.environ["SYNC_LOAD_LOG"])
        return res
    finally:  # SIGTERM stops it cleanly (a final checkpoint); it waits for its learners at most 5 s here
        proc.terminate()
        try:
            proc.wait(5 if not os.environ.get("SYNC_LOAD_PROFILE") else 60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(work, ignore_errors=True)


def report(res: LoadResult) -> dict[str, float | None]:
    """Print one load's figures; returns them (ms, counts)."""
    s = res.spec
    fig = {
        "heartbeat_p50_ms": percentile_ms(res.heartbeat_s, 0.50),
        "heartbeat_p99_ms": percentile_ms(res.heartbeat_s, 0.99),
        "announce_p50_ms": percentile_ms(res.announce_s, 0.50), "announce_p99_ms": percentile_ms(res.announce_s, 0.99),
        "health_p50_ms": percentile_ms(res.health_s, 0.50), "health_p99_ms": percentile_ms(res.health_s, 0.99),
        "dropped": float(res.dropped),
    }

    def ms(v: float | None) -> str:
        return "n/a" if v is None else f"{v:.1f}"

    print(f"{s.learners} learners, heartbeat every {s.heartbeat_s:g}s, announce every >= {s.announce_s:g}s, "
          f"{s.seconds:g}s measured after {s.warmup_s:g}s:")
    print(f"  heartbeat p50 {ms(fig['heartbeat_p50_ms'])} ms  p99 {ms(fig['heartbeat_p99_ms'])} ms  "
          f"({len(res.heartbeat_s)} measured, {len(res.heartbeat_s) / s.seconds:.0f}/s)")
    print(f"  announce  p50 {ms(fig['announce_p50_ms'])} ms  p99 {ms(fig['announce_p99_ms'])} ms  "
          f"({len(res.announce_s)} measured; acks {dict(sorted(res.acks.items()))})")
    base = fig["health_p99_ms"]
    ratio = (f"; heartbeat p99 / health p99 = {fig['heartbeat_p99_ms'] / base:.2f}"
             if base and fig["heartbeat_p99_ms"] is not None else "")
    print(f"  baseline GET /health p50 {ms(fig['health_p50_ms'])} ms  p99 {ms(base)} ms{ratio}")
    print(f"  sent {dict(sorted(res.sent.items()))}  answered {dict(sorted(res.answered.items()))}  "
          f"pushed events {dict(sorted(res.pushed_by_type.items()))}  websockets lost {res.ws_lost}  "
          f"dropped {res.dropped}")
    cpu = ", ".join(f"{k} {v / s.seconds:.0%}" for k, v in res.cpu_s.items())
    answered = len(res.heartbeat_s) + len(res.announce_s) + len(res.health_s)
    fig["sync_cpu_us_per_request"] = 1e6 * res.cpu_s.get("synchronizer", 0.0) / max(1, answered)
    print(f"  synchronizer CPU per request answered in the window: {fig['sync_cpu_us_per_request']:.0f} us "
          "(pushes included in the CPU, not in the count)")
    lags = ", ".join(f"{1000 * v:.1f}" for v in res.loop_lag_by_process)
    gen_cpu = ", ".join(f"{v / s.seconds:.0%}" for v in res.cpu_by_generator_s)
    print(f"  load generators ({len(res.loop_lag_by_process)} processes): loop lag max {lags} ms; CPU of one core: "
          f"{cpu} (each generator {gen_cpu})")
    w = res.sync_watch
    fig["sync_loop_lag_max_ms"] = w.get("lag_max_ms")
    fig["generator_loop_lag_max_ms"] = 1000 * res.loop_lag_max_s
    if w.get("lines"):
        gcs = "; ".join(f"gen{g} {int(n)}x max {mx:.1f} ms" for g, (n, mx, _tot) in sorted(w["gc"].items())) or "none"
        print(f"  synchronizer (its loop watch, {w['lines']} s): loop lag max {w['lag_max_ms']:.1f} ms, "
              f"{w['lag_over_20ms']} of {w['ticks']} ticks late > 20 ms; collections {gcs}; slowest actor part "
              f"{w['slow'][0]} {w['slow'][1]:.1f} ms", flush=True)
    for err in res.errors[:5]:
        print(f"  error: {err}")
    return fig


def _load_bars(res: LoadResult, goal_ms: float) -> list[Bar]:
    fig = report(res)
    n = res.spec.learners
    return [
        Bar(f"sync load {n} learners: announce p99 (ms)", fig["announce_p99_ms"], goal_ms, "max",
            detail=f"p50 {fig['announce_p50_ms'] or 0:.1f} ms, /health p99 {fig['health_p99_ms'] or 0:.1f} ms"),
        Bar(f"sync load {n} learners: heartbeat p99 (ms)", fig["heartbeat_p99_ms"], goal_ms, "max",
            detail=f"p50 {fig['heartbeat_p50_ms'] or 0:.1f} ms"),
        Bar(f"sync load {n} learners: messages dropped", fig["dropped"], 0, "max",
            detail=f"{sum(res.sent.values())} sent"),
    ]


def bars(quick: bool = False) -> list[Bar]:
    """The load's bars: 1,000 learners (p99 < 50 ms) and 256 (p99 < 20 ms), none dropped; ``quick``:
    32 learners for 5 s (p99 < 50 ms)."""
    if quick:
        return _load_bars(run_load(LoadSpec(32, 0.25, 2.0, seconds=5.0, warmup_s=3.0)), GOAL_P99_MS_1000)
    out = _load_bars(run_load(LoadSpec(256, 0.25, 8.0, seconds=30.0)), GOAL_P99_MS_256)
    out += _load_bars(run_load(LoadSpec(1000, 1.0, 10.0, seconds=30.0, warmup_s=8.0)), GOAL_P99_MS_1000)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.sync_load", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="32 learners for 5 s")
    ap.add_argument("--learners", type=int, default=None, help="one load of N learners instead of the two")
    ap.add_argument("--seconds", type=float, default=30.0, help="measured seconds (with --learners)")
    ap.add_argument("--heartbeat-s", type=float, default=None, help="heartbeat period (with --learners)")
    ap.add_argument("--generators", type=int, default=2, help="load generator processes (with --learners)")
    ap.add_argument("--baseline-tree", default=None, metavar="DIR",
                    help="with --learners: the same load first on a synchronizer run from DIR (e.g. "
                         "`git archive main | tar -x -C DIR`), printed as context")
    args = ap.parse_args(argv)
    if args.learners is not None:
        hb = args.heartbeat_s or (0.25 if args.learners <= 256 else 1.0)
        goal = GOAL_P99_MS_256 if args.learners <= 256 else GOAL_P99_MS_1000
        spec = LoadSpec(args.learners, hb, 8.0 if args.learners <= 256 else 10.0, args.seconds,
                        warmup_s=5.0 if args.learners <= 256 else 8.0, generators=args.generators)
        if args.baseline_tree:
            print(f"baseline: the synchronizer of {args.baseline_tree}")
            report(run_load(spec, os.path.abspath(args.baseline_tree)))
            print("this tree:")
        return print_bars(_load_bars(run_load(spec), goal))
    return print_bars(bars(args.quick))


if __name__ == "__main__":
    sys.exit(main())
