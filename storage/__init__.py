"""Object-store layer over fsspec: immutable keys, verified reads, checkpoints (DESIGN §5)."""

from storage.store import IntegrityError, ObjectRef, ObjectStore, sha256_hex

__all__ = ["IntegrityError", "ObjectRef", "ObjectStore", "sha256_hex"]
