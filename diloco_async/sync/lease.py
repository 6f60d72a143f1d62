"""The synchronizer's lease on its run: fencing of a second synchronizer (issue 14 item 5).

Objects under ``{run_id}/lease/`` (:mod:`diloco_async.storage.keys`), each written with the store's
exclusive create (``FileExistsError`` if the key exists: ``os.link`` on local files,
``If-None-Match: *`` on S3, ``ifGenerationMatch=0`` on GCS, a lock in ``memory://``)::

    {lease_epoch:08d}/claim.json          who took epoch n: host, pid, since (unix s), ttl_s
    {lease_epoch:08d}/renewal-{k:08d}.json renewal k (unix s); the holder deletes renewal k-1
    {lease_epoch:08d}/released.json       the holder stopped cleanly

* **Taking it.** A synchronizer reads the newest epoch n. The lease is *free* when there is
  none, when epoch n was released, when its newest renewal (or its claim) is older than the
  holder's ``ttl_s`` by the local wall clock, or when the holder ran on this host and its
  process is gone (pid absent, or another process under that pid). Otherwise :func:`acquire`
  raises :class:`LeaseHeld` naming the holder. When free, it creates ``claim.json`` of epoch
  n + 1: of two synchronizers racing, exactly one create succeeds; the other reads again and
  finds the lease held.
* **Holding it.** :meth:`Lease.renew` (every ``renew_s``, in a thread started by
  :meth:`Lease.start_renewing`) checks that no epoch n + 1 exists, then writes the next renewal.
  The holder trusts its lease for ``ttl_s - 2 * renew_s`` after the start of its last successful
  renewal (its monotonic clock), so a taker that waits a whole ``ttl_s`` by its own clock finds
  it silent even with clocks ``renew_s`` apart.
* **Fenced writes.** :class:`FencedStore` calls :meth:`Lease.check` right before every write
  and delete: a successor epoch in the store marks the lease lost for good (:class:`LeaseLost`,
  reason ``lease_lost``); a lease not renewed in time refuses the write (:class:`LeaseExpired`)
  until a renewal succeeds again.

What is left to chance: a write that passed its check and is then delayed by more than the
margin may land after a successor took over. Versions are exclusive-create and carry the lease
epoch, and resume orders checkpoints by lease epoch first, so such a write never overwrites the
successor's objects nor becomes the checkpoint a resume picks (docs/resume-and-fencing.md).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psutil

from diloco_async.storage import keys
from diloco_async.storage.store import ObjectStore
from diloco_async.sync.lifecycle import Lifecycle, Phase

__all__ = ["Holder", "Lease", "LeaseHeld", "LeaseLost", "LeaseExpired", "FencedStore", "Fence", "acquire",
           "read_holder"]

log = logging.getLogger("diloco.synchronizer")


@dataclass(frozen=True)
class Holder:
    """The holder of a lease epoch as the store shows it.

    ``since_unix`` and ``renewed_unix`` are unix seconds by the holder's clock; ``started_unix``
    is when the holder's process started (to tell a reused pid from the holder itself).
    """

    lease_epoch: int
    host: str
    pid: int
    since_unix: float
    renewed_unix: float
    ttl_s: float
    started_unix: float = 0.0
    released: bool = False

    def describe(self) -> str:
        since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.since_unix))
        return f"host={self.host} pid={self.pid} epoch={self.lease_epoch} since={since}"


class LeaseHeld(RuntimeError):
    """Another synchronizer holds the run's lease and renews it: this one must not start."""

    def __init__(self, run_id: str, holder: Holder, now_unix: float) -> None:
        self.holder = holder
        super().__init__(f"run {run_id} is held by another synchronizer ({holder.describe()}; renewed "
                         f"{now_unix - holder.renewed_unix:.1f}s ago, ttl {holder.ttl_s:.0f}s): refusing to start")


class LeaseLost(RuntimeError):
    """A newer lease epoch exists: this synchronizer must stop publishing and checkpointing."""


class LeaseExpired(RuntimeError):
    """The lease was not renewed in time: writes wait until a renewal succeeds."""


def _process_started_unix(pid: int) -> float | None:
    """Start time of process ``pid`` (unix s), or None when there is none."""
    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return None
    except psutil.AccessDenied:
        return 0.0  # it exists


def _gone(holder: Holder) -> bool:
    """The holder ran on this host and its process is no longer there."""
    if holder.host != socket.gethostname():
        return False
    started = _process_started_unix(holder.pid)
    if started is None:
        return True
    return bool(holder.started_unix and started and abs(started - holder.started_unix) > 1.0)


def _why_free(holder: Holder, now_unix: float) -> str:
    if holder.released:
        return "released"
    silent = now_unix - holder.renewed_unix
    return f"not renewed for {silent:.1f}s" if silent > holder.ttl_s else "its process is gone"


