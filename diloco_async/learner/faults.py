"""Fault injection of a learner (config ``[faults]``), applied once where the learner is assembled
(issue 42). The learner's training and comms code has no chaos branch: :class:`LearnerFaults`
wraps what a learner is made of, and with no fault configured every wrapper hands back what it
was given.

* a **faulty store**: :class:`diloco_async.storage.faults.FaultyStore` under the learner's store
  (``faults.storage_faults``, a seeded :class:`~diloco_async.storage.faults.FaultPlan` schedule);
* a **faulty client transport**: control messages (heartbeats, announcements) delayed or dropped
  before they are sent (``faults.control_delay_s``, ``control_drop_prob``: :class:`ControlFaults`
  as the :class:`~diloco_async.protocol.client.SyncClient`'s ``before_post``), and outer
  gradients poisoned on send (``faults.poison``: :class:`PoisonedPayloads` as the uploads'
  ``encode_payload``), to test the update guard (issue 14); every announcement to one synchronizer
  shard dropped (``faults.unreachable_shard``: :class:`CutRoute`);
* a **slowed workload**: each inner step of emulated slower or noisier hardware
  (``faults.speed_factors``, ``step_jitter``) and a lower process priority once ready to train
  (``faults.nice_after_ready``): :class:`SlowedWorkload`.

The poison transforms are pure (tensors in, new tensors out):

* ``scale``: Δ · 10⁶ (caught by the guard's norm bound);
* ``sign_flip``: −Δ (same norm: the guard cannot see it; RDA and token weighting dilute it);
* ``constant``: every element of a tensor set to that tensor's RMS (same norm, no information).
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, cast

import aiohttp
import torch

from diloco_async.codec import wire
from diloco_async.config.faults import FaultsConfig
from diloco_async.inner.workload import Workload, emulated_delay_s, jitter_random
from diloco_async.learner.comms import Comms
from diloco_async.learner.state import LearnerSlot, UploadJob
from diloco_async.storage.faults import FaultyStore
from diloco_async.storage.store import ObjectStore

__all__ = ["POISON_MODES", "POISON_SCALE", "poison_outer_gradient", "ControlFaults", "PoisonedPayloads",
           "SlowedWorkload", "LearnerFaults"]

log = logging.getLogger("diloco.learner")

POISON_MODES = ("none", "scale", "sign_flip", "constant")
POISON_SCALE = 1e6


def poison_outer_gradient(delta: Mapping[str, torch.Tensor], mode: str) -> dict[str, torch.Tensor]:
    """The outer gradient a learner poisoned with ``mode`` sends instead of ``delta`` (new tensors).

    Raises:
        ValueError: an unknown mode.
    """
    if mode not in POISON_MODES:
        raise ValueError(f"unknown poison mode {mode!r}; expected one of {POISON_MODES}")
    if mode == "none":
        return dict(delta)
    if mode == "scale":
        return {n: t * POISON_SCALE for n, t in delta.items()}
    if mode == "sign_flip":
        return {n: -t for n, t in delta.items()}
    return {n: torch.full_like(t, float(t.float().pow(2).mean().sqrt())) for n, t in delta.items()}


class ControlFaults:
    """A client's ``before_post`` (``faults.control_delay_s``, ``control_drop_prob``): delay a
    control message by an exponential time of mean ``delay_s`` (seconds), or drop it before it is
    sent with chance ``drop_prob`` (raises ``aiohttp.ClientConnectionError``, as a lost link would)."""

    def __init__(self, delay_s: float, drop_prob: float, rng: random.Random) -> None:
        self.delay_s, self.drop_prob, self.rng = delay_s, drop_prob, rng

    async def __call__(self, path: str) -> None:
        if self.delay_s > 0:
            await asyncio.sleep(self.rng.expovariate(1.0 / self.delay_s))
        if self.rng.random() < self.drop_prob:
            raise aiohttp.ClientConnectionError(f"chaos: {path} dropped before sending")


class CutRoute:
    """The ``before_post`` of the client of one synchronizer shard whose route is cut for
    contributions (``faults.unreachable_shard``): every announcement to it fails before it is sent
    (``aiohttp.ClientConnectionError``, as a lost link would); the joins and heartbeats pass, so the
    learner joined the run and hears that shard's rounds (a route cut before the join would leave
    nothing to count)."""

    def __init__(self, shard: int) -> None:
        self.shard = shard

    async def __call__(self, path: str) -> None:
        if path.endswith("/announce"):
            raise aiohttp.ClientConnectionError(f"chaos: the route to synchronizer shard {self.shard} is cut "
                                                f"({path})")


class PoisonedPayloads:
    """The uploads' ``encode_payload`` of a poisoner: the outer gradient of each contribution is
    poisoned with ``mode`` (:func:`poison_outer_gradient`), then encoded by ``encode``. One that
    the training thread already encoded (a late learner answering several rounds at once) is
    decoded first (float32, shapes from ``shapes_of(fragment)``): the poison of its codec's value."""

    def __init__(self, encode: Callable[[UploadJob, dict[str, str]], bytes], mode: str, codec: str,
                 shapes_of: Callable[[int], dict[str, tuple[int, ...]]]) -> None:
        if mode not in POISON_MODES:
            raise ValueError(f"unknown poison mode {mode!r}; expected one of {POISON_MODES}")
        self.encode, self.mode, self.codec, self.shapes_of = encode, mode, codec, shapes_of

    def __call__(self, job: UploadJob, meta: dict[str, str]) -> bytes:
        delta = job.delta
        if job.encoded is not None:
            delta, job.encoded = wire.decode(job.encoded, job.codec or self.codec, self.shapes_of(job.fragment)), None
        job.delta = poison_outer_gradient(delta, self.mode)
        return self.encode(job, meta)


