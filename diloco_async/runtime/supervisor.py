"""Supervision: restart the learners that die while the run goes on, whatever launched them
(:mod:`diloco_async.runtime.procs` locally, Prefect deployments elsewhere)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Restart", "Supervisor"]


# Supervision


@dataclass
class Restart:
    """One restart decision: learner ``index`` died (``reason``) and came back as ``incarnation``."""

    index: int
    incarnation: int
    reason: str
    at: float


@dataclass
class _Slot:
    handle: Any
    incarnation: int
    restarts: int = 0
    due: float | None = None  # when a restart is due (monotonic seconds)
    reason: str = ""
    given_up: bool = False


@dataclass
class Supervisor:
    """Keeps every learner slot running while the synchronizer runs.

    A learner whose handle reports a failure (:meth:`ProcessHandle.failure`: a non-zero exit, a
    signal, a crashed or failed flow run) is started again after ``restart_delay_s`` seconds as
    the next incarnation (it rejoins from the store), at most ``max_restarts`` times per slot.
    A clean exit (code 0) or a cancelled flow run is never restarted.

    Args:
        start: ``start(index, incarnation) -> handle`` starts one learner.
        restart_delay_s: seconds between seeing a failure and the restart.
        max_restarts: restarts per slot; after that the slot stays down (logged once).
        log: called with one line per decision.
    """

    start: Callable[[int, int], Any]
    restart_delay_s: float = 1.0
    max_restarts: int = 10
    log: Callable[[str], None] = print
    slots: dict[int, _Slot] = field(default_factory=dict)
    restarts: list[Restart] = field(default_factory=list)

    def launch(self, index: int, incarnation: int = 0) -> Any:
        """Start learner ``index`` as ``incarnation`` and supervise it from now on."""
        handle = self.start(index, incarnation)
        self.slots[index] = _Slot(handle=handle, incarnation=incarnation)
        return handle

    def handles(self) -> list[Any]:
        return [s.handle for s in self.slots.values()]

    def next_due(self) -> float | None:
        """The earliest pending restart time (monotonic seconds), or None."""
        due = [s.due for s in self.slots.values() if s.due is not None]
        return min(due) if due else None

    def check(self, now: float | None = None) -> list[Restart]:
        """Look at every slot once: note new failures, start the restarts that are due.

        Returns the restarts made by this call. A restart whose ``start`` raises is logged and
        tried again ``max(restart_delay_s, 1)`` seconds later; nothing is raised.
        """
        now = time.monotonic() if now is None else now
        made: list[Restart] = []
        for index, slot in sorted(self.slots.items()):
            if slot.given_up:
                continue
            if slot.due is None:
                reason = slot.handle.failure()
                if reason is None:
                    continue
                if slot.restarts >= self.max_restarts:
                    slot.given_up = True
                    self.log(f"learner-{index} ({reason}) reached learners.max_restarts={self.max_restarts}; "
                             "not restarting it")
                    continue
                slot.due, slot.reason = now + self.restart_delay_s, reason
                self.log(f"learner-{index} incarnation {slot.incarnation} died ({reason}); restarting it "
                         f"in {self.restart_delay_s:.1f}s as incarnation {slot.incarnation + 1}")
            if slot.due is not None and now >= slot.due:
                incarnation = slot.incarnation + 1
                try:
                    handle = self.start(index, incarnation)
                except Exception as err:  # noqa: BLE001 - e.g. the Prefect API briefly unreachable
                    slot.due = now + max(self.restart_delay_s, 1.0)
                    self.log(f"restart of learner-{index} as incarnation {incarnation} failed ({err}); "
                             "trying again")
                    continue
                restart = Restart(index, incarnation, slot.reason, now)
                self.slots[index] = _Slot(handle=handle, incarnation=incarnation, restarts=slot.restarts + 1)
                self.restarts.append(restart)
                made.append(restart)
        return made
