"""A bounded pool of worker coroutines draining a FIFO of jobs (the synchronizer's verifications).

One task per job that waits for a free slot (a semaphore) costs the event loop a task, a waiter
future and a timeout task per contribution, created while the announcements arrive: at 1,000
learners hundreds of them come in the same few hundred milliseconds after a round opens (issue
17). Here a job is a deque entry, and at most ``slots`` worker tasks run, each taking the next job
when it has finished its last, in the order the jobs came.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

__all__ = ["WorkQueue"]

log = logging.getLogger("diloco.synchronizer")


class WorkQueue:
    """Runs ``await job(*args)`` for every :meth:`submit`, at most ``slots`` at once, in order.

    Args:
        slots: jobs running at once (>= 1).
        spawn: starts a worker coroutine as a task (the actor's, which cancels them when it ends).

    Raises:
        ValueError: ``slots`` < 1.
    """

    def __init__(self, slots: int, spawn: Callable[[Coroutine[Any, Any, None]], None]) -> None:
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.slots, self._spawn = slots, spawn
        self.jobs: deque[tuple[Callable[..., Awaitable[None]], tuple]] = deque()
        self.workers = 0  # worker tasks running

    def __len__(self) -> int:
        """Jobs waiting for a worker (not those running)."""
        return len(self.jobs)

    def submit(self, job: Callable[..., Awaitable[None]], *args: Any) -> None:
        """Queue ``job(*args)``; a worker starts when fewer than ``slots`` run. Never blocks."""
        self.jobs.append((job, args))
        if self.workers < self.slots:
            self.workers += 1
            self._spawn(self._work())

    async def _work(self) -> None:
        try:
            while self.jobs:
                job, args = self.jobs.popleft()
                try:
                    await job(*args)
                except Exception:  # a job handles its own errors; one that escapes is logged, the next runs
                    log.exception("a queued job failed; the queue goes on")
        finally:
            self.workers -= 1
