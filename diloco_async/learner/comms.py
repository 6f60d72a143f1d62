"""The learner's comms thread: an asyncio loop with one synchronizer client (DESIGN §3).

It joins, sends heartbeats (which bring open rounds, new versions and the stop signal), listens on
the WebSocket push channel, downloads new versions for the training thread, and runs the upload
pipeline (:class:`~diloco_async.learner.uploads.Uploads`). Heartbeats and announcements go over
the push channel's WebSocket while it is open and over HTTP while it is not (before it connects,
after the synchronizer restarts, until it reconnects): :class:`~diloco_async.protocol.client.SyncClient`.
If the synchronizer is unreachable the learner keeps training and reconnects with exponential
backoff; after ``give_up_after_s`` without any answer the comms fail with
:class:`~diloco_async.protocol.client.ProtocolError` (the learner exits 3).
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time

import aiohttp
import torch

from diloco_async.codec import versions as version_codec
from diloco_async.config.schema import Config
from diloco_async.inner.base_file import BaseFile, HeldBase, keep_base
from diloco_async.learner.link import link_budget_s
from diloco_async.learner.state import LearnerSlot, Shared, SyncEndpoint
from diloco_async.learner.uploads import Uploads, synchronizer_backoff
from diloco_async.protocol.client import ProtocolError, SyncClient
from diloco_async.protocol.messages import HeartbeatResponse, JoinResponse, VersionInfo
from diloco_async.protocol.versions import read_version
from diloco_async.runtime.priority import BACKGROUND_NICE, lower_thread_priority
from storage.store import ObjectRef, ObjectStore

__all__ = ["Comms"]

log = logging.getLogger("diloco.learner")

_UNREACHABLE = (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError)


class Comms:
    """The comms thread of learner ``slot``; :meth:`start` it, then :meth:`configure` it
    once the run's config is known (the training thread does both).

    Args:
        slot: the learner's id and incarnation.
        endpoint: the synchronizer's URL, this learner's token, the give-up time and link delay.
        store: the run's object store.
        shared: state shared with the training thread.
        started_s: ``time.monotonic()`` at the process's start (its uptime is reported at join).
    """

    def __init__(self, slot: LearnerSlot, endpoint: SyncEndpoint, store: ObjectStore, shared: Shared,
                 started_s: float) -> None:
        learner_id = slot.learner_id
        self.learner_id, self.incarnation = learner_id, slot.incarnation
        self.store = store
        self.shared = shared
        self.started_s = started_s
        self.give_up_after_s = endpoint.give_up_after_s
        self.heartbeat_s = 0.25  # until the run's config is known
        self.shapes: dict[int, dict[str, tuple[int, ...]]] = {}  # fragment -> tensor shapes, to decode versions
        self.epoch: str | None = None  # the synchronizer's; a change means it restarted
        self.client = SyncClient(endpoint.url.rstrip("/"), endpoint.token, link_delay_s=endpoint.link_delay_s)
        self.uploads = Uploads(learner_id, slot.incarnation, store, shared)
        self._downloading: dict[int, int] = {}
        self._held: dict[int, tuple[int, BaseFile | HeldBase]] = {}  # fragment -> newest value downloaded
        self.base_in_ram = False  # base copies in RAM, not local files: the parameters are on an accelerator
        self.pin_device: torch.device | None = None  # ... a CUDA device: those copies are pinned for it
        self._fetch_locks: dict[int, asyncio.Lock] = {}
        # one version decoded at a time, and not while an upload holds its buffers (Uploads.io_slot):
        # one fragment's fp32 in flight
        self._download_slot = self.uploads.io_slot
        self.sync_every, self.num_fragments = 1, 1  # H and P, for the link-bound check
        shared.link.learner_id = learner_id
        self._bg: set[asyncio.Task] = set()
        self._thread = threading.Thread(target=self._main, name=f"{learner_id}-comms", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout=timeout_s)

    def configure(self, cfg: Config, store: ObjectStore) -> None:
        """Apply the run's config: the store (the learner's, maybe wrapped), timeouts, heartbeat
        period and codec."""
        lc = cfg.learners
        self.store = store
        self.uploads.configure(store, lc.codec, lc.storage_timeout_s)
        self.heartbeat_s = lc.heartbeat_s
        self.sync_every, self.num_fragments = cfg.synchronizer.sync_every, cfg.synchronizer.num_fragments
        self.client.request_timeout_s = lc.request_timeout_s

    def fetch_version(self, v: VersionInfo) -> BaseFile | HeldBase:
        """Download and decode a published version (blocking; verifies size and sha256): its
        compact form when there is one this learner can rebuild exactly (a whole one, or a delta
        from the version it holds; :mod:`diloco_async.codec.versions`), else the fp32 value
        streamed into tensors allocated once (:func:`diloco_async.protocol.versions.read_version`). Either
        way the result is the synchronizer's published value bit for bit, kept in a local file
        (:class:`~diloco_async.inner.base_file.BaseFile`), not in RAM, unless ``base_in_ram``
        (:class:`~diloco_async.inner.base_file.HeldBase`, pinned for ``pin_device``). Counts the bytes and seconds
        (:class:`~diloco_async.learner.link.LinkMeter`).

        Raises:
            FileNotFoundError: the version was collected; storage.store.IntegrityError;
            ValueError: not an fp32 version of this fragment's tensors.
        """
        t0 = time.monotonic()
        tensors, nbytes = self._fetch_compact(v), v.compact.nbytes if v.compact else 0
        if tensors is None:
            tensors, nbytes = read_version(self.store, ObjectRef(v.key, v.nbytes, v.sha256), self.shapes[v.fragment]), \
                v.nbytes
        self.shared.link.record("down", v.fragment, nbytes, time.monotonic() - t0)
        # a file: the decoded fp32 is freed
        tensors = keep_base(tensors, self.learner_id, in_ram=self.base_in_ram, pin_device=self.pin_device)
        with self.shared.lock:
            self.shared.stats.bytes_down += nbytes
            held = self._held.get(v.fragment)
            if held is None or held[0] < v.version:
                self._held[v.fragment] = (v.version, tensors)
        return tensors

    def _fetch_compact(self, v: VersionInfo) -> dict[str, torch.Tensor] | None:
        """The published value rebuilt from ``v``'s compact form; None when there is none or this
        learner does not hold the version its delta applies to, or it failed (logged)."""
        c = v.compact
        with self.shared.lock:
            held = self._held.get(v.fragment)
        if c is None:
            return None
        if c.mode == "delta" and (held is None or held[0] != c.base_version):
            log.info("%s fragment %d v%d: downloaded whole (fp32), the delta applies to v%d and this learner holds "
                     "%s", self.learner_id, v.fragment, v.version, c.base_version, held and f"v{held[0]}")
            return None
        try:
            form = version_codec.CompactForm(c.codec, c.mode, c.block_size, c.base_version, c.published_sha256)
            return version_codec.read_compact(self.store, ObjectRef(c.key, c.nbytes, c.sha256), self.shapes[v.fragment],
                                              form, base=held[1] if held else None)
        except Exception as err:  # noqa: BLE001 - the whole fp32 version is there to fall back on
            log.warning("%s compact download of fragment %d v%d failed (%s); downloading it whole", self.learner_id,
                        v.fragment, v.version, err)
            return None

    def _main(self) -> None:
        lower_thread_priority(BACKGROUND_NICE)  # the training thread comes first (its executor threads inherit it)
        loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(self._run())
        finally:
            loop.close()

    async def _run(self) -> None:
        sh = self.shared
        async with self.client:
            tasks = [asyncio.create_task(self._heartbeat_loop()),
                     asyncio.create_task(self.uploads.run(self.client)),
                     asyncio.create_task(self._push_loop())]
            while not sh.stop_event.is_set():
                await asyncio.sleep(0.05)
                for t in tasks:
                    if t.done() and t.exception() is not None:
                        sh.fatal = f"{type(t.exception()).__name__}: {t.exception()}"
                        log.error("%s comms failed: %s", self.learner_id, sh.fatal)
                        sh.stop_event.set()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            log.info("%s heartbeats and announcements sent by transport: %s", self.learner_id,
                     dict(sorted(self.client.sent_by_transport.items())))
            if sh.joined.is_set() and sh.fatal is None:
                # Last word: final counters, and the synchronizer learns we heard the stop.
                try:
                    await asyncio.wait_for(self.client.heartbeat(self.heartbeat_body()), 2.0)
                except (TimeoutError, aiohttp.ClientError, OSError, ProtocolError):
                    pass

    async def _join(self) -> JoinResponse:
        body = {"learner_id": self.learner_id, "incarnation": self.incarnation,
                "uptime_s": time.monotonic() - self.started_s}
        return JoinResponse.model_validate(await self.client.join(body))

    async def _heartbeat_loop(self) -> None:
        sh = self.shared
        backoff = synchronizer_backoff()
        last_ok = time.monotonic()
        while not sh.stop_event.is_set():
            try:
                if not sh.joined.is_set():
                    sh.join_response = await self._join()
                    self.epoch = sh.join_response.epoch
                    sh.joined.set()
                    log.info("%s joined run %s", self.learner_id, sh.join_response.run_id)
                resp = HeartbeatResponse.model_validate(await self.client.heartbeat(self.heartbeat_body()))
                last_ok = time.monotonic()
                backoff.reset()
                if not self._on_heartbeat(resp):
                    await self._join()  # unknown to the synchronizer
                    continue
                if resp.stop:
                    log.info("%s told to stop", self.learner_id)
                    sh.stop_event.set()
                    return
                await asyncio.sleep(self.heartbeat_s)
            except ProtocolError:
                raise
            except _UNREACHABLE as err:
                silent = time.monotonic() - last_ok
                if silent > self.give_up_after_s:
                    raise ProtocolError(f"synchronizer unreachable for {silent:.0f}s") from err
                pause_s = backoff.next_pause_s()
                log.warning("%s synchronizer unreachable (%s); retrying in %.1fs, training continues",
                            self.learner_id, type(err).__name__, pause_s)
                await asyncio.sleep(pause_s)

    def _on_heartbeat(self, resp: HeartbeatResponse) -> bool:
        """Take in a heartbeat's answer: epoch, open rounds, versions. False: rejoin (the
        synchronizer does not know this learner), nothing else taken in."""
        sh = self.shared
        if resp.epoch != self.epoch:
            log.warning("%s: the synchronizer restarted (epoch %s -> %s); resetting round state",
                        self.learner_id, self.epoch, resp.epoch)
            self.epoch = resp.epoch
            with sh.lock:
                sh.open_rounds.clear()
            self._downloading.clear()
            sh.epoch_changed.set()
        if not resp.known:
            log.warning("%s unknown to the synchronizer; rejoining", self.learner_id)
            return False
        now = time.monotonic()
        with sh.lock:
            listed = {(r.fragment, r.round_n): r.version for r in resp.open_rounds}
            # Keep rounds just pushed over the WebSocket that this response predates.
            sh.open_rounds = {k: vt for k, vt in sh.open_rounds.items() if k in listed or now - vt[1] < 1.0}
            for k, version in listed.items():
                sh.open_rounds.setdefault(k, (version, now))
        for v in resp.versions:
            sh.newest_versions[v.fragment] = v
            self._maybe_download(v)
        return True

    def heartbeat_body(self) -> dict:
        """The ``Heartbeat`` to send now; restarts the loss and token window."""
        now = time.monotonic()
        sh = self.shared
        with sh.lock:
            s = sh.stats
            loss = s.loss_sum / s.loss_count if s.loss_count else None
            window = now - s.window_start_s
            tps = s.window_tokens / window if s.loss_count and window > 0 else None
            body = {"learner_id": self.learner_id, "incarnation": self.incarnation, "step": s.step,
                    "step_time_s": s.step_time_s, "tokens_total": s.tokens_total, "train_loss": loss,
                    "tokens_per_s": tps, "bytes_down": s.bytes_down, "bytes_up": s.bytes_up,
                    "uptime_s": now - self.started_s, "blocked_s": s.blocked_now_s(time.time()),
                    "base_versions": {str(k): v for k, v in sh.base.items()}}
            step_time_s = s.step_time_s
            s.loss_sum, s.loss_count, s.window_tokens, s.window_start_s = 0.0, 0, 0, now
        if loss is not None and not math.isfinite(loss):
            body["train_loss"] = None
        up, down = sh.link.bytes_snapshot()
        budget_s = link_budget_s(step_time_s, self.sync_every, self.num_fragments)
        need_s, _bound = sh.link.check(budget_s)
        body.update(bytes_up_by_fragment={str(p): n for p, n in up.items()},
                    bytes_down_by_fragment={str(p): n for p, n in down.items()},
                    link_s_per_fragment=need_s, link_budget_s=budget_s)
        return body

    async def _push_loop(self) -> None:
        """Receive pushed events over the WebSocket; reconnect with backoff; heartbeats cover gaps."""
        sh = self.shared
        backoff = synchronizer_backoff()
        while not sh.stop_event.is_set():
            if not sh.joined.is_set():
                await asyncio.sleep(0.05)
                continue
            try:
                async with self.client.push(self.learner_id) as events:
                    backoff.reset()
                    async for event in events:
                        self._on_push(event)
            except _UNREACHABLE as err:
                log.debug("%s push channel down (%s)", self.learner_id, err)
            await asyncio.sleep(backoff.next_pause_s())

    def _on_push(self, event: dict) -> None:
        sh = self.shared
        kind = event.pop("type", None)
        if kind == "round_open":
            with sh.lock:
                sh.open_rounds.setdefault((event["fragment"], event["round_n"]), (event["version"], time.monotonic()))
        elif kind == "version":
            self._maybe_download(VersionInfo.model_validate(event))
        elif kind == "stop":
            log.info("%s told to stop (%s)", self.learner_id, event.get("reason"))
            sh.stop_event.set()

    def _maybe_download(self, v: VersionInfo) -> None:
        if not self.shared.ready.is_set():
            return
        have = max(self.shared.base.get(v.fragment, -1), self._downloading.get(v.fragment, -1))
        if v.version > have:
            self._downloading[v.fragment] = v.version
            task = asyncio.create_task(self._download(v))
            self._bg.add(task)
            task.add_done_callback(self._bg.discard)

    async def _download(self, v: VersionInfo) -> None:
        try:  # one download per fragment at a time: a delta applies to the version downloaded before it
            async with self._fetch_locks.setdefault(v.fragment, asyncio.Lock()), self._download_slot:
                tensors = await asyncio.to_thread(self.fetch_version, v)
                self.shared.large_frees.set()  # the download's buffers (the decoded fp32 is in a local file)
        except Exception as err:  # counted in the log; the next heartbeat retries
            log.warning("%s download of fragment %d v%d failed: %s", self.learner_id, v.fragment, v.version, err)
            self._downloading.pop(v.fragment, None)  # the next heartbeat retries
            return
        self.shared.adopt_queue.put((v, tensors))
