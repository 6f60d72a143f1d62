"""A real store with a layer under it: the base of the test and emulation wrappers
(:class:`~diloco_async.storage.faults.FaultyStore` injects faults,
:class:`~diloco_async.storage.latency.LatencyStore` adds round trips). The wrapper keeps the real
store's URL, policy (timeouts, retries), counters and code paths; only the backend requests pass
through :meth:`ForwardingBackend.request` first."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from diloco_async.storage.backends import Backend, Stream, Upload
from diloco_async.storage.store import ObjectStore

__all__ = ["ForwardingBackend", "wrap_store"]


class ForwardingBackend(Backend):
    """Forwards every request of the store to ``inner``, each through :meth:`request` (``op`` is
    ``put``, ``begin``, ``read``, ``open``, ``size``, ``exists``, ``delete`` or ``find``)."""

    def __init__(self, inner: Backend) -> None:
        self.inner = inner
        self.multipart, self.parallel_parts = inner.multipart, inner.parallel_parts
        self.resend_parts, self.part_quantum = inner.resend_parts, inner.part_quantum
        self.reads_into = inner.reads_into

    @property
    def fs(self) -> Any:  # the real backend's, renewed in place when credentials expire
        return self.inner.fs

    @fs.setter
    def fs(self, value: Any) -> None:
        self.inner.fs = value

    def request(self, op: str, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        """Make one request of the real backend (``fn(*args)``); subclasses wrap it."""
        return fn(*args)

    def put(self, path: str, data: bytes) -> None:
        self.request("put", path, self.inner.put, path, data)

    def begin(self, path: str) -> Upload:
        return self.request("begin", path, self.inner.begin, path)

    def read(self, path: str, start: int | None, end: int | None) -> bytes:
        return self.request("read", path, self.inner.read, path, start, end)

    def open_stream(self, path: str, start: int, end: int) -> Stream:
        return self.request("open", path, self.inner.open_stream, path, start, end)

    def size(self, path: str) -> int:
        return self.request("size", path, self.inner.size, path)

    def exists(self, path: str) -> bool:
        return self.request("exists", path, self.inner.exists, path)

    def delete(self, path: str) -> None:
        self.request("delete", path, self.inner.delete, path)

    def find(self, path: str) -> dict[str, int]:
        return self.request("find", path, self.inner.find, path)


def wrap_store(outer: ObjectStore, inner: ObjectStore, backend: Backend) -> None:
    """Make ``outer`` (an uninitialised :class:`ObjectStore` subclass) ``inner`` with ``backend``
    under it: the same URL, policy and counters (shared), ``outer.inner`` naming the real store."""
    vars(outer).update(vars(inner))
    outer.inner = inner
    outer._access = inner.access.on(backend)
