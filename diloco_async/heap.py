"""The C heap's retention of freed memory (issue 17 item 3), for the learner and synchronizer processes.

torch allocates CPU tensors with the C allocator. With glibc, memory freed by one thread goes back
to that thread's arena and large freed blocks stay in the heap once its dynamic mmap threshold has
grown, so a process whose comms and worker threads decode, encode and free fragment-sized
tensors keeps growing in RSS long after the tensors are gone. :func:`limit_heap_retention`
caps the arenas at process start; :func:`release_free_memory` hands free heap pages back to the
system (``malloc_trim``) after a burst of large frees (a checkpoint, an adoption, a merge). Both
do nothing where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

__all__ = ["limit_heap_retention", "release_free_memory"]

log = logging.getLogger("diloco.heap")

_M_ARENA_MAX = -8  # glibc's mallopt parameter numbers (malloc.h)
_M_MMAP_THRESHOLD = -3
_M_TRIM_THRESHOLD = -1


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim  # noqa: B018 - only glibc has it
        libc.mallopt  # noqa: B018
    except (OSError, AttributeError):
        return None
    return libc


def limit_heap_retention(arena_max: int = 2, mmap_threshold_bytes: int | None = None,
                         trim_threshold_bytes: int | None = None) -> bool:
    """Cap the C heap at ``arena_max`` arenas (call before threads start); True where applied.

    ``mmap_threshold_bytes``: allocations of at least this size are mapped on their own and given
    back to the system when freed. Setting it also stops glibc from raising the threshold after
    each large free (up to 32 MiB by default), which is what lets fragment-sized buffers freed by
    worker threads pile up in the heap. The price is fresh pages (page faults) for every such
    allocation: right for the synchronizer, whose large buffers come and go once per merge,
    publish or checkpoint; for a training loop, only with a threshold above its per-step buffers.

    ``trim_threshold_bytes``: free memory at the top of an arena is given back to the system on
    its own only once it exceeds this (bytes). A fixed ``mmap_threshold_bytes`` also fixes this one
    at glibc's 128 KiB, so a training loop's activations, freed at the end of every step, are
    handed back and faulted in again at the next one; a large value keeps them, and
    :func:`release_free_memory` still returns free pages when called.
    """
    libc = _glibc()
    if libc is None:
        return False
    ok = bool(libc.mallopt(_M_ARENA_MAX, int(arena_max)))
    if mmap_threshold_bytes is not None:
        ok = bool(libc.mallopt(_M_MMAP_THRESHOLD, int(mmap_threshold_bytes))) and ok
    if trim_threshold_bytes is not None:
        ok = bool(libc.mallopt(_M_TRIM_THRESHOLD, int(trim_threshold_bytes))) and ok
    return ok


def release_free_memory() -> None:
    """Return the free pages of every arena of the C heap to the system (``malloc_trim(0)``).
    Costs a walk of the heap (milliseconds); call it after large frees, not every step."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)
