"""The fragment book: the fragments one synchronizer owns (DESIGN §2, §4).

:class:`FragmentBook` holds, for each fragment index it was given (a subset of the fragment plan's
indices, all of them by default), that fragment's :class:`~diloco_async.sync.state.FragmentState`:
its value Θ_p and outer momentum (fp32), its outer optimizer, its kept versions and their store
refs, its round counter and whether a round of it is in flight. The fragments are independent (each
has its own rounds, versions and momentum), so a synchronizer over a subset of the plan runs the
same math on its fragments as one over the whole plan (issue 40).

Owned by the actor's task; a worker thread gets the one fragment whose round it merges.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence

import torch

from diloco_async.config.schema import SynchronizerConfig
from diloco_async.policy.fragments import FragmentPlan
from diloco_async.policy.schedules import OuterSchedule
from diloco_async.storage.store import ObjectStore
from diloco_async.sync.state import FragmentState, Merged, new_fragments

__all__ = ["FragmentBook"]


class FragmentBook:
    """The fragments of ``plan`` held by one synchronizer, by fragment index.

    Args:
        plan: the run's whole fragment plan (its schema hash, offsets and shares count every fragment).
        fragments: the states of the fragments held, each ``f.p`` an index of ``plan``.

    Iterating gives the held fragments in index order; ``book[p]`` the state of fragment ``p``.

    Raises:
        ValueError: an index outside the plan, or held twice.
    """

    def __init__(self, plan: FragmentPlan, fragments: Iterable[FragmentState]) -> None:
        self.plan = plan
        self._by_index: dict[int, FragmentState] = {}
        for f in sorted(fragments, key=lambda f: f.p):
            if not 0 <= f.p < plan.num_fragments or f.p in self._by_index:
                raise ValueError(f"fragment index {f.p} is outside the plan's {plan.num_fragments} fragments "
                                 "or held twice")
            self._by_index[f.p] = f
        self.indices: tuple[int, ...] = tuple(self._by_index)

    @classmethod
    def build(cls, plan: FragmentPlan, params: dict[str, torch.Tensor], sc: SynchronizerConfig,
              store: ObjectStore | None = None, indices: Sequence[int] | None = None) -> FragmentBook:
        """Version 0 of the fragments ``indices`` of ``plan`` (None: all of them), cut from the
        model's ``params`` (see :func:`~diloco_async.sync.state.new_fragments`).

        Raises:
            ValueError: an index outside the plan.
        """
        return cls(plan, new_fragments(plan, params, sc, store, indices))

    # -- reading ------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[FragmentState]:
        return iter(self._by_index.values())

    def __len__(self) -> int:
        return len(self._by_index)

    def __contains__(self, p: object) -> bool:
        return p in self._by_index

    def __getitem__(self, p: int) -> FragmentState:
        """The state of held fragment ``p`` (KeyError when it is not held)."""
        return self._by_index[p]

    def get(self, p: int) -> FragmentState | None:
        """The state of fragment ``p``, or None when this book does not hold it."""
        return self._by_index.get(p)

    def versions(self) -> dict[int, int]:
        """The current version of every held fragment, by index."""
        return {f.p: f.version for f in self}

    def numel(self) -> dict[str, int]:
        """Elements of every tensor of the held fragments (what the update guard may be shown)."""
        return {n: math.prod(shape) for f in self for n, shape in f.shapes.items()}

    # -- changing (on the actor's task) -------------------------------------------------------

    def begin_round(self, f: FragmentState, n: int) -> None:
        """Round ``n`` of ``f`` is in flight; the next one it opens is ``n + 1``."""
        f.busy, f.next_round = True, n + 1

    def set_outer_lr(self, f: FragmentState, schedule: OuterSchedule, run_tokens: int) -> float:
        """Set η of ``f``'s next outer step (on the actor's task, before the merge's thread starts):
        the schedule at ``run_tokens``, the tokens processed by the run now; returns it."""
        f.optimizer.lr = schedule.lr(run_tokens)
        return f.optimizer.lr

    def end_round(self, f: FragmentState) -> None:
        """``f``'s round in flight is over (merged, failed or abandoned)."""
        f.busy = False

    def adopt(self, f: FragmentState, res: Merged, max_staleness: int) -> None:
        """The version ``res`` published becomes ``f``'s value; versions older than the
        ``max_staleness`` a contribution may lag behind leave the history (DESIGN §3.5)."""
        f.version = res.version
        f.current, f.momentum, f.outer_steps = res.new, res.momentum, res.outer_steps
        f.published, f.compact = res.published or res.new, res.compact
        f.history[f.version], f.refs[f.version] = f.published, res.ref
        for old in [v for v in f.history if v < f.version - max_staleness]:
            del f.history[old]