def read_holder(store: ObjectStore, run_id: str) -> Holder | None:
    """The holder of the newest lease epoch of ``run_id``, or None when no epoch was ever taken.

    Raises:
        OSError, TimeoutError: the store could not be read.
    """
    found: dict[int, dict[str, list[int]]] = {}
    for key in store.list(keys.lease_prefix(run_id)):
        parsed = keys.parse_lease_key(run_id, key)
        if parsed is not None:
            epoch, kind, k = parsed
            found.setdefault(epoch, {}).setdefault(kind, []).append(k)
    claimed = sorted(e for e, kinds in found.items() if "claim" in kinds)
    if not claimed:
        return None
    epoch = claimed[-1]
    claim = store.get_json(keys.lease_claim_key(run_id, epoch))
    renewed = float(claim["since_unix"])
    for k in sorted(found[epoch].get("renewal", []), reverse=True):
        try:
            renewed = max(renewed, float(store.get_json(keys.lease_renewal_key(run_id, epoch, k))["renewed_unix"]))
            break
        except FileNotFoundError:  # deleted by the holder since the listing
            continue
    return Holder(lease_epoch=epoch, host=str(claim["host"]), pid=int(claim["pid"]),
                  since_unix=float(claim["since_unix"]), renewed_unix=renewed, ttl_s=float(claim["ttl_s"]),
                  started_unix=float(claim.get("started_unix", 0.0)), released="released" in found[epoch])


def acquire(store: ObjectStore, run_id: str, ttl_s: float, renew_s: float, *,
            wall: Callable[[], float] = time.time, clock: Callable[[], float] = time.monotonic,
            attempts: int = 3) -> Lease:
    """Take the next lease epoch of ``run_id`` (see the module doc), blocking.

    Args:
        ttl_s: how long a lease not renewed stays held (s); renew_s: the renewal period (s).

    Raises:
        LeaseHeld: another synchronizer holds the lease and renews it.
        ValueError: ``renew_s`` is not below ``ttl_s / 2``.
    """
    if not 0 < 2 * renew_s < ttl_s:
        raise ValueError(f"lease renewal period {renew_s}s must be below half the ttl {ttl_s}s")
    me = os.getpid()
    started = _process_started_unix(me) or wall()
    holder = None
    for _ in range(attempts):
        holder = read_holder(store, run_id)
        now = wall()
        if holder is not None and not (holder.released or now - holder.renewed_unix > holder.ttl_s or _gone(holder)):
            raise LeaseHeld(run_id, holder, now)
        epoch = 1 if holder is None else holder.lease_epoch + 1
        t0 = clock()
        body = {"run_id": run_id, "lease_epoch": epoch, "host": socket.gethostname(), "pid": me,
                "since_unix": now, "started_unix": started, "ttl_s": ttl_s, "renew_s": renew_s,
                "token": uuid.uuid4().hex}
        try:
            store.put_json(keys.lease_claim_key(run_id, epoch), body)
        except FileExistsError:  # another synchronizer took this epoch first: look again
            continue
        if holder is not None:
            log.warning("run %s: took lease epoch %d over from %s (%s)", run_id, epoch, holder.describe(),
                        _why_free(holder, now))
        log.info("run %s: lease epoch %d taken (ttl %.0fs, renewed every %.1fs)", run_id, epoch, ttl_s, renew_s)
        return Lease(store, run_id, epoch, ttl_s, renew_s, valid_from_s=t0, clock=clock, wall=wall)
    assert holder is not None
    raise LeaseHeld(run_id, read_holder(store, run_id) or holder, wall())


