"""Lower the scheduling priority of one thread, so that background work of a learner (the comms
thread, the rest of an inner-state spool) yields the CPU to its training thread (issue 17).

On Linux a thread's nice value is its own (``setpriority`` with the thread's native id), and the
threads it starts later inherit it. Elsewhere, or where the call is refused, nothing changes.
"""

from __future__ import annotations

import logging
import os
import sys
import threading

__all__ = ["BACKGROUND_NICE", "lower_thread_priority"]

log = logging.getLogger("diloco.priority")

#: nice increment of a learner's background threads: at +5 a busy background thread gets about a
#: quarter of a core that the training thread (at +0) also wants, and all of an idle one
BACKGROUND_NICE = 5


def lower_thread_priority(increment: int) -> int | None:
    """Add ``increment`` (> 0, capped at nice 19) to the calling thread's nice value; returns the
    new value, or None where threads cannot be reniced one by one (not Linux) or it failed."""
    if not hasattr(os, "setpriority") or not sys.platform.startswith("linux"):
        return None
    tid = threading.get_native_id()
    try:
        value = min(19, os.getpriority(os.PRIO_PROCESS, tid) + max(0, increment))
        os.setpriority(os.PRIO_PROCESS, tid, value)
    except OSError as err:
        log.debug("could not lower thread %d's priority: %s", tid, err)
        return None
    return value
