"""Object-store layer over fsspec: immutable keys, verified reads, checkpoints (DESIGN §5).

* :mod:`storage.store`: :class:`ObjectStore` chosen by URL (``file://``, ``memory://``,
  ``s3://``, ``gs://``), exclusive create, streamed parts, timeouts and retries; built from
  :mod:`storage.refs` (refs), :mod:`storage.digest` (object digests), :mod:`storage.retry` (timeouts, retries),
  :mod:`storage.writer` (exclusive-create writes) and :mod:`storage.reader` (verified reads),
  which see the store as a :class:`~storage.access.StoreAccess`;
* :mod:`storage.backends`: one backend per protocol (single requests, no policy), on the
  filesystems of :mod:`storage.filesystems` (one attempt per request: only the store retries);
* :mod:`storage.keys` and :mod:`storage.checkpoint`: the run layout and its checkpoints;
* :mod:`storage.options`: the storage options passed to child processes in the environment;
* :mod:`storage.gc`: garbage collection behind the newest verified checkpoint;
* :mod:`storage.faults`: :class:`~storage.faults.FaultyStore` for fault-injection tests.
"""

from storage.options import STORAGE_OPTIONS_ENV, storage_options_from_env
from storage.store import IntegrityError, ObjectRef, ObjectStore, ObjectWriter, is_transient, object_digest, sha256_hex

__all__ = ["IntegrityError", "ObjectRef", "ObjectStore", "ObjectWriter", "is_transient", "object_digest", "sha256_hex",
           "STORAGE_OPTIONS_ENV", "storage_options_from_env"]
