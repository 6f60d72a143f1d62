"""Verified reads of one object, for :class:`~diloco_async.storage.store.ObjectStore` (DESIGN §5); each
function takes the store as a :class:`~diloco_async.storage.access.StoreAccess`.

A small object is read in one request and checked against its :class:`~diloco_async.storage.refs.ObjectRef`.
A large one streams in chunks of ``part_nbytes`` (from a local file: of at most
:data:`INTO_CHUNK_NBYTES`), the next chunk prefetched while the last one
is hashed; each chunk read is bounded by the policy's ``timeout_s`` and, after a transient error,
the stream reopens where it stopped. Nothing unverified reaches a caller's file.

Where the backend reads into a caller's buffer (local files, ``reads_into``), :func:`read_object`
reads a large object straight into the ``bytes`` it returns, in chunks of at most
:data:`INTO_CHUNK_NBYTES`, hashing each chunk while the next one is read: one pass over memory
for the data and one for the hash, at the same time, and no copy to join chunks (issue 17). The
hash is of exactly the bytes returned.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import hashlib
import logging
import mmap
import os
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from diloco_async.storage import backends
from diloco_async.storage.access import StoreAccess
from diloco_async.storage.credentials import is_expired_credentials
from diloco_async.storage.digest import PIECE_NBYTES, PieceHasher, object_digest
from diloco_async.storage.refs import IntegrityError, ObjectRef, check_ref
from diloco_async.storage.retry import is_transient

__all__ = ["read_object", "read_unverified", "read_to_file", "read_verified", "stream_range", "INTO_CHUNK_NBYTES"]

log = logging.getLogger("diloco.storage")

#: largest chunk read into the result at once (smaller chunks overlap hashing and reading better)
INTO_CHUNK_NBYTES = 4 << 20


def read_object(access: StoreAccess, ref: ObjectRef) -> bytes:
    """The bytes ``ref`` names, verified (see :meth:`ObjectStore.get`)."""
    into = access.backend.reads_into
    if ref.nbytes <= access.part_nbytes and not (into and ref.nbytes > INTO_CHUNK_NBYTES):
        data = read_unverified(access, ref.key)
        _check(access, ref, len(data), object_digest(data))
        return data
    if into:
        return _read_into_bytes(access, ref)
    chunks: list[bytes] = []
    read_verified(access, ref, chunks.append)
    return b"".join(chunks)


def read_unverified(access: StoreAccess, key: str) -> bytes:
    """The bytes under ``key`` in one request, unchecked (see :meth:`ObjectStore.get_unverified`)."""
    return access.call(f"read {access.where(key)}", access.backend.read, access.path(key), None, None)


def _read_into_bytes(access: StoreAccess, ref: ObjectRef) -> bytes:
    """:func:`read_object` on a backend that ``reads_into``: chunks land in the result, each one
    hashed while the next is read; the size is checked before anything is allocated."""
    path, where = access.path(ref.key), access.where(ref.key)
    size = access.call(f"size {where}", access.backend.size, path)
    if size != ref.nbytes:
        raise IntegrityError(f"{ref.key}: size {size} bytes, expected {ref.nbytes}", reason="size_mismatch")
    target = _Target(ref.nbytes)
    hasher = PieceHasher()
    chunk_nbytes = min(access.part_nbytes, INTO_CHUNK_NBYTES)
    pos, failures, backoff = 0, 0, access.policy.backoff()
    while pos < ref.nbytes:
        reader = None
        try:
            stream = access.call(f"open {where} at {pos}", access.backend.open_stream, path, pos, ref.nbytes,
                                 retry=False)  # retried by this loop
            reader = PrefetchInto(stream, target, pos, ref.nbytes, chunk_nbytes)
            while pos < ref.nbytes:
                n = reader.next(access.policy.timeout_s, f"read {where} at {pos}")
                if not n:
                    raise IntegrityError(f"{where}: size {pos} bytes, expected {ref.nbytes} (ended early)",
                                         reason="size_mismatch")
                hasher.update(target.view[pos : pos + n])  # while the next chunk is read
                pos += n
                failures = 0
                backoff.reset()
        except Exception as err:
            if isinstance(err, TimeoutError):
                access.count("timeouts")
            if not (is_transient(err) or is_expired_credentials(err)) or failures >= access.policy.retries:
                raise
            failures += 1
            access.count("retries")
            log.warning("read %s: %s: %s at byte %d, reopening (retry %d of %d)",
                        where, type(err).__name__, err, pos, failures, access.policy.retries)
            time.sleep(backoff.next_pause_s())
        finally:
            if reader is not None and reader.close():
                target = target.moved(pos)  # a hung read may still land in the old buffer: leave it to it
    _check(access, ref, pos, hasher.hexdigest())
    return target.take()


def _bytes_api() -> tuple[Callable[..., Any], Callable[..., Any]] | None:
    """CPython's ``PyBytes_FromStringAndSize(NULL, n)`` and ``PyBytes_AsString``, or None."""
    try:
        new, address = ctypes.pythonapi.PyBytes_FromStringAndSize, ctypes.pythonapi.PyBytes_AsString
    except (AttributeError, OSError):
        return None
    new.restype, new.argtypes = ctypes.py_object, (ctypes.c_void_p, ctypes.c_ssize_t)
    address.restype, address.argtypes = ctypes.c_void_p, (ctypes.py_object,)
    return new, address


