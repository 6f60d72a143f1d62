"""The digest that names an object's bytes in an :class:`~diloco_async.storage.refs.ObjectRef` (DESIGN §5).

One sha256 pass runs on one core at a fixed speed (~1.1–1.3 GB/s with the SHA extensions of
the reference machine), often slower than the page cache writes and reads the same bytes. A
store that hashes every object it writes and every object it reads then spends most of a
transfer hashing, however well hashing and I/O overlap (issue 17, on the 2-core machine:
``file://`` put+get at 0.67–0.71 of raw file I/O; the best a store hashing whole objects could
reach there, each pass overlapped with its own I/O, was 0.66–0.86 from run to run).

So a large object is hashed in pieces, each piece on whichever core is free:

* an object of at most :data:`PIECE_NBYTES` (4 MiB) has the plain sha256 of its bytes as its
  digest, exactly as before;
* a larger one is cut into pieces of :data:`PIECE_NBYTES` (the last one shorter); its digest is
  the sha256 of a fixed prefix followed by the 32-byte sha256 of every piece in order. A hash
  list of this kind is what S3 computes for the composite checksum of a multipart upload.

Every byte still goes through sha256, and changing any byte, the order of the pieces or the
size changes the digest (sizes are also checked on their own). The pieces of one stream are
hashed by a pool shared by the process (:func:`hash_threads` threads; ``hashlib`` releases the
GIL), while the caller goes on reading or writing.

Objects over 4 MiB written before this format carry their whole-object sha256; readers accept it
after checking it (:mod:`diloco_async.storage.reader`), so older checkpoints still resume.
"""

from __future__ import annotations

import collections
import concurrent.futures
import hashlib
import os
import threading
from typing import Any

__all__ = ["PIECE_NBYTES", "PieceHasher", "object_digest", "digest_of_pieces", "hash_threads", "set_hash_threads",
           "usable_cores"]

#: size of one hashed piece; part of the format (changing it changes every large object's digest)
PIECE_NBYTES = 4 << 20

#: pieces per hashing thread that may wait or run for one stream before its update blocks
BACKLOG_PIECES = 2

#: what the piece digests are prefixed with before the top-level sha256
_TOP_PREFIX = b"diloco-async object digest v1: sha256 of 4194304-byte pieces\n"

#: environment variable that sets the number of hashing threads (default: cores, at most 4)
HASH_THREADS_ENV = "DILOCO_HASH_THREADS"

_pool_lock = threading.Lock()
_pool: concurrent.futures.ThreadPoolExecutor | None = None
_threads_set: int | None = None  # set_hash_threads's, over the environment's


def hash_threads() -> int:
    """Threads that hash the pieces of large objects: ``DILOCO_HASH_THREADS`` if set (1 hashes
    in the caller's thread), else the cores this process may use, at most 4.

    Raises:
        ValueError: the variable is set to something other than a whole number ≥ 1.
    """
    if _threads_set is not None:
        return _threads_set
    text = os.environ.get(HASH_THREADS_ENV, "").strip()
    if text:
        if not text.isdigit() or int(text) < 1:
            raise ValueError(f"{HASH_THREADS_ENV}={text!r}: expected a whole number >= 1")
        return int(text)
    return max(1, min(4, usable_cores()))


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity; the machine's count where there is none)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def set_hash_threads(threads: int | None) -> None:
    """Set this process's hashing threads (None: back to :func:`hash_threads`'s default). A
    learner keeps one core for its training thread: hashing beside it on that core too slowed
    its steps. Streams already being hashed finish on the pool they started with.

    Raises:
        ValueError: ``threads`` < 1.
    """
    global _threads_set, _pool
    if threads is not None and threads < 1:
        raise ValueError(f"hash threads must be >= 1, got {threads}")
    with _pool_lock:
        _threads_set = threads
        old, _pool = _pool, None
    if old is not None:
        old.shutdown(wait=False)  # what was queued still runs


def _shared_pool() -> concurrent.futures.ThreadPoolExecutor | None:
    """The process's hashing pool, made on first use; None where one thread is asked for."""
    global _pool
    if _pool is None:
        threads = hash_threads()
        if threads == 1:
            return None
        with _pool_lock:
            if _pool is None:
                _pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="storage-hash")
    return _pool


def _forget_pool_after_fork() -> None:
    """A forked child has none of its parent's threads: it starts a pool of its own."""
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_pool_after_fork)


def _piece_digest(view: memoryview) -> bytes:
    return hashlib.sha256(view).digest()


