"""Verified reads of one object, for :class:`~storage.store.ObjectStore` (DESIGN §5).

A small object is read in one request and checked against its :class:`~storage.refs.ObjectRef`.
A large one streams in chunks of ``part_nbytes``, the next chunk prefetched while the last one
is hashed; each chunk read is bounded by the policy's ``timeout_s`` and, after a transient error,
the stream reopens where it stopped. Nothing unverified reaches a caller's file.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import logging
import os
import time
import uuid
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from storage import backends
from storage.credentials import is_expired_credentials
from storage.refs import IntegrityError, ObjectRef, check_ref, sha256_hex
from storage.retry import Backoff, is_transient

if TYPE_CHECKING:
    from storage.store import ObjectStore

__all__ = ["read_object", "read_to_file", "read_verified", "stream_range"]

log = logging.getLogger("diloco.storage")


def read_object(store: ObjectStore, ref: ObjectRef) -> bytes:
    """The bytes ``ref`` names, verified (see :meth:`ObjectStore.get`)."""
    if ref.nbytes <= store.part_nbytes:
        data = store.get_unverified(ref.key)
        check_ref(ref, len(data), sha256_hex(data))
        return data
    chunks: list[bytes] = []
    read_verified(store, ref, chunks.append)
    return b"".join(chunks)


def read_to_file(store: ObjectStore, ref: ObjectRef, local_path: str | os.PathLike) -> None:
    """Stream ``ref`` into a temporary file next to ``local_path``; rename it over
    ``local_path`` once verified, delete it otherwise (see :meth:`ObjectStore.get_to_file`)."""
    local_path = os.fspath(local_path)
    folder = os.path.dirname(os.path.abspath(local_path))
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f"{backends.TEMP_PREFIX}{uuid.uuid4().hex}")
    try:
        with open(tmp, "wb") as fh:
            read_verified(store, ref, fh.write)
        os.replace(tmp, local_path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def read_verified(store: ObjectStore, ref: ObjectRef, sink: Callable[[bytes], Any]) -> None:
    """Hand every chunk of ``ref`` to ``sink``, hashing on the way; raise at the end if what
    went through is not what ``ref`` names (a size mismatch is caught before any chunk).

    Raises:
        FileNotFoundError: no object under ``ref.key``.
        IntegrityError: its size or sha256 differs from ``ref``.
    """
    path, where = store._path(ref.key), store._where(ref.key)
    size = store._call(f"size {where}", store._backend.size, path)
    if size != ref.nbytes:
        raise IntegrityError(f"{ref.key}: size {size} bytes, expected {ref.nbytes}", reason="size_mismatch")
    hasher = hashlib.sha256()
    nbytes = 0
    for chunk in stream_range(store, path, where, ref.nbytes):
        hasher.update(chunk)  # while the next chunk is on its way
        sink(chunk)
        nbytes += len(chunk)
    check_ref(ref, nbytes, hasher.hexdigest())


def stream_range(store: ObjectStore, path: str, where: str, nbytes: int) -> Iterator[bytes]:
    """Chunks of ``[0, nbytes)`` of one object, the next one prefetched. Each chunk read is
    bounded by ``timeout_s``; after a transient error the stream reopens where it stopped
    (``retries`` times in a row at most, with the policy's backoff between)."""
    policy = store.policy
    pos, failures, backoff = 0, 0, Backoff(policy)
    while pos < nbytes:
        reader = None
        try:
            stream = store._call(f"open {where} at {pos}", store._backend.open_stream, path, pos, nbytes,
                                 retry=False)  # retried by this loop
            reader = Prefetch(stream, store.part_nbytes)
            while pos < nbytes:
                chunk = reader.next(policy.timeout_s, f"read {where} at {pos}")
                if not chunk:
                    raise IntegrityError(f"{where}: size {pos} bytes, expected {nbytes} (ended early)",
                                         reason="size_mismatch")
                pos += len(chunk)
                failures = 0
                backoff.reset()
                yield chunk
        except Exception as err:
            if isinstance(err, TimeoutError):
                store._count("timeouts")
            if not (is_transient(err) or is_expired_credentials(err)) or failures >= policy.retries:
                raise
            failures += 1
            store._count("retries")
            log.warning("read %s: %s: %s at byte %d, reopening (retry %d of %d)",
                        where, type(err).__name__, err, pos, failures, policy.retries)
            time.sleep(backoff.next_pause_s())
        finally:
            if reader is not None:
                reader.close()


class Prefetch:
    """Reads the next chunk of a stream in a worker thread while the caller uses the last one."""

    def __init__(self, stream: backends.Stream, chunk_nbytes: int) -> None:
        self.stream, self.chunk_nbytes = stream, chunk_nbytes
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="storage-stream")
        self.future: concurrent.futures.Future | None = self.pool.submit(stream.read, chunk_nbytes)

    def next(self, timeout_s: float | None, what: str) -> bytes:
        """The next chunk (``b""`` at the end); ``TimeoutError`` if it takes over ``timeout_s``."""
        assert self.future is not None
        try:
            chunk = self.future.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"{what}: no answer within {timeout_s:.3g} s") from None
        self.future = self.pool.submit(self.stream.read, self.chunk_nbytes) if chunk else None
        return chunk

    def close(self) -> None:
        """Close the stream once no read is running on it (a hung read keeps it until it ends)."""
        future, self.future = self.future, None
        self.pool.shutdown(wait=False, cancel_futures=True)
        if future is None or future.cancel() or future.done():
            _close_quietly(self.stream)
        else:
            future.add_done_callback(lambda _: _close_quietly(self.stream))


def _close_quietly(stream: backends.Stream) -> None:
    try:
        stream.close()
    except Exception as err:  # the stream is dropped either way
        log.debug("closing a read stream: %s: %s", type(err).__name__, err)
