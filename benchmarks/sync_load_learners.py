"""The simulated learners of ``benchmarks/sync_load.py`` and one load generator process of them.

Split out of ``sync_load`` (which starts the synchronizer, spreads the learners over these
processes, merges their results and prints the figures). ``python -m benchmarks.sync_load_learners``
runs the same benchmark as ``python -m benchmarks.sync_load``.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import random
import time
import uuid
from dataclasses import dataclass, field

import aiohttp
import torch

from diloco_async.codec import wire
from diloco_async.policy.fragments import FragmentPlan
from diloco_async.protocol.auth import learner_token
from diloco_async.protocol.client import ChannelClosed, ProtocolError, RequestChannel
from diloco_async.storage import keys
from diloco_async.storage.store import ObjectStore

__all__ = ["LoadSpec", "LoadResult", "RUN_ID", "STEPS_PER_S", "LEARNERS_PER_GENERATOR", "generators_for"]

RUN_ID = "load"
STEPS_PER_S = 10.0  # each simulated learner's inner steps per second
#: simulated learners one generator process drives at most: a merge pushes two events to each, so a
#: generator of 500 lagged 20-52 ms on its own loop and timed that backlog as the synchronizer's
LEARNERS_PER_GENERATOR = 250
ANNOUNCE_JITTER_S = 0.3  # a learner announces up to this long after it heard of a round (its last steps)


@dataclass(frozen=True)
class LoadSpec:
    """One load: ``learners`` learners, ``heartbeat_s`` and ``announce_s`` (s) apart, measured for
    ``seconds`` after ``warmup_s``."""

    learners: int
    heartbeat_s: float
    announce_s: float
    seconds: float
    warmup_s: float = 5.0
    generators: int = 2  # load generator processes the learners are spread over (see generators_for)
    ws_requests: bool = True  # heartbeats and announcements over the WebSocket, as the real learner sends them


@dataclass
class LoadResult:
    """Latencies (s) measured after the warm-up, and counts over the whole run."""

    spec: LoadSpec
    heartbeat_s: list[float] = field(default_factory=list)
    announce_s: list[float] = field(default_factory=list)
    health_s: list[float] = field(default_factory=list)
    sent: dict[str, int] = field(default_factory=dict)
    sent_by_transport: dict[str, int] = field(default_factory=dict)  # heartbeats and announcements: "ws", "http"
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


def generators_for(learners: int) -> int:
    """Load generator processes for ``learners`` simulated learners: one per
    :data:`LEARNERS_PER_GENERATOR`, at least 2."""
    return max(2, -(-learners // LEARNERS_PER_GENERATOR))


@dataclass
class _Generator:
    """What the simulated learners of one generator process share: the synchronizer's URL, one HTTP
    session, the store, the fragment plans, the load, the results, when measuring starts (a
    one-element list, set once) and the stop event."""

    url: str
    session: aiohttp.ClientSession
    store: ObjectStore
    plans: dict
    spec: LoadSpec
    res: LoadResult
    measure_from: list[float]
    stop: asyncio.Event


class _Learner:
    """One simulated learner: join, WebSocket, heartbeats, announcements."""

    def __init__(self, lid: str, token: str, gen: _Generator, rng: random.Random) -> None:
        self.lid, self.url, self.session, self.store, self.plans = lid, gen.url, gen.session, gen.store, gen.plans
        self.headers = {"Authorization": f"Bearer {token}"}
        self.spec, self.res, self.measure_from, self.stop, self.rng = gen.spec, gen.res, gen.measure_from, gen.stop, rng
        self.versions: dict[int, int] = {}
        self.channel: RequestChannel | None = None  # requests over the WebSocket while it is open
        self.started = time.monotonic()
        self.last_announce = time.monotonic() - rng.uniform(0, gen.spec.announce_s)
        self.announced: set[tuple[int, int]] = set()
        self.tasks: set[asyncio.Task] = set()
        self.payloads: dict[int, bytes] = gen.plans.setdefault("payloads", {})  # type: ignore[assignment]

    def step(self) -> int:
        return int((time.monotonic() - self.started) * STEPS_PER_S)

    async def _over_ws(self, kind: str, body: dict) -> dict | None:
        """``kind`` over the WebSocket as the real learner sends it (:class:`RequestChannel`); None:
        the socket is not open, or closed before the answer (the caller sends it over HTTP)."""
        channel = self.channel
        if channel is None or channel.closed or not self.spec.ws_requests:
            return None
        try:
            got = await channel.request(kind, body, 30.0)
        except ChannelClosed:
            return None
        self.res.sent_by_transport["ws"] = self.res.sent_by_transport.get("ws", 0) + 1
        return got

    async def post(self, kind: str, path: str, body: dict) -> dict | None:
        """Send ``kind`` as the real learner's client does (heartbeats and announcements over the
        WebSocket when it is open, else HTTP; :class:`diloco_async.protocol.client.SyncClient`); the
        latency from send to answer is measured after the warm-up."""
        self.res.sent[kind] = self.res.sent.get(kind, 0) + 1
        t0 = time.monotonic()
        try:
            doc = await self._over_ws(kind, body) if kind in ("heartbeat", "announce") else None
            if doc is None:
                async with self.session.post(f"{self.url}{path}", json=body, headers=self.headers,
                                             timeout=aiohttp.ClientTimeout(total=30)) as resp:
                    doc = await resp.json()
                    if resp.status != 200:
                        self.res.errors.append(f"{path}: HTTP {resp.status} {str(doc)[:200]}")
                        return None
                if kind in ("heartbeat", "announce"):
                    self.res.sent_by_transport["http"] = self.res.sent_by_transport.get("http", 0) + 1
        except (aiohttp.ClientError, TimeoutError, OSError, ProtocolError) as err:
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
        # written on the loop, not in a worker thread: a real learner uploads in its own process, and
        # here 500 learners' puts in the thread pool held the GIL while this loop timed other requests
        ref = self.store.put(key, data)  # ~1.5 KiB to /dev/shm
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
                self.channel = RequestChannel(ws, self.url)
                ready.set()
                async for msg in ws:
                    if msg.type != aiohttp.WSMsgType.TEXT:
                        break
                    ev = json.loads(msg.data)
                    if self.channel.take(ev):  # the answer to a request
                        continue
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
            if self.channel is not None:
                self.channel.close()
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
        gen = _Generator(url, session, store, plans, spec, res, measure_from, stop)
        learners = [_Learner(f"l{i:04d}", learner_token(secret, RUN_ID, f"l{i:04d}"), gen, random.Random(seeds[i]))
                    for i in mine]
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