class PieceHasher:
    """The digest of a stream of bytes, fed in chunks of any size (see the module's docstring).

    Whole pieces go to the shared pool as they arrive and :meth:`update` returns at once: the
    bytes given must not change until :meth:`hexdigest` returns (``bytes``, or views of buffers
    that nobody writes any more). Bytes of a piece that a chunk leaves unfinished are hashed in
    the caller's thread. At most ``lanes`` pieces of this stream are hashed at once (default:
    every thread of the pool); :meth:`widen` raises that while the stream is being hashed. At
    most :data:`BACKLOG_PIECES` per thread wait or run: :meth:`update` blocks until there is
    room, so a writer faster than hashing does not pile up its buffers (a synchronizer writing
    its state held ~0.4 model sizes more without this bound).
    Not thread-safe: one stream, one caller (``widen`` may come from another thread).
    """

    def __init__(self, lanes: int | None = None) -> None:
        self._pool = _shared_pool()
        self._pieces: list[Any] = []  # a Future[bytes] or the piece's digest, in order
        self._tail = hashlib.sha256()  # the unfinished piece
        self._tail_nbytes = 0
        self.nbytes = 0
        threads = hash_threads()
        self._lanes = max(1, lanes) if lanes is not None else threads
        self._lock = threading.Lock()
        self._room = threading.Condition(self._lock)
        self._backlog = BACKLOG_PIECES * max(self._lanes, threads)
        self._waiting: collections.deque[tuple[concurrent.futures.Future, memoryview]] = collections.deque()
        self._running = 0

    def update(self, data: bytes | bytearray | memoryview) -> None:
        """Feed the next bytes of the stream."""
        view = memoryview(data).cast("B")
        self.nbytes += len(view)
        if self._tail_nbytes:
            take = min(PIECE_NBYTES - self._tail_nbytes, len(view))
            self._tail.update(view[:take])
            self._tail_nbytes += take
            view = view[take:]
            if self._tail_nbytes == PIECE_NBYTES:
                self._pieces.append(self._tail.digest())
                self._tail, self._tail_nbytes = hashlib.sha256(), 0
        while len(view) >= PIECE_NBYTES:
            piece, view = view[:PIECE_NBYTES], view[PIECE_NBYTES:]
            if self._pool is None:
                self._pieces.append(_piece_digest(piece))
                continue
            future: concurrent.futures.Future = concurrent.futures.Future()
            self._pieces.append(future)
            with self._room:
                self._room.wait_for(lambda: len(self._waiting) + self._running < self._backlog)
                self._waiting.append((future, piece))
            self._start_some()
        if len(view):
            self._tail.update(view)
            self._tail_nbytes = len(view)

    def widen(self, lanes: int | None = None) -> None:
        """Hash up to ``lanes`` pieces at once from now on (default: every thread of the pool)."""
        self._lanes = max(self._lanes, lanes if lanes is not None else hash_threads())
        self._start_some()

    def _start_some(self) -> None:
        if self._pool is None:  # one thread: every piece was hashed in update
            return
        while True:
            with self._lock:
                if self._running >= self._lanes or not self._waiting:
                    return
                self._running += 1
                future, piece = self._waiting.popleft()
            try:
                self._pool.submit(self._hash_one, future, piece)
            except RuntimeError:  # that pool was shut down (interpreter exit, set_hash_threads): hash here
                self._hash_one(future, piece)

    def _hash_one(self, future: concurrent.futures.Future, piece: memoryview) -> None:
        try:
            future.set_result(_piece_digest(piece))
        except BaseException as err:  # the caller gets it from hexdigest
            future.set_exception(err)
        with self._room:
            self._running -= 1
            self._room.notify_all()
        self._start_some()

    def hexdigest(self) -> str:
        """Lowercase hex digest (64 characters) of everything fed so far; waits for the pool."""
        digests = [p.result() if isinstance(p, concurrent.futures.Future) else p for p in self._pieces]
        self._pieces = list(digests)
        if self._tail_nbytes or not digests:
            digests.append(self._tail.digest())
        return digest_of_pieces(digests)


def digest_of_pieces(piece_digests: list[bytes]) -> str:
    """The object digest (hex) of an object whose pieces of :data:`PIECE_NBYTES`, in order, have
    the raw sha256 digests ``piece_digests`` (one piece: that piece's own sha256)."""
    if len(piece_digests) == 1:  # at most one piece: the plain sha256 of the bytes
        return piece_digests[0].hex()
    return hashlib.sha256(_TOP_PREFIX + b"".join(piece_digests)).hexdigest()


def object_digest(data: bytes | bytearray | memoryview) -> str:
    """The digest an :class:`~diloco_async.storage.refs.ObjectRef` carries for ``data`` (hex, 64 characters):
    its sha256 up to :data:`PIECE_NBYTES`, the sha256 of its pieces' sha256s above."""
    if memoryview(data).nbytes <= PIECE_NBYTES:  # one piece: its plain sha256, no pool
        return hashlib.sha256(data).hexdigest()
    hasher = PieceHasher()
    hasher.update(data)
    return hasher.hexdigest()