class Lease:
    """Lease epoch ``lease_epoch`` of a run, held by this process (made by :func:`acquire`).

    Thread-safe: the renewal task and the writer threads share it. ``lost`` is set (for good)
    once a successor epoch is seen.
    """

    def __init__(self, store: ObjectStore, run_id: str, lease_epoch: int, ttl_s: float, renew_s: float, *,
                 valid_from_s: float, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        self.store, self.run_id, self.lease_epoch = store, run_id, lease_epoch
        self.ttl_s, self.renew_s = ttl_s, renew_s
        self.clock, self.wall = clock, wall
        self.lost: str | None = None
        self.renewal_failures = 0
        self._renewals = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._valid_until_s = valid_from_s + self.trusted_s

    @property
    def trusted_s(self) -> float:
        """How long after the start of a successful renewal the holder trusts its lease (s)."""
        return self.ttl_s - 2 * self.renew_s

    def _successor(self) -> None:
        """Raise :class:`LeaseLost` (and remember it) when epoch ``lease_epoch + 1`` exists."""
        if self.lost is None and self.store.exists(keys.lease_claim_key(self.run_id, self.lease_epoch + 1)):
            holder = read_holder(self.store, self.run_id)
            who = holder.describe() if holder is not None else f"epoch {self.lease_epoch + 1}"
            self.lost = (f"lease_lost: run {self.run_id} lease epoch {self.lease_epoch} was taken over by "
                         f"{who}")
        if self.lost is not None:
            raise LeaseLost(self.lost)

    def check(self) -> None:
        """Right before a write: the lease is still ours and was renewed in time (blocking).

        Raises:
            LeaseLost: a successor epoch exists (for good).
            LeaseExpired: not renewed for ``trusted_s``; the write must not happen now.
        """
        self._successor()
        if self.clock() > self._valid_until_s:
            raise LeaseExpired(f"run {self.run_id} lease epoch {self.lease_epoch} not renewed for over "
                               f"{self.trusted_s:.0f}s: write refused")

    def renew(self) -> None:
        """Write the next renewal, then delete the previous one (blocking).

        Raises:
            LeaseLost: a successor epoch exists.
            OSError, TimeoutError: the store failed (the lease stays trusted until it expires).
        """
        with self._lock:
            t0 = self.clock()
            self._successor()
            k = self._renewals + 1
            self.store.put_json(keys.lease_renewal_key(self.run_id, self.lease_epoch, k),
                                {"lease_epoch": self.lease_epoch, "renewed_unix": self.wall(), "pid": os.getpid()})
            self._renewals = k
            self._valid_until_s = max(self._valid_until_s, t0 + self.trusted_s)
            if k > 1:
                self.store.delete(keys.lease_renewal_key(self.run_id, self.lease_epoch, k - 1))

    def start_renewing(self) -> None:
        """Renew every ``renew_s`` in a daemon thread until :meth:`stop_renewing` or a successor
        is seen. A failed renewal is counted (``renewal_failures``), logged and tried again at the
        next period; the lease stays trusted until it expires."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._renew_loop, name=f"lease-{self.lease_epoch}", daemon=True)
            self._thread.start()

    def stop_renewing(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.renew_s + 5.0)

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.renew_s):
            try:
                self.renew()
            except LeaseLost as err:
                log.error("%s", err)
                return
            except Exception as err:
                self.renewal_failures += 1
                log.warning("run %s: renewal of lease epoch %d failed (%s: %s); retrying in %.1fs", self.run_id,
                            self.lease_epoch, type(err).__name__, err, self.renew_s)

    def release(self) -> None:
        """Stop renewing and mark the lease released after a clean stop, so a resume may take it
        at once (blocking; nothing is written when it was lost)."""
        self.stop_renewing()
        if self.lost is None:
            self.store.put_json(keys.lease_released_key(self.run_id, self.lease_epoch),
                                {"lease_epoch": self.lease_epoch, "released_unix": self.wall()})
            log.info("run %s: lease epoch %d released", self.run_id, self.lease_epoch)


class FencedStore:
    """An :class:`~diloco_async.storage.store.ObjectStore` whose writes and deletes first check a lease.

    Reads pass through unchanged. Every ``put``/``put_json``/``put_from_file``/``open_writer``/
    ``delete`` calls :meth:`Lease.check` first and raises what it raises.
    """

    def __init__(self, store: ObjectStore, lease: Lease) -> None:
        self._store, self.lease = store, lease

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def __repr__(self) -> str:
        return f"FencedStore({self._store!r}, lease epoch {self.lease.lease_epoch})"

    def put(self, key: str, data: bytes) -> Any:
        self.lease.check()
        return self._store.put(key, data)

    def put_json(self, key: str, obj: Any) -> Any:
        self.lease.check()
        return self._store.put_json(key, obj)

    def put_from_file(self, key: str, local_path: str | os.PathLike) -> Any:
        self.lease.check()
        return self._store.put_from_file(key, local_path)

    def open_writer(self, key: str, nbytes: int | None = None, max_concurrency: int | None = None) -> Any:
        self.lease.check()
        return self._store.open_writer(key, nbytes, max_concurrency)

    def delete(self, key: str) -> None:
        self.lease.check()
        self._store.delete(key)


class Fence:
    """The actor's side of its lease on the run (the renewal runs in the lease's own thread): the
    lease, its epoch and the store whose every write and delete checks it.

    Args:
        store: the run's object store.
        lease: this process's lease on the run (:func:`acquire`), or None: no fencing (epoch 0,
            the store as it is).
    """

    def __init__(self, store: ObjectStore, lease: Lease | None = None) -> None:
        self.lease = lease
        self.lease_epoch = lease.lease_epoch if lease is not None else 0
        self.store = FencedStore(store, lease) if lease is not None else store

    def check(self, life: Lifecycle, counters: Counter[str]) -> bool:
        """Called at every pass of the actor. A lost lease (seen by the renewal or by a fenced
        write) moves ``life`` to FENCED at once: no round, checkpoint or summary is written any
        more; learners are not told to stop. Keeps ``lease_renewal_failures`` in ``counters``
        (with a lease) and counts ``lease_lost``. True: the run was fenced by this call."""
        if self.lease is None:
            return False
        counters["lease_renewal_failures"] = self.lease.renewal_failures
        if not self.lease.lost or life.phase in (Phase.FENCED, Phase.FINISHED):
            return False
        counters["lease_lost"] += 1
        log.error("%s; this synchronizer stops publishing and checkpointing and exits (phase was %s)",
                  self.lease.lost, life.phase.value)
        life.move(Phase.FENCED)
        life.stop_reason = "lease_lost"
        return True

    def raise_lost(self) -> None:
        """After the actor stopped FENCED: raise :class:`LeaseLost` with the reason."""
        assert self.lease is not None and self.lease.lost
        raise LeaseLost(self.lease.lost)
