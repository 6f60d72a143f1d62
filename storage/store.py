"""The object store: a narrow interface over fsspec, chosen by URL (DESIGN §5).

* ``put`` writes an immutable object with exclusive create: an existing key is never
  overwritten (``FileExistsError``). Local files go to a unique temporary name and are published
  with ``os.link`` (atomic, fails if the key exists); S3 uses ``If-None-Match: *`` on the PUT or
  on the multipart completion; GCS uses ``ifGenerationMatch=0``; ``memory://`` checks under a lock.
* Large objects stream in parts of ``part_nbytes`` (S3 multipart upload, GCS resumable upload,
  local temp file): memory stays at a few parts, and an error in the middle aborts the upload so
  nothing appears under the final key (bug case C11). Large reads stream too, hashed on the way
  while the next chunk is read; a read that fails resumes where it stopped.
* ``get`` takes an :class:`ObjectRef` (key, size, sha256) and verifies size and digest of what it
  read; a mismatch raises :class:`IntegrityError`. Readers trust only what an announcement or a
  manifest names, and read exact keys, never a listing.
* Every backend call runs under a per-call timeout (a hung call raises ``TimeoutError``, case
  C08) and transient errors are retried with exponential backoff within an overall deadline.
  ``FileExistsError``, ``FileNotFoundError`` and ``IntegrityError`` are never retried.
* Every call is synchronous; async callers use ``asyncio.to_thread``.
"""

from __future__ import annotations

import collections
import concurrent.futures
import copy
import errno
import hashlib
import json
import logging
import os
import random
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import fsspec

from storage import backends

__all__ = ["ObjectRef", "ObjectStore", "ObjectWriter", "IntegrityError", "sha256_hex", "is_transient"]

log = logging.getLogger("diloco.storage")

MiB = 1 << 20


class IntegrityError(ValueError):
    """An object's size or sha256 does not match the reference that named it."""


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class ObjectRef:
    """What a reader needs to fetch and verify one immutable object.

    Attributes:
        key: path relative to the store root, ``/``-separated.
        nbytes: exact size in bytes.
        sha256: hex digest of the bytes.
    """

    key: str
    nbytes: int
    sha256: str

    def to_json(self) -> dict:
        return {"key": self.key, "nbytes": self.nbytes, "sha256": self.sha256}

    @classmethod
    def from_json(cls, d: dict) -> "ObjectRef":
        return cls(key=str(d["key"]), nbytes=int(d["nbytes"]), sha256=str(d["sha256"]))


# -- which errors are worth another try --------------------------------------------------------

_PERMANENT_ERRNOS = {errno.EINVAL, errno.ENOSYS, errno.EPERM, errno.EACCES, errno.ENOSPC, errno.EROFS,
                     errno.EEXIST, errno.ENOENT, errno.EISDIR, errno.ENOTDIR, errno.ENAMETOOLONG,
                     getattr(errno, "EREMCHG", errno.ENOENT)}
_RETRYABLE_HTTP = {408, 429, 500, 502, 503, 504}


def is_transient(err: BaseException) -> bool:
    """True for errors that another attempt may cure: timeouts, dropped connections, 5xx/429.

    Never transient: a key that exists or is missing, a digest mismatch, a permission or
    argument error.
    """
    if isinstance(err, (IntegrityError, FileExistsError, FileNotFoundError, PermissionError,
                        IsADirectoryError, NotADirectoryError)):
        return False
    if isinstance(err, (TimeoutError, ConnectionError)):
        return True
    if isinstance(err, OSError):
        return err.errno not in _PERMANENT_ERRNOS
    code = getattr(err, "code", None)  # gcsfs HttpError
    if type(err).__name__ == "HttpError" and isinstance(code, int):
        return code in _RETRYABLE_HTTP
    module = type(err).__module__ or ""
    if module.startswith("aiohttp"):  # ClientConnectionError, ClientPayloadError, ...
        return type(err).__name__ not in ("InvalidURL", "ClientResponseError", "ContentTypeError")
    if module.startswith("botocore"):  # EndpointConnectionError, ReadTimeoutError, ...
        return "Connection" in type(err).__name__ or "Timeout" in type(err).__name__
    return False


