"""The C heap's retention of freed memory (issue 17 item 3), for the learner and synchronizer processes.

torch allocates CPU tensors with the C allocator. With glibc, memory freed by one thread goes back
to that thread's arena and large freed blocks stay in the heap once its dynamic mmap threshold has
grown, so a process whose comms and worker threads decode, encode and free fragment-sized
tensors keeps growing in RSS long after the tensors are gone. :func:`limit_heap_retention`
caps the arenas at process start; :func:`release_free_memory` hands free heap pages back to the
system (``malloc_trim``) after a burst of large frees (a checkpoint, a merge). Both do nothing
where the C library is not glibc. :class:`ReleaseWhenItPays` decides when a training loop releases:
a release also hands back what its next step would reuse.
"""

from __future__ import annotations

import ctypes
import functools
import logging

__all__ = ["ReleaseWhenItPays", "limit_heap_retention", "release_free_memory"]

log = logging.getLogger("diloco.heap")

_M_ARENA_MAX = -8  # glibc's mallopt parameter numbers (malloc.h)
_M_MMAP_THRESHOLD = -3
_M_TRIM_THRESHOLD = -1


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    try:
        # the symbols already loaded into this process (the C library Python runs on): no search,
        # where ctypes.util.find_library would start `ldconfig -p` in a subprocess
        libc = ctypes.CDLL(None)
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


class ReleaseWhenItPays:
    """When a training loop hands its free heap pages back after large frees (downloads, uploads,
    adoptions, spooled inner states): at every chance while releasing pays, rarely once it does not.

    ``malloc_trim`` returns every free page of the heap, and at a step boundary those include the
    buffers the next step reuses (activations, gradients' and the optimizer's temporaries), which
    it then faults in again. A release is judged at the end of the step after it, from the resident
    size before the release, right after it, and at that step's end:

    * faulted back: the step's end minus right after the release;
    * kept: before the release minus the step's end.

    It pays when it faulted back at most ``cheap_faulted_bytes`` (a training loop sets the model's
    fp32 size: cheap next to a step that reads and writes parameters, gradients and moments), or
    when it kept at least ``min_gain_bytes`` and at least half of what was faulted back. Each
    release that does not pay doubles the number of chances skipped before the next one, up to
    ``max_skip``; one that pays resets it to none. A learner whose step buffers are far larger than
    its fragments (the HF Llama recipe: ~200 MiB against 5 MB) released and faulted them in again
    three times per fragment round, a tenth of its tokens/s (issue 17); one whose fragments
    dominate keeps releasing at every chance, which holds its resident size near the model's.
    Pure: the caller reads the resident size (bytes), releases, and reads it again.

    Raises:
        ValueError: ``cheap_faulted_bytes`` or ``min_gain_bytes`` is negative, or ``max_skip`` is
            below 1.
    """

    def __init__(self, cheap_faulted_bytes: int, min_gain_bytes: int, *, max_skip: int = 64) -> None:
        if cheap_faulted_bytes < 0 or min_gain_bytes < 0 or max_skip < 1:
            raise ValueError("cheap_faulted_bytes and min_gain_bytes must be >= 0 and max_skip >= 1; got "
                             f"{cheap_faulted_bytes}, {min_gain_bytes}, {max_skip}")
        self.cheap_faulted_bytes, self.min_gain_bytes = int(cheap_faulted_bytes), int(min_gain_bytes)
        self.max_skip = int(max_skip)
        self.releases = 0  # releases so far
        self.paid = 0  # ... of which paid
        self.skip = 0  # chances skipped after each release that did not pay
        self.last_kept_bytes = self.last_faulted_bytes = 0  # of the last release judged
        self._left = 0  # chances still to skip
        self._before: int | None = None  # resident size before the release being judged
        self._released_to: int | None = None  # ... and right after it

    def after_step(self, rss_bytes: int, freed: bool) -> bool:
        """At the end of a step: the resident size (bytes), and whether large buffers were freed
        since the last call (a chance to release). True: release now."""
        if self._before is not None:  # the step after a release
            released_to = self._before if self._released_to is None else self._released_to
            kept, faulted = self._before - rss_bytes, rss_bytes - released_to
            self.last_kept_bytes, self.last_faulted_bytes = kept, faulted
            if faulted <= self.cheap_faulted_bytes or (kept >= self.min_gain_bytes and 2 * kept >= faulted):
                self.paid += 1
                self.skip = 0
            else:
                self.skip = min(self.max_skip, max(1, 2 * self.skip))
            self._left, self._before, self._released_to = self.skip, None, None
        if not freed:
            return False
        if self._left > 0:
            self._left -= 1
            return False
        self._before = rss_bytes
        self.releases += 1
        return True

    def released(self, rss_bytes: int) -> None:
        """The resident size (bytes) right after the release :meth:`after_step` asked for."""
        if self._before is not None:
            self._released_to = rss_bytes
