"""Scripted protocol clients of a live synchronizer: honest learners that keep rounds merging
without a model, and a poisoner that announces hostile contribution objects (issue 14).

Both speak HTTP through :class:`~diloco_async.protocol.client.SyncClient` with the learner's own token
(:func:`learner_token`), write their objects to the run's real store and are driven by asyncio
tasks; neither imports the learner or trains. Used by the API fuzz (:mod:`diloco_async.chaos.fuzz_run`).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from collections import Counter, deque

import aiohttp
import torch

from diloco_async.codec import wire
from diloco_async.policy.fragments import FragmentPlan
from diloco_async.protocol.auth import learner_token
from diloco_async.protocol.client import ProtocolError, SyncClient
from diloco_async.storage import keys
from diloco_async.storage.store import ObjectStore, object_digest

__all__ = ["ScriptedLearners", "Poisoner", "POISONS", "published_extremes"]

log = logging.getLogger("diloco.chaos.scripted")


class ScriptedLearners:
    """Honest learners without a model: each heartbeat moves the step by one; each open round
    the synchronizer names gets a small random outer gradient (fp32, norm ~0.01 per element).

    Args:
        url: the synchronizer's URL. run_id, run_secret: the run's id and secret. store: the run's store.
        learner_ids: ids of the honest learners. interval_s: seconds between two heartbeats.
        steps_per_beat: inner steps reported per heartbeat. step_time_s: the step time (s) each
            heartbeat reports (None: none).

    Attributes:
        acks: announcement answers by status; ``errors``: failed calls by kind; ``latencies``:
            ``(monotonic start s, seconds)`` of each heartbeat.
    """

    def __init__(self, url: str, run_id: str, run_secret: str, store: ObjectStore, learner_ids: list[str],
                 interval_s: float = 0.1, steps_per_beat: int = 1, step_time_s: float | None = 0.05) -> None:
        self.url, self.run_id, self.secret, self.store = url, run_id, run_secret, store
        self.ids, self.interval_s, self.steps_per_beat = learner_ids, interval_s, steps_per_beat
        self.step_time_s = step_time_s
        self.acks: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.latencies: deque[tuple[float, float]] = deque(maxlen=100_000)  # (monotonic s, heartbeat s)
        self.plan: FragmentPlan | None = None
        self.rng = torch.Generator().manual_seed(0)

    async def run(self, stop: asyncio.Event) -> None:
        """Every learner heartbeats and contributes until ``stop`` is set."""
        await asyncio.gather(*(self._one(lid, stop) for lid in self.ids))

    async def _join(self, client: SyncClient, lid: str, incarnation: int) -> None:
        jr = await client.join({"learner_id": lid, "incarnation": incarnation})
        self.plan = FragmentPlan.from_json(jr["plan"])

    async def _one(self, lid: str, stop: asyncio.Event) -> None:
        step, incarnation, done = 0, 0, set()
        token = learner_token(self.secret, self.run_id, lid)
        async with SyncClient(self.url, token, request_timeout_s=10.0) as client:
            joined = False
            while not stop.is_set():
                try:
                    if not joined:
                        await self._join(client, lid, incarnation)
                        joined = True
                    step += self.steps_per_beat
                    t0 = time.monotonic()
                    body = {"learner_id": lid, "incarnation": incarnation, "step": step, "tokens_total": step * 64}
                    if self.step_time_s is not None:
                        body["step_time_s"] = self.step_time_s
                    hb = await client.heartbeat(body)
                    self.latencies.append((t0, time.monotonic() - t0))
                    if not hb["known"]:  # evicted (or the synchronizer restarted): join again
                        self.errors["rejoin"] += 1
                        incarnation, joined = incarnation + 1, False
                        continue
                    for r in hb["open_rounds"]:
                        if (r["fragment"], r["round_n"]) not in done:
                            done.add((r["fragment"], r["round_n"]))
                            await self._contribute(client, lid, r)
                except (aiohttp.ClientError, TimeoutError, OSError, ProtocolError) as err:
                    self.errors[type(err).__name__] += 1
                    joined = joined and not isinstance(err, ProtocolError)
                await asyncio.sleep(self.interval_s)

    async def _contribute(self, client: SyncClient, lid: str, r: dict) -> None:
        assert self.plan is not None
        p, n = r["fragment"], r["round_n"]
        delta = {s.name: torch.randn(s.shape, generator=self.rng) * 0.01 for s in self.plan.fragments[p]}
        data = wire.encode_to_bytes(delta, "fp32", {})
        key = keys.contribution_key(self.run_id, p, n, lid, uuid.uuid4().hex[:8])
        ref = await asyncio.to_thread(self.store.put, key, data)
        ack = await client.announce({"learner_id": lid, "fragment": p, "round_n": n, "base_version": r["version"],
                                     "c_steps": 4, "c_tokens": 256, "compute_s": 0.2, "key": ref.key,
                                     "nbytes": ref.nbytes, "sha256": ref.sha256, "codec": "fp32",
                                     "update_id": uuid.uuid4().hex[:12]})
        self.acks[ack["status"]] += 1


POISONS = ("norm_1e30", "nan", "truncated", "norm_1e6", "inf", "sign_flip_x100", "wrong_shape", "missing_tensor",
           "garbage", "digest_mismatch")
"""Hostile contribution objects the :class:`Poisoner` writes and announces."""


def _poison_bytes(kind: str, specs, rng: random.Random) -> tuple[bytes, bytes]:
    """(bytes written, bytes the announcement describes) of one hostile contribution."""
    delta = {s.name: torch.full(s.shape, 0.01) for s in specs}
    if kind in ("nan", "inf"):
        name = specs[rng.randrange(len(specs))].name
        delta[name].view(-1)[0] = float(kind)
    elif kind == "norm_1e30":
        delta = {k: v * 1e32 for k, v in delta.items()}
    elif kind == "norm_1e6":
        delta = {k: v * 1e8 for k, v in delta.items()}
    elif kind == "sign_flip_x100":
        delta = {k: -v * 100 for k, v in delta.items()}
    elif kind == "wrong_shape":
        name = specs[0].name
        delta[name] = torch.zeros(delta[name].numel() + 1)
    elif kind == "missing_tensor":
        delta.pop(specs[-1].name)
    data = wire.encode_to_bytes(delta, "fp32", {})
    if kind == "garbage":
        data = bytes(rng.randrange(256) for _ in range(len(data)))
    if kind == "truncated":  # a partial object announced as the whole one
        return data[: len(data) // 2], data
    if kind == "digest_mismatch":
        return data, data[:-1] + bytes([data[-1] ^ 1])
    return data, data


class Poisoner:
    """A compromised learner that joins as itself and announces one hostile contribution to every
    open round it hears of, cycling through :data:`POISONS` in order. ``sent`` counts them by kind;
    ``acks`` counts the answers as ``kind/status``."""

    def __init__(self, url: str, run_id: str, run_secret: str, store: ObjectStore, learner_id: str,
                 seed: int = 0, interval_s: float = 0.2) -> None:
        self.url, self.run_id, self.store, self.lid = url, run_id, store, learner_id
        self.token = learner_token(run_secret, run_id, learner_id)
        self.rng, self.interval_s = random.Random(seed), interval_s
        self.sent: Counter[str] = Counter()
        self.acks: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()

    async def run(self, stop: asyncio.Event) -> None:
        step, done = 0, set()
        async with SyncClient(self.url, self.token, request_timeout_s=10.0) as client:
            while not stop.is_set():
                try:
                    jr = await client.join({"learner_id": self.lid})
                    plan = FragmentPlan.from_json(jr["plan"])
                    while not stop.is_set():
                        step += 1
                        hb = await client.heartbeat({"learner_id": self.lid, "step": step, "step_time_s": 0.05})
                        if not hb["known"]:
                            break
                        for r in hb["open_rounds"]:
                            if (r["fragment"], r["round_n"]) not in done:
                                done.add((r["fragment"], r["round_n"]))
                                await self._poison(client, plan, r)
                        await asyncio.sleep(self.interval_s)
                except (aiohttp.ClientError, TimeoutError, OSError, ProtocolError) as err:
                    self.errors[type(err).__name__] += 1
                    await asyncio.sleep(self.interval_s)

    async def _poison(self, client: SyncClient, plan: FragmentPlan, r: dict) -> None:
        kind = POISONS[sum(self.sent.values()) % len(POISONS)]
        p, n = r["fragment"], r["round_n"]
        written, described = _poison_bytes(kind, plan.fragments[p], self.rng)
        key = keys.contribution_key(self.run_id, p, n, self.lid, uuid.uuid4().hex[:8])
        ref = await asyncio.to_thread(self.store.put, key, written)
        ack = await client.announce({"learner_id": self.lid, "fragment": p, "round_n": n, "base_version": r["version"],
                                     "c_steps": 4, "c_tokens": 256, "compute_s": 0.2, "key": ref.key,
                                     "nbytes": len(described), "sha256": object_digest(described),
                                     "codec": "fp32", "update_id": uuid.uuid4().hex[:12]})
        self.sent[kind] += 1
        self.acks[f"{kind}/{ack['status']}"] += 1


def published_extremes(store: ObjectStore, run_id: str, plan: FragmentPlan) -> tuple[int, int, float]:
    """Read back every published global version: (versions read, versions with a non-finite value,
    largest absolute value seen)."""
    shapes = [{s.name: s.shape for s in frag} for frag in plan.fragments]
    read = bad = 0
    largest = 0.0
    for key in store.list(keys.versions_prefix(run_id)):
        parsed = keys.parse_version_key(run_id, key)
        if parsed is None:
            continue
        tensors, _ = wire.decode_from_bytes(store.get_unverified(key), "fp32", shapes[parsed[0]])
        read += 1
        finite = all(bool(torch.isfinite(t).all()) for t in tensors.values())
        bad += not finite
        if finite:
            largest = max([largest] + [float(t.abs().max()) for t in tensors.values() if t.numel()])
    return read, bad, largest
