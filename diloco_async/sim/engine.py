"""The simulator's event loop over jobs (the model is in :mod:`diloco_async.sim.simulator`).

Events: slice failure (competing exponential clocks on busy slices, redrawn after every event),
slice return, end of a pause, end of a scale-up batch window. Pure: all randomness comes from
the given :class:`~diloco_async.sim.draws.Draws`.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

from diloco_async.sim.calibration import Calibration
from diloco_async.sim.draws import Barrier, Draws

__all__ = ["Jobs", "Engine"]

_RETURN, _PAUSE_END, _DEADLINE = 0, 1, 2  # event kinds


@dataclass
class Jobs:
    """What is simulated: ``n`` jobs of ``n_slices`` slices of ``chips_per_slice`` chips each."""

    n: int
    n_slices: int
    chips_per_slice: float
    elastic: bool
    quorum: int
    straggle: float  # productive share of a running job's time when quorum == 1
    barrier: Barrier | None  # per-learner shares when quorum > 1


class Engine:
    """Event loop over jobs (the model: :mod:`diloco_async.sim.simulator`). Events: slice failure (competing exponential
    clocks on busy slices, redrawn after every event), slice return, end of a pause, end of a
    scale-up batch window. Productive chip-seconds are settled lazily per job when its rate changes.
    """

    def __init__(self, jobs: Jobs, cal: Calibration, mtbi_s: float, draws: Draws) -> None:
        n = jobs.n
        self.jobs, self.draws, self.horizon = jobs, draws, cal.run.horizon_s
        self.c_down, self.c_up = cal.elastic.reshard_pause_s, cal.elastic.scale_up_pause_s
        self.window = cal.elastic.scale_up_batch_window_s
        self.c_restart = cal.non_elastic.restart_pause_s
        self.hazard_per_slice = jobs.chips_per_slice / mtbi_s  # failures per busy slice-second
        self.healthy = [jobs.n_slices] * n  # slices in the job (computing, or paused with it)
        self.down = [0] * n  # slices being recovered
        self.waiting = [0] * n  # recovered slices not yet taken back (elastic)
        self.paused = [False] * n
        self.pause_ver = [0] * n
        self.deadline_ver = [0] * n
        self.deadline_set = [False] * n
        self.running = [True] * n
        self.n_running = n
        self.busy_slices = 0  # sum of healthy slices over busy jobs
        self.counted = [0] * n  # each job's share of busy_slices
        self.busy = [False] * n
        self.rate = [0.0] * n  # productive chip-seconds per second
        self.useful = [0.0] * n
        self.last = [0.0] * n
        self.heap: list[tuple[float, int, int, int, int]] = []
        self.seq = 0
        self.now = 0.0
        self.failures = 0
        self.up_s = 0.0
        self.up_since: float | None = None

    # -- accounting ------------------------------------------------------------------------

    def _settle(self, j: int, factors: Sequence[float] | None) -> None:
        now, jobs = self.now, self.jobs
        self.useful[j] += (now - self.last[j]) * self.rate[j]
        self.last[j] = now
        busy = self.running[j] and self.n_running >= jobs.quorum
        counted = self.healthy[j] if busy else 0
        self.busy_slices += counted - self.counted[j]
        self.counted[j] = counted
        self.busy[j] = busy
        f = factors[j] if factors is not None else jobs.straggle
        self.rate[j] = self.healthy[j] * jobs.chips_per_slice * f if busy else 0.0

    def _update(self, j: int) -> None:
        """Job ``j`` changed state at ``now``: re-derive what depends on it."""
        jobs = self.jobs
        run = not self.paused[j] and self.healthy[j] > 0 and (jobs.elastic or self.down[j] == 0)
        was_active = self.n_running >= jobs.quorum
        self.n_running += int(run) - int(self.running[j])
        self.running[j] = run
        active = self.n_running >= jobs.quorum
        if active != was_active:
            if active:
                self.up_since = self.now
            elif self.up_since is not None:
                self.up_s += self.now - self.up_since
                self.up_since = None
        if jobs.barrier is None and active == was_active:
            self._settle(j, None)
        else:
            self._settle_all()

    def _settle_all(self) -> None:
        barrier = self.jobs.barrier
        factors = barrier.factors(self.running) if barrier is not None else None
        for i in range(self.jobs.n):
            self._settle(i, factors)

    # -- events ----------------------------------------------------------------------------

    def _push(self, t: float, kind: int, j: int, ver: int) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, j, ver))

    def _pause(self, j: int, length_s: float) -> None:
        self.paused[j] = True
        self.pause_ver[j] += 1
        self._push(self.now + length_s, _PAUSE_END, j, self.pause_ver[j])

    def _fail(self) -> int:
        """A slice of a busy job fails, chosen in proportion to busy slices."""
        self.failures += 1
        pick = self.draws.uniform() * self.busy_slices
        j = -1
        for i in range(self.jobs.n):
            if self.busy[i]:
                j = i
                pick -= self.healthy[i]
                if pick < 0:
                    break
        assert j >= 0, "a failure needs a busy job"
        self.healthy[j] -= 1
        self.down[j] += 1
        self._push(self.now + self.draws.recovery(), _RETURN, j, 0)
        if self.jobs.elastic:  # re-shard; slices waiting to rejoin come back with it
            self.deadline_ver[j] += 1
            self.deadline_set[j] = False
            self._pause(j, self.c_down)
        return j

    def _on_return(self, j: int) -> None:
        self.down[j] -= 1
        if not self.jobs.elastic:
            self.healthy[j] += 1
            if self.down[j] == 0:
                self._pause(j, self.c_restart)
            return
        self.waiting[j] += 1
        if self.paused[j]:
            return  # joins when the pause ends
        if self.healthy[j] == 0 or self.window == 0:
            self._pause(j, self.c_up)
        elif not self.deadline_set[j]:
            self.deadline_set[j] = True
            self._push(self.now + self.window, _DEADLINE, j, self.deadline_ver[j])

    def _on_deadline(self, j: int) -> None:
        self.deadline_set[j] = False
        if self.waiting[j] and not self.paused[j]:
            self._pause(j, self.c_up)

    def _on_pause_end(self, j: int) -> None:
        self.paused[j] = False
        self.healthy[j] += self.waiting[j]
        self.waiting[j] = 0
        self.deadline_ver[j] += 1
        self.deadline_set[j] = False

    def run(self) -> tuple[list[float], float, int]:
        """Per-job productive chip-seconds, seconds with >= quorum jobs running, failures."""
        self.up_since = 0.0 if self.n_running >= self.jobs.quorum else None
        self._settle_all()
        heap, draws, horizon = self.heap, self.draws, self.horizon
        while True:
            hazard = self.busy_slices * self.hazard_per_slice
            t_fail = self.now + draws.exp() / hazard if hazard > 0 else math.inf
            t_event = heap[0][0] if heap else math.inf
            if min(t_fail, t_event) >= horizon:
                break
            if t_fail < t_event:
                self.now = t_fail
                j = self._fail()
            else:
                self.now, _, kind, j, ver = heapq.heappop(heap)
                if kind == _RETURN:
                    self._on_return(j)
                elif kind == _DEADLINE:
                    if ver != self.deadline_ver[j]:
                        continue
                    self._on_deadline(j)
                else:
                    if ver != self.pause_ver[j]:
                        continue
                    self._on_pause_end(j)
            self._update(j)
        self.now = horizon
        self._settle_all()
        if self.up_since is not None:
            self.up_s += horizon - self.up_since
        return self.useful, self.up_s, self.failures
