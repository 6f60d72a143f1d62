"""How long this OS process has existed: the start time that the learners and the DDP ranks report."""

from __future__ import annotations

import os
import time

__all__ = ["process_uptime_s"]

_IMPORTED_S = time.monotonic()


def process_uptime_s() -> float:
    """Seconds since this OS process started (Linux ``/proc``), including interpreter start and
    imports; where ``/proc`` cannot be read, seconds since this module was imported."""
    try:
        with open("/proc/self/stat") as fh:
            start_ticks = int(fh.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as fh:
            boot_s = float(fh.read().split()[0])
        return max(0.0, boot_s - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.monotonic() - _IMPORTED_S
