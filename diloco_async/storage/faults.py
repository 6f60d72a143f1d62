"""Fault injection through the real store interface (STYLE habit 7; bug cases C08, C10, C11).

:class:`FaultyStore` is an :class:`~diloco_async.storage.store.ObjectStore` built from a real one. It keeps
the real store's URL, policy (timeouts, retries) and code paths, and puts a faulty layer *under*
them, around the backend: so the product's own retries, timeouts, aborts and digest checks are
what the tests exercise, and product code has no test branches.

Faults, by explicit toggles on ``store.faults`` (a :class:`FaultPlan`) or by a seeded schedule:

* ``fail(op)``: the next call raises a transient error (``ConnectionError`` by default);
* ``hang(op)``: the next call blocks until :meth:`FaultPlan.release` (then fails as a dead
  connection would) or for ``hold_s``;
* ``slow(op, delay_s)``: the next call takes ``delay_s`` longer;
* ``tear(after_nbytes)``: the next write crashes after ``after_nbytes`` went through the real
  write path (temp file, multipart or resumable upload) and leaves the upload as a killed
  process would: not completed, not aborted;
* ``lose_reply(op)``: the next call reaches the store, then its answer is lost (the caller sees
  ``ConnectionError`` although the write landed);
* ``corrupt()``: the next read returns one flipped byte;
* ``truncate(nbytes)``: the next write is published ``nbytes`` short (its final part, or the
  single PUT, loses its tail on the way) while the writer believes it went through whole;
* ``FaultyStore.freeze_listings()``: listings return the snapshot taken at that moment.

Operations (``op``): ``put begin send commit abort open read size exists delete find``
(``open`` starts a streamed read; ``read`` is a whole read or one chunk of a stream).
"""

from __future__ import annotations

import collections
import random
import threading
import time
from typing import Any

from diloco_async.storage.backends import Backend, Stream, Upload
from diloco_async.storage.store import ObjectStore
from diloco_async.storage.wrapped import ForwardingBackend, wrap_store

__all__ = ["FaultPlan", "FaultyStore", "SimulatedCrash", "OPS"]

OPS = ("put", "begin", "send", "commit", "abort", "open", "read", "size", "exists", "delete", "find")


class SimulatedCrash(Exception):
    """The writer 'died' in the middle of a write (a torn write). Not transient: never retried."""


