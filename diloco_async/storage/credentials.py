"""Credentials that expire: recognise the error and renew the filesystem (long-running processes).

Temporary cloud credentials (STS session tokens, rotated access keys, OAuth tokens) run out
while a learner or a synchronizer keeps working for days. The client an fsspec filesystem built
at start-up keeps what it read then, so after a rotation every call fails the same way. The
store recognises such an error (:func:`is_expired_credentials`), builds a new filesystem that
reads the credentials again (environment, profile, or the store's ``refresh_options``), and
tries the call once more (:class:`CredentialRefresher`, used by
:func:`diloco_async.storage.retry.call_with_retry`).

Expired-credential errors: S3 ``ExpiredToken``, ``ExpiredTokenException``, ``RequestExpired``,
``TokenRefreshRequired``, ``InvalidToken``, ``InvalidAccessKeyId`` (a rotated-out key),
``InvalidClientTokenId``; GCS HTTP 401. s3fs turns the botocore error into a ``PermissionError``
whose ``__cause__`` holds the original; the chain is searched.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

__all__ = ["EXPIRED_CODES", "is_expired_credentials", "CredentialRefresher"]

log = logging.getLogger("diloco.storage")

#: S3/STS error codes that mean "these credentials are no longer good; fetch new ones"
EXPIRED_CODES = frozenset({"ExpiredToken", "ExpiredTokenException", "RequestExpired", "TokenRefreshRequired",
                           "InvalidToken", "InvalidAccessKeyId", "InvalidClientTokenId"})


def _chain(err: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    cur: BaseException | None = err
    while cur is not None and cur not in seen and len(seen) < 8:
        seen.append(cur)
        cur = cur.__cause__ or cur.__context__
    return seen


def is_expired_credentials(err: BaseException) -> bool:
    """True when ``err`` (or an error it was raised from) says the credentials expired or were
    rotated out: an S3 error code in :data:`EXPIRED_CODES`, or a GCS HTTP 401."""
    for e in _chain(err):
        response = getattr(e, "response", None)  # botocore ClientError
        if isinstance(response, dict) and response.get("Error", {}).get("Code") in EXPIRED_CODES:
            return True
        if type(e).__name__ == "HttpError" and getattr(e, "code", None) == 401:  # gcsfs
            return True
    return False


class CredentialRefresher:
    """Renews one store's filesystem when its credentials expire, once per expiry.

    Calls in flight together (parts of one upload) may all fail with the old credentials; each
    tells :meth:`refresh` the :attr:`generation` it ran with, and only the first one to come
    back rebuilds: the others find a newer generation and simply try again.

    Args:
        rebuild: makes and installs a new filesystem (fresh credentials); may raise.
        count: told ``"credentials_refreshed"`` per rebuild.
    """

    def __init__(self, rebuild: Callable[[], None], count: Callable[[str], None]) -> None:
        self._rebuild, self._count = rebuild, count
        self._lock = threading.Lock()
        #: how many times the filesystem was rebuilt
        self.generation = 0

    def refresh(self, seen_generation: int, what: str, err: BaseException) -> None:
        """Rebuild the filesystem unless someone did since ``seen_generation``."""
        with self._lock:
            if self.generation != seen_generation:
                return
            log.warning("%s: credentials rejected (%s: %s); renewing the filesystem with fresh credentials",
                        what, type(err).__name__, str(err).splitlines()[0][:200] if str(err) else "")
            self._rebuild()
            self.generation += 1
            self._count("credentials_refreshed")