def _run_with_timeout(fn: Callable[..., Any], args: tuple, timeout_s: float | None, what: str) -> Any:
    """Run ``fn(*args)`` in a daemon thread and wait at most ``timeout_s``.

    A call that does not return in time raises ``TimeoutError`` here; its thread is left to
    finish or fail on its own (a blocked socket cannot be interrupted from outside).
    """
    if timeout_s is None:
        return fn(*args)
    future: concurrent.futures.Future = concurrent.futures.Future()

    def target() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn(*args))
        except BaseException as err:  # noqa: BLE001 - handed to the caller
            future.set_exception(err)

    threading.Thread(target=target, name=f"storage-call {what[:60]}", daemon=True).start()
    try:
        return future.result(timeout=timeout_s)
    except concurrent.futures.TimeoutError:
        raise TimeoutError(f"{what}: no answer within {timeout_s:.3g} s") from None


class ObjectStore:
    """Objects under one root URL (``file://``, ``memory://``, ``s3://``, ``gs://``).

    Args:
        url: root URL; a plain path is taken as ``file://``. Relative local paths are made
            absolute, so child processes see the same folder.
        storage_options: passed to fsspec (endpoints, credentials). Never logged; credentials
            may equally come from the environment (``AWS_*``, ``GOOGLE_APPLICATION_CREDENTIALS``).
        timeout_s: bound on one backend call (one request or one part); a call that takes
            longer raises ``TimeoutError`` (and is retried).
        retries: further attempts after a transient error or a timeout.
        backoff_s: wait before the first retry; doubles each time, up to ``max_backoff_s``,
            with jitter.
        deadline_s: bound on one call including all its retries.
        part_nbytes: size of one upload part and of one chunk read. Objects larger than this
            stream in parts. A multiple of 256 KiB, and at least 5 MiB on S3.
        max_concurrency: parts in flight at once per upload (S3, local files). Reads stream
            with the next chunk prefetched.

    Raises:
        ValueError: an unknown protocol or an invalid setting.
    """

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None, *,
                 timeout_s: float = 60.0, retries: int = 3, backoff_s: float = 0.5,
                 max_backoff_s: float = 8.0, deadline_s: float = 300.0,
                 part_nbytes: int = 16 * MiB, max_concurrency: int = 4) -> None:
        protocol, path = fsspec.core.split_protocol(url)
        protocol = {None: "file", "local": "file", "gcs": "gs", "s3a": "s3"}.get(protocol, protocol)
        if protocol not in backends.PROTOCOLS:
            raise ValueError(f"unsupported store URL {url!r}: protocol {protocol!r} not in {sorted(backends.PROTOCOLS)}")
        if protocol == "file":
            path = os.path.abspath(path)
        if timeout_s is not None and timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0 or None, got {timeout_s}")
        if retries < 0 or backoff_s < 0 or deadline_s <= 0:
            raise ValueError(f"invalid retry policy: retries={retries}, backoff_s={backoff_s}, deadline_s={deadline_s}")
        if part_nbytes < backends.PART_QUANTUM or part_nbytes % backends.PART_QUANTUM:
            raise ValueError(f"part_nbytes must be a positive multiple of 256 KiB, got {part_nbytes}")
        if protocol == "s3" and part_nbytes < 5 * MiB:
            raise ValueError(f"part_nbytes must be at least 5 MiB on S3, got {part_nbytes}")
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        self.protocol = protocol
        self.root = path.rstrip("/") if path not in ("/", "") else path
        self.url = f"{protocol}://{self.root}"
        self.storage_options = dict(storage_options or {})
        self.timeout_s, self.retries, self.deadline_s = timeout_s, retries, deadline_s
        self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
        self.part_nbytes, self.max_concurrency = part_nbytes, max_concurrency
        self._backend: backends.Backend = backends.make_backend(protocol, self.storage_options)
        #: retries, timeouts, aborted uploads ... of this store and its children
        self.counters: collections.Counter[str] = collections.Counter()
        self._counters_lock = threading.Lock()

    def __repr__(self) -> str:  # never the storage options: they may hold credentials
        return f"{type(self).__name__}({self.url!r})"

    @property
    def fs(self) -> fsspec.AbstractFileSystem:
        """The fsspec filesystem underneath (for tools and tests; product code uses the methods)."""
        return self._backend.fs

    def child(self, prefix: str) -> "ObjectStore":
        """A store rooted at ``{root}/{prefix}`` sharing options, policy, backend and counters."""
        other = copy.copy(self)
        other.root = self._path(prefix)
        other.url = f"{self.protocol}://{other.root}"
        return other

    def _path(self, key: str) -> str:
        key = key.strip("/")
        if not key or ".." in key.split("/") or key.rsplit("/", 1)[-1].startswith(backends.TEMP_PREFIX):
            raise ValueError(f"invalid object key {key!r}")
        return f"{self.root}/{key}"

    def _where(self, key: str) -> str:
        return f"{self.url}/{key.strip('/')}"

    def _count(self, name: str, n: int = 1) -> None:
        with self._counters_lock:
            self.counters[name] += n

    # -- resilience ---------------------------------------------------------------------------

    def _call(self, what: str, fn: Callable[..., Any], *args: Any, retry: bool = True) -> Any:
        """One backend call under the timeout, retried on transient errors (see module doc)."""
        deadline = time.monotonic() + self.deadline_s
        delay = self.backoff_s
        attempt = 0
        while True:
            attempt += 1
            remaining = deadline - time.monotonic()
            timeout = None if self.timeout_s is None else max(min(self.timeout_s, remaining), 1e-3)
            try:
                return _run_with_timeout(fn, args, timeout, what)
            except Exception as err:
                if isinstance(err, TimeoutError):
                    self._count("timeouts")
                if not retry or attempt > self.retries or not is_transient(err):
                    raise
                pause = delay * random.uniform(0.5, 1.0)
                if time.monotonic() + pause >= deadline:
                    raise
                self._count("retries")
                log.warning("%s: %s: %s (attempt %d of %d), retrying in %.2f s",
                            what, type(err).__name__, err, attempt, self.retries + 1, pause)
                time.sleep(pause)
                delay = min(delay * 2, self.max_backoff_s)

    # -- writes -------------------------------------------------------------------------------

    def put(self, key: str, data: bytes) -> ObjectRef:
        """Write ``data`` under ``key`` once. Objects over ``part_nbytes`` go to S3/GCS in parts.

        Raises:
            FileExistsError: the key already exists (it is left untouched).
            TimeoutError, OSError: the store did not take it within the retry policy (nothing
                is published).
        """
        view = memoryview(data).cast("B")
        if len(view) <= self.part_nbytes or not self._backend.multipart:
            path = self._path(key)
            payload = data if isinstance(data, bytes) else bytes(view)
            hasher = _Hasher(payload)  # hashes in parallel with the upload
            ref = lambda: hasher.ref_for(key, len(payload))  # noqa: E731
            self._put_single(key, path, payload, ref)
            return ref()
        return self._upload(key, lambda: iter([view]))

    def put_json(self, key: str, obj: Any) -> ObjectRef:
        return self.put(key, json.dumps(obj, sort_keys=True, indent=1).encode())

    def put_from_file(self, key: str, local_path: str | os.PathLike) -> ObjectRef:
        """Stream a local file to ``key`` (exclusive create), hashing on the way.

        Memory stays at ``max_concurrency + 1`` parts whatever the file size.

        Raises:
            FileExistsError: the key already exists.
            FileNotFoundError: no file at ``local_path``.
        """
        def chunks() -> Iterator[bytes]:
            with open(local_path, "rb") as fh:
                while chunk := fh.read(self.part_nbytes):
                    yield chunk

        os.stat(local_path)  # FileNotFoundError before anything is started
        return self._upload(key, chunks)

    def open_writer(self, key: str) -> "ObjectWriter":
        """A writer that streams one object to ``key``; use it as a context manager.

        The object is published when the block exits normally and never when it raises: the
        upload is aborted and the key stays absent (C11). ``writer.ref`` names what was written.
        """
        return ObjectWriter(self, key)

    def _upload(self, key: str, chunks: Callable[[], Iterator[bytes]]) -> ObjectRef:
        """Stream ``chunks()`` through a writer; restart from the source if the backend cannot
        resend one part (GCS resumable uploads) and the failure was transient."""
        attempt = 0
        while True:
            attempt += 1
            try:
                with self.open_writer(key) as writer:
                    for chunk in chunks():
                        writer.write(chunk)
                return writer.ref
            except Exception as err:
                if self._backend.resend_parts or attempt > self.retries or not is_transient(err):
                    raise
                self._count("upload_restarts")
                log.warning("%s: upload failed (%s: %s), starting it again", self._where(key), type(err).__name__, err)

    def _put_single(self, key: str, path: str, data: bytes, ref: Callable[[], ObjectRef]) -> None:
        """One exclusive PUT, retried; ``ref()`` names the bytes (asked only if needed)."""
        attempts = [0]

        def attempt() -> None:
            attempts[0] += 1
            self._backend.put(path, data)

        try:
            self._call(f"put {self._where(key)}", attempt)
        except FileExistsError:
            if attempts[0] > 1 and self._holds(ref()):
                return  # an earlier attempt that timed out did land: same bytes, done
            raise FileExistsError(f"object exists: {self._where(key)}") from None

    def _holds(self, ref: ObjectRef) -> bool:
        """Whether ``ref.key`` holds exactly ``ref`` (after an ambiguous retry)."""
        try:
            self.verify(ref)
            log.info("%s: an earlier attempt landed; identical bytes, accepted", self._where(ref.key))
            return True
        except (FileNotFoundError, IntegrityError):
            return False

    def delete(self, key: str) -> None:
        """Remove one object; a missing key is not an error."""
        self._call(f"delete {self._where(key)}", self._backend.delete, self._path(key))

    # -- reads --------------------------------------------------------------------------------

    def get(self, ref: ObjectRef) -> bytes:
        """Read and verify one object (large ones stream, hashed on the way).

        Raises:
            FileNotFoundError: no object under ``ref.key``.
            IntegrityError: its size or sha256 differs from ``ref``.
        """
        if ref.nbytes <= self.part_nbytes:
            data = self.get_unverified(ref.key)
            _check(ref, len(data), sha256_hex(data))
            return data
        chunks: list[bytes] = []
        self._read_verified(ref, chunks.append)
        return b"".join(chunks)

    def get_to_file(self, ref: ObjectRef, local_path: str | os.PathLike) -> None:
        """Stream and verify one object into ``local_path`` (replaced atomically, only when the
        bytes verify; nothing is left behind otherwise).

        Raises:
            FileNotFoundError: no object under ``ref.key``.
            IntegrityError: its size or sha256 differs from ``ref``.
        """
        local_path = os.fspath(local_path)
        folder = os.path.dirname(os.path.abspath(local_path))
        os.makedirs(folder, exist_ok=True)
        tmp = os.path.join(folder, f"{backends.TEMP_PREFIX}{uuid.uuid4().hex}")
        try:
            with open(tmp, "wb") as fh:
                self._read_verified(ref, fh.write)
            os.replace(tmp, local_path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    def verify(self, ref: ObjectRef) -> None:
        """Read ``ref`` through without keeping it; raise if it does not match.

        Raises:
            FileNotFoundError, IntegrityError: as :meth:`get`.
        """
        self._read_verified(ref, lambda chunk: None)

    def _read_verified(self, ref: ObjectRef, sink: Callable[[bytes], Any]) -> None:
        path, where = self._path(ref.key), self._where(ref.key)
        size = self._call(f"size {where}", self._backend.size, path)
        if size != ref.nbytes:
            raise IntegrityError(f"{ref.key}: size {size} bytes, expected {ref.nbytes}")
        hasher = hashlib.sha256()
        nbytes = 0
        for chunk in self._stream(path, where, ref.nbytes):
            hasher.update(chunk)  # while the next chunk is on its way
            sink(chunk)
            nbytes += len(chunk)
        _check(ref, nbytes, hasher.hexdigest())

    def _stream(self, path: str, where: str, nbytes: int) -> Iterator[bytes]:
        """Chunks of ``[0, nbytes)`` of one object, the next one prefetched. Each chunk read is
        bounded by ``timeout_s``; after a transient error the stream reopens where it stopped."""
        pos, failures, delay = 0, 0, self.backoff_s
        while pos < nbytes:
            reader = None
            try:
                stream = self._call(f"open {where} at {pos}", self._backend.open_stream, path, pos, nbytes,
                                    retry=False)  # retried by this loop
                reader = _Prefetch(stream, self.part_nbytes)
                while pos < nbytes:
                    chunk = reader.next(self.timeout_s, f"read {where} at {pos}")
                    if not chunk:
                        raise IntegrityError(f"{where}: size {pos} bytes, expected {nbytes} (ended early)")
                    pos += len(chunk)
                    failures, delay = 0, self.backoff_s
                    yield chunk
            except Exception as err:
                if isinstance(err, TimeoutError):
                    self._count("timeouts")
                if not is_transient(err) or failures >= self.retries:
                    raise
                failures += 1
                self._count("retries")
                log.warning("read %s: %s: %s at byte %d, reopening (retry %d of %d)",
                            where, type(err).__name__, err, pos, failures, self.retries)
                time.sleep(delay * random.uniform(0.5, 1.0))
                delay = min(delay * 2, self.max_backoff_s)
            finally:
                if reader is not None:
                    reader.close()

    def get_unverified(self, key: str) -> bytes:
        """Read an object that carries its own integrity data (a manifest, a plan)."""
        return self._call(f"read {self._where(key)}", self._backend.read, self._path(key), None, None)

    def get_json(self, key: str) -> Any:
        return json.loads(self.get_unverified(key))

    def exists(self, key: str) -> bool:
        return self._call(f"exists {self._where(key)}", self._backend.exists, self._path(key))

    def list(self, prefix: str) -> list[str]:
        """Keys under ``prefix`` (recursive, sorted), relative to the root; temp files skipped.

        A listing may lag behind writes on some stores: use it to discover, then read exact
        keys; never treat a key missing from a listing as absent.
        """
        return sorted(self.sizes(prefix))

    def sizes(self, prefix: str) -> dict[str, int]:
        """``{key: nbytes}`` of the objects under ``prefix`` (as :meth:`list`; ``""``: all)."""
        base = self._path(prefix) if prefix.strip("/") else self.root
        found = self._call(f"list {self._where(prefix)}", self._backend.find, base)
        root = self.root.lstrip("/")
        out = {}
        for p, nbytes in found.items():
            rel = p.lstrip("/")[len(root):].lstrip("/")
            if rel and not rel.rsplit("/", 1)[-1].startswith(backends.TEMP_PREFIX):
                out[rel] = nbytes
        return out


class _Prefetch:
    """Reads the next chunk of a stream in a worker thread while the caller uses the last one."""

    def __init__(self, stream: backends.Stream, chunk_nbytes: int) -> None:
        self.stream, self.chunk_nbytes = stream, chunk_nbytes
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="storage-stream")
        self.future: concurrent.futures.Future | None = self.pool.submit(stream.read, chunk_nbytes)

    def next(self, timeout_s: float | None, what: str) -> bytes:
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


