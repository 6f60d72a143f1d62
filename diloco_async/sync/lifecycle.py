"""The synchronizer's lifecycle: one phase at a time, moved only along allowed transitions.

::

    RUNNING ──> DRAINING ──> STOPPING ──> FINAL_CHECKPOINT ──> WRITING_SUMMARY ──> FINISHING ──> FINISHED
       └──────────────────────^

* RUNNING: rounds are scheduled, budgets checked, checkpoints taken periodically.
* DRAINING: the budget is spent (or a stop was asked); a last round of every fragment is open so
  the learners' latest progress is merged; at most ``synchronizer.drain_s``.
* STOPPING: learners are told to stop; open rounds merge or are abandoned.
* FINAL_CHECKPOINT: no round left; the final checkpoint is being written.
* WRITING_SUMMARY: the summary is fixed; metrics, summary and merge log go to the store.
* FINISHING: written; waiting until every live learner was told to stop (at most 15 s).
* FINISHED: the actor loop ends.
* FENCED (from any phase but FINISHED): the run's lease was lost to another synchronizer; nothing
  more is published or checkpointed, learners are not told to stop (they reconnect to the
  holder), and the actor loop ends at once.
"""

from __future__ import annotations

import enum

__all__ = ["Phase", "Lifecycle"]


class Phase(enum.Enum):
    RUNNING = "running"
    DRAINING = "draining"
    STOPPING = "stopping"
    FINAL_CHECKPOINT = "final_checkpoint"
    WRITING_SUMMARY = "writing_summary"
    FINISHING = "finishing"
    FINISHED = "finished"
    FENCED = "fenced"


_ALLOWED: dict[Phase, frozenset[Phase]] = {
    Phase.RUNNING: frozenset({Phase.DRAINING, Phase.STOPPING, Phase.FENCED}),
    Phase.DRAINING: frozenset({Phase.STOPPING, Phase.FENCED}),
    Phase.STOPPING: frozenset({Phase.FINAL_CHECKPOINT, Phase.FENCED}),
    Phase.FINAL_CHECKPOINT: frozenset({Phase.WRITING_SUMMARY, Phase.FENCED}),
    Phase.WRITING_SUMMARY: frozenset({Phase.FINISHING, Phase.FENCED}),
    Phase.FINISHING: frozenset({Phase.FINISHED, Phase.FENCED}),
    Phase.FINISHED: frozenset(),
    Phase.FENCED: frozenset(),
}

_STOPPED = frozenset({Phase.STOPPING, Phase.FINAL_CHECKPOINT, Phase.WRITING_SUMMARY, Phase.FINISHING,
                      Phase.FINISHED})


class Lifecycle:
    """The current :class:`Phase`, the reasons of a drain and of the stop, and when the stop began.

    Raises:
        RuntimeError: from :meth:`move`, for a transition the diagram above does not allow.
    """

    def __init__(self) -> None:
        self.phase = Phase.RUNNING
        self.drain_reason: str | None = None
        self.stop_reason: str | None = None
        self.stop_since_s: float | None = None  # clock seconds

    def move(self, to: Phase) -> None:
        if to not in _ALLOWED[self.phase]:
            raise RuntimeError(f"synchronizer lifecycle: {self.phase.value} -> {to.value} is not allowed")
        self.phase = to

    @property
    def running(self) -> bool:
        """Scheduling rounds, checking budgets, taking periodic checkpoints."""
        return self.phase is Phase.RUNNING

    @property
    def ended(self) -> bool:
        """The actor loop ends: FINISHED, or FENCED."""
        return self.phase in (Phase.FINISHED, Phase.FENCED)

    @property
    def stopped(self) -> bool:
        """Learners are (being) told to stop: STOPPING or any later phase."""
        return self.phase in _STOPPED
