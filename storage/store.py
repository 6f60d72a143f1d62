"""The object store: a narrow interface over fsspec, chosen by URL (DESIGN §5).

* ``put`` writes an immutable object with exclusive create: an existing key is never
  overwritten (``FileExistsError``). Local files are written to a unique temporary name and
  published with ``os.link`` (atomic, fails if the key exists), so a crash never leaves a torn
  object under a final key; object stores get a single conditional PUT (S3 ``If-None-Match``,
  GCS generation match 0) through fsspec's ``mode="create"``.
* ``get`` takes an :class:`ObjectRef` (key, size, sha256) and verifies size and digest of what it
  read; a mismatch raises :class:`IntegrityError`. Readers trust only what an announcement or a
  manifest names.
* Every call is synchronous; async callers use ``asyncio.to_thread``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import uuid
from dataclasses import dataclass
from typing import Any

import fsspec

__all__ = ["ObjectRef", "ObjectStore", "IntegrityError", "sha256_hex"]

log = logging.getLogger("diloco.storage")


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


_MEMORY_LOCK = threading.Lock()


class ObjectStore:
    """Objects under one root URL (``file://``, ``memory://``, ``s3://``, ``gs://``).

    Args:
        url: root URL; a plain path is taken as ``file://``. Relative local paths are made
            absolute, so child processes see the same folder.
        storage_options: passed to fsspec (endpoints, credentials). Never logged.
    """

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        protocol, path = fsspec.core.split_protocol(url)
        protocol = protocol or "file"
        if protocol in ("file", "local"):
            path = os.path.abspath(path)
        self.protocol = protocol
        self.root = path.rstrip("/") if path not in ("/", "") else path
        self.url = f"{protocol}://{self.root}"
        self.storage_options = dict(storage_options or {})
        self.fs = fsspec.filesystem(protocol, **self.storage_options)

    def __repr__(self) -> str:
        return f"ObjectStore({self.url!r})"

    def child(self, prefix: str) -> "ObjectStore":
        """A store rooted at ``{root}/{prefix}`` sharing the same options."""
        return ObjectStore(f"{self.url}/{prefix.strip('/')}", self.storage_options)

    def _path(self, key: str) -> str:
        key = key.strip("/")
        if not key or ".." in key.split("/"):
            raise ValueError(f"invalid object key {key!r}")
        return f"{self.root}/{key}"

    # -- writes -------------------------------------------------------------------------------

    def put(self, key: str, data: bytes) -> ObjectRef:
        """Write ``data`` under ``key`` once.

        Raises:
            FileExistsError: the key already exists (it is left untouched).
        """
        path = self._path(key)
        if self.protocol in ("file", "local"):
            self._put_local(path, data)
        elif self.protocol == "memory":
            with _MEMORY_LOCK:
                if self.fs.exists(path):
                    raise FileExistsError(f"object exists: {self.url}/{key.strip('/')}")
                self.fs.pipe_file(path, bytes(data))
        else:
            try:
                self.fs.pipe_file(path, bytes(data), mode="create")
            except FileExistsError:
                raise FileExistsError(f"object exists: {self.url}/{key.strip('/')}") from None
        return ObjectRef(key=key.strip("/"), nbytes=len(data), sha256=sha256_hex(data))

    @staticmethod
    def _put_local(path: str, data: bytes) -> None:
        folder = os.path.dirname(path)
        os.makedirs(folder, exist_ok=True)
        tmp = os.path.join(folder, f".tmp-{uuid.uuid4().hex}")
        try:
            with open(tmp, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            try:
                os.link(tmp, path)
            except FileExistsError:
                raise FileExistsError(f"object exists: file://{path}") from None
        finally:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass

    def put_json(self, key: str, obj: Any) -> ObjectRef:
        return self.put(key, json.dumps(obj, sort_keys=True, indent=1).encode())

    def delete(self, key: str) -> None:
        """Remove one object; a missing key is not an error."""
        try:
            self.fs.rm_file(self._path(key))
        except FileNotFoundError:
            pass

    # -- reads --------------------------------------------------------------------------------

    def get(self, ref: ObjectRef) -> bytes:
        """Read and verify one object.

        Raises:
            FileNotFoundError: no object under ``ref.key``.
            IntegrityError: its size or sha256 differs from ``ref``.
        """
        data = self.fs.cat_file(self._path(ref.key))
        if len(data) != ref.nbytes:
            raise IntegrityError(f"{ref.key}: size {len(data)} bytes, expected {ref.nbytes}")
        digest = sha256_hex(data)
        if digest != ref.sha256:
            raise IntegrityError(f"{ref.key}: sha256 {digest[:12]}…, expected {ref.sha256[:12]}…")
        return data

    def get_unverified(self, key: str) -> bytes:
        """Read an object that carries its own integrity data (a manifest, a plan)."""
        return self.fs.cat_file(self._path(key))

    def get_json(self, key: str) -> Any:
        return json.loads(self.get_unverified(key))

    def exists(self, key: str) -> bool:
        return self.fs.exists(self._path(key))

    def list(self, prefix: str) -> list[str]:
        """Keys under ``prefix`` (recursive, sorted), relative to the root; temp files skipped."""
        base = self._path(prefix)
        try:
            found = self.fs.find(base)
        except FileNotFoundError:
            return []
        root = self.root.lstrip("/")
        keys = []
        for p in found:
            rel = p.lstrip("/")[len(root):].lstrip("/")
            if not rel.rsplit("/", 1)[-1].startswith(".tmp-"):
                keys.append(rel)
        return sorted(keys)
