"""How long this OS process has existed: the start time that the learners and the DDP ranks report."""

from __future__ import annotations

import time

import psutil

__all__ = ["process_uptime_s"]

_IMPORTED_S = time.monotonic()


def _since_boot_s() -> float | None:
    """Seconds since boot on the clock the kernel dates processes by (Linux ``CLOCK_BOOTTIME``,
    suspend included); None where there is no such clock."""
    clock = getattr(time, "CLOCK_BOOTTIME", None)
    return None if clock is None else time.clock_gettime(clock)


def process_uptime_s() -> float:
    """Seconds since this OS process started, interpreter start and imports included, >= 0.

    The start is psutil's ``Process().create_time()``. On Linux that is the boot time plus the
    kernel's start ticks (10 ms), and psutil's boot time is ``/proc/stat``'s whole seconds, so the
    uptime is taken as ``CLOCK_BOOTTIME - (create_time() - boot_time())``: exact to a tick, where
    ``time.time() - create_time()`` would be off by the boot instant's fraction of a second (up to
    1 s) and follow the wall clock's steps. Without ``CLOCK_BOOTTIME`` (not Linux) it is
    ``time.time() - create_time()``; where psutil cannot read this process, the seconds since this
    module was imported.
    """
    try:
        proc = psutil.Process()
        since_boot_s = _since_boot_s()
        if since_boot_s is None:
            return max(0.0, time.time() - proc.create_time())
        return max(0.0, since_boot_s - (proc.create_time() - psutil.boot_time()))
    except (psutil.Error, OSError, RuntimeError):  # RuntimeError: psutil finds no boot time in /proc/stat
        return time.monotonic() - _IMPORTED_S
