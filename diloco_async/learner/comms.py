"""The learner's comms thread: an asyncio loop with one synchronizer client (DESIGN §3).

It joins, sends heartbeats (which bring open rounds, new versions and the stop signal), listens on the
WebSocket push channel, downloads new versions for the training thread, and runs the upload pipeline
(:class:`~diloco_async.learner.uploads.Uploads`). Heartbeats and announcements go over the push channel's
WebSocket while it is open, else over HTTP (:class:`~diloco_async.protocol.client.SyncClient`, one per
shard behind :class:`~diloco_async.learner.sharded_client.ShardedSyncClient`). An unreachable synchronizer
is retried with backoff while training goes on; after ``give_up_after_s``: ``ProtocolError`` (exit 3). In a
replay (:mod:`~diloco_async.learner.replay`) rounds, versions and the stop come with the step boundaries.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
import threading
import time
from collections.abc import Iterator

import aiohttp
import torch

from diloco_async.codec import versions as version_codec
from diloco_async.config.schema import Config
from diloco_async.inner.base_file import BaseFile, HeldBase, keep_base
from diloco_async.learner.link import UploadCodecs, link_budget_s
from diloco_async.learner.sharded_client import ShardedSyncClient, ShardListMismatch, split_sync_urls
from diloco_async.learner.slices import lease_loop
from diloco_async.learner.state import LearnerSlot, Shared, SyncEndpoint
from diloco_async.learner.uploads import Uploads, synchronizer_backoff
from diloco_async.policy.catchup import FetchChoice, version_to_fetch
from diloco_async.policy.link_bound import download_yields
from diloco_async.protocol.client import ProtocolError
from diloco_async.protocol.messages import HeartbeatResponse, JoinResponse, VersionInfo
from diloco_async.protocol.versions import read_version
from diloco_async.runtime.priority import BACKGROUND_NICE, lower_thread_priority
from diloco_async.storage.store import ObjectRef, ObjectStore

__all__ = ["Comms"]

log = logging.getLogger("diloco.learner")

_UNREACHABLE = (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError)
#: the most seconds a link-bound learner's read waits for its pending uploads (policy/link_bound.py)
UPLOADS_FIRST_MAX_S = 2.0


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
        # one client per synchronizer shard (a comma-separated URL list, in shard order), used as one
        self.client = ShardedSyncClient(split_sync_urls(endpoint.url), endpoint.token,
                                        link_delay_s=endpoint.link_delay_s)
        self.uploads = Uploads(learner_id, slot.incarnation, store, shared)
        self._held: dict[int, tuple[int, BaseFile | HeldBase]] = {}  # fragment -> newest value downloaded
        self.base_in_ram = False  # base copies in RAM, not local files: the parameters are on an accelerator
        self.pin_device: torch.device | None = None  # ... a CUDA device: those copies are pinned for it
        self.defer_reads = False  # a sharded group (fsdp): versions are told, each rank reads its rows itself
        # Downloads (DESIGN §3.8, issue 47): one task per fragment at most, which reads the newest
        # version told (policy/catchup.py: the ones in between are skipped), in the download lane:
        # one version decoded at a time (one fragment's fp32 in flight), beside the uploads, which
        # never wait for it (Uploads.run takes them one at a time)
        self._download_slot = asyncio.Lock()
        self._fetchers: dict[int, asyncio.Task] = {}  # fragment -> its download task
        self._gone: dict[int, int] = {}  # fragment -> newest version found collected (never asked for again)
        self._reading: dict[int, int] = {}  # fragment -> version read now (under shared.lock): the read lease
        self._wake: asyncio.Event | None = None  # set: send the next heartbeat now (the comms loop's)
        #: versions downloaded, versions skipped (never downloaded: a newer one was told first), versions
        #: found collected before they were read; logged when the comms end
        self.downloads: collections.Counter[str] = collections.Counter()
        self.sync_every, self.num_fragments = 1, 1  # H and P, for the link-bound check
        self.upload_codecs = UploadCodecs(learner_id, ["bf16"])  # configure() sets learners.codec's ladder
        shared.link.learner_id = learner_id
        self._bg: set[asyncio.Task] = set()
        self.replay = False  # run.schedule = "replay" (configure): no rounds, versions or stop taken in here
        self.loop: asyncio.AbstractEventLoop | None = None  # the comms loop, once running
        self._thread = threading.Thread(target=self._main, name=f"{learner_id}-comms", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout=timeout_s)

    def configure(self, cfg: Config, store: ObjectStore) -> None:
        """Apply the run's config: the store (the learner's, maybe wrapped), timeouts, heartbeat period, codec."""
        lc = cfg.learners
        self.store = store
        self.uploads.configure(store, lc.codec, lc.storage_timeout_s, lc.announce_timeout_s)
        self.heartbeat_s = lc.heartbeat_s
        self.sync_every, self.num_fragments = cfg.synchronizer.sync_every, cfg.synchronizer.num_fragments
        # a link-bound learner steps its upload codec down learners.link_codecs (policy/link_bound.py)
        self.upload_codecs = UploadCodecs(self.learner_id, [lc.codec, *lc.link_codecs], self.num_fragments)
        self.shared.upload_codec = None  # learners.codec until the link is measured
        self.client.request_timeout_s = lc.request_timeout_s
        self.replay = cfg.run.schedule == "replay"
        self.uploads.replay_outbox = [] if self.replay else None  # replay: announced with a boundary

    def fetch_version(self, v: VersionInfo) -> BaseFile | HeldBase:
        """Download and decode a published version (blocking; verifies size and sha256): its compact
        form when this learner can rebuild it exactly (whole, or a delta from the version it holds;
        :mod:`diloco_async.codec.versions`), else the fp32 value streamed into tensors allocated once
        (:func:`diloco_async.protocol.versions.read_version`): the published value bit for bit, in a local
        file (:class:`~diloco_async.inner.base_file.BaseFile`), or in RAM if ``base_in_ram`` (``HeldBase``,
        pinned for ``pin_device``). Counts the bytes and seconds (:class:`~diloco_async.learner.link.LinkMeter`).

        Raises:
            FileNotFoundError: the version was collected; diloco_async.storage.store.IntegrityError;
            ValueError: not an fp32 version of this fragment's tensors.
        """
        if self.defer_reads:  # a sharded group: each rank reads its own rows at the step boundary
            return {}
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

    @contextlib.contextmanager
    def reading(self, v: VersionInfo) -> Iterator[None]:
        """Name ``v`` as being read (heartbeats report it: ``fetching_versions``, the read lease
        that keeps it from garbage collection) for the duration of the ``with``. Any thread."""
        with self.shared.lock:
            self._reading[v.fragment] = v.version
        try:
            yield
        finally:
            with self.shared.lock:
                if self._reading.get(v.fragment) == v.version:
                    del self._reading[v.fragment]

    def told(self, v: VersionInfo) -> None:
        """Take in a version the synchronizer told of: the newest of each fragment is kept (a
        heartbeat's answer may arrive after a newer version was pushed)."""
        with self.shared.lock:
            cur = self.shared.newest_versions.get(v.fragment)
            if cur is None or v.version > cur.version:
                self.shared.newest_versions[v.fragment] = v

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
        self._wake, self.loop = asyncio.Event(), asyncio.get_running_loop()
        async with self.client:
            tasks = [asyncio.create_task(self._heartbeat_loop()),
                     asyncio.create_task(self.uploads.run(self.client)),
                     asyncio.create_task(self._push_loop()),
                     asyncio.create_task(lease_loop(sh, self.client, self.learner_id, self.incarnation))]
            while not sh.stop_event.is_set():
                await asyncio.sleep(0.05)
                for t in tasks:
                    if t.done() and t.exception() is not None:
                        sh.fatal = f"{type(t.exception()).__name__}: {t.exception()}"
                        sh.fatal_code = 2 if isinstance(t.exception(), ShardListMismatch) else 3
                        log.error("%s comms failed: %s", self.learner_id, sh.fatal)
                        sh.stop_event.set()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            log.info("%s heartbeats and announcements sent by transport: %s", self.learner_id,
                     dict(sorted(self.client.sent_by_transport.items())))
            fetchers = list(self._fetchers.values())
            for t in fetchers:
                t.cancel()
            await asyncio.gather(*fetchers, return_exceptions=True)
            log.info("%s versions downloaded %d, skipped %d (a newer one was told first), found collected %d",
                     self.learner_id, *(self.downloads[k] for k in ("downloaded", "skipped", "collected")))
            log.info("%s uploads: codec %s now, %d codec change(s); reads that waited for uploads %d",
                     self.learner_id, self.upload_codecs.codec, self.upload_codecs.changes,
                     self.downloads["waited_for_uploads"])
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
                    for v in sh.join_response.versions:
                        self.told(v)
                    self.epoch = sh.join_response.epoch
                    sh.run_tokens = sh.join_response.run_tokens  # the run's point on the lr schedule
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
                await self._until_next_heartbeat()
            except ProtocolError:
                raise
            except _UNREACHABLE as err:
                silent = time.monotonic() - last_ok
                if silent > self.give_up_after_s:
                    raise ProtocolError(f"synchronizer unreachable for {silent:.0f}s") from err
                pause_s = backoff.next_pause_s()
                why = f"{type(err).__name__}: {err}"[:300] if isinstance(err, aiohttp.ClientSSLError) else ""
                log.warning("%s synchronizer unreachable (%s); retrying in %.1fs, training continues",
                            self.learner_id, why or type(err).__name__, pause_s)  # a TLS refusal says why
                await asyncio.sleep(pause_s)

    async def _until_next_heartbeat(self) -> None:
        """Wait ``heartbeat_s``, or less when woken (a version found collected: the next heartbeat
        brings the newest one)."""
        assert self._wake is not None
        try:
            async with asyncio.timeout(self.heartbeat_s):
                await self._wake.wait()
        except TimeoutError:
            pass
        self._wake.clear()

    def _on_heartbeat(self, resp: HeartbeatResponse) -> bool:
        """Take in a heartbeat's answer: epoch, open rounds, versions. False: rejoin (unknown), nothing taken in."""
        sh = self.shared
        if resp.epoch != self.epoch:
            log.warning("%s: the synchronizer restarted (epoch %s -> %s); resetting round state",
                        self.learner_id, self.epoch, resp.epoch)
            self.epoch = resp.epoch
            with sh.lock:
                sh.open_rounds.clear()
                sh.newest_versions.clear()  # the restarted synchronizer's versions replace them
            self._gone.clear()
            sh.epoch_changed.set()
        if not resp.known:
            log.warning("%s unknown to the synchronizer; rejoining", self.learner_id)
            return False
        if self.replay:
            return True  # rounds, versions and the lr schedule's progress come with the step boundaries
        sh.run_tokens = resp.run_tokens
        now = time.monotonic()
        with sh.lock:
            listed = {(r.fragment, r.round_n): r.version for r in resp.open_rounds}
            # Keep rounds just pushed over the WebSocket that this response predates.
            sh.open_rounds = {k: vt for k, vt in sh.open_rounds.items() if k in listed or now - vt[1] < 1.0}
            for k, version in listed.items():
                sh.open_rounds.setdefault(k, (version, now))
        for v in resp.versions:
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
                    "base_versions": {str(k): v for k, v in sh.base.items()},
                    # the read lease (policy/catchup.py): no read of a version older than these starts
                    # from now on, and those in progress are named
                    "known_versions": {str(p): v.version for p, v in sh.newest_versions.items()},
                    "fetching_versions": {str(p): v for p, v in self._reading.items()}}
            step_time_s = s.step_time_s
            s.loss_sum, s.loss_count, s.window_tokens, s.window_start_s = 0.0, 0, 0, now
        if loss is not None and not math.isfinite(loss):
            body["train_loss"] = None
        up, down = sh.link.bytes_snapshot()
        budget_s = link_budget_s(step_time_s, self.sync_every, self.num_fragments)
        need_s, bound = sh.link.check(budget_s)
        sh.upload_codec = self.upload_codecs.update(sh.link, bound, need_s, budget_s)
        body.update(bytes_up_by_fragment={str(p): n for p, n in up.items()},
                    bytes_down_by_fragment={str(p): n for p, n in down.items()},
                    undeliverable_by_fragment={**sh.undeliverable}, link_s_per_fragment=need_s, link_budget_s=budget_s)
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
        kind = None if self.replay else event.pop("type", None)  # replay: all comes with the step boundaries
        if kind == "round_open":
            with sh.lock:
                sh.open_rounds.setdefault((event["fragment"], event["round_n"]), (event["version"], time.monotonic()))
        elif kind == "version":
            self._maybe_download(VersionInfo.model_validate(event))
        elif kind == "stop":
            log.info("%s told to stop (%s)", self.learner_id, event.get("reason"))
            sh.stop_event.set()

    def _maybe_download(self, v: VersionInfo) -> None:
        """Take in a version told (heartbeat or push); start its fragment's download task if none is in flight."""
        self.told(v)
        p = v.fragment
        if not self.shared.ready.is_set() or p in self._fetchers:
            return  # a fragment's task takes the newest version told when the lane frees up
        if self._choice(p)[1].version is None:
            return
        task = asyncio.create_task(self._fetch_newest(p))
        self._fetchers[p] = task
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)

    def _choice(self, p: int) -> tuple[VersionInfo | None, FetchChoice]:
        """The version of fragment ``p`` to download now (:func:`~diloco_async.policy.catchup.version_to_fetch`)."""
        with self.shared.lock:
            told = self.shared.newest_versions.get(p)
            held = max(self.shared.base.get(p, -1), self._held.get(p, (-1,))[0])
        return told, version_to_fetch(told.version if told else None, held, self._gone.get(p, -1))

    async def _uploads_first(self) -> None:
        """With ``learners.link_codecs``, a link-bound learner's next read waits for its pending uploads (at
        most :data:`UPLOADS_FIRST_MAX_S`; :func:`~diloco_async.policy.link_bound.download_yields`)."""
        if len(self.upload_codecs.ladder) == 1:
            return
        t0 = time.monotonic()
        while not self.shared.stop_event.is_set():
            wait, _why = download_yields(self.shared.link.bound, self.uploads.pending(), time.monotonic() - t0,
                                         UPLOADS_FIRST_MAX_S)
            if not wait:
                break
            await asyncio.sleep(0.02)
        if time.monotonic() - t0 > 0.02:
            self.downloads["waited_for_uploads"] += 1

    async def _fetch_newest(self, p: int) -> None:
        """Download fragment ``p``'s newest version told, again while a newer one was told meanwhile, in
        the download lane (one fragment at a time, first come first served). A version found collected is
        not asked for again: the newest told is read, now or after a heartbeat sent now. Another failure
        ends the task (logged); the next heartbeat starts it again."""
        sh, v = self.shared, None
        try:
            while not sh.stop_event.is_set():
                async with self._download_slot:
                    await self._uploads_first()
                    v, choice = self._choice(p)
                    if v is None or choice.version is None:
                        return
                    if choice.skipped:
                        self.downloads["skipped"] += choice.skipped
                        log.info("%s fragment %d: reading v%d (%s)", self.learner_id, p, v.version, choice.reason)
                    try:
                        with self.reading(v):
                            tensors = await asyncio.to_thread(self.fetch_version, v)
                    except FileNotFoundError as err:
                        self._gone[p] = max(self._gone.get(p, -1), v.version)
                        self.downloads["collected"] += 1
                        log.warning("%s fragment %d v%d was collected before it was read (%s); reading the newest "
                                    "version told instead", self.learner_id, p, v.version, err)
                        assert self._wake is not None
                        self._wake.set()  # a heartbeat now: it names the newest version
                        continue
                    self.downloads["downloaded"] += 1
                    sh.large_frees.set()  # the download's buffers (the decoded fp32 is in a local file)
                sh.adopt_queue.put((v, tensors))
                del tensors
        except Exception as err:  # counted in the log; the next heartbeat starts the task again
            log.warning("%s download of fragment %d v%s failed: %s", self.learner_id, p, v.version if v else "?", err)
        finally:
            self._fetchers.pop(p, None)
