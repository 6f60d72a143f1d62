"""The fsspec filesystems under the store, built so that the store's policy is the only retry
layer (DESIGN §5; docs/storage.md, "Which layer retries").

Left alone, one store attempt on S3 is retried by botocore (5 attempts in its default ``legacy``
mode) inside s3fs's own loop (5 attempts): 25 requests and about 30 s against an endpoint that
answers 503, before the store's own retries multiply that again; gcsfs retries each request 6
times with 1..32 s pauses (about 34 s). Here botocore gets ``retries={"total_max_attempts": 1}``
(its other retry settings, such as ``mode``, are kept), s3fs's ``retries`` is set to 1 on the
instance (it has no constructor option; after a failed attempt it still pauses 0.1 s before
raising), and gcsfs's request method is replaced on the instance by
the undecorated one (its retry count is fixed when the class is defined; no option reaches it).
The store's options set ``use_listings_cache``, so fsspec's instance cache does not hand these
filesystems to other code in the process that opens the same bucket with plain options.
"""

from __future__ import annotations

import logging
import types
from typing import Any

import fsspec

__all__ = ["new_filesystem"]

log = logging.getLogger("diloco.storage")


def new_filesystem(protocol: str, storage_options: dict[str, Any],
                   stale: fsspec.AbstractFileSystem | None = None) -> fsspec.AbstractFileSystem:
    """The filesystem for ``protocol``, trying each request once (the store retries), with listing
    caches off on S3 and GCS unless the options say otherwise (a store must see its own writes).
    ``stale``: a filesystem whose credentials expired; it is dropped from fsspec's instance cache
    first, so neither this call nor any later one hands it back, and the new one reads the
    credentials afresh."""
    options = dict(storage_options)
    if protocol in ("s3", "gs"):
        options.setdefault("use_listings_cache", False)
    if protocol == "s3":
        config = dict(options.get("config_kwargs") or {})
        config["retries"] = {**(config.get("retries") or {}), "total_max_attempts": 1}
        options["config_kwargs"] = config
    if stale is not None:
        cache = getattr(type(stale), "_cache", {})
        token = getattr(stale, "_fs_token_", None)
        if cache.get(token) is stale:
            cache.pop(token, None)
    fs = fsspec.filesystem(protocol, **options)
    if protocol == "s3":
        fs.retries = 1  # s3fs's own loop around every call: one attempt
    elif protocol == "gs":
        _one_gcs_attempt(fs)
    return fs


def _one_gcs_attempt(fs: Any) -> None:
    """Make ``fs`` (a gcsfs filesystem) send each request once: its ``_request`` is wrapped by
    ``gcsfs.retry.retry_request`` (6 attempts); the wrapped function, without the loop, replaces
    it on this instance. A gcsfs without that wrapper is left as it is, with a warning."""
    request = getattr(type(fs), "_request", None)
    plain = getattr(request, "__wrapped__", None)
    if plain is None:
        log.warning("%s._request has no retry wrapper to take off (a changed gcsfs?): gcsfs may retry "
                    "under the store", type(fs).__name__)
        return
    fs._request = types.MethodType(plain, fs)