class FaultPlan:
    """What to inject, and a record of what was injected.

    Args:
        seed: seeds the random schedule (same seed, same faults for the same calls).
        p_transient, p_hang, p_slow: per-call probabilities of each fault, for ``ops``.
        slow_s: delay of a random slow call.
        hold_s: how long a random hang blocks (None: until :meth:`release`).
        ops: the operations the random schedule applies to.
    """

    def __init__(self, seed: int = 0, p_transient: float = 0.0, p_hang: float = 0.0, p_slow: float = 0.0,
                 slow_s: float = 0.05, hold_s: float | None = None, ops: tuple[str, ...] = OPS) -> None:
        unknown = set(ops) - set(OPS)
        if unknown:
            raise ValueError(f"unknown operations {sorted(unknown)}; known: {OPS}")
        if min(p_transient, p_hang, p_slow) < 0 or p_transient + p_hang + p_slow > 1:
            raise ValueError(f"fault probabilities must be >= 0 and sum to <= 1, got "
                             f"{p_transient}, {p_hang}, {p_slow}")
        self.rng = random.Random(seed)
        self.p_transient, self.p_hang, self.p_slow = p_transient, p_hang, p_slow
        self.slow_s, self.hold_s, self.ops = slow_s, hold_s, tuple(ops)
        self._queued: dict[str, collections.deque] = collections.defaultdict(collections.deque)
        self._tear_after: int | None = None
        self._tear_skip = 0
        self._truncate_nbytes = 0
        self._released = threading.Event()
        self._lock = threading.Lock()
        self.snapshot: dict[str, int] | None = None
        #: faults injected so far, by kind ("transient", "hang", "slow", "tear", "corrupt", "stale_list")
        self.injected: collections.Counter[str] = collections.Counter()
        #: calls seen so far, by operation
        self.calls: collections.Counter[str] = collections.Counter()

    # -- toggles ---------------------------------------------------------------------------------

    def fail(self, op: str, times: int = 1, error: BaseException | None = None) -> None:
        """The next ``times`` calls of ``op`` raise ``error`` (default: ``ConnectionError``)."""
        self._queue(op, times, ("error", error))

    def hang(self, op: str, times: int = 1, hold_s: float | None = None) -> None:
        """The next ``times`` calls of ``op`` block until :meth:`release` or for ``hold_s``."""
        self._released.clear()
        self._queue(op, times, ("hang", hold_s))

    def slow(self, op: str, delay_s: float, times: int = 1) -> None:
        self._queue(op, times, ("slow", delay_s))

    def lose_reply(self, op: str, times: int = 1) -> None:
        """The next ``times`` calls of ``op`` take effect, then fail with ``ConnectionError``."""
        self._queue(op, times, ("lose_reply", None))

    def corrupt(self, times: int = 1) -> None:
        """The next ``times`` reads return the object with one byte flipped."""
        self._queue("read", times, ("corrupt", None))

    def tear(self, after_nbytes: int, skip: int = 0) -> None:
        """A write (``put`` or upload) crashes once ``after_nbytes`` of it are written: the next
        one, or the one after ``skip`` complete writes."""
        if after_nbytes < 0 or skip < 0:
            raise ValueError(f"after_nbytes and skip must be >= 0, got {after_nbytes}, {skip}")
        with self._lock:
            self._tear_after, self._tear_skip = after_nbytes, skip

    def truncate(self, nbytes: int = 1) -> None:
        """The next write (``put`` or upload) is published ``nbytes`` short of what was sent."""
        if nbytes < 1:
            raise ValueError(f"nbytes must be >= 1, got {nbytes}")
        with self._lock:
            self._truncate_nbytes = nbytes

    def take_truncate(self, data: bytes) -> bytes:
        """``data`` short of its tail if a truncation is due (called for a final part or a PUT)."""
        with self._lock:
            cut, self._truncate_nbytes = self._truncate_nbytes, 0
        if cut:
            self.injected["truncate"] += 1
        return bytes(data[: max(len(data) - cut, 0)]) if cut else data

    def release(self) -> None:
        """Wake every hung call (now and later); each then fails with ``ConnectionError``."""
        self._released.set()

    def _queue(self, op: str, times: int, fault: tuple) -> None:
        if op not in OPS:
            raise ValueError(f"unknown operation {op!r}; known: {OPS}")
        with self._lock:
            self._queued[op].extend([fault] * times)

    # -- used by the faulty backend ----------------------------------------------------------------

    def take_tear(self) -> int | None:
        """The tear point if this write is the one to tear (called once per write)."""
        with self._lock:
            if self._tear_after is None:
                return None
            if self._tear_skip:
                self._tear_skip -= 1
                return None
            after, self._tear_after = self._tear_after, None
        return after

    def before(self, op: str, what: str) -> str | None:
        """Apply the fault due for this call of ``op``; returns what to do after the real call
        ("corrupt" the data read, or "lose_reply")."""
        with self._lock:
            self.calls[op] += 1
            fault = self._queued[op].popleft() if self._queued[op] else self._draw(op)
        if fault is None:
            return None
        kind, arg = fault
        if kind == "error":
            self.injected["transient"] += 1
            raise arg if arg is not None else ConnectionError(f"injected transient error: {op} {what}")
        if kind == "hang":
            self.injected["hang"] += 1
            self._released.wait(arg)
            raise ConnectionError(f"injected hang ended (connection reset): {op} {what}")
        if kind == "slow":
            self.injected["slow"] += 1
            time.sleep(arg)
            return None
        self.injected[kind] += 1
        return kind

    def _draw(self, op: str) -> tuple | None:
        if op not in self.ops or not (self.p_transient or self.p_hang or self.p_slow):
            return None
        r = self.rng.random()
        if r < self.p_transient:
            return ("error", None)
        if r < self.p_transient + self.p_hang:
            return ("hang", self.hold_s)
        if r < self.p_transient + self.p_hang + self.p_slow:
            return ("slow", self.slow_s)
        return None


class _FaultyBackend(ForwardingBackend):
    def __init__(self, inner: Backend, plan: FaultPlan) -> None:
        super().__init__(inner)
        self.plan = plan

    def put(self, path: str, data: bytes) -> None:
        after = self.plan.take_tear()
        if after is not None:  # a single PUT torn: bytes go out through a real upload, then death
            if not data:
                self.plan.injected["tear"] += 1
                raise SimulatedCrash("crashed before writing")
            _FaultyUpload(self.inner.begin(path), self, after).send(1, 0, data, True)
        self.request("put", path, self.inner.put, path, self.plan.take_truncate(data))

    def begin(self, path: str) -> Upload:
        return _FaultyUpload(super().begin(path), self, self.plan.take_tear())

    def open_stream(self, path: str, start: int, end: int) -> Stream:
        return _FaultyStream(super().open_stream(path, start, end), self.plan, path)

    def find(self, path: str) -> dict[str, int]:
        snapshot = self.plan.snapshot
        if snapshot is None:
            return super().find(path)
        self.plan.before("find", path)
        self.plan.injected["stale_list"] += 1
        base = path.strip("/")
        return {p: n for p, n in snapshot.items() if p.strip("/") == base or p.lstrip("/").startswith(base + "/")}

    def request(self, op: str, what: str, fn: Any, *args: Any) -> Any:
        return _finish(self.plan.before(op, what), op, what, fn(*args))


