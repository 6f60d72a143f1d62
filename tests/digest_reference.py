"""The object digest written out from its definition (docs/storage.md), in the plainest way: the
reference that tests/unit/test_digest.py and the storage contract compare :mod:`diloco_async.storage.digest` with.
Do not edit; changing it changes the format of every stored object over 4 MiB."""

from __future__ import annotations

import hashlib

PIECE = 4 * 1024 * 1024


def reference_digest(data: bytes) -> str:
    """sha256 of ``data`` up to 4 MiB; above, sha256 of the prefix line and every 4 MiB piece's
    32-byte sha256, in order."""
    if len(data) <= PIECE:
        return hashlib.sha256(data).hexdigest()
    top = hashlib.sha256(b"diloco-async object digest v1: sha256 of 4194304-byte pieces\n")
    for start in range(0, len(data), PIECE):
        top.update(hashlib.sha256(data[start:start + PIECE]).digest())
    return top.hexdigest()