_BYTES_API = _bytes_api()


def _madvise() -> Callable[[int, int, int], int] | None:
    """libc's ``madvise(addr, length, advice)``, or None where there is none (not Linux)."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (AttributeError, OSError):
        return None
    fn.restype, fn.argtypes = ctypes.c_int, (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return fn


_MADVISE = _madvise()

#: buffers at least this large are advised to take transparent huge pages
HUGE_PAGES_FROM_NBYTES = 4 << 20


def _advise_huge_pages(address: int, nbytes: int) -> None:
    """Ask the kernel to back ``[address, address + nbytes)`` (the whole pages inside) with
    transparent huge pages when it is first written. Filling a fresh 64 MiB buffer from the page
    cache took 28.7 ms in 4 KiB pages (16,384 page faults) and 16.2 ms in 2 MiB ones on the
    reference machine (``transparent_hugepage`` in ``madvise`` mode, the usual default). A hint:
    where huge pages are off or the call fails, nothing changes."""
    if _MADVISE is None or nbytes < HUGE_PAGES_FROM_NBYTES:
        return
    page = mmap.PAGESIZE
    start, end = (address + page - 1) // page * page, (address + nbytes) // page * page
    if end > start:
        _MADVISE(start, end - start, mmap.MADV_HUGEPAGE)


class _Target:
    """The ``bytes`` object a read fills, and a writable view of it until :meth:`take`.

    CPython's C API documents this way of building ``bytes``: ``PyBytes_FromStringAndSize(NULL,
    n)`` makes an object of ``n`` uninitialized bytes that may be written through
    ``PyBytes_AsString`` until it is handed out. The object is fresh and referenced only here, so
    nothing sees it change. The view keeps the object alive (a read left hanging in a worker can
    never write into freed memory). Without that API (another interpreter) a ``bytearray`` is
    filled and copied once at the end."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        if _BYTES_API is not None and nbytes > 0:
            new, address = _BYTES_API
            self.data = new(None, nbytes)
            _advise_huge_pages(address(self.data), nbytes)  # before any byte is written
            window = (ctypes.c_char * nbytes).from_address(address(self.data))
            window.owner = self.data  # the view below keeps the window, the window keeps the bytes
            self.view = memoryview(window).cast("B")
        else:
            self.data = bytearray(nbytes)
            self.view = memoryview(self.data)

    def moved(self, nbytes: int) -> _Target:
        """A fresh target holding the first ``nbytes`` of this one."""
        other = _Target(self.nbytes)
        other.view[:nbytes] = self.view[:nbytes]
        return other

    def take(self) -> bytes:
        data = self.data
        self.view.release()
        del self.view, self.data
        return data if isinstance(data, bytes) else bytes(data)


