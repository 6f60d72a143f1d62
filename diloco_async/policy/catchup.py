"""Catch-up of a learner whose reads are slower than the versions move (issue 47; DESIGN §3.8, §5).

Two decisions, pure (plain values in, a decision with its reason out):

* **Which version a learner downloads** (:func:`version_to_fetch`): when the I/O lane frees up
  for a fragment, only the newest version it was told of, never the ones in between. A learner
  whose link cannot keep up with the versions skips them instead of queueing one read per
  version, each stale (and perhaps collected) before it starts.
* **Which versions garbage collection keeps for the learners' reads** (:class:`ReadLeases`): a
  version a live learner was told of and may still be reading is never collected. Each heartbeat
  reports, per fragment, the newest version the learner was told of (``known_versions``: it
  starts no read of an older one from then on) and the version it is reading now
  (``fetching_versions``); the lease holds those, and everything from the known version up, while
  the learner is live. It ends with the learner's liveness (the heartbeat timeout) and is bounded
  to ``max_behind`` versions behind the fragment's current one, so a learner cannot pin the
  history.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

__all__ = ["FetchChoice", "version_to_fetch", "ReadClaim", "ReadLeases"]


@dataclass(frozen=True)
class FetchChoice:
    """What to download next for one fragment: ``version`` (None: nothing), ``skipped`` (versions
    told of and never downloaded, between the one held and the one chosen) and why."""

    version: int | None
    skipped: int
    reason: str


def version_to_fetch(told: int | None, held: int, gone: int = -1) -> FetchChoice:
    """The version of one fragment to download when the learner's download lane frees up.

    Args:
        told: the newest version the learner was told of (None: none yet).
        held: the newest version it holds (adopted, or downloaded and waiting to be adopted); -1: none.
        gone: the newest version it found collected (-1: none): never asked for again.

    Returns:
        the newest version told, when it is newer than both ``held`` and ``gone``, with the number of
        intermediate versions skipped; else nothing, with the reason.
    """
    if told is None:
        return FetchChoice(None, 0, "no version told yet")
    if told <= held:
        return FetchChoice(None, 0, f"v{told} told, v{held} held")
    if told <= gone:
        return FetchChoice(None, 0, f"v{told} is collected; waiting to be told of a newer one")
    skipped = max(0, told - max(held, gone) - 1)
    reason = f"newest told v{told}" + (f", skipping {skipped} intermediate version(s)" if skipped else "")
    return FetchChoice(told, skipped, reason)


@dataclass
class ReadClaim:
    """What one learner may still read, by fragment: from ``known[p]`` on (the newest version it was
    told of as of its last heartbeat, or at join), and ``fetching[p]`` (the read in progress)."""

    known: dict[int, int] = field(default_factory=dict)
    fetching: dict[int, int] = field(default_factory=dict)


class ReadLeases:
    """The read leases of a run's learners (owned by the synchronizer's actor).

    Args:
        max_behind: a lease keeps no version more than this many behind its fragment's current one (>= 0).

    Raises:
        ValueError: a negative ``max_behind``.
    """

    def __init__(self, max_behind: int) -> None:
        if max_behind < 0:
            raise ValueError(f"max_behind must be >= 0 versions, got {max_behind}")
        self.max_behind = max_behind
        self.claims: dict[str, ReadClaim] = {}

    def joined(self, learner_id: str, told: Mapping[int, int]) -> None:
        """A learner (re)joined and was told the versions ``told`` (fragment -> version), which it reads next."""
        self.claims[learner_id] = ReadClaim(known=dict(told))

    def heartbeat(self, learner_id: str, known: Mapping[int, int], fetching: Mapping[int, int]) -> None:
        """A learner's heartbeat: the newest versions it was told of (a fragment it does not name
        keeps its previous value) and the reads it has in progress (those it does not name ended)."""
        claim = self.claims.setdefault(learner_id, ReadClaim())
        claim.known.update(known)
        claim.fetching = dict(fetching)

    def keep(self, live: Iterable[str], current: Mapping[int, int]) -> dict[int, set[int]]:
        """The versions of each fragment that garbage collection must not delete: for every live
        learner, its read in progress and every version from its known one to ``current`` (fragment
        -> version), each at most ``max_behind`` behind current. Learners not in ``live`` hold nothing."""
        keep: dict[int, set[int]] = {}
        for lid in live:
            claim = self.claims.get(lid)
            if claim is None:
                continue
            for p, now in current.items():
                floor = now - self.max_behind
                held = keep.setdefault(p, set())
                known = claim.known.get(p)
                if known is not None:
                    held.update(range(max(known, floor), now + 1))
                reading = claim.fetching.get(p)
                if reading is not None and floor <= reading <= now:
                    held.add(reading)
        return {p: vs for p, vs in keep.items() if vs}
