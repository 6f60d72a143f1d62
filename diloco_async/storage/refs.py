"""Naming and checking one immutable object: :class:`ObjectRef` (key, size, digest).

Readers trust only what a ref names: :func:`check_ref` compares what was read with it and
raises :class:`IntegrityError` on any difference (DESIGN §5).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

__all__ = ["ObjectRef", "IntegrityError", "sha256_hex", "check_ref"]


class IntegrityError(ValueError):
    """An object's size or sha256 does not match the reference that named it.

    Attributes:
        reason: ``size_mismatch`` or ``digest`` (the rejection reasons counted upstream).
    """

    def __init__(self, message: str, reason: str = "digest") -> None:
        super().__init__(message)
        self.reason = reason


def sha256_hex(data: bytes) -> str:
    """Lowercase hex sha256 of ``data`` (64 characters): the digest of an object of at most
    4 MiB; :func:`diloco_async.storage.digest.object_digest` gives that of an object of any size."""
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class ObjectRef:
    """What a reader needs to fetch and verify one immutable object.

    Attributes:
        key: path relative to the store root, ``/``-separated.
        nbytes: exact size in bytes.
        sha256: hex digest of the bytes (:func:`diloco_async.storage.digest.object_digest`): their sha256 up
            to 4 MiB; above, the sha256 of the sha256 of each 4 MiB piece. Objects over 4 MiB
            written before piece digests carry their whole sha256, which readers still accept.
    """

    key: str
    nbytes: int
    sha256: str

    def to_json(self) -> dict:
        return {"key": self.key, "nbytes": self.nbytes, "sha256": self.sha256}

    @classmethod
    def from_json(cls, d: dict) -> ObjectRef:
        return cls(key=str(d["key"]), nbytes=int(d["nbytes"]), sha256=str(d["sha256"]))


def check_ref(ref: ObjectRef, nbytes: int, digest: str) -> None:
    """Raise :class:`IntegrityError` unless ``nbytes`` bytes with hex sha256 ``digest`` are
    exactly what ``ref`` names (the size is compared first)."""
    if nbytes != ref.nbytes:
        raise IntegrityError(f"{ref.key}: size {nbytes} bytes, expected {ref.nbytes}", reason="size_mismatch")
    if digest != ref.sha256:
        raise IntegrityError(f"{ref.key}: sha256 {digest[:12]}…, expected {ref.sha256[:12]}…")