def _check(ref: ObjectRef, nbytes: int, digest: str) -> None:
    if nbytes != ref.nbytes:
        raise IntegrityError(f"{ref.key}: size {nbytes} bytes, expected {ref.nbytes}")
    if digest != ref.sha256:
        raise IntegrityError(f"{ref.key}: sha256 {digest[:12]}…, expected {ref.sha256[:12]}…")


class _Hasher:
    """sha256 of one buffer, computed in a thread (hashlib releases the GIL) while it uploads."""

    def __init__(self, data: bytes) -> None:
        self._digest: str | None = None
        self._data = data
        self._thread = None
        if len(data) > MiB:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        else:
            self._run()

    def _run(self) -> None:
        self._digest = sha256_hex(self._data)

    def ref_for(self, key: str, nbytes: int) -> ObjectRef:
        if self._thread is not None:
            self._thread.join()
        assert self._digest is not None
        return ObjectRef(key=key.strip("/"), nbytes=nbytes, sha256=self._digest)


class ObjectWriter:
    """Streams one immutable object in parts; publishes on :meth:`close`, never on error.

    Parts of ``part_nbytes`` go out as soon as they are full (up to ``max_concurrency`` in
    flight) while the writer hashes; the last part is held back until ``close`` so that a
    backend that must mark the final part (GCS) can. An object that fits one part is sent with
    a single exclusive PUT at close. Use as a context manager; ``ref`` is set after close.
    """

    def __init__(self, store: ObjectStore, key: str) -> None:
        self.store, self.key = store, key.strip("/")
        self._path = store._path(key)
        self._where = store._where(key)
        self._part = store.part_nbytes
        self._hash = hashlib.sha256()
        self._nbytes = 0
        self._held: collections.deque[memoryview] = collections.deque()  # written, not yet sent
        self._held_nbytes = 0
        self._upload: backends.Upload | None = None
        self._parts = 0
        self._offset = 0
        self._pending: collections.deque = collections.deque()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._state = "open"
        self.ref: ObjectRef | None = None

    def __enter__(self) -> "ObjectWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def write(self, data: bytes | bytearray | memoryview) -> int:
        """Append ``data``; returns its length. Raises what a part upload raised.

        Read-only buffers (``bytes``) are kept by reference until sent (a part that is exactly
        one ``bytes`` object goes out without a copy); writable ones are copied, since the
        caller may reuse them.
        """
        if self._state != "open":
            raise ValueError(f"{self._where}: writer is {self._state}")
        view = memoryview(data).cast("B")
        n = len(view)
        if not n:
            return 0
        try:
            self._held.append(view if view.readonly else memoryview(bytes(view)))
            self._held_nbytes += n
            while self._held_nbytes > self._part:  # keep the last part back for close()
                self._send(self._take(self._part), last=False)
        except BaseException:
            self.abort()
            raise
        return n

    def _take(self, nbytes: int) -> bytes:
        """The first ``nbytes`` held, as one ``bytes`` (copied only if they span or split pieces)."""
        first = self._held[0]
        if len(first) == nbytes and isinstance(first.obj, bytes) and len(first.obj) == nbytes:
            self._held.popleft()
            self._held_nbytes -= nbytes
            return first.obj
        out = bytearray()
        while len(out) < nbytes:
            piece = self._held.popleft()
            need = nbytes - len(out)
            if len(piece) > need:
                self._held.appendleft(piece[need:])
                piece = piece[:need]
            out += piece
        self._held_nbytes -= nbytes
        return bytes(out)

    def _send(self, chunk: bytes, last: bool) -> None:
        """Start uploading one part; hash it while it travels."""
        self._nbytes += len(chunk)
        store = self.store
        if self._upload is None:
            self._upload = store._call(f"begin upload {self._where}", store._backend.begin, self._path)
            if store._backend.parallel_parts and store.max_concurrency > 1:
                self._pool = concurrent.futures.ThreadPoolExecutor(store.max_concurrency,
                                                                   thread_name_prefix="storage-part")
        self._parts += 1
        args = (self._parts, self._offset, chunk, last)
        self._offset += len(chunk)
        what = f"upload part {self._parts} of {self._where}"
        resend = store._backend.resend_parts
        if self._pool is None:
            self._hash.update(chunk)
            store._call(what, self._send_part, *args, retry=resend)
            return
        while len(self._pending) >= store.max_concurrency:
            self._pending.popleft().result()
        self._pending.append(self._pool.submit(store._call, what, self._send_part, *args, retry=resend))
        self._hash.update(chunk)

    def _send_part(self, number: int, offset: int, data: bytes, last: bool) -> None:
        if self._state == "aborted":  # stop a part's retries once the upload is dropped
            raise RuntimeError(f"{self._where}: upload aborted")
        assert self._upload is not None
        self._upload.send(number, offset, data, last)

    def close(self) -> ObjectRef:
        """Send what is left and publish the object (exclusive create).

        Raises:
            FileExistsError: the key already exists (the upload is aborted, nothing changes).
        """
        if self._state == "closed":
            assert self.ref is not None
            return self.ref
        if self._state != "open":
            raise ValueError(f"{self._where}: writer is {self._state}")
        try:
            if self._upload is None:
                data = self._take(self._held_nbytes) if self._held_nbytes else b""
                self._hash.update(data)
                self._nbytes += len(data)
                self.ref = ObjectRef(self.key, self._nbytes, self._hash.hexdigest())
                self.store._put_single(self.key, self._path, data, lambda: self.ref)
            else:
                self._send(self._take(self._held_nbytes), last=True)
                while self._pending:
                    self._pending.popleft().result()
                self.ref = ObjectRef(self.key, self._nbytes, self._hash.hexdigest())
                self._commit()
        except BaseException:
            self.abort()
            raise
        self._state = "closed"
        self._shutdown()
        return self.ref

    def _commit(self) -> None:
        store, upload = self.store, self._upload
        attempts = [0]

        def attempt() -> None:
            attempts[0] += 1
            upload.commit()

        try:
            store._call(f"complete upload {self._where}", attempt)
        except (FileExistsError, FileNotFoundError) as err:
            # after a lost answer the retry finds its own object (or no upload left to complete)
            if attempts[0] > 1 and store._holds(self.ref):
                return
            if isinstance(err, FileExistsError):
                raise FileExistsError(f"object exists: {self._where}") from None
            raise

    def abort(self) -> None:
        """Drop the upload: nothing is published. Safe to call more than once."""
        if self._state in ("closed", "aborted"):
            return
        self._state = "aborted"
        for fut in self._pending:
            fut.cancel()
        running = [fut for fut in self._pending if not fut.cancelled()]
        if running:  # let parts on the wire land first, so the abort is the last word
            concurrent.futures.wait(running, timeout=self.store.timeout_s)
        self._pending.clear()
        self._held.clear()
        self._held_nbytes = 0
        if self._upload is not None:
            self.store._count("aborted_uploads")
            try:
                self.store._call(f"abort upload {self._where}", self._upload.abort)
            except Exception as err:  # the upload stays invisible; lifecycle rules or gc reap it
                self.store._count("abort_failures")
                log.warning("%s: could not abort the upload (%s: %s); nothing was published",
                            self._where, type(err).__name__, err)
        self._shutdown()

    def _shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def __del__(self) -> None:  # never publish from the garbage collector (C11)
        if getattr(self, "_state", "closed") == "open" and self._upload is not None:
            log.warning("%s: writer dropped without close(); nothing published", self._where)