def read_to_file(access: StoreAccess, ref: ObjectRef, local_path: str | os.PathLike) -> None:
    """Stream ``ref`` into a temporary file next to ``local_path``; rename it over
    ``local_path`` once verified, delete it otherwise (see :meth:`ObjectStore.get_to_file`)."""
    local_path = os.fspath(local_path)
    folder = os.path.dirname(os.path.abspath(local_path))
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f"{backends.TEMP_PREFIX}{uuid.uuid4().hex}")
    try:
        with open(tmp, "wb") as fh:
            read_verified(access, ref, fh.write)
        os.replace(tmp, local_path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def read_verified(access: StoreAccess, ref: ObjectRef, sink: Callable[[bytes], Any]) -> None:
    """Hand every chunk of ``ref`` to ``sink``, hashing on the way; raise at the end if what
    went through is not what ``ref`` names (a size mismatch is caught before any chunk).

    Raises:
        FileNotFoundError: no object under ``ref.key``.
        IntegrityError: its size or sha256 differs from ``ref``.
    """
    path, where = access.path(ref.key), access.where(ref.key)
    size = access.call(f"size {where}", access.backend.size, path)
    if size != ref.nbytes:
        raise IntegrityError(f"{ref.key}: size {size} bytes, expected {ref.nbytes}", reason="size_mismatch")
    hasher = PieceHasher()
    nbytes = 0
    for chunk in stream_range(access, path, where, ref.nbytes):
        hasher.update(chunk)  # while the next chunk is on its way
        sink(chunk)
        nbytes += len(chunk)
    _check(access, ref, nbytes, hasher.hexdigest())


def _check(access: StoreAccess, ref: ObjectRef, nbytes: int, digest: str) -> None:
    """:func:`~diloco_async.storage.refs.check_ref`, accepting an object over
    :data:`~diloco_async.storage.digest.PIECE_NBYTES`
    written before piece digests (its ref carries the whole-object sha256) once
    :func:`_is_legacy_object` has checked that the bytes read are that object's."""
    try:
        check_ref(ref, nbytes, digest)
    except IntegrityError as err:
        if err.reason != "digest" or ref.nbytes <= PIECE_NBYTES or not _is_legacy_object(access, ref, digest):
            raise


def _is_legacy_object(access: StoreAccess, ref: ObjectRef, seen: str) -> bool:
    """Whether ``ref`` names, by its whole-object sha256, the same bytes whose piece digest a read
    just computed as ``seen``. The object is read again and both digests are computed on that
    pass: the piece digest ties the second read to the bytes the caller already has, the whole
    sha256 ties them to ``ref``. Only a mismatch pays this (an older object or a corrupt one)."""
    where = access.where(ref.key)
    pieces, whole = PieceHasher(), hashlib.sha256()
    try:
        for chunk in stream_range(access, access.path(ref.key), where, ref.nbytes):
            pieces.update(chunk)
            whole.update(chunk)
    except Exception as err:  # the first read's IntegrityError is what the caller gets
        log.warning("read %s: re-reading for a whole-object sha256 failed (%s: %s)", where, type(err).__name__, err)
        return False
    if pieces.hexdigest() != seen or whole.hexdigest() != ref.sha256:
        return False
    access.count("legacy_digests")
    log.info("read %s: accepted by its whole-object sha256 (written before piece digests)", where)
    return True


def stream_range(access: StoreAccess, path: str, where: str, nbytes: int) -> Iterator[bytes]:
    """Chunks of ``[0, nbytes)`` of one object, the next one prefetched. Each chunk read is
    bounded by ``timeout_s``; after a transient error the stream reopens where it stopped
    (``retries`` times in a row at most, with the policy's backoff between)."""
    policy = access.policy
    pos, failures, backoff = 0, 0, policy.backoff()
    while pos < nbytes:
        reader = None
        try:
            stream = access.call(f"open {where} at {pos}", access.backend.open_stream, path, pos, nbytes,
                                 retry=False)  # retried by this loop
            reader = Prefetch(stream, _chunk_nbytes(access))
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
                access.count("timeouts")
            if not (is_transient(err) or is_expired_credentials(err)) or failures >= policy.retries:
                raise
            failures += 1
            access.count("retries")
            log.warning("read %s: %s: %s at byte %d, reopening (retry %d of %d)",
                        where, type(err).__name__, err, pos, failures, policy.retries)
            time.sleep(backoff.next_pause_s())
        finally:
            if reader is not None:
                reader.close()


def _chunk_nbytes(access: StoreAccess) -> int:
    """Bytes per chunk of a streamed read: ``part_nbytes`` (fewer requests on S3 and GCS), at
    most :data:`INTO_CHUNK_NBYTES` from a local file, where a read costs no request and two
    chunks in memory (the one in use, the one prefetched) are all it holds."""
    return min(access.part_nbytes, INTO_CHUNK_NBYTES) if access.backend.reads_into else access.part_nbytes


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


class PrefetchInto:
    """Reads ``[pos, end)`` of a stream into ``target`` chunk by chunk, the next chunk in a worker
    thread while the caller hashes the last one."""

    def __init__(self, stream: backends.IntoStream, target: _Target, pos: int, end: int, chunk_nbytes: int) -> None:
        self.stream, self.target, self.end, self.chunk_nbytes = stream, target, end, chunk_nbytes
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="storage-stream")
        self.future: concurrent.futures.Future | None = self._submit(pos)

    def _submit(self, pos: int) -> concurrent.futures.Future | None:
        self.pos = pos  # where the pending chunk starts
        if pos >= self.end:
            return None
        return self.pool.submit(self.stream.readinto, self.target.view[pos : min(pos + self.chunk_nbytes, self.end)])

    def next(self, timeout_s: float | None, what: str) -> int:
        """Bytes read by the pending chunk (0 at the end); ``TimeoutError`` past ``timeout_s``."""
        if self.future is None:
            return 0
        try:
            n = self.future.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"{what}: no answer within {timeout_s:.3g} s") from None
        self.future = self._submit(self.pos + n) if n else None
        return n

    def close(self) -> bool:
        """Close the stream once no read runs on it; True if a read is still running (hung)."""
        future, self.future = self.future, None
        self.pool.shutdown(wait=False, cancel_futures=True)
        if future is None or future.cancel() or future.done():
            _close_quietly(self.stream)
            return False
        future.add_done_callback(lambda _: _close_quietly(self.stream))
        return True


def _close_quietly(stream: backends.Stream) -> None:
    try:
        stream.close()
    except Exception as err:  # the stream is dropped either way
        log.debug("closing a read stream: %s: %s", type(err).__name__, err)
