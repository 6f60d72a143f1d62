"""What a test did outside its own process: started a process, bound or connected a socket, slept.

The unit tier (``tests/unit/``) forbids all three: a unit test runs on injected clocks and in-process
fakes, so it cannot wait on another process, a port or the wall clock, and cannot fail because the
machine is busy. This module watches through CPython's audit hooks (PEP 578), which see every
``subprocess.Popen``, ``os.fork``/``os.posix_spawn``, ``socket.bind``/``socket.connect`` and
``time.sleep`` (from Python 3.12) however deep in a library it happens, plus wrappers around
``asyncio.sleep`` (which does not call ``time.sleep``), ``time.sleep`` before 3.12 (installed before
the tests import, so a module's ``from time import sleep`` gets the wrapper too) and
``multiprocessing``'s process start (whose spawn raises no audit event of its own).

An audit hook cannot be removed, so one hook is installed once per interpreter and does nothing
unless a :class:`Watch` is active. A violation is recorded (so one caught in a library's background
thread still fails the test) and raised as :class:`TierViolation` in the thread that did it.
"""

from __future__ import annotations

import asyncio
import multiprocessing.process
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field

__all__ = ["MAX_SLEEP_S", "TierViolation", "Watch", "install", "watch"]

#: the longest real sleep a unit test may take (yielding to the event loop with ``asyncio.sleep(0)``
#: or a ``time.sleep(0.001)`` spin is allowed; anything that waits on the wall clock is not)
MAX_SLEEP_S = 0.01


class TierViolation(RuntimeError):
    """A unit test started a process, used a socket or slept for real."""


@dataclass
class Watch:
    """The violations seen while this watch was active: ``(kind, detail)`` pairs, first of each
    kind and detail only. ``enforce`` raises :class:`TierViolation` where the violation happened."""

    enforce: bool = True
    seen: list[tuple[str, str]] = field(default_factory=list)
    #: where each of ``seen`` happened: the innermost frames outside this module, one string each
    where: list[str] = field(default_factory=list)

    def record(self, kind: str, detail: str) -> None:
        if (kind, detail) not in self.seen:
            self.seen.append((kind, detail))
            frames = [f for f in traceback.extract_stack()[:-1] if f.filename != __file__]
            self.where.append("".join(traceback.format_list(frames[-8:])))
        if self.enforce:
            raise TierViolation(f"a unit test may not {kind}: {detail} (move the test to tests/contract/ "
                                f"or tests/system/, or inject a clock or a fake)")


_active: Watch | None = None
_installed = False
_lock = threading.Lock()
_real_asyncio_sleep = asyncio.sleep
_real_time_sleep = time.sleep
#: CPython raises a ``time.sleep`` audit event from 3.12 on; before that, time.sleep is wrapped
_SLEEP_AUDITED = sys.version_info >= (3, 12)
_real_process_start = multiprocessing.process.BaseProcess.start


def _audit(event: str, args: tuple) -> None:
    current = _active
    if current is None:
        return
    if event == "time.sleep":
        if args and args[0] > MAX_SLEEP_S:
            current.record("sleep", f"time.sleep({args[0]})")
    elif event in ("subprocess.Popen", "os.posix_spawn", "os.spawn", "os.system", "os.exec"):
        current.record("start a process", f"{event} {str(args[:2])[:200]}")
    elif event in ("os.fork", "os.forkpty"):
        current.record("start a process", event)
    elif event in ("socket.bind", "socket.connect"):
        current.record("use a socket", f"{event} {args[1]!r}" if len(args) > 1 else event)


def _watched_time_sleep(secs: float) -> None:
    current = _active
    if current is not None and secs > MAX_SLEEP_S:
        current.record("sleep", f"time.sleep({secs})")
    _real_time_sleep(secs)


async def _watched_asyncio_sleep(delay, result=None):
    current = _active
    if current is not None and delay > MAX_SLEEP_S:
        current.record("sleep", f"asyncio.sleep({delay})")
    return await _real_asyncio_sleep(delay, result)


def _watched_process_start(self) -> None:
    current = _active
    if current is not None:
        current.record("start a process", f"multiprocessing {self!r}")
    return _real_process_start(self)


def install() -> None:
    global _installed
    with _lock:
        if _installed:
            return
        sys.addaudithook(_audit)
        asyncio.sleep = _watched_asyncio_sleep
        if not _SLEEP_AUDITED:
            time.sleep = _watched_time_sleep
        multiprocessing.process.BaseProcess.start = _watched_process_start
        _installed = True


class watch:  # noqa: N801 (a context manager, used as ``with watch():``)
    """Active for the ``with`` block: ``with watch(enforce=False) as w: ...; w.seen``."""

    def __init__(self, enforce: bool = True) -> None:
        self.state = Watch(enforce=enforce)

    def __enter__(self) -> Watch:
        global _active
        install()
        _active = self.state
        return self.state

    def __exit__(self, *exc) -> None:
        global _active
        _active = None
