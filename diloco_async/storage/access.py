"""What the reader and the writer need of one store, as one value (DESIGN §5).

:class:`~diloco_async.storage.store.ObjectStore` builds a :class:`StoreAccess` once (and one per
:meth:`~diloco_async.storage.store.ObjectStore.child`) and hands it to :mod:`diloco_async.storage.reader` and
:mod:`diloco_async.storage.writer`: the backend, where keys live, the retry policy, the part settings, and the
two callables that carry the store's state (``call``: one backend call under the timeout and the
retries, renewing expired credentials; ``count``: the store's counters). The reader and writer
import nothing of :mod:`diloco_async.storage.store`, so the façade sits above its parts, never beside them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from diloco_async.storage.backends import TEMP_PREFIX, Backend
from diloco_async.storage.parts import PartLimits
from diloco_async.storage.retry import RetryPolicy

__all__ = ["StoreAccess", "Call", "Count"]


class Call(Protocol):
    """``call(what, fn, *args, retry=True)``: ``fn(*args)`` under the store's timeout, retried on
    transient errors unless ``retry`` is False (see :func:`diloco_async.storage.retry.call_with_retry`);
    ``what`` names the call in errors and logs."""

    def __call__(self, what: str, fn: Callable[..., Any], *args: Any, retry: bool = True) -> Any: ...


class Count(Protocol):
    """``count(name, n=1)``: add ``n`` to the store's counter ``name`` (``retries``, ``timeouts`` ...)."""

    def __call__(self, name: str, n: int = 1) -> None: ...


@dataclass(frozen=True)
class StoreAccess:
    """One store as its reader and writer see it.

    Attributes:
        backend: the backend of the protocol (shared by a store, its children and its wrappers;
            its filesystem is renewed in place when credentials expire).
        protocol: ``file``, ``memory``, ``s3`` or ``gs``.
        root: the full path keys are under (``bucket/prefix``, ``/abs/path``), no trailing ``/``.
        policy: timeouts and retries of one backend call.
        part_nbytes: preferred size of one upload part and of one chunk read, bytes.
        max_concurrency: parts in flight at once per upload.
        part_limits: the backend's part limits (:mod:`diloco_async.storage.parts`).
        call: one backend call under ``policy`` (:class:`Call`).
        count: the store's counters (:class:`Count`).
    """

    backend: Backend
    protocol: str
    root: str
    policy: RetryPolicy
    part_nbytes: int
    max_concurrency: int
    part_limits: PartLimits
    call: Call
    count: Count

    @property
    def url(self) -> str:
        """``{protocol}://{root}``."""
        return f"{self.protocol}://{self.root}"

    def path(self, key: str) -> str:
        """The backend path of ``key`` (relative to :attr:`root`).

        Raises:
            ValueError: an empty key, one with a ``..`` segment, or one named like a temporary file.
        """
        key = key.strip("/")
        if not key or ".." in key.split("/") or key.rsplit("/", 1)[-1].startswith(TEMP_PREFIX):
            raise ValueError(f"invalid object key {key!r}")
        return f"{self.root}/{key}"

    def where(self, key: str) -> str:
        """``key`` as a URL, for errors and logs."""
        return f"{self.url}/{key.strip('/')}"

    def under(self, prefix: str) -> StoreAccess:
        """The same store rooted at ``{root}/{prefix}``."""
        return dataclasses.replace(self, root=self.path(prefix))

    def on(self, backend: Backend) -> StoreAccess:
        """The same store with ``backend`` under it (a wrapper's, :mod:`diloco_async.storage.wrapped`)."""
        return dataclasses.replace(self, backend=backend)
