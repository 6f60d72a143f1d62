"""When the actor's sweeps run: the parts of its clock-driven pass that look at every live learner
(the schedule's global step, the rounds' quorum checks; DESIGN §2.1, issue 17).

They run once the inbox is empty, but at most every :data:`SWEEP_MIN_S` of real time (at 1,000
learners the inbox empties after almost every message), and at least every :data:`SWEEP_S` of the
actor's clock while messages keep coming.
"""

from __future__ import annotations

import time

__all__ = ["SweepTimer", "SWEEP_S", "SWEEP_MIN_S"]

SWEEP_S = 0.01  # seconds (actor's clock) at most between two runs of the schedule and the rounds' checks
SWEEP_MIN_S = 0.005  # seconds (real time) at least between two of them while messages keep coming


class SweepTimer:
    """When the sweeps last ran (see the module doc); owned by the actor's task."""

    def __init__(self) -> None:
        self._at_s = -float("inf")  # when they last ran (clock s)
        self._at_real_s = -float("inf")  # the same, time.monotonic() (SWEEP_MIN_S)
        self.pending = False  # a sweep was put off (SWEEP_MIN_S): the next pass comes sooner

    def due(self, now_s: float, inbox_empty: bool) -> bool:
        """Do they run in this pass (at ``now_s``, the actor's clock)? True marks them run."""
        real_s = time.monotonic()
        sweep = (inbox_empty and real_s - self._at_real_s >= SWEEP_MIN_S) or now_s - self._at_s >= SWEEP_S
        self.pending = not sweep
        if sweep:
            self._at_s, self._at_real_s = now_s, real_s
        return sweep
