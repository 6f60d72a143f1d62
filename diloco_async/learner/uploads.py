"""The learner's upload pipeline, on the comms thread (DESIGN §3.4 and §5).

A contribution is encoded, uploaded to an immutable key and only then announced (publish, then
mark); the announcement is retried with the same update id, so it is merged at most once. The
learner's own inner-state checkpoints travel the same queue and are written with
:func:`diloco_async.storage.checkpoint.write_state` (or, spooled to a local file by the spool thread,
:class:`~diloco_async.learner.spool.StateSpooler`, :func:`diloco_async.storage.checkpoint.write_state_file`);
the newest one is kept (an older one is deleted only once a newer one is complete).

Uploads run one at a time, in the order queued (:meth:`Uploads.run` awaits each), so two uploads'
buffers never overlap. They do not wait for the downloads, which take their own lane one at a time
(:class:`~diloco_async.learner.comms.Comms`): a contribution is never queued behind a slow read of
a version that will be superseded before it is adopted (issue 47; DESIGN §5, learner memory).

With ``learners.error_feedback`` the fragment's residual is added to Δ before encoding and kept
only for an upload that was put and taken (:mod:`diloco_async.learner.feedback`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import time
from collections.abc import Callable

import aiohttp

from diloco_async.codec import wire
from diloco_async.inner.state import InnerState
from diloco_async.learner.sharded_client import ShardedSyncClient
from diloco_async.learner.state import Shared, SpooledState, UploadJob
from diloco_async.protocol.client import SyncClient
from diloco_async.protocol.messages import AnnouncementAck, ShardObject, shard_list_digest
from diloco_async.storage import keys
from diloco_async.storage.checkpoint import write_state, write_state_file
from diloco_async.storage.retry import Backoff
from diloco_async.storage.store import ObjectRef, ObjectStore

__all__ = ["Uploads", "synchronizer_backoff", "sharded_ref"]

log = logging.getLogger("diloco.learner")

#: first and largest pause between tries of the synchronizer, seconds
RETRY_FIRST_S, RETRY_MAX_S = 0.1, 5.0


def synchronizer_backoff() -> Backoff:
    """The pauses between a learner's tries of the synchronizer (an announcement, a heartbeat, the
    push channel's reconnect): the project's one :class:`~diloco_async.storage.retry.Backoff`, from
    :data:`RETRY_FIRST_S` doubling up to :data:`RETRY_MAX_S`, jittered so that learners cut off
    together (a synchronizer restart) do not come back in step."""
    return Backoff(RETRY_FIRST_S, RETRY_MAX_S)


def sharded_ref(shards: list[ObjectRef]) -> ObjectRef:
    """What a sharded group's announcement names as its object (DESIGN §3.1): shard 0's key, the
    shards' total size and :func:`~diloco_async.protocol.messages.shard_list_digest` of the list."""
    listed = [ShardObject(key=r.key, nbytes=r.nbytes, sha256=r.sha256) for r in shards]
    return ObjectRef(shards[0].key, sum(r.nbytes for r in shards), shard_list_digest(listed))


