"""Object-store layer over fsspec: immutable keys, verified reads, checkpoints (DESIGN §5).

* :mod:`diloco_async.storage.store`: :class:`ObjectStore` chosen by URL (``file://``, ``memory://``,
  ``s3://``, ``gs://``), exclusive create, streamed parts, timeouts and retries; built from
  :mod:`diloco_async.storage.refs` (refs), :mod:`diloco_async.storage.digest` (object digests),
  :mod:`diloco_async.storage.retry` (timeouts, retries), :mod:`diloco_async.storage.writer`
  (exclusive-create writes) and :mod:`diloco_async.storage.reader` (verified reads),
  which see the store as a :class:`~diloco_async.storage.access.StoreAccess`;
* :mod:`diloco_async.storage.backends`: one backend per protocol (single requests, no policy), on the
  filesystems of :mod:`diloco_async.storage.filesystems` (one attempt per request: only the store retries);
* :mod:`diloco_async.storage.keys` and :mod:`diloco_async.storage.checkpoint`: the run layout and its checkpoints;
* :mod:`diloco_async.storage.options`: the storage options passed to child processes in the environment;
* :mod:`diloco_async.storage.gc`: garbage collection behind the newest verified checkpoint;
* :mod:`diloco_async.storage.faults`: :class:`~diloco_async.storage.faults.FaultyStore` for fault-injection tests.
"""

from diloco_async.storage.options import STORAGE_OPTIONS_ENV, storage_options_from_env
from diloco_async.storage.store import (
           IntegrityError,
           ObjectRef,
           ObjectStore,
           ObjectWriter,
           is_transient,
           object_digest,
           sha256_hex,
)

__all__ = ["IntegrityError", "ObjectRef", "ObjectStore", "ObjectWriter", "is_transient", "object_digest", "sha256_hex",
           "STORAGE_OPTIONS_ENV", "storage_options_from_env"]
