"""Reusable CPU buffers for the merge and the outer step (issue 17 item 1).

A merge of a large fragment writes its results into new full-size tensors; memory fresh from the
kernel costs a page fault and a zeroing per 4 KiB page, several times the cost of writing into
memory already mapped (glibc hands tensors above its mmap threshold straight back to the kernel
when they are freed, and the synchronizer trims the heap after each merge). :class:`BufferPool`
keeps the buffers of earlier merges and hands one out again only once it can prove that nothing
references it any more.

The proof is a reference count. Each buffer is an anonymous ``mmap`` owned by the pool; the
tensors handed out are made with ``torch.frombuffer``, whose storage holds a reference to the
``mmap`` object until the storage is freed. Every tensor, view, ``numpy()`` array or pickle in
flight that can reach that memory keeps its storage, hence the ``mmap`` object, alive; so when
the ``mmap``'s reference count is the pool's own, no tensor uses it and it may be written again.
(Code that keeps only a raw ``data_ptr()`` and no tensor is not covered; nothing here does.)
Pure: torch and the standard library.
"""

from __future__ import annotations

import math
import mmap
import sys
import threading

import torch
from torch import Tensor

__all__ = ["BufferPool", "DEFAULT_SPARE"]

#: free buffers of one byte size a pool keeps for later (the rest are given back to the system).
#: A merge takes up to four buffers of one tensor's size (the new value, the merged outer gradient
#: that becomes the momentum, a kept anchored outer gradient and a workspace buffer), which come
#: free a merge or two later; tensors of equal size (a block's up and down projections) share them.
#: The pool never holds more buffers of a size than were in use at once.
DEFAULT_SPARE = 8

#: besides ``spare``, free buffers of one size are kept while they hold less than this in all
#: (chunk buffers of 1 MiB come and go by the dozen within one merge)
SMALL_SPARE_BYTES = 32 << 20


def _refs_when_free(holder: list, i: int) -> int:
    return sys.getrefcount(holder[i])


# what _refs_when_free reports for a buffer that only the pool's list references
_FREE_REFS = _refs_when_free([mmap.mmap(-1, mmap.PAGESIZE, flags=mmap.MAP_PRIVATE)], 0)


class BufferPool:
    """Contiguous CPU buffers, reused once no tensor references them; thread-safe.

    Args:
        spare: free buffers kept per byte size (≥ 0; more of a small size, up to
            :data:`SMALL_SPARE_BYTES`); more are released when found free.
        max_free_bytes: with a value, the free buffers kept in all sizes together stay within
            it (:meth:`trim`, also whenever a new buffer is made): one pool serves every fragment of
            a synchronizer, whose memory at rest is then the fragments' state plus this budget.

    Raises:
        ValueError: a negative ``spare`` or ``max_free_bytes``.
    """

    def __init__(self, spare: int = DEFAULT_SPARE, max_free_bytes: int | None = None) -> None:
        if spare < 0:
            raise ValueError(f"spare must be >= 0, got {spare}")
        if max_free_bytes is not None and max_free_bytes < 0:
            raise ValueError(f"max_free_bytes must be >= 0, got {max_free_bytes}")
        self.spare = spare
        self.max_free_bytes = max_free_bytes
        self._bufs: dict[int, list[mmap.mmap]] = {}
        self._lock = threading.Lock()
        self.allocated = 0  # buffers made since construction (a test and the benchmark read it)
        self.reused = 0  # buffers handed out again

    def empty(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> Tensor:
        """An uninitialised contiguous CPU tensor of ``shape`` and ``dtype`` (it may hold the
        values of an earlier use). The caller owns it until it drops every reference to it and
        to its views.

        Raises:
            ValueError: a negative dimension.
        """
        shape = tuple(int(s) for s in shape)
        if any(s < 0 for s in shape):
            raise ValueError(f"negative dimension in shape {shape}")
        numel = math.prod(shape)
        nbytes = numel * dtype.itemsize
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        buf = self._take(nbytes)
        return torch.frombuffer(buf, dtype=dtype, count=numel).view(shape)

    def _take(self, nbytes: int) -> mmap.mmap:
        with self._lock:
            bufs = self._bufs.setdefault(nbytes, [])
            free = [i for i in range(len(bufs)) if _refs_when_free(bufs, i) <= _FREE_REFS]
            if free:
                buf = bufs[free[0]]
                keep = max(self.spare, SMALL_SPARE_BYTES // nbytes)  # free ones besides the one taken
                for i in reversed(free[1 + keep:]):
                    bufs.pop(i).close()
                self.reused += 1
            else:
                buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)  # page-aligned, mapped on first write
                bufs.append(buf)
                self.allocated += 1
                # only when memory grows: a reused buffer leaves fewer free bytes, not more (and
                # the walk over every buffer costs more than many small merges' kernels)
                self._trim_locked()  # ``buf`` is referenced here: not free, not given back
            return buf

    def trim(self) -> int:
        """Give back the free buffers beyond ``max_free_bytes`` (larger sizes are kept first);
        returns the bytes given back (0 without a budget)."""
        with self._lock:
            return self._trim_locked()

    def _trim_locked(self) -> int:
        if self.max_free_bytes is None:
            return 0
        kept = released = 0
        for nbytes in sorted(self._bufs, reverse=True):
            bufs = self._bufs[nbytes]
            for i in reversed(range(len(bufs))):
                if _refs_when_free(bufs, i) > _FREE_REFS:
                    continue
                if kept + nbytes <= self.max_free_bytes:
                    kept += nbytes
                else:
                    bufs.pop(i).close()
                    released += nbytes
        return released

    def held_bytes(self) -> int:
        """Bytes of every buffer the pool holds, in use or free."""
        with self._lock:
            return sum(n * len(b) for n, b in self._bufs.items())

    def free_bytes(self) -> int:
        """Bytes of the buffers that no tensor references now."""
        with self._lock:
            return sum(n for n, bufs in self._bufs.items() for i in range(len(bufs))
                       if _refs_when_free(bufs, i) <= _FREE_REFS)
