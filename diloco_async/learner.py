"""The learner process: inner AdamW steps that never wait for the network (DESIGN §3).

Two threads:

* the **training thread** (main) runs inner steps; at each step boundary it adopts downloaded
  versions and answers open rounds by snapshotting its outer gradient Δ = Θ^base − θ of a
  fragment and handing it to the comms thread;
* the **comms thread** runs an asyncio loop with an aiohttp session: join, heartbeats (which bring
  open rounds, new versions and the stop signal), downloads of new versions, and the upload
  pipeline (encode, upload to an immutable key, then announce, retried with the same update id).

If the synchronizer is unreachable the learner keeps training and reconnects with exponential
backoff; after ``give_up_after_s`` without any answer it exits (code 3).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import queue
import random
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import aiohttp
import torch

from diloco_async import codec as wire
from diloco_async.config import Config, config_hash
from diloco_async.data import Corpus, corpus_urls, load_corpus
from diloco_async.fragments import FragmentPlan, fragment_offset, plan_fragments, specs_of
from diloco_async.inner_state import InnerState
from diloco_async.inner_state import capture as capture_inner
from diloco_async.inner_state import restore as restore_inner
from diloco_async.messages import AnnouncementAck, HeartbeatResponse, JoinResponse, VersionInfo
from diloco_async.model import ByteGPT, embedding_names
from diloco_async.timeline import Recorder
from storage import keys
from storage.checkpoint import latest_state, list_state_seqs, write_state
from storage.faults import FaultyStore
from storage.options import storage_options_from_env
from storage.store import ObjectRef, ObjectStore

__all__ = ["Learner", "main"]

log = logging.getLogger("diloco.learner")

TOKEN_ENV = "DILOCO_RUN_TOKEN"
#: Folder for per-learner timeline records (``{dir}/{learner_id}.jsonl``); unset: none written.
TIMELINE_DIR_ENV = "DILOCO_TIMELINE_DIR"


def process_uptime_s() -> float:
    """Seconds since this OS process started (Linux /proc), including interpreter start and imports."""
    try:
        with open("/proc/self/stat") as fh:
            start_ticks = int(fh.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as fh:
            boot_s = float(fh.read().split()[0])
        return max(0.0, boot_s - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.monotonic() - _IMPORTED_S


_IMPORTED_S = time.monotonic()


class ProtocolError(RuntimeError):
    """The synchronizer answered with something this learner cannot work with (e.g. 401, 413)."""


@dataclass
class _UploadJob:
    fragment: int
    round_n: int
    base_version: int
    c_steps: int
    c_tokens: int
    compute_s: float
    delta: dict[str, torch.Tensor]
    update_id: str = field(default_factory=lambda: uuid.uuid4().hex[:16])


@dataclass
class _Stats:
    """Counters shared by both threads (guarded by the learner's lock)."""

    step: int = 0
    tokens_total: int = 0
    step_time_s: Optional[float] = None
    loss_sum: float = 0.0
    loss_count: int = 0
    window_tokens: int = 0
    window_start_s: float = field(default_factory=time.monotonic)
    bytes_down: int = 0
    bytes_up: int = 0


class Learner:
    """One learner.

    Args:
        learner_id: unique id of the learner slot (``[A-Za-z0-9_.-]``).
        index: data shard index in ``[0, learners.count)``.
        sync_url: base URL of the synchronizer, e.g. ``http://127.0.0.1:8765``.
        store: the run's object store (same root as the synchronizer's).
        token: the run's secret token.
        incarnation: restart count of this slot (0 for the first start).
        give_up_after_s: exit when the synchronizer has not answered for this long.
    """

    def __init__(self, learner_id: str, index: int, sync_url: str, store: ObjectStore, token: str,
                 incarnation: int = 0, give_up_after_s: float = 120.0,
                 recorder: Optional[Recorder] = None) -> None:
        self.learner_id = learner_id
        self.recorder = recorder or Recorder(None)
        self.control_drops = 0
        self.index = index
        self.sync_url = sync_url.rstrip("/")
        self.store = store
        self.token = token
        self.incarnation = incarnation
        self.give_up_after_s = give_up_after_s
        self.started_s = time.monotonic() - process_uptime_s()
        self.lock = threading.Lock()
        self.stats = _Stats()
        self.stop_event = threading.Event()
        self.joined = threading.Event()
        self.join_response: Optional[JoinResponse] = None
        self.fatal: Optional[str] = None
        # (fragment, round) -> (version the round builds on, when heard of)
        self.open_rounds: dict[tuple[int, int], tuple[int, float]] = {}
        # outcomes of our contributions, for the training thread: (fragment, round, status)
        self.outcomes: "queue.Queue[tuple[int, int, str]]" = queue.Queue()
        self.adopt_queue: "queue.Queue[tuple[VersionInfo, dict[str, torch.Tensor]]]" = queue.Queue()
        self.upload_queue: "queue.Queue[_UploadJob | InnerState]" = queue.Queue()
        self.base: dict[int, int] = {}
        self._downloading: dict[int, int] = {}
        self._bg: set[asyncio.Task] = set()
        self.ready = threading.Event()  # plan known: versions can be decoded
        self.epoch: Optional[str] = None  # the synchronizer's; a change means it restarted
        self.epoch_changed = threading.Event()
        self._shapes: dict[int, dict[str, tuple[int, ...]]] = {}
        self.newest_versions: dict[int, VersionInfo] = {}  # from the latest heartbeat
        self._comms_thread = threading.Thread(target=self._comms_main, name=f"{learner_id}-comms", daemon=True)

    # ------------------------------------------------------------------ comms thread --------

    def _comms_main(self) -> None:
        loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(self._comms())
        finally:
            loop.close()

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    async def _control_faults(self, path: str) -> None:
        """Chaos: delay a control message, or drop it before it is sent (learners.control_*)."""
        lc = getattr(self, "cfg", None) and self.cfg.learners
        if not lc or (lc.control_delay_s == 0 and lc.control_drop_prob == 0):
            return
        if lc.control_delay_s > 0:
            await asyncio.sleep(self._chaos_rng.expovariate(1.0 / lc.control_delay_s))
        if self._chaos_rng.random() < lc.control_drop_prob:
            self.control_drops += 1
            raise aiohttp.ClientConnectionError(f"chaos: {path} dropped before sending")

    async def _post(self, session: aiohttp.ClientSession, path: str, body: dict) -> dict:
        await self._control_faults(path)
        async with session.post(f"{self.sync_url}{path}", json=body, headers=self._headers()) as resp:
            if resp.status in (401, 403, 413):
                raise ProtocolError(f"{path}: HTTP {resp.status} {await resp.text()}")
            if resp.status >= 400:
                raise aiohttp.ClientResponseError(resp.request_info, (), status=resp.status,
                                                  message=await resp.text())
            return await resp.json()

    async def _comms(self) -> None:
        timeout = aiohttp.ClientTimeout(total=self.cfg_request_timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            tasks = [asyncio.create_task(self._heartbeat_loop(session)),
                     asyncio.create_task(self._upload_loop(session)),
                     asyncio.create_task(self._push_loop(session))]
            while not self.stop_event.is_set():
                await asyncio.sleep(0.05)
                for t in tasks:
                    if t.done() and t.exception() is not None:
                        self.fatal = f"{type(t.exception()).__name__}: {t.exception()}"
                        log.error("%s comms failed: %s", self.learner_id, self.fatal)
                        self.stop_event.set()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if self.joined.is_set() and self.fatal is None:
                # Last word: final counters, and the synchronizer learns we heard the stop.
                try:
                    await asyncio.wait_for(self._post(session, "/heartbeat", self._heartbeat_body()), 2.0)
                except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ProtocolError):
                    pass

    cfg_request_timeout_s = 10.0
    cfg_heartbeat_s = 0.25

    async def _join(self, session: aiohttp.ClientSession) -> JoinResponse:
        body = {"learner_id": self.learner_id, "incarnation": self.incarnation,
                "uptime_s": time.monotonic() - self.started_s}
        return JoinResponse.model_validate(await self._post(session, "/join", body))

    async def _heartbeat_loop(self, session: aiohttp.ClientSession) -> None:
        backoff = 0.1
        last_ok = time.monotonic()
        while not self.stop_event.is_set():
            try:
                if not self.joined.is_set():
                    self.join_response = await self._join(session)
                    self.epoch = self.join_response.epoch
                    self.joined.set()
                    log.info("%s joined run %s", self.learner_id, self.join_response.run_id)
                resp = HeartbeatResponse.model_validate(await self._post(session, "/heartbeat", self._heartbeat_body()))
                last_ok, backoff = time.monotonic(), 0.1
                if resp.epoch != self.epoch:
                    log.warning("%s: the synchronizer restarted (epoch %s -> %s); resetting round state",
                                self.learner_id, self.epoch, resp.epoch)
                    self.epoch = resp.epoch
                    with self.lock:
                        self.open_rounds.clear()
                    self._downloading.clear()
                    self.epoch_changed.set()
                if not resp.known:
                    log.warning("%s unknown to the synchronizer; rejoining", self.learner_id)
                    await self._join(session)
                    continue
                now = time.monotonic()
                with self.lock:
                    listed = {(r.fragment, r.round_n): r.version for r in resp.open_rounds}
                    # Keep rounds just pushed over the WebSocket that this response predates.
                    self.open_rounds = {k: vt for k, vt in self.open_rounds.items() if k in listed or now - vt[1] < 1.0}
                    for k, version in listed.items():
                        self.open_rounds.setdefault(k, (version, now))
                for v in resp.versions:
                    self.newest_versions[v.fragment] = v
                    self._maybe_download(v)
                if resp.stop:
                    log.info("%s told to stop", self.learner_id)
                    self.stop_event.set()
                    return
                await asyncio.sleep(self.cfg_heartbeat_s)
            except ProtocolError:
                raise
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as err:
                silent = time.monotonic() - last_ok
                if silent > self.give_up_after_s:
                    raise ProtocolError(f"synchronizer unreachable for {silent:.0f}s") from err
                log.warning("%s synchronizer unreachable (%s); retrying in %.1fs, training continues",
                            self.learner_id, type(err).__name__, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)

    def _maybe_download(self, v: VersionInfo) -> None:
        if not self.ready.is_set():
            return
        have = max(self.base.get(v.fragment, -1), self._downloading.get(v.fragment, -1))
        if v.version > have:
            self._downloading[v.fragment] = v.version
            task = asyncio.create_task(self._download(v))
            self._bg.add(task)
            task.add_done_callback(self._bg.discard)

    async def _push_loop(self, session: aiohttp.ClientSession) -> None:
        """Receive pushed events over the WebSocket; reconnect with backoff; heartbeats cover gaps."""
        backoff = 0.1
        while not self.stop_event.is_set():
            if not self.joined.is_set():
                await asyncio.sleep(0.05)
                continue
            try:
                async with session.ws_connect(f"{self.sync_url}/ws?learner_id={self.learner_id}",
                                              headers=self._headers(), heartbeat=10.0) as ws:
                    backoff = 0.1
                    async for msg in ws:
                        if msg.type != aiohttp.WSMsgType.TEXT:
                            break
                        event = json.loads(msg.data)
                        kind = event.pop("type", None)
                        if kind == "round_open":
                            with self.lock:
                                self.open_rounds.setdefault((event["fragment"], event["round_n"]),
                                                            (event["version"], time.monotonic()))
                        elif kind == "version":
                            self._maybe_download(VersionInfo.model_validate(event))
                        elif kind == "stop":
                            log.info("%s told to stop (%s)", self.learner_id, event.get("reason"))
                            self.stop_event.set()
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as err:
                log.debug("%s push channel down (%s)", self.learner_id, err)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 5.0)

    def _heartbeat_body(self) -> dict:
        now = time.monotonic()
        with self.lock:
            s = self.stats
            loss = s.loss_sum / s.loss_count if s.loss_count else None
            window = now - s.window_start_s
            tps = s.window_tokens / window if s.loss_count and window > 0 else None
            body = {"learner_id": self.learner_id, "incarnation": self.incarnation, "step": s.step,
                    "step_time_s": s.step_time_s, "tokens_total": s.tokens_total, "train_loss": loss,
                    "tokens_per_s": tps, "bytes_down": s.bytes_down, "bytes_up": s.bytes_up,
                    "uptime_s": now - self.started_s, "base_versions": {str(k): v for k, v in self.base.items()}}
            s.loss_sum, s.loss_count, s.window_tokens, s.window_start_s = 0.0, 0, 0, now
        if loss is not None and not math.isfinite(loss):
            body["train_loss"] = None
        return body

    async def _download(self, v: VersionInfo) -> None:
        try:
            tensors = await asyncio.to_thread(self._fetch_version, v)
        except Exception as err:  # counted in the log; the next heartbeat retries
            log.warning("%s download of fragment %d v%d failed: %s", self.learner_id, v.fragment, v.version, err)
            self._downloading.pop(v.fragment, None)  # the next heartbeat retries
            return
        with self.lock:
            self.stats.bytes_down += v.nbytes
        self.adopt_queue.put((v, tensors))

    def _fetch_version(self, v: VersionInfo) -> dict[str, torch.Tensor]:
        data = self.store.get(ObjectRef(v.key, v.nbytes, v.sha256))
        tensors, _ = wire.decode_from_bytes(data, "fp32", self._shapes[v.fragment])
        return tensors

    async def _upload_loop(self, session: aiohttp.ClientSession) -> None:
        while not self.stop_event.is_set():
            try:
                job = await asyncio.to_thread(self.upload_queue.get, True, 0.2)
            except queue.Empty:
                continue
            if isinstance(job, InnerState):
                await self._save_inner_state(job)
            else:
                await self._upload_and_announce(session, job)

    def _prune_inner_states(self, newest: int, keep: int = 2) -> None:
        """Delete this slot's inner states older than the ``keep`` newest (the newest is verified
        by being just written); a failure is logged and retried after the next save."""
        try:
            for key in self.store.list(self._state_prefix):
                rel = key[len(self._state_prefix):].strip("/").split("/", 1)[0]
                if rel.isdigit() and int(rel) <= newest - keep:
                    self.store.delete(key)
        except Exception as err:
            log.warning("%s could not prune old inner states (%s: %s)", self.learner_id, type(err).__name__, err)

    async def _save_inner_state(self, state: InnerState) -> None:
        self._state_seq += 1
        seq = self._state_seq
        try:
            await asyncio.wait_for(asyncio.to_thread(write_state, self.store, self._state_prefix, seq, state.tensors,
                                                     {"inner": state.meta, "learner": self.learner_id,
                                                      "incarnation": self.incarnation}),
                                   self.storage_timeout_s)
            log.info("%s saved its inner state as checkpoint %d (step %d)", self.learner_id, seq, state.meta["step"])
            await asyncio.to_thread(self._prune_inner_states, seq)
        except Exception as err:  # counted in the log; training goes on, the next period retries
            log.warning("%s could not save its inner state (%s: %s)", self.learner_id, type(err).__name__, err)

    async def _upload_and_announce(self, session: aiohttp.ClientSession, job: _UploadJob) -> None:
        run_id = self.join_response.run_id  # type: ignore[union-attr]
        key = keys.contribution_key(run_id, job.fragment, job.round_n, self.learner_id, job.update_id)
        meta = {"learner": self.learner_id, "fragment": str(job.fragment), "round": str(job.round_n),
                "base_version": str(job.base_version)}
        try:
            data = await asyncio.to_thread(wire.encode_to_bytes, job.delta, self.codec, meta)
            ref = await asyncio.wait_for(asyncio.to_thread(self.store.put, key, data), self.storage_timeout_s)
        except Exception as err:  # nothing was published under the key; nothing is announced
            log.warning("%s upload of fragment %d round %d failed: %s", self.learner_id, job.fragment,
                        job.round_n, err)
            self.outcomes.put((job.fragment, job.round_n, "failed"))
            return
        with self.lock:
            self.stats.bytes_up += ref.nbytes
        body = {"learner_id": self.learner_id, "fragment": job.fragment, "round_n": job.round_n,
                "base_version": job.base_version, "c_steps": job.c_steps, "c_tokens": job.c_tokens,
                "compute_s": job.compute_s, "key": ref.key, "nbytes": ref.nbytes, "sha256": ref.sha256,
                "codec": self.codec, "update_id": job.update_id}
        backoff = 0.1
        deadline = time.monotonic() + 60.0
        while not self.stop_event.is_set() and time.monotonic() < deadline:
            try:
                ack = AnnouncementAck.model_validate(await self._post(session, "/announce", body))
                level = logging.INFO if ack.status in ("accepted", "duplicate") else logging.WARNING
                log.log(level, "%s fragment %d round %d: %s (%s)", self.learner_id, job.fragment,
                        job.round_n, ack.status, ack.reason)
                self.outcomes.put((job.fragment, job.round_n, ack.status))
                return
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as err:
                log.warning("%s announce failed (%s); retrying with the same update id", self.learner_id, err)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
        self.outcomes.put((job.fragment, job.round_n, "failed"))

    # ------------------------------------------------------------------ training thread ------

    def run(self, max_wait_join_s: float = 120.0) -> int:
        """Join, load the newest versions, train until told to stop. Returns the exit code."""
        self._comms_thread.start()
        if not self.joined.wait(max_wait_join_s):
            log.error("%s could not join within %.0fs", self.learner_id, max_wait_join_s)
            self.stop_event.set()
            return 3
        jr = self.join_response
        assert jr is not None
        cfg = Config.model_validate(jr.config)
        if config_hash(cfg) != jr.config_hash:
            raise ProtocolError("config hash from the synchronizer does not match its config")
        self.cfg = cfg
        self._chaos_rng = random.Random(cfg.run.seed * 7919 + self.index * 104729 + self.incarnation)
        if cfg.learners.storage_faults:
            plan = dict(cfg.learners.storage_faults)
            plan.setdefault("seed", cfg.run.seed * 31 + self.index * 1_000_003 + self.incarnation)
            self.store = FaultyStore(self.store, **plan)
            log.warning("%s: storage faults injected: %s", self.learner_id, plan)
        self.codec = cfg.learners.codec
        self.storage_timeout_s = cfg.learners.storage_timeout_s
        self.cfg_heartbeat_s = cfg.learners.heartbeat_s
        torch.set_num_threads(cfg.learners.threads)
        model = ByteGPT(cfg.model)
        params = dict(model.named_parameters())
        plan = plan_fragments(specs_of({n: p.detach() for n, p in params.items()}),
                              cfg.synchronizer.num_fragments, embedding_names(model))
        if plan.schema_hash != jr.schema_hash:
            raise ProtocolError(f"fragment plan mismatch: mine {plan.schema_hash[:12]}, "
                                f"synchronizer's {jr.schema_hash[:12]}")
        self.plan: FragmentPlan = plan
        self._shapes = {p: {s.name: s.shape for s in plan.fragments[p]} for p in range(plan.num_fragments)}
        lc = cfg.learners
        opt = torch.optim.AdamW(model.parameters(), lr=lc.lr, weight_decay=lc.weight_decay)
        gen = torch.Generator().manual_seed(cfg.run.seed * 1_000_003 + self.index * 1009 + self.incarnation)
        self._state_prefix = keys.learner_prefix(jr.run_id, self.learner_id)
        saved = latest_state(self.store, self._state_prefix) if lc.checkpoint_every_s > 0 else None
        self._state_seq = max(list_state_seqs(self.store, self._state_prefix), default=0)
        counters: dict[int, tuple[int, int, float]] = {}
        start_step = jr.start_step
        restored_step = 0  # steps up to here are in the restored inner state (timeline attribution)
        if saved is not None:
            # The base copies come from the saved state, never from the weights present now (C03).
            local_step, base_tensors, versions, counters = restore_inner(
                InnerState(saved.tensors, saved.manifest["inner"]), params, opt, gen)
            self.base.update(versions)
            start_step = max(start_step, local_step)
            restored_step = local_step
            log.info("%s restored its inner state from checkpoint %d (step %d, bases %s)", self.learner_id,
                     saved.seq, local_step, versions)
        else:
            base_tensors = {}
            with torch.no_grad():
                for v in jr.versions:
                    t, v = self._fetch_initial(v)
                    for n, val in t.items():
                        params[n].copy_(val)
                    base_tensors[v.fragment] = t
                    self.base[v.fragment] = v.version
        self.ready.set()
        corpus = Corpus(load_corpus(corpus_urls(cfg.data)), cfg.data.eval_fraction, cfg.model.context)
        shard = corpus.shard(self.index, cfg.learners.count)
        log.info("%s ready: shard %d/%d of %d bytes, %d parameters, versions %s", self.learner_id, self.index,
                 cfg.learners.count, len(shard), sum(p.numel() for p in params.values()), self.base)
        if cfg.learners.nice_after_ready:
            os.nice(cfg.learners.nice_after_ready)
        self.recorder.record("ready", step=start_step, restored=restored_step)
        self._train(cfg, model, params, opt, gen, base_tensors, counters, start_step, shard, restored=saved is not None)
        self.stop_event.set()
        self._comms_thread.join(timeout=10)
        if self.fatal:
            log.error("%s stopped: %s", self.learner_id, self.fatal)
            return 3
        log.info("%s finished after %d steps, %d tokens", self.learner_id, self.stats.step, self.stats.tokens_total)
        return 0

    def _block(self, why: str, ready: Callable[[], bool]) -> None:
        """Synchronous-DiLoCo barrier (``learners.barrier``): hold the training thread until
        ``ready()`` (called under the lock), a stop or a synchronizer restart, and record the
        blocked time in the timeline."""
        t0 = time.time()
        while not (self.stop_event.is_set() or self.epoch_changed.is_set()):
            with self.lock:
                if ready():
                    break
            time.sleep(0.005)
            if time.time() - t0 >= 1.0:  # in pieces, so that a kill loses at most one second of it
                t1 = time.time()
                self.recorder.record("blocked", t0=t0, t1=t1, why=why)
                t0 = t1
        t1 = time.time()
        if t1 - t0 > 0.001:
            self.recorder.record("blocked", t0=t0, t1=t1, why=why)

    def _fetch_initial(self, v: VersionInfo, attempts: int = 20) -> tuple[dict[str, torch.Tensor], VersionInfo]:
        """Download the version named at join; if garbage collection removed it meanwhile (the
        run moved on while this process was starting), take the newest one a heartbeat names.

        Raises:
            FileNotFoundError: no listed version of the fragment could be read after ``attempts``.
        """
        for _ in range(attempts):
            try:
                return self._fetch_version(v), v
            except FileNotFoundError:
                log.warning("%s: fragment %d version %d is gone (collected); taking a newer one",
                            self.learner_id, v.fragment, v.version)
                deadline = time.monotonic() + 10 * self.cfg_heartbeat_s + 5
                while time.monotonic() < deadline:
                    newer = self.newest_versions.get(v.fragment)
                    if newer is not None and newer.version > v.version:
                        v = newer
                        break
                    time.sleep(self.cfg_heartbeat_s)
        raise FileNotFoundError(f"no readable version of fragment {v.fragment} (last tried {v.version})")

    def _train(self, cfg: Config, model: ByteGPT, params: dict[str, torch.nn.Parameter],
               opt: torch.optim.AdamW, gen: torch.Generator, base_tensors: dict[int, dict[str, torch.Tensor]],
               counters: dict[int, tuple[int, int, float]], start_step: int, shard: torch.Tensor,
               restored: bool = False) -> None:
        lc = cfg.learners
        P = self.plan.num_fragments
        c_steps = [counters.get(p, (0, 0, 0.0))[0] for p in range(P)]
        c_tokens = [counters.get(p, (0, 0, 0.0))[1] for p in range(P)]
        c_secs = [counters.get(p, (0, 0, 0.0))[2] for p in range(P)]
        last_state_s = time.monotonic()
        # fragment -> (round, parameters at the snapshot, c_steps, c_tokens, c_secs) of a contribution
        # in flight; cleared on adoption, or when it is known that it will not be merged.
        snapshot: dict[int, tuple[int, dict[str, torch.Tensor], int, int, float]] = {}
        answered: set[tuple[int, int]] = set()
        tokens_per_step = lc.batch_size * cfg.model.context
        ema_alpha = cfg.synchronizer.ema_alpha
        step = start_step  # a restarted slot continues its step count
        H = cfg.synchronizer.sync_every
        offsets = [fragment_offset(p, P, H) for p in range(P)]
        next_n = [max(1, -(-(step - offsets[p]) // H)) for p in range(P)]  # next round each fragment owes
        speed = lc.speed_factors[self.index] if self.index < len(lc.speed_factors) else 1.0
        jitter_rng = random.Random(cfg.run.seed * 65537 + self.index * 257 + self.incarnation)
        # After an inner-state restore, the restored progress on a fragment is contributed (on its
        # old base, if the synchronizer still keeps it) before a newer version of the fragment is
        # adopted: an overwrite first would throw that progress away. Held for two rounds at most.
        hold = {p for p in range(P) if restored and c_steps[p] >= 1}
        hold_until_step = step + 2 * H
        with self.lock:
            self.stats.step = step
        while not self.stop_event.is_set():
            # -- step boundary: adopt, then answer open rounds --
            deferred = []
            while True:
                try:
                    v, new = self.adopt_queue.get_nowait()
                except queue.Empty:
                    break
                p = v.fragment
                if v.version <= self.base.get(p, -1):
                    continue
                if p in hold and step < hold_until_step:
                    deferred.append((v, new))
                    continue
                snap = snapshot.pop(p, None)
                with torch.no_grad():
                    for n, val in new.items():
                        if lc.adopt == "overwrite":
                            params[n].copy_(val)
                        elif lc.adopt == "mix":
                            params[n].mul_(1 - lc.mix_alpha).add_(val, alpha=lc.mix_alpha)
                        else:  # rebase: keep the local progress made since the snapshot (or the base)
                            ref = snap[1][n] if snap else base_tensors[p][n]
                            params[n].add_(val - ref)
                if lc.adopt == "rebase" and snap:
                    c_steps[p] -= snap[2]
                    c_tokens[p] -= snap[3]
                    c_secs[p] -= snap[4]
                elif lc.adopt != "rebase":
                    c_steps[p], c_tokens[p], c_secs[p] = 0, 0, 0.0
                base_tensors[p] = new
                with self.lock:
                    self.base[p] = v.version
                log.debug("%s adopted fragment %d v%d", self.learner_id, p, v.version)
            for item in deferred:
                self.adopt_queue.put(item)
            if self.epoch_changed.is_set():
                self.epoch_changed.clear()
                answered.clear()  # round numbers may be reused by the restarted synchronizer
                snapshot.clear()  # contributions in flight will not be merged
            while True:
                try:
                    p, n, status = self.outcomes.get_nowait()
                except queue.Empty:
                    break
                if status not in ("accepted", "duplicate") and p in snapshot and snapshot[p][0] == n:
                    del snapshot[p]  # nothing of it will be merged: the progress stays in θ for the next round
                    hold.discard(p)
            with self.lock:
                rounds = sorted((k, vt[0]) for k, vt in self.open_rounds.items() if k not in answered)
            for (p, n), round_version in rounds:
                if round_version < self.base[p]:
                    answered.add((p, n))  # that round already published a version we adopted
                    next_n[p] = max(next_n[p], n + 1)
                    continue
                if p in snapshot and snapshot[p][0] < n and round_version == self.base[p]:
                    del snapshot[p]  # our round closed without a new version (abandoned)
                if c_steps[p] < 1 or p in snapshot:
                    continue
                answered.add((p, n))
                next_n[p] = max(next_n[p], n + 1)
                with torch.no_grad():
                    snap_t = {name: params[name].detach().clone() for name in self.plan.names(p)}
                    delta = {name: base_tensors[p][name] - snap_t[name] for name in snap_t}
                snapshot[p] = (n, snap_t, c_steps[p], c_tokens[p], c_secs[p])
                hold.discard(p)
                job = _UploadJob(p, n, self.base[p], c_steps[p], c_tokens[p], c_secs[p], delta)
                self.recorder.record("contribution", fragment=p, round=n, last_step=step, c_steps=c_steps[p],
                                     update_id=job.update_id)
                self.upload_queue.put(job)
            if lc.barrier and snapshot:
                # wait for the round we contributed to: a version to adopt, an outcome, or a newer
                # round on the version we hold (ours was abandoned)
                self._block("merge", lambda: not self.adopt_queue.empty() or not self.outcomes.empty() or any(
                    n > snapshot[p][0] and vt[0] == self.base.get(p)
                    for (p, n), vt in self.open_rounds.items() if p in snapshot))
                continue  # adopt what arrived before the next step
            if lc.barrier:
                # never step past the due step of a round that is not open yet: every learner does
                # exactly H steps per round and waits for the slowest (synchronous DiLoCo)
                def is_open(p: int) -> bool:
                    return any(q == p and n >= next_n[p] for (q, n) in self.open_rounds)

                with self.lock:
                    waiting = [p for p in range(P) if step >= offsets[p] + next_n[p] * H and not is_open(p)]
                if waiting:
                    self._block("round", lambda waiting=waiting: all(is_open(p) for p in waiting))
                    continue  # answer the round at this step boundary
            if lc.checkpoint_every_s > 0 and time.monotonic() - last_state_s >= lc.checkpoint_every_s:
                last_state_s = time.monotonic()
                counters_now = {p: (c_steps[p], c_tokens[p], c_secs[p]) for p in range(P)}
                self.upload_queue.put(capture_inner(params, opt, gen, step=step, base_tensors=base_tensors,
                                                    base_versions=dict(self.base), counters=counters_now))
            # -- one inner step --
            t0 = time.perf_counter()
            t0_unix = time.time()
            x, y = Corpus.sample(shard, lc.batch_size, cfg.model.context, gen)
            lr = lc.lr * min(1.0, (step + 1) / max(1, lc.warmup_steps))  # no second warm-up after a restart
            for group in opt.param_groups:
                group["lr"] = lr
            loss = model.loss(x, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), lc.grad_clip)
            opt.step()
            if speed < 1.0 or lc.step_jitter > 0:  # emulated slower or noisy hardware (chaos)
                dt = time.perf_counter() - t0
                time.sleep(dt * (1.0 / speed - 1.0) + dt * abs(jitter_rng.gauss(0.0, lc.step_jitter)))
            dt = time.perf_counter() - t0
            step += 1
            self.recorder.record("step", t0=t0_unix, t1=time.time(), step=step, tokens=tokens_per_step)
            for p in range(P):
                c_steps[p] += 1
                c_tokens[p] += tokens_per_step
                c_secs[p] += dt
            with self.lock:
                s = self.stats
                s.step = step
                s.tokens_total += tokens_per_step
                s.window_tokens += tokens_per_step
                s.step_time_s = dt if s.step_time_s is None else ema_alpha * dt + (1 - ema_alpha) * s.step_time_s
                s.loss_sum += float(loss.detach())
                s.loss_count += 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m diloco_async.learner", description="Run one learner.")
    ap.add_argument("--learner-id", required=True)
    ap.add_argument("--index", type=int, required=True, help="data shard index")
    ap.add_argument("--sync-url", required=True)
    ap.add_argument("--store", required=True, help="object store root URL")
    ap.add_argument("--incarnation", type=int, default=0)
    ap.add_argument("--give-up-after-s", type=float, default=120.0)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s learner {args.learner_id} %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)
    token = os.environ.get(TOKEN_ENV, "")
    if not token:
        print(f"error: {TOKEN_ENV} is not set", file=sys.stderr)
        return 2
    options: dict[str, Any] = storage_options_from_env()
    tl_dir = os.environ.get(TIMELINE_DIR_ENV)
    recorder = Recorder(os.path.join(tl_dir, f"{args.learner_id}.jsonl") if tl_dir else None, inc=args.incarnation)
    recorder.record("start")
    learner = Learner(args.learner_id, args.index, args.sync_url, ObjectStore(args.store, options), token,
                      incarnation=args.incarnation, give_up_after_s=args.give_up_after_s, recorder=recorder)
    try:
        code = learner.run()
    except ProtocolError as err:
        log.error("%s: %s", args.learner_id, err)
        code = 3
    recorder.record("stopped", code=code)
    recorder.close()
    return code


if __name__ == "__main__":
    raise SystemExit(main())