class SlowedWorkload:
    """A :class:`~diloco_async.inner.workload.Workload` on emulated slower or noisier hardware:
    each :meth:`step` then sleeps :func:`~diloco_async.inner.workload.emulated_delay_s` of its
    compute time (``speed`` in (0, 1], ``jitter`` >= 0, ``rng`` drawn once per step), and once
    :meth:`load_data` returned (the learner is ready to train) the process's priority is lowered
    by ``nice`` (0: kept). Everything else is the wrapped workload's."""

    def __init__(self, inner: Workload, speed: float, jitter: float, rng: random.Random, nice: int = 0) -> None:
        self.inner, self.speed, self.jitter, self.rng, self.nice = inner, speed, jitter, rng, nice

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def step(self, step: int, run_tokens: float = 0.0, first_token: int | None = None) -> float:
        t0 = time.perf_counter()
        loss = (self.inner.step(step, run_tokens) if first_token is None  # (leased slices: DESIGN §5.2)
                else self.inner.step(step, run_tokens, first_token))
        delay_s = emulated_delay_s(time.perf_counter() - t0, self.speed, self.jitter, self.rng)
        if delay_s > 0:
            time.sleep(delay_s)
        return loss

    def load_data(self, cfg: Any, index: int) -> int:
        tokens = self.inner.load_data(cfg, index)
        if self.nice:
            os.nice(self.nice)
        return tokens


@dataclass(frozen=True)
class LearnerFaults:
    """The faults of learner ``slot`` in a run of seed ``seed``: the one place that reads
    ``[faults]``. Each wrapper's random schedule is seeded by (seed, index, incarnation)."""

    faults: FaultsConfig
    seed: int
    slot: LearnerSlot

    def _of_index(self, values: list, default: Any) -> Any:
        index = self.slot.index
        return values[index] if index < len(values) else default

    def wrap_store(self, store: ObjectStore) -> ObjectStore:
        """``store``, or a :class:`~diloco_async.storage.faults.FaultyStore` over it (``faults.storage_faults``, for
        the learner indexes of ``faults.storage_fault_learners``, or every learner when that is empty)."""
        chosen = self.faults.storage_fault_learners
        if not self.faults.storage_faults or (chosen and self.slot.index not in chosen):
            return store
        plan = dict(self.faults.storage_faults)
        plan.setdefault("seed", self.seed * 31 + self.slot.index * 1_000_003 + self.slot.incarnation)
        log.warning("%s: storage faults injected: %s", self.slot.learner_id, plan)
        return FaultyStore(store, **plan)

    def wrap_transport(self, comms: Comms) -> None:
        """Make the comms' client delay or drop control messages, and its uploads poison the outer
        gradients they send (in the codec the comms were configured with: call after
        :meth:`~diloco_async.learner.comms.Comms.configure`)."""
        f, uploads = self.faults, comms.uploads
        if f.control_delay_s > 0 or f.control_drop_prob > 0:
            rng = random.Random(self.seed * 7919 + self.slot.index * 104729 + self.slot.incarnation)
            comms.client.before_post = ControlFaults(f.control_delay_s, f.control_drop_prob, rng)
        cut = self._of_index(f.unreachable_shard, -1)
        shards = getattr(comms.client, "clients", None)
        if cut >= 0 and shards is not None and cut < len(shards):
            log.warning("%s: its route to synchronizer shard %d is cut (fault injection)", self.slot.learner_id, cut)
            shards[cut].before_post = CutRoute(cut)
        mode = self._of_index(f.poison, "none")
        if mode != "none":
            log.warning("%s: sends %s-poisoned outer gradients (fault injection)", self.slot.learner_id, mode)
            uploads.encode_payload = PoisonedPayloads(uploads.encode_payload, mode, uploads.codec,
                                                      lambda fragment: comms.shapes[fragment])

    def wrap_workload(self, workload: Workload) -> Workload:
        """``workload``, or a :class:`SlowedWorkload` over it (``faults.speed_factors``, ``step_jitter``,
        ``nice_after_ready``)."""
        f, slot = self.faults, self.slot
        speed = self._of_index(f.speed_factors, 1.0)
        if speed >= 1.0 and f.step_jitter <= 0 and not f.nice_after_ready:
            return workload
        rng = jitter_random(self.seed, slot.index, slot.incarnation)
        return cast(Workload, SlowedWorkload(workload, speed, f.step_jitter, rng, f.nice_after_ready))
