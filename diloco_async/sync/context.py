"""What the synchronizer actor's components share and none of them changes.

:class:`ActorContext` is set once when the actor is made: the run's config and identity, the
store (fenced by the lease when there is one), the clock, and the two ways back to the actor's
task (its inbox, and :attr:`ActorContext.spawn` for a task it cancels and awaits when it stops).
Each component keeps its own changing state; the context holds none.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from diloco_async.config.schema import Config, SynchronizerConfig
from diloco_async.storage import keys
from diloco_async.storage.store import ObjectStore

__all__ = ["ActorContext"]


@dataclass(frozen=True)
class ActorContext:
    """The actor's fixed surroundings (times in seconds on ``clock``).

    Attributes:
        cfg: the validated config.
        run_id: the run's id; it lives under ``{store}/{run_id}/``.
        epoch: this process's epoch (changes at every (re)start; learners then reset their round state).
        store: the object store, fenced by the lease when there is one (a
            :class:`~diloco_async.sync.lease.FencedStore` has its interface).
        lease_epoch: the epoch of this process's lease on the run (0: no fencing); published
            versions and checkpoints carry it.
        clock: monotonic clock in seconds (injectable for tests).
        started_s: when the actor was made, on ``clock``.
        inbox: the actor's queue; worker tasks post their results to it.
        spawn: starts a task that the actor cancels and awaits when it stops.
        shard: this synchronizer's shard index, in ``[0, cfg.synchronizer.shards)`` (DESIGN §2.2).
    """

    cfg: Config
    run_id: str
    epoch: str
    store: ObjectStore
    lease_epoch: int
    clock: Callable[[], float]
    started_s: float
    inbox: asyncio.Queue
    spawn: Callable[[Coroutine[Any, Any, None]], None]
    shard: int = 0

    @property
    def sc(self) -> SynchronizerConfig:
        """The ``[synchronizer]`` section of :attr:`cfg`."""
        return self.cfg.synchronizer

    @property
    def owner_id(self) -> str:
        """The key root of what this synchronizer's lifetime owns (checkpoints, epochs; the lease
        is taken under it too): the run id with one shard, ``{run_id}/shards/{shard:03d}`` with
        more (:func:`diloco_async.storage.keys.synchronizer_root`)."""
        return keys.synchronizer_root(self.run_id, self.shard, self.sc.shards)
