"""Timeouts and retries of backend calls (bug case C08).

Every backend call runs under a per-call timeout (a hung call raises ``TimeoutError``) and a
transient error is retried with jittered exponential backoff, within an overall deadline.
``FileExistsError``, ``FileNotFoundError`` and ``IntegrityError`` are never retried. Expired
credentials renew the filesystem and are tried once more (:mod:`diloco_async.storage.credentials`).
"""

from __future__ import annotations

import concurrent.futures
import errno
import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from diloco_async.storage.credentials import CredentialRefresher, is_expired_credentials
from diloco_async.storage.refs import IntegrityError

__all__ = ["RetryPolicy", "Backoff", "is_transient", "run_with_timeout", "call_with_retry"]

log = logging.getLogger("diloco.storage")

_PERMANENT_ERRNOS = {errno.EINVAL, errno.ENOSYS, errno.EPERM, errno.EACCES, errno.ENOSPC, errno.EROFS,
                     errno.EEXIST, errno.ENOENT, errno.EISDIR, errno.ENOTDIR, errno.ENAMETOOLONG,
                     getattr(errno, "EREMCHG", errno.ENOENT)}
_RETRYABLE_HTTP = {408, 429, 500, 502, 503, 504}


def is_transient(err: BaseException) -> bool:
    """True for errors that another attempt may cure: timeouts, dropped connections, 5xx/429.

    Never transient: a key that exists or is missing, a digest mismatch, a permission or
    argument error.
    """
    if isinstance(err, (IntegrityError, FileExistsError, FileNotFoundError, PermissionError,
                        IsADirectoryError, NotADirectoryError)):
        return False
    if isinstance(err, (TimeoutError, ConnectionError)):
        return True
    if isinstance(err, OSError):
        return err.errno not in _PERMANENT_ERRNOS
    code = getattr(err, "code", None)  # gcsfs HttpError
    if type(err).__name__ == "HttpError" and isinstance(code, int):
        return code in _RETRYABLE_HTTP
    module = type(err).__module__ or ""
    if module.startswith("aiohttp"):  # ClientConnectionError, ClientPayloadError, ...
        return type(err).__name__ not in ("InvalidURL", "ClientResponseError", "ContentTypeError")
    if module.startswith("botocore"):  # EndpointConnectionError, ReadTimeoutError, ...
        return "Connection" in type(err).__name__ or "Timeout" in type(err).__name__
    return False


@dataclass(frozen=True)
class RetryPolicy:
    """How long one backend call may take and how often it is tried again: the ``policy`` of an
    :class:`~diloco_async.storage.store.ObjectStore` (its defaults are the store's).

    Attributes:
        timeout_s: bound on one attempt (one request or one part); None: unbounded.
        retries: further attempts after a transient error or a timeout.
        backoff_s: wait before the first retry; doubles each time, up to ``max_backoff_s``,
            with jitter (see :class:`Backoff`), seconds.
        max_backoff_s: the longest wait between two attempts, seconds.
        deadline_s: bound on one call including all its retries, seconds.

    Raises:
        ValueError: a bound that is not positive, or a negative count or wait.
    """

    timeout_s: float | None = 60.0
    retries: int = 3
    backoff_s: float = 0.5
    max_backoff_s: float = 8.0
    deadline_s: float = 300.0

    def __post_init__(self) -> None:
        if self.timeout_s is not None and self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0 or None, got {self.timeout_s}")
        if self.retries < 0 or self.backoff_s < 0 or self.max_backoff_s < 0 or self.deadline_s <= 0:
            raise ValueError(f"invalid retry policy: retries={self.retries}, backoff_s={self.backoff_s}, "
                             f"max_backoff_s={self.max_backoff_s}, deadline_s={self.deadline_s}")

    def backoff(self, rng: random.Random | None = None) -> Backoff:
        """The :class:`Backoff` of this policy (``backoff_s`` doubling up to ``max_backoff_s``)."""
        return Backoff(self.backoff_s, self.max_backoff_s, rng)