def _finish(after: str | None, op: str, what: str, out: Any) -> Any:
    if after == "lose_reply":
        raise ConnectionError(f"injected: {op} {what} landed but its answer was lost")
    if after == "corrupt" and isinstance(out, bytes) and out:
        return bytes([out[0] ^ 0xFF]) + out[1:]
    return out


class _FaultyStream:
    def __init__(self, inner: Stream, plan: FaultPlan, path: str) -> None:
        self.inner, self.plan, self.path = inner, plan, path

    def read(self, nbytes: int) -> bytes:
        return _finish(self.plan.before("read", self.path), "read", self.path, self.inner.read(nbytes))

    def readinto(self, view: memoryview) -> int:
        after = self.plan.before("read", self.path)
        n = self.inner.readinto(view)  # type: ignore[attr-defined] - only where the backend reads_into
        if after == "corrupt" and n:
            view[0] ^= 0xFF
        return _finish(None if after == "corrupt" else after, "read", self.path, n)

    def close(self) -> None:
        self.inner.close()


class _FaultyUpload:
    """Forwards to a real upload; when torn, sends the bytes up to the tear through it, then
    raises :class:`SimulatedCrash` and from then on ignores commit and abort (a dead process
    completes nothing and cleans nothing up)."""

    def __init__(self, inner: Upload, backend: _FaultyBackend, tear_after: int | None) -> None:
        self.inner, self.backend, self.plan = inner, backend, backend.plan
        self.tear_after = tear_after
        self.crashed = False
        self._sent = 0
        self._lock = threading.Lock()

    def send(self, number: int, offset: int, data: bytes, last: bool) -> None:
        after = self.plan.before("send", f"part {number}")
        with self._lock:
            if self.crashed:
                raise SimulatedCrash("the writer is dead")
            # the last part always tears: sending it whole could publish the object (GCS)
            torn = self.tear_after is not None and (last or self._sent + len(data) > self.tear_after)
            if torn:
                self.crashed = True
            else:
                self._sent += len(data)
        if torn:
            quantum = self.backend.part_quantum
            cut = min(max(self.tear_after - offset, 0), len(data) - 1)
            cut = (cut // quantum) * quantum
            if cut:
                self.inner.send(number, offset, bytes(data[:cut]), False)
            self.plan.injected["tear"] += 1
            raise SimulatedCrash(f"crashed after writing {offset + cut} bytes")
        if last:
            data = self.plan.take_truncate(data)
        _finish(after, "send", f"part {number}", self.inner.send(number, offset, data, last))

    def commit(self) -> None:
        if self.crashed or self.tear_after is not None:
            self.crashed = True
            raise SimulatedCrash("the writer is dead")
        _finish(self.plan.before("commit", ""), "commit", "", self.inner.commit())

    def abort(self) -> None:
        if self.crashed:
            return
        _finish(self.plan.before("abort", ""), "abort", "", self.inner.abort())


class FaultyStore(ObjectStore):
    """A real store with faults injected under its retry, timeout and commit logic.

    Args:
        inner: the real store (any backend); its policy and counters are shared.
        faults: the plan to follow; by default a new :class:`FaultPlan` made from ``schedule``.
        **schedule: :class:`FaultPlan` arguments (``seed``, ``p_transient``, ...).
    """

    def __init__(self, inner: ObjectStore, faults: FaultPlan | None = None, **schedule: Any) -> None:
        self.faults = faults if faults is not None else FaultPlan(**schedule)
        wrap_store(self, inner, _FaultyBackend(inner._backend, self.faults))

    def freeze_listings(self) -> None:
        """From now on listings return what the store held at this moment (stale listings)."""
        self.faults.snapshot = None
        self.faults.snapshot = self.inner._backend.find(self.root)

    def thaw_listings(self) -> None:
        self.faults.snapshot = None
