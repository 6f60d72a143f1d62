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
* Credentials that expire or are rotated (temporary cloud credentials) renew the filesystem
  and the call is tried again (:mod:`diloco_async.storage.credentials`); the stale filesystem leaves fsspec's
  instance cache, so neither this store nor a later one gets the stale client back.
* Part sizes follow the object size and the backend's limits (:mod:`diloco_async.storage.parts`), and the
  size of every object written is checked after the create: a short object is deleted and the
  write raises :class:`IntegrityError` (reason ``size_mismatch``), so it is never announced.
* Every call is synchronous; async callers use ``asyncio.to_thread``.

This module is the façade; the parts live in :mod:`diloco_async.storage.refs` (refs and hashing),
:mod:`diloco_async.storage.retry` (timeouts and retries), :mod:`diloco_async.storage.writer` (exclusive-create writes,
:class:`ObjectWriter`), :mod:`diloco_async.storage.reader` (verified streaming reads) and
:mod:`diloco_async.storage.backends` (one backend per protocol). The store hands the reader and the writer a
:class:`~diloco_async.storage.access.StoreAccess` (backend, root, policy, part settings, its retrying ``call``
and its counters); they import nothing of this module.
"""

from __future__ import annotations

import collections
import copy
import functools
import json
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import fsspec

from diloco_async.storage import backends, reader, writer
from diloco_async.storage.access import StoreAccess
from diloco_async.storage.credentials import CredentialRefresher
from diloco_async.storage.digest import object_digest
from diloco_async.storage.parts import GCS_LIMITS, NO_LIMITS, S3_LIMITS, PartLimits
from diloco_async.storage.refs import IntegrityError, ObjectRef, sha256_hex
from diloco_async.storage.retry import RetryPolicy, call_with_retry, is_transient
from diloco_async.storage.writer import ObjectWriter

__all__ = ["ObjectRef", "ObjectStore", "ObjectWriter", "IntegrityError", "object_digest", "sha256_hex", "is_transient"]

MiB = 1 << 20

_PROTOCOL_ALIASES = {None: "file", "local": "file", "gcs": "gs", "s3a": "s3"}
_PART_LIMITS = {"s3": S3_LIMITS, "gs": GCS_LIMITS}


class ObjectStore:
    """Objects under one root URL (``file://``, ``memory://``, ``s3://``, ``gs://``).

    Args:
        url: root URL; a plain path is taken as ``file://``. Relative local paths are made
            absolute, so child processes see the same folder.
        storage_options: passed to fsspec (endpoints, credentials). Never logged; credentials
            may equally come from the environment (``AWS_*``, ``GOOGLE_APPLICATION_CREDENTIALS``).
        policy: timeouts and retries of one backend call (:class:`~diloco_async.storage.retry.RetryPolicy`:
            ``timeout_s`` bounds one request or one part, a call that takes longer raises
            ``TimeoutError`` and is retried; ``retries`` further attempts after a transient
            error, ``backoff_s`` doubling up to ``max_backoff_s`` with jitter in between;
            ``deadline_s`` bounds one call with all its retries). Default: ``RetryPolicy()``
            (60 s, 3 retries, 0.5..8 s, 300 s). This is the only layer that retries under the
            store: the s3fs, botocore and gcsfs retries are off (docs/storage.md).
        part_nbytes: size of one upload part and of one chunk read. Objects larger than this
            stream in parts (larger ones where the backend's part count needs it). A multiple of
            256 KiB, and at least 5 MiB on S3.
        max_concurrency: parts in flight at once per upload (S3, local files). Reads stream
            with the next chunk prefetched.
        part_limits: the backend's part limits (default: those of the protocol, e.g. 10,000
            parts of 5 MiB..5 GiB on S3); give tighter ones for an S3-compatible store that has them.
        refresh_options: called when the credentials expire, for the storage options of the new
            filesystem (fresh credentials); default: the same options (credentials from the
            environment or profile are read again).

    Attributes:
        policy, part_nbytes, max_concurrency, part_limits: as given (or their defaults).
        access: the :class:`~diloco_async.storage.access.StoreAccess` its reader and writer work through.
        counters: retries, timeouts, aborted uploads, ``credentials_refreshed``,
            ``size_mismatch`` ... of this store and its children.

    Raises:
        ValueError: an unknown protocol or an invalid setting.
    """

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None, *,
                 policy: RetryPolicy | None = None, part_nbytes: int = 16 * MiB, max_concurrency: int = 4,
                 part_limits: PartLimits | None = None,
                 refresh_options: Callable[[], dict[str, Any]] | None = None) -> None:
        protocol, path = fsspec.core.split_protocol(url)
        protocol = _PROTOCOL_ALIASES.get(protocol, protocol)
        if protocol not in backends.PROTOCOLS:
            raise ValueError(f"unsupported store URL {url!r}: protocol {protocol!r} not in "
                             f"{sorted(backends.PROTOCOLS)}")
        if protocol == "file":
            path = os.path.abspath(path)
        policy = RetryPolicy() if policy is None else policy
        if part_nbytes < backends.PART_QUANTUM or part_nbytes % backends.PART_QUANTUM:
            raise ValueError(f"part_nbytes must be a positive multiple of 256 KiB, got {part_nbytes}")
        part_limits = part_limits or _PART_LIMITS.get(protocol, NO_LIMITS)
        if part_nbytes < part_limits.min_part_nbytes:
            raise ValueError(f"part_nbytes must be at least {part_limits.min_part_nbytes} bytes on "
                             f"{protocol}, got {part_nbytes}")
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        self.storage_options = dict(storage_options or {})
        self._refresh_options = refresh_options
        self.counters: collections.Counter[str] = collections.Counter()
        self._counters_lock = threading.Lock()
        self._refresher = CredentialRefresher(self._renew_filesystem, self._count)
        self._access = StoreAccess(
            backend=backends.make_backend(protocol, self.storage_options), protocol=protocol,
            root=path.rstrip("/") if path not in ("/", "") else path, policy=policy, part_nbytes=part_nbytes,
            max_concurrency=max_concurrency, part_limits=part_limits,
            call=functools.partial(call_with_retry, policy, count=self._count, refresher=self._refresher),
            count=self._count)

    def __repr__(self) -> str:  # never the storage options: they may hold credentials
        return f"{type(self).__name__}({self.url!r})"

    @property
    def access(self) -> StoreAccess:
        return self._access

    @property
    def protocol(self) -> str:
        return self._access.protocol

    @property
    def root(self) -> str:
        return self._access.root

    @property
    def url(self) -> str:
        return self._access.url

    @property
    def policy(self) -> RetryPolicy:
        return self._access.policy

    @property
    def part_nbytes(self) -> int:
        return self._access.part_nbytes

    @property
    def max_concurrency(self) -> int:
        return self._access.max_concurrency

    @property
    def part_limits(self) -> PartLimits:
        return self._access.part_limits

    @property
    def _backend(self) -> backends.Backend:  # the test and emulation wrappers look underneath
        return self._access.backend

    @property
    def fs(self) -> fsspec.AbstractFileSystem:
        """The fsspec filesystem underneath (for tools and tests; product code uses the methods)."""
        return self._access.backend.fs

    def child(self, prefix: str) -> ObjectStore:
        """A store rooted at ``{root}/{prefix}`` sharing options, policy, backend and counters."""
        other = copy.copy(self)
        other._access = self._access.under(prefix)
        return other

    def _count(self, name: str, n: int = 1) -> None:
        with self._counters_lock:
            self.counters[name] += n

    def _renew_filesystem(self) -> None:
        """A new fsspec filesystem (fresh credentials) under the backend this store and its
        children share; uploads in progress continue on it."""
        options = self.storage_options if self._refresh_options is None else dict(self._refresh_options())
        backend = self._access.backend
        backend.fs = backends.new_filesystem(self.protocol, options, stale=backend.fs)

    # -- writes -------------------------------------------------------------------------------

    def put(self, key: str, data: bytes) -> ObjectRef:
        """Write ``data`` under ``key`` once. Objects over ``part_nbytes`` go to S3/GCS in parts.

        Raises:
            FileExistsError: the key already exists (it is left untouched).
            TimeoutError, OSError: the store did not take it within the retry policy (nothing
                is published).
        """
        return writer.put_bytes(self._access, key, data)

    def put_json(self, key: str, obj: Any) -> ObjectRef:
        return self.put(key, json.dumps(obj, sort_keys=True, indent=1).encode())

    def put_from_file(self, key: str, local_path: str | os.PathLike, max_concurrency: int | None = None
                      ) -> ObjectRef:
        """Stream a local file to ``key`` (exclusive create), hashing on the way.

        Memory stays at ``max_concurrency + 1`` parts whatever the file size (``max_concurrency``:
        parts in flight at most; None: the store's).

        Raises:
            FileExistsError: the key already exists.
            FileNotFoundError: no file at ``local_path``.
        """
        def chunks() -> Iterator[bytes]:
            with open(local_path, "rb") as fh:
                while chunk := fh.read(self.part_nbytes):
                    yield chunk

        nbytes = os.stat(local_path).st_size  # FileNotFoundError before anything is started
        return writer.upload_chunks(self._access, key, chunks, nbytes, max_concurrency)

    def open_writer(self, key: str, nbytes: int | None = None, max_concurrency: int | None = None) -> ObjectWriter:
        """A writer that streams one object to ``key``; use it as a context manager. ``nbytes``,
        the object's size if known, fixes the part size (else parts grow along the stream).
        ``max_concurrency``: parts in flight (default: the store's); memory holds one more part.

        The object is published when the block exits normally and never when it raises: the
        upload is aborted and the key stays absent (C11). ``writer.ref`` names what was written.
        """
        return ObjectWriter(self._access, key, nbytes, max_concurrency)

    def delete(self, key: str) -> None:
        """Remove one object; a missing key is not an error."""
        a = self._access
        a.call(f"delete {a.where(key)}", a.backend.delete, a.path(key))

    # -- reads --------------------------------------------------------------------------------

    def get(self, ref: ObjectRef) -> bytes:
        """Read and verify one object (large ones stream, hashed on the way).

        Raises:
            FileNotFoundError: no object under ``ref.key``.
            IntegrityError: its size or sha256 differs from ``ref``.
        """
        return reader.read_object(self._access, ref)

    def get_to_file(self, ref: ObjectRef, local_path: str | os.PathLike) -> None:
        """Stream and verify one object into ``local_path`` (replaced atomically, only when the
        bytes verify; nothing is left behind otherwise).

        Raises:
            FileNotFoundError: no object under ``ref.key``.
            IntegrityError: its size or sha256 differs from ``ref``.
        """
        reader.read_to_file(self._access, ref, local_path)

    def verify(self, ref: ObjectRef) -> None:
        """Read ``ref`` through without keeping it; raise if it does not match.

        Raises:
            FileNotFoundError, IntegrityError: as :meth:`get`.
        """
        reader.read_verified(self._access, ref, lambda chunk: None)

    def stream(self, ref: ObjectRef, sink: Callable[[bytes], Any]) -> None:
        """Hand every chunk of ``ref`` to ``sink`` in order, hashing on the way (memory stays at
        a couple of chunks); the size is checked before the first chunk and the digest after the
        last, so a caller discards what it built when this raises.

        Raises:
            FileNotFoundError, IntegrityError: as :meth:`get`.
        """
        reader.read_verified(self._access, ref, sink)

    def get_unverified(self, key: str) -> bytes:
        """Read an object that carries its own integrity data (a manifest, a plan)."""
        return reader.read_unverified(self._access, key)

    def get_range(self, key: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of the object under ``key``, in one ranged request, unchecked:
        the caller checks them (:mod:`diloco_async.storage.pieces` hashes whole pieces against the object's digest).

        Raises:
            FileNotFoundError: no object under ``key``.
        """
        a = self._access
        return a.call(f"read {a.where(key)} [{start}, {end})", a.backend.read, a.path(key), start, end)

    def get_json(self, key: str) -> Any:
        return json.loads(self.get_unverified(key))

    def exists(self, key: str) -> bool:
        a = self._access
        return a.call(f"exists {a.where(key)}", a.backend.exists, a.path(key))

    def list(self, prefix: str) -> list[str]:
        """Keys under ``prefix`` (recursive, sorted), relative to the root; temp files skipped.

        A listing may lag behind writes on some stores: use it to discover, then read exact
        keys; never treat a key missing from a listing as absent.
        """
        return sorted(self.sizes(prefix))

    def folders(self, prefix: str = "") -> list[str]:
        """Names of the folders directly under ``prefix`` (``""``: the root), sorted: one
        non-recursive listing (on S3/GCS, the common prefixes). A root that does not exist has none.
        Like :meth:`list`, it may lag behind writes."""
        a = self._access
        base = a.path(prefix) if prefix.strip("/") else a.root
        return a.call(f"list folders {a.where(prefix)}", self._folders, base)

    def _folders(self, base: str) -> list[str]:
        fs = self._access.backend.fs
        fs.invalidate_cache(base)
        try:
            entries = fs.ls(base, detail=True)
        except FileNotFoundError:
            return []
        names = {e["name"].rstrip("/").rsplit("/", 1)[-1] for e in entries if e.get("type") == "directory"}
        return sorted(n for n in names if n and not n.startswith(backends.TEMP_PREFIX))

    def sizes(self, prefix: str) -> dict[str, int]:
        """``{key: nbytes}`` of the objects under ``prefix`` (as :meth:`list`; ``""``: all)."""
        a = self._access
        base = a.path(prefix) if prefix.strip("/") else a.root
        found = a.call(f"list {a.where(prefix)}", a.backend.find, base)
        root = self.root.lstrip("/")
        out = {}
        for p, nbytes in found.items():
            rel = p.lstrip("/")[len(root):].lstrip("/")
            if rel and not rel.rsplit("/", 1)[-1].startswith(backends.TEMP_PREFIX):
                out[rel] = nbytes
        return out