class Backoff:
    """Jittered exponential pauses: the project's one backoff, for every retry loop (store calls,
    streamed reads, the learner's reconnects and announcements, the tracking client).

    The n-th pause (from 0) is drawn uniformly from ``[0.5, 1] x`` the n-th delay in seconds, where
    the first delay is ``first_s`` and each next one doubles, up to ``max_s``; :meth:`reset` (after
    a success) starts over. The jitter spreads out clients that failed together (learners after a
    synchronizer restart, parts of one upload).

    Args:
        first_s: the first delay, seconds.
        max_s: the largest delay, seconds.
        rng: the random source of the jitter (tests pass a seeded one; default: :mod:`random`).

    Raises:
        ValueError: a negative delay.
    """

    def __init__(self, first_s: float, max_s: float, rng: random.Random | None = None) -> None:
        if first_s < 0 or max_s < 0:
            raise ValueError(f"backoff delays must be >= 0, got first_s={first_s}, max_s={max_s}")
        self.first_s, self.max_s = first_s, max_s
        self._uniform = (rng or random).uniform
        self.reset()

    def reset(self) -> None:
        self._delay_s = self.first_s

    def next_pause_s(self) -> float:
        pause_s = self._delay_s * self._uniform(0.5, 1.0)
        self._delay_s = min(self._delay_s * 2, self.max_s)
        return pause_s


def run_with_timeout(fn: Callable[..., Any], args: tuple, timeout_s: float | None, what: str) -> Any:
    """Run ``fn(*args)`` in a daemon thread and wait at most ``timeout_s`` (None: call directly).

    A call that does not return in time raises ``TimeoutError`` here; its thread is left to
    finish or fail on its own (a blocked socket cannot be interrupted from outside).
    """
    if timeout_s is None:
        return fn(*args)
    future: concurrent.futures.Future = concurrent.futures.Future()

    def target() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn(*args))
        except BaseException as err:  # noqa: BLE001 - handed to the caller
            future.set_exception(err)

    threading.Thread(target=target, name=f"storage-call {what[:60]}", daemon=True).start()
    try:
        return future.result(timeout=timeout_s)
    except concurrent.futures.TimeoutError:
        raise TimeoutError(f"{what}: no answer within {timeout_s:.3g} s") from None


def _no_count(name: str, n: int = 1) -> None:
    pass


def call_with_retry(policy: RetryPolicy, what: str, fn: Callable[..., Any], *args: Any, retry: bool = True,
                    count: Callable[[str], None] = _no_count, clock: Callable[[], float] = time.monotonic,
                    sleep: Callable[[float], None] = time.sleep, refresher: CredentialRefresher | None = None) -> Any:
    """``fn(*args)`` under ``policy``: each attempt bounded by ``timeout_s`` (and by what is left
    of ``deadline_s``), a transient error retried up to ``retries`` times unless the pause would
    pass the deadline. ``retry=False``: one attempt, still under the timeout.

    Args:
        what: names the call in errors and logs (never credentials).
        count: told ``"timeouts"`` for every attempt that timed out and ``"retries"`` for every retry.
        clock, sleep: seconds; injected by tests.
        refresher: on an expired-credentials error, renews the filesystem; the call is then
            tried once more at once (with ``retry=False`` it is renewed and the error raised).

    Raises:
        whatever the last attempt raised; ``TimeoutError`` for an attempt that took too long.
    """
    deadline = clock() + policy.deadline_s
    backoff = policy.backoff()
    attempt = renewed = 0
    while True:
        attempt += 1
        remaining_s = deadline - clock()
        timeout_s = None if policy.timeout_s is None else max(min(policy.timeout_s, remaining_s), 1e-3)
        generation = refresher.generation if refresher is not None else 0
        try:
            return run_with_timeout(fn, args, timeout_s, what)
        except Exception as err:
            if refresher is not None and not renewed and is_expired_credentials(err):
                renewed = 1
                refresher.refresh(generation, what, err)
                if retry:
                    attempt -= 1  # a renewal is not a retry
                    continue
                raise
            if isinstance(err, TimeoutError):
                count("timeouts")
            if not retry or attempt > policy.retries or not is_transient(err):
                raise
            pause_s = backoff.next_pause_s()
            if clock() + pause_s >= deadline:
                raise
            count("retries")
            log.warning("%s: %s: %s (attempt %d of %d), retrying in %.2f s",
                        what, type(err).__name__, err, attempt, policy.retries + 1, pause_s)
            sleep(pause_s)
