"""Exclusive-create writes, for :class:`~diloco_async.storage.store.ObjectStore` (DESIGN §5, bug case C11); each
function takes the store as a :class:`~diloco_async.storage.access.StoreAccess`.

* :func:`put_bytes`: an object that fits one part (or a backend without parts) goes out in one
  exclusive PUT, hashed in a thread while it travels; a larger one goes through a writer.
* :class:`ObjectWriter`: streams one object in parts (S3 multipart upload, GCS resumable
  upload, a local temporary file) and publishes it only on a clean close; an error in the
  middle aborts the upload, so nothing appears under the final key.
* :func:`upload_chunks`: writes a source through a writer, restarting it from the source where
  the backend cannot resend one part (GCS).

A create retried after a lost answer may find its own object: it is accepted when the object
there holds exactly the bytes written, refused otherwise.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Iterator

from diloco_async.storage import backends
from diloco_async.storage.access import StoreAccess
from diloco_async.storage.credentials import is_expired_credentials
from diloco_async.storage.digest import PIECE_NBYTES, PieceHasher, hash_threads
from diloco_async.storage.parts import part_nbytes_for, streaming_part_nbytes
from diloco_async.storage.reader import read_verified
from diloco_async.storage.refs import IntegrityError, ObjectRef
from diloco_async.storage.retry import is_transient

__all__ = ["ObjectWriter", "put_bytes", "upload_chunks"]

log = logging.getLogger("diloco.storage")

#: buffers larger than this are hashed in a thread while they upload
_HASH_IN_THREAD_NBYTES = 1 << 20


def put_bytes(access: StoreAccess, key: str, data: bytes | bytearray | memoryview) -> ObjectRef:
    """Write ``data`` under ``key`` once (see :meth:`ObjectStore.put`)."""
    view = memoryview(data).cast("B")
    if len(view) <= access.part_nbytes or not access.backend.multipart:
        path = access.path(key)
        payload = data if isinstance(data, bytes) else bytes(view)
        ref = lambda: hasher.ref_for(key, len(payload))  # noqa: E731
        if isinstance(access.backend, backends.LocalBackend) and len(payload) > PIECE_NBYTES:
            # a local write is a memory copy on this machine's cores: hash beside it on one lane
            # fewer than the pool has, then on all of them while the file syncs to disk
            hasher = _Hasher(payload, lanes=hash_threads() - 1)
            put = lambda: _write_then_sync(access.backend, path, payload, hasher.widen)  # noqa: E731
            _create_once(access, "put", key, put, ref, (FileExistsError,))
        else:
            hasher = _Hasher(payload)  # hashes in parallel with the upload
            _put_single(access, key, path, payload, ref)
        return ref()
    return upload_chunks(access, key, lambda: iter([view]), len(view))


def upload_chunks(access: StoreAccess, key: str, chunks: Callable[[], Iterator[bytes]],
                  nbytes: int | None = None, max_concurrency: int | None = None) -> ObjectRef:
    """Stream ``chunks()`` (``nbytes`` in all, if known: it sets the part size) through a writer;
    restart from the source if the backend cannot resend one part (GCS resumable uploads) and
    the failure was transient (after the policy's backoff) or the credentials expired and were
    renewed (at once). ``max_concurrency``: parts in flight at most (None: the store's)."""
    attempt, backoff = 0, access.policy.backoff()
    while True:
        attempt += 1
        try:
            with ObjectWriter(access, key, nbytes, max_concurrency) as writer:
                for chunk in chunks():
                    writer.write(chunk)
            return writer.ref
        except Exception as err:
            retryable = is_transient(err) or is_expired_credentials(err)
            if access.backend.resend_parts or attempt > access.policy.retries or not retryable:
                raise
            access.count("upload_restarts")
            pause_s = 0.0 if is_expired_credentials(err) else backoff.next_pause_s()
            log.warning("%s: upload failed (%s: %s), starting it again in %.2f s", access.where(key),
                        type(err).__name__, err, pause_s)
            time.sleep(pause_s)


def _joined(pieces: list[memoryview]) -> bytes:
    """``pieces`` as one ``bytes``: the piece's own object when it is one whole ``bytes``, else
    one copy."""
    if len(pieces) == 1 and isinstance(pieces[0].obj, bytes) and len(pieces[0].obj) == len(pieces[0]):
        return pieces[0].obj
    return b"".join(pieces)


def _put_single(access: StoreAccess, key: str, path: str, data: bytes, ref: Callable[[], ObjectRef]) -> None:
    """One exclusive PUT of ``data`` to ``path`` (that of ``key``), retried; ``ref()`` names
    the bytes (asked only if needed)."""
    _create_once(access, "put", key, lambda: access.backend.put(path, data), ref, (FileExistsError,))


def _write_then_sync(backend: backends.Backend, path: str, data: bytes, written: Callable[[], None]) -> None:
    """A local exclusive create (temp file, write, fsync, link) with ``written()`` called
    between the write, a copy into the page cache on this CPU, and the fsync, a wait."""
    upload = backend.begin(path)
    try:
        upload.send(1, 0, data, True)
        written()
        upload.commit()
    finally:
        upload.abort()


def _create_once(access: StoreAccess, verb: str, key: str, create: Callable[[], None],
                 ref: Callable[[], ObjectRef], ambiguous: tuple[type[Exception], ...]) -> None:
    """``create()`` (an exclusive create) under the retry policy. When a retry fails with one of
    ``ambiguous`` (the key exists; for a completion also: no upload left), an earlier attempt
    may have landed: the object is accepted if it holds exactly ``ref()``.

    Raises:
        FileExistsError: the key holds something else.
    """
    where = access.where(key)
    attempts = 0

    def attempt() -> None:
        nonlocal attempts
        attempts += 1
        create()

    try:
        access.call(f"{verb} {where}", attempt)
    except ambiguous as err:
        if attempts > 1 and _holds(access, ref()):
            return  # an earlier attempt that timed out did land: same bytes, done
        if isinstance(err, FileExistsError):
            raise FileExistsError(f"object exists: {where}") from None
        raise
    _check_size(access, ref())


def _check_size(access: StoreAccess, ref: ObjectRef) -> None:
    """After a create: the store must hold exactly ``ref.nbytes`` under ``ref.key``. A short (or
    long) object is deleted and never handed to a caller, so it is never announced.

    Raises:
        IntegrityError: reason ``size_mismatch``.
    """
    path, where = access.path(ref.key), access.where(ref.key)
    held = access.call(f"size {where}", access.backend.size, path)
    if held == ref.nbytes:
        return
    access.count("size_mismatch")
    log.error("%s: the store holds %d bytes after the write, %d were sent: deleting it", where, held, ref.nbytes)
    try:
        access.call(f"delete {where}", access.backend.delete, path)
    except Exception as err:  # never referenced by anyone; gc or an operator removes it
        access.count("delete_failures")
        log.warning("%s: could not delete the short object (%s: %s)", where, type(err).__name__, err)
    raise IntegrityError(f"{where}: size_mismatch: the store holds {held} bytes, {ref.nbytes} were written",
                         reason="size_mismatch")


def _holds(access: StoreAccess, ref: ObjectRef) -> bool:
    """Whether ``ref.key`` holds exactly ``ref`` (after an ambiguous retry)."""
    try:
        read_verified(access, ref, lambda chunk: None)
        log.info("%s: an earlier attempt landed; identical bytes, accepted", access.where(ref.key))
        return True
    except (FileNotFoundError, IntegrityError):
        return False


class _Hasher:
    """The digest of one buffer (:mod:`diloco_async.storage.digest`), computed beside the upload: its pieces
    on the shared hashing pool, the rest in a thread of its own."""

    def __init__(self, data: bytes, lanes: int | None = None) -> None:
        self._digest: str | None = None
        self._data = data
        self._hasher = PieceHasher(lanes)
        self._thread = None
        if len(data) > _HASH_IN_THREAD_NBYTES:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        else:
            self._run()

    def _run(self) -> None:
        self._hasher.update(self._data)
        self._digest = self._hasher.hexdigest()

    def widen(self) -> None:
        """Hash on every lane of the pool from now on."""
        self._hasher.widen()

    def ref_for(self, key: str, nbytes: int) -> ObjectRef:
        if self._thread is not None:
            self._thread.join()
        assert self._digest is not None
        return ObjectRef(key=key.strip("/"), nbytes=nbytes, sha256=self._digest)


class ObjectWriter:
    """Streams one immutable object in parts; publishes on :meth:`close`, never on error.

    Parts go out as soon as they are full (up to ``max_concurrency`` in flight: the store's, or
    fewer where the caller asks, to bound memory) while the writer hashes. Their size is the
    store's ``part_nbytes``, raised where the backend's part limits need it (:mod:`diloco_async.storage.parts`):
    fixed when ``nbytes`` (the object's total size) is given, growing along the stream otherwise;
    the last part is held back until ``close`` so that a backend that must mark the final part
    (GCS) can. An object that fits one part is sent with
    a single exclusive PUT at close. Use as a context manager; ``ref`` is set after close.

    Made by :meth:`ObjectStore.open_writer <diloco_async.storage.store.ObjectStore.open_writer>` (``access``: that
    store's :class:`~diloco_async.storage.access.StoreAccess`).
    """

    def __init__(self, access: StoreAccess, key: str, nbytes: int | None = None,
                 max_concurrency: int | None = None) -> None:
        self.access, self.key = access, key.strip("/")
        self._concurrency = access.max_concurrency if max_concurrency is None else max(1, int(max_concurrency))
        self._path = access.path(key)
        self._where = access.where(key)
        self._limits = access.part_limits
        self._fixed_part = None if nbytes is None else part_nbytes_for(nbytes, access.part_nbytes, self._limits)
        self._hash = PieceHasher()  # fed read-only views only (see write)
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

    def __enter__(self) -> ObjectWriter:
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
            while self._held_nbytes > (part := self._next_part_nbytes()):  # the last part waits for close()
                self._send(self._take(part), last=False)
        except BaseException:
            self.abort()
            raise
        return n

    def _next_part_nbytes(self) -> int:
        if self._fixed_part is not None:
            return self._fixed_part
        return streaming_part_nbytes(self._parts + 1, self.access.part_nbytes, self._limits)

    def _take(self, nbytes: int) -> list[memoryview]:
        """The first ``nbytes`` held, as the pieces that hold them (views: nothing is copied)."""
        pieces: list[memoryview] = []
        need = nbytes
        while need:
            piece = self._held.popleft()
            if len(piece) > need:
                self._held.appendleft(piece[need:])
                piece = piece[:need]
            pieces.append(piece)
            need -= len(piece)
        self._held_nbytes -= nbytes
        return pieces

    def _send(self, pieces: list[memoryview], last: bool) -> None:
        """Start uploading one part made of ``pieces``; hash it while it travels. The pieces are
        joined into one ``bytes`` (one copy) unless the backend writes at offsets (local files),
        where each piece is written where it belongs, straight from the caller's memory."""
        access = self.access
        if self._limits.max_parts is not None and self._parts >= self._limits.max_parts:
            raise ValueError(f"{self._where}: part {self._parts + 1} is past the backend's limit of "
                             f"{self._limits.max_parts} parts (the object is larger than announced)")
        chunk: bytes | list[memoryview]
        if access.backend.writes_at_offsets:
            chunk, nbytes = pieces, sum(len(p) for p in pieces)
        else:
            chunk = _joined(pieces)
            nbytes = len(chunk)
        self._nbytes += nbytes
        if self._upload is None:
            self._upload = access.call(f"begin upload {self._where}", access.backend.begin, self._path)
            if access.backend.parallel_parts and self._concurrency > 1:
                self._pool = concurrent.futures.ThreadPoolExecutor(self._concurrency,
                                                                   thread_name_prefix="storage-part")
        self._parts += 1
        args = (self._parts, self._offset, chunk, last)
        self._offset += nbytes
        what = f"upload part {self._parts} of {self._where}"
        resend = access.backend.resend_parts
        if self._pool is not None:
            while len(self._pending) >= self._concurrency:
                self._pending.popleft().result()
            self._pending.append(self._pool.submit(access.call, what, self._send_part, *args, retry=resend))
        for piece in pieces:
            self._hash.update(piece)
        if self._pool is None:
            access.call(what, self._send_part, *args, retry=resend)

    def _send_part(self, number: int, offset: int, data: bytes | list[memoryview], last: bool) -> None:
        if self._state == "aborted":  # stop a part's retries once the upload is dropped
            raise RuntimeError(f"{self._where}: upload aborted")
        assert self._upload is not None
        if isinstance(data, bytes):
            self._upload.send(number, offset, data, last)
            return
        for i, piece in enumerate(data):  # a backend that writes at offsets (see _send)
            self._upload.send(number, offset, piece, last and i == len(data) - 1)
            offset += len(piece)

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
                data = _joined(self._take(self._held_nbytes))
                self._hash.update(data)
                self._nbytes += len(data)
                self.ref = ObjectRef(self.key, self._nbytes, self._hash.hexdigest())
                _put_single(self.access, self.key, self._path, data, lambda: self.ref)
            else:
                self._send(self._take(self._held_nbytes), last=True)
                while self._pending:
                    self._pending.popleft().result()
                self.ref = ObjectRef(self.key, self._nbytes, self._hash.hexdigest())
                # after a lost answer the retry finds its own object (or no upload left to complete)
                _create_once(self.access, "complete upload", self.key, self._upload.commit, lambda: self.ref,
                             (FileExistsError, FileNotFoundError))
        except BaseException:
            self.abort()
            raise
        self._state = "closed"
        self._shutdown()
        return self.ref

    def abort(self) -> None:
        """Drop the upload: nothing is published. Safe to call more than once."""
        if self._state in ("closed", "aborted"):
            return
        self._state = "aborted"
        for fut in self._pending:
            fut.cancel()
        running = [fut for fut in self._pending if not fut.cancelled()]
        if running:  # let parts on the wire land first, so the abort is the last word
            concurrent.futures.wait(running, timeout=self.access.policy.timeout_s)
        self._pending.clear()
        self._held.clear()
        self._held_nbytes = 0
        if self._upload is not None:
            self.access.count("aborted_uploads")
            try:
                self.access.call(f"abort upload {self._where}", self._upload.abort)
            except Exception as err:  # the upload stays invisible; lifecycle rules or gc reap it
                self.access.count("abort_failures")
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
