"""Added network latency through the real store interface (issue 13: application-level delay
where the kernel has no ``netem``).

:class:`LatencyStore` is an :class:`~diloco_async.storage.store.ObjectStore` built from a real one, like
:class:`~diloco_async.storage.faults.FaultyStore`: it keeps the real store's URL, policy (timeouts, retries) and
code paths, and puts a layer *under* them, around the backend, that waits one round trip
(``2 x delay_s``, the one-way delay there and back) before each request the backend makes:

* ``put``, ``begin`` (S3: create the multipart upload), each part ``send``, ``commit``, ``abort``;
* ``read`` (one ranged GET), ``open`` (the streamed GET's first byte; the chunks that follow come on
  the same response and wait no more), ``size``, ``exists``, ``delete``, ``find`` (one listing).

Limits: the latency is per request, not per packet: it does not model TCP's window growth (slow
start) or the bandwidth-delay product of a long transfer; the link's rate is the kernel's shaping.
Requests in flight at once (parallel parts) wait their round trips at the same time, as on a
real link. The wait counts against the store's per-call timeout, as real latency would.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from diloco_async.storage.backends import Backend, Upload
from diloco_async.storage.store import ObjectStore
from diloco_async.storage.wrapped import ForwardingBackend, wrap_store

__all__ = ["LatencyStore"]


class _LatencyBackend(ForwardingBackend):
    def __init__(self, inner: Backend, rtt_s: float) -> None:
        super().__init__(inner)
        self.rtt_s = rtt_s
        #: requests delayed so far (one round trip each)
        self.requests = 0

    def round_trip(self) -> None:
        """Wait one round trip (called before each request)."""
        self.requests += 1
        time.sleep(self.rtt_s)

    def request(self, op: str, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        self.round_trip()
        return fn(*args)

    def begin(self, path: str) -> Upload:
        return _LatencyUpload(super().begin(path), self)  # each part, the commit and an abort wait too


class _LatencyUpload:
    def __init__(self, inner: Upload, backend: _LatencyBackend) -> None:
        self.inner, self.backend = inner, backend

    def send(self, number: int, offset: int, data: bytes, last: bool) -> None:
        self.backend.round_trip()
        self.inner.send(number, offset, data, last)

    def commit(self) -> None:
        self.backend.round_trip()
        self.inner.commit()

    def abort(self) -> None:
        self.backend.round_trip()
        self.inner.abort()


class LatencyStore(ObjectStore):
    """A real store whose every backend request waits one round trip first (module docstring).

    Args:
        inner: the real store (any backend); its policy and counters are shared.
        delay_s: the one-way added latency in seconds (a request waits ``2 x delay_s``).

    Raises:
        ValueError: ``delay_s`` negative or not finite.
    """

    def __init__(self, inner: ObjectStore, delay_s: float) -> None:
        if not 0 <= delay_s < float("inf"):
            raise ValueError(f"delay_s must be a finite number >= 0, got {delay_s!r}")
        self.delay_s = float(delay_s)
        wrap_store(self, inner, _LatencyBackend(inner._backend, 2 * self.delay_s))

    @property
    def requests_delayed(self) -> int:
        """Requests that waited a round trip so far (this store and its children)."""
        return self._backend.requests  # type: ignore[attr-defined]
