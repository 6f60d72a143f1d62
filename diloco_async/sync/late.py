"""Late contributions at the synchronizer (DESIGN §3.5, ``synchronizer.fold_late``): the round a
contribution announced after its round closed joins instead, and those waiting for that round to open.

A component of the :class:`~diloco_async.sync.rounds.RoundTable`, on the actor's task only. The
decisions are :func:`~diloco_async.policy.admission.folds_into_next` and
:func:`~diloco_async.policy.admission.parks_for_next` (pure); this class holds the waiting ones.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from diloco_async.policy.admission import folds_into_next, parks_for_next
from diloco_async.policy.rounds import RoundStage
from diloco_async.protocol.messages import Announcement
from diloco_async.sync.logs import BoundedMap
from diloco_async.sync.state import Contribution, FragmentState, Round

__all__ = ["LateDesk"]


class LateDesk:
    """Where late contributions go (see the module docstring).

    Args:
        enabled: ``synchronizer.fold_late``; off, every late contribution is answered ``late``.
        joined_cap: how many (learner, fragment, round) -> joined round answers are kept for retries.
        progress_kept: the learners keep their progress on adoption (``learners.adopt = "rebase"``).
    """

    def __init__(self, enabled: bool, joined_cap: int = 4096, progress_kept: bool = False) -> None:
        self.enabled = enabled
        self.progress_kept = progress_kept  # learners.adopt = "rebase" (parks_for_next)
        self.parked: dict[tuple[int, int], dict[str, Contribution]] = {}  # (p, n) -> learner -> waiting for it
        # (learner, fragment, announced round) -> the round it joined, for the ack of a retry
        self.joined: BoundedMap[tuple[str, int, int], int] = BoundedMap(joined_cap)
        self.late_last: set[tuple[str, int]] = set()  # (learner, fragment) whose last contribution was answered late

    def answered(self, learner: str, p: int, late: bool) -> None:
        """``learner``'s contribution to fragment ``p`` was answered ``late`` (``late``), or taken into
        its round on time: whether its next late one may wait (:func:`parks_for_next`). One that
        waited or was folded leaves the record as it was (a learner late every time keeps waiting)."""
        if late:
            self.late_last.add((learner, p))
        else:
            self.late_last.discard((learner, p))

    def joins(self, ann: Announcement, f: FragmentState | None, rnd: Round | None,
              rounds: Mapping[tuple[int, int], Round], settled_key: str | None, may_wait: bool) -> int | None:
        """The round ``ann`` joins instead of being answered ``late``, or None (not late, or it stays late).

        Its round n (``rnd``: the round table's, None once gone) closed: gone, or merging without it.
        It joins round n + 1 when that round is open and takes it (:func:`folds_into_next`), or when
        round n + 1 is the one fragment ``f`` opens next, ``may_wait`` (the run is running: no round
        opens once it stops) and it may wait for it (:func:`parks_for_next`: with progress kept on
        adoption, only when its previous contribution to the fragment was late too). ``settled_key``:
        the key its learner had settled in round n, if any."""
        lid, p, n = ann.learner_id, ann.fragment, ann.round_n
        if not self.enabled or f is None or n >= f.next_round:
            return None
        if rnd is not None and (rnd.state.stage is not RoundStage.MERGING or lid in rnd.state.entries):
            return None
        nxt = rounds.get((p, n + 1))
        if nxt is not None:
            return n + 1 if folds_into_next(ann, nxt.state, settled_key) else None
        opens_next = may_wait and f.next_round == n + 1
        return n + 1 if opens_next and parks_for_next(ann, self.parked.get((p, n + 1), {}), settled_key,
                                                      self.progress_kept, (lid, p) in self.late_last) else None

    def joined_round(self, ann: Announcement, settled_key: str | None) -> int | None:
        """The round a repeat of ``ann`` joined (it was folded or waits), or None: a retry whose first
        answer was lost learns it too."""
        if settled_key != ann.key:
            return None
        return self.joined.get((ann.learner_id, ann.fragment, ann.round_n))

    def park(self, contrib: Contribution) -> None:
        """``contrib`` (its announcement already names the round it joins) waits for that round."""
        ann = contrib.ann
        self.parked.setdefault((ann.fragment, ann.round_n), {})[ann.learner_id] = contrib

    def take(self, p: int, n: int) -> tuple[list[Contribution], list[Contribution]]:
        """Round ``n`` of fragment ``p`` opens: (the contributions waiting for it, those waiting for an
        earlier round of ``p``, which the schedule skipped: it never opens). None of them waits after."""
        skipped = [c for m in sorted(m for q, m in self.parked if q == p and m < n) for c in self.take(p, m)[0]]
        return list(self.parked.pop((p, n), {}).values()), skipped

    def awaited(self, next_rounds: Mapping[int, int]) -> set[int]:
        """The fragments whose next round (``next_rounds``: fragment -> its number) has contributions
        waiting for it: the schedule opens that round under its number (:func:`schedule_rounds`)."""
        return {p for (p, n), waiting in self.parked.items() if waiting and next_rounds.get(p) == n}

    def take_all(self) -> list[Contribution]:
        """Every waiting contribution (their rounds will not open); none wait after."""
        out = [c for waiting in self.parked.values() for c in waiting.values()]
        self.parked.clear()
        return out

    def waiting_contributions(self) -> Iterator[Contribution]:
        """The contributions waiting now (their slices are in flight, DESIGN §5.2)."""
        for waiting in self.parked.values():
            yield from waiting.values()