class Uploads:
    """Takes :class:`UploadJob` and :class:`InnerState` items off ``shared.upload_queue``."""

    def __init__(self, learner_id: str, incarnation: int, store: ObjectStore, shared: Shared) -> None:
        self.learner_id, self.incarnation = learner_id, incarnation
        self.store = store
        self.shared = shared
        self.codec = "bf16"
        self.storage_timeout_s = 60.0
        self.announce_timeout_s = 60.0  # learners.announce_timeout_s
        self.state_prefix: str | None = None  # where this slot's inner states go
        self.state_seq = 0  # the newest inner-state sequence number used
        self._uploading = 0  # contributions taken off the queue and not yet announced (0 or 1)
        self._announcing: set[asyncio.Task] = set()  # with shards: announcements retried beside the uploads
        #: error feedback: update id -> (the residual its upload left, the one before), until announced
        self._residuals: dict[str, tuple[dict, dict | None]] = {}
        #: the bytes of a contribution (job, safetensors metadata): :meth:`encode` in ``codec``; the
        #: seam a faulty transport wraps (:class:`~diloco_async.learner.faults.PoisonedPayloads`)
        self.encode_payload: Callable[[UploadJob, dict[str, str]], bytes] = self.encode
        #: run.schedule = "replay": announcements are not sent but kept for the next step boundary
        #: (:mod:`diloco_async.learner.replay`), with their jobs, in the order uploaded (a body of None: the
        #: upload failed, its outcome told already); None: announcements are sent
        self.replay_outbox: list[tuple[UploadJob, dict | None]] | None = None

    def configure(self, store: ObjectStore, codec: str, storage_timeout_s: float, announce_timeout_s: float = 60.0
                  ) -> None:
        self.store, self.codec, self.storage_timeout_s = store, codec, storage_timeout_s
        self.announce_timeout_s = announce_timeout_s

    def encode(self, job: UploadJob, meta: dict[str, str]) -> bytes:
        """``job``'s outer gradient as a wire payload in its codec (:meth:`codec_of`) with ``meta``
        (one the training thread encoded already is only serialized)."""
        if job.encoded is not None:  # encoded by the training thread (diloco_async/learner/training.py)
            return wire.encoded_to_bytes(job.encoded, self.codec_of(job), meta)
        return wire.encode_to_bytes(job.delta, self.codec_of(job), meta)

    def codec_of(self, job: UploadJob) -> str:
        """The codec of ``job``: its own (a link-bound learner's step-down), else ``learners.codec``."""
        return job.codec or self.codec

    async def run(self, client: SyncClient | ShardedSyncClient) -> None:
        """Until the stop: upload and announce contributions, save inner states."""
        try:
            while not self.shared.stop_event.is_set():
                try:
                    job = await asyncio.to_thread(self.shared.upload_queue.get, True, 0.2)
                except queue.Empty:
                    continue
                if isinstance(job, (InnerState, SpooledState)):
                    await self._save_inner_state(job)
                else:
                    self._uploading = 1
                    try:
                        await self._upload_and_announce(client, job)
                    finally:
                        self._uploading = 0
                del job  # not held (with its outer gradient) until the next item arrives
        finally:
            for task in list(self._announcing):  # with shards: announcements still being retried
                task.cancel()
            await asyncio.gather(*self._announcing, return_exceptions=True)

    def pending(self) -> int:
        """Items waiting in the upload queue plus the contributions being uploaded or announced (with
        shards, announcements run beside the uploads: each one being retried counts)."""
        return self.shared.upload_queue.qsize() + self._uploading + len(self._announcing)

    def _prune_inner_states(self, newest: int, keep: int = 1) -> None:
        """Delete this slot's inner states older than the ``keep`` newest (the newest is verified
        by being just written); a failure is logged and retried after the next save."""
        assert self.state_prefix is not None
        try:
            for key in self.store.list(self.state_prefix):
                rel = key[len(self.state_prefix):].strip("/").split("/", 1)[0]
                if rel.isdigit() and int(rel) <= newest - keep:
                    self.store.delete(key)
        except Exception as err:
            log.warning("%s could not prune old inner states (%s: %s)", self.learner_id, type(err).__name__, err)

    async def _save_inner_state(self, state: InnerState | SpooledState) -> None:
        self.state_seq += 1
        seq = self.state_seq
        manifest = {"inner": state.meta, "learner": self.learner_id, "incarnation": self.incarnation}
        try:
            if isinstance(state, SpooledState):
                write = asyncio.to_thread(write_state_file, self.store, self.state_prefix, seq, state.path, manifest)
            else:
                write = asyncio.to_thread(write_state, self.store, self.state_prefix, seq, state.tensors, manifest)
            await asyncio.wait_for(write, self.storage_timeout_s)
            log.info("%s saved its inner state as checkpoint %d (step %d)", self.learner_id, seq, state.meta["step"])
            await asyncio.to_thread(self._prune_inner_states, seq)
        except Exception as err:  # counted in the log; training goes on, the next period retries
            log.warning("%s could not save its inner state (%s: %s)", self.learner_id, type(err).__name__, err)
        finally:
            if isinstance(state, SpooledState):
                try:
                    os.unlink(state.path)
                except OSError:
                    pass
                self.shared.state_spooled.clear()

    async def _upload_and_announce(self, client: SyncClient | ShardedSyncClient, job: UploadJob) -> None:
        run_id = self.shared.join_response.run_id  # type: ignore[union-attr]
        key = keys.contribution_key(run_id, job.fragment, job.round_n, self.learner_id, job.update_id)
        meta = {"learner": self.learner_id, "fragment": str(job.fragment), "round": str(job.round_n),
                "base_version": str(job.base_version)}
        if job.shards is None:
            log.info("%s uploading fragment %d round %d (base v%d, %s) to %s", self.learner_id, job.fragment,
                     job.round_n, job.base_version, self.codec_of(job), key)
        try:  # one upload at a time (this loop); a sharded group's ranks put their shards already
            ref = sharded_ref(job.shards) if job.shards is not None else await self._encode_and_put(job, key, meta)
        except Exception as err:  # nothing was published under the key (a short one is deleted); nothing is announced
            log.warning("%s upload of fragment %d round %d failed (%s): %s", self.learner_id, job.fragment,
                        job.round_n, getattr(err, "reason", type(err).__name__), err)
            self.shared.outcomes.put((job.fragment, job.round_n, "failed"))
            if self.replay_outbox is not None:  # the boundary waiting for this upload counts it done
                self.replay_outbox.append((job, None))
            return
        with self.shared.lock:
            self.shared.stats.bytes_up += ref.nbytes
        body = {"learner_id": self.learner_id, "fragment": job.fragment, "round_n": job.round_n,
                "base_version": job.base_version, "c_steps": job.c_steps, "c_tokens": job.c_tokens,
                "compute_s": job.compute_s, "key": ref.key, "nbytes": ref.nbytes, "sha256": ref.sha256,
                "codec": self.codec_of(job), "update_id": job.update_id}
        if job.shards is not None:
            body["shards"] = [r.to_json() for r in job.shards]
        if job.slices:
            body["slices"] = job.slices
        if self.replay_outbox is not None:  # announced with the next step boundary
            self.replay_outbox.append((job, body))
            return
        if len(getattr(client, "clients", ())) > 1:  # shards: one that is down must not hold the others' announcements
            task = asyncio.create_task(self._announce_and_report(client, job, body))
            self._announcing.add(task)
            task.add_done_callback(self._announcing.discard)
            return
        await self._announce_and_report(client, job, body)

    def replay_done(self) -> int:
        """Replay: contributions uploaded (or failed) since the outbox was last taken."""
        return len(self.replay_outbox or ())

    def take_replay_outbox(self) -> list[tuple[UploadJob, dict | None]]:
        """The contributions uploaded (or failed) and not announced yet (replay), in upload order; emptied."""
        taken = self.replay_outbox or []
        if self.replay_outbox is not None:
            self.replay_outbox = []
        return taken

    def settle_replayed(self, announced: list[tuple[UploadJob, dict | None]], acks: list[AnnouncementAck]) -> None:
        """A replayed boundary's answers to the contributions it carried (in order): as :meth:`_announce_and_report`
        does with one ack (a missing ack: ``failed``)."""
        for i, (job, _body) in enumerate(announced):
            ack = acks[i] if i < len(acks) else None
            status = ack.status if ack is not None else "failed"
            level = logging.INFO if status in ("accepted", "duplicate") else logging.WARNING
            log.log(level, "%s fragment %d round %d: %s (%s; replay)", self.learner_id, job.fragment, job.round_n,
                    status, ack.reason if ack is not None else "no answer")
            self._report(job, status, ack.round_n if ack is not None else None)

    async def _announce_and_report(self, client: SyncClient | ShardedSyncClient, job: UploadJob, body: dict) -> None:
        ack = await self._announce(client, job, body)
        self._report(job, ack.status if ack is not None else "failed", ack.round_n if ack is not None else None)

    def _report(self, job: UploadJob, status: str, joined_round: int | None = None) -> None:
        """What became of ``job``'s announcement: its error-feedback residual kept or not, the training
        thread told. ``joined_round``: the round it was admitted into when its own had closed (DESIGN §3.5),
        told as a second outcome ``(fragment, joined_round, "folded")``."""
        settle = self._residuals.pop(job.update_id, None)
        if settle is not None and self.shared.feedback is not None:  # error feedback: kept only if taken
            self.shared.feedback.settle(job.fragment, *settle, status)
        self.shared.outcomes.put((job.fragment, job.round_n, status))
        if status in ("accepted", "duplicate") and joined_round is not None and joined_round != job.round_n:
            self.shared.outcomes.put((job.fragment, joined_round, "folded"))

    async def _encode_and_put(self, job: UploadJob, key: str, meta: dict[str, str]) -> ObjectRef:
        """Encode ``job``'s outer gradient, free it, and put the bytes under ``key``; returns the ref."""
        if job.delta_ready is not None:  # the copy of Δ from the GPU (training did not wait for it)
            await asyncio.to_thread(job.delta_ready.synchronize)
            job.delta_ready = None
        residual = None
        feedback = self.shared.feedback
        if feedback is not None and job.encoded is None:  # Δ plus the fragment's residual (codec/feedback.py)
            job.encoded, residual = await asyncio.to_thread(feedback.encode, job.fragment, job.delta,
                                                            self.codec_of(job))
        data = await asyncio.to_thread(self.encode_payload, job, meta)
        job.delta, job.encoded = {}, None  # the outer gradient is freed before the upload and the announce
        t0 = time.monotonic()
        ref = await asyncio.wait_for(asyncio.to_thread(self.store.put, key, data), self.storage_timeout_s)
        del data
        if feedback is not None and residual is not None:  # the upload was made: its residual is current
            self._residuals[job.update_id] = (residual, feedback.put_made(job.fragment, residual))
        self.shared.large_frees.set()  # the outer gradient and its bytes
        self.shared.link.record("up", job.fragment, ref.nbytes, time.monotonic() - t0)
        return ref

    async def _announce(self, client: SyncClient | ShardedSyncClient, job: UploadJob,
                        body: dict) -> AnnouncementAck | None:
        """Announce until acknowledged (same update id every time), stopped, or
        ``announce_timeout_s`` passed; returns the ack, or None (``failed``): then the
        contribution is counted undeliverable (``shared.undeliverable``, reported in heartbeats to
        every synchronizer shard; DESIGN §2.2), never dropped silently."""
        backoff = synchronizer_backoff()
        deadline = time.monotonic() + self.announce_timeout_s
        while not self.shared.stop_event.is_set() and time.monotonic() < deadline:
            try:
                ack = AnnouncementAck.model_validate(await client.announce(body))
            except (TimeoutError, aiohttp.ClientError, OSError) as err:
                log.warning("%s announce failed (%s); retrying with the same update id", self.learner_id, err)
                await asyncio.sleep(backoff.next_pause_s())
                continue
            level = logging.INFO if ack.status in ("accepted", "duplicate") else logging.WARNING
            log.log(level, "%s fragment %d round %d: %s (%s)", self.learner_id, job.fragment, job.round_n,
                    ack.status, ack.reason)
            return ack
        self.shared.undeliverable[str(job.fragment)] += 1
        log.warning("%s fragment %d round %d: announcement not acknowledged within %.0f s (its synchronizer "
                    "unreachable): counted undeliverable, %d of fragment %d so far", self.learner_id, job.fragment,
                    job.round_n, self.announce_timeout_s, self.shared.undeliverable[str(job.fragment)], job.fragment)
        return None
