"""What the synchronizer's state looks like to the modules that read the whole of it.

:class:`ActorView` is the part of :class:`~diloco_async.sync.actor.Synchronizer` that
:mod:`~diloco_async.sync.persistence` (publish, checkpoint payload, restore) and
:mod:`~diloco_async.sync.summary` (summary, status) read or, for a restore, set. They take the view
rather than the actor's class, so that neither imports the actor that imports them. Only the
actor's own task calls them (one asyncio task owns the state, DESIGN §4).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from diloco_async.sync.checkpoints import Checkpointer
from diloco_async.sync.context import ActorContext
from diloco_async.sync.fragment_book import FragmentBook
from diloco_async.sync.learners import LearnerRegistry
from diloco_async.sync.lifecycle import Lifecycle
from diloco_async.sync.reporting import Reporter
from diloco_async.sync.rounds import RoundTable

__all__ = ["ActorView"]


@runtime_checkable
class ActorView(Protocol):
    """The synchronizer's state, by name (types as the actor holds them; times on ``clock``, s)."""

    ctx: ActorContext  # config, run id, epoch, store, lease epoch, clock, start
    book: FragmentBook  # the fragments this synchronizer holds (and the plan)
    table: RoundTable  # the open rounds and the global step
    registry: LearnerRegistry
    report: Reporter
    checkpoints: Checkpointer  # its book: sequence numbers, in flight, resumed from
    life: Lifecycle
    final_summary: dict | None
