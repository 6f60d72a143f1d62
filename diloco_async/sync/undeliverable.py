"""Contributions a learner could not hand to the synchronizer shard that owns their fragment
(issue 40 item 2; DESIGN §2.2): counted, never lost silently.

A learner whose announcement is not acknowledged within ``learners.announce_timeout_s`` gives it
up and counts it by fragment; its heartbeats tell every shard the counts since its process started
(``undeliverable_by_fragment``). Each shard keeps them for every fragment, as
:class:`~diloco_async.sync.wire_bytes.WireBytes` keeps downloads: the owner may be the very shard
the learner cannot reach, and it learns of them once the route is back, while the other shards
report them meanwhile (the run's figure takes, fragment by fragment, the largest any shard heard:
:mod:`diloco_async.metrics.shards`). Owned by the actor (the learner registry holds it).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Mapping

__all__ = ["Undeliverable"]


class Undeliverable:
    """Running counts of undeliverable contributions by learner and fragment, across a learner's
    incarnations (each reports from 0)."""

    def __init__(self) -> None:
        self.by_learner: dict[str, dict[int, int]] = defaultdict(lambda: defaultdict(int))
        self._seen: dict[str, tuple[int, dict[int, int]]] = {}  # learner -> (incarnation, reported)

    def heartbeat(self, learner_id: str, incarnation: int, by_fragment: Mapping[int, int]) -> int:
        """Take in a heartbeat's ``undeliverable_by_fragment``; returns how many it adds (a count
        lower than the last one seen from that incarnation adds nothing)."""
        inc, seen = self._seen.get(learner_id, (incarnation, {}))
        if inc != incarnation:
            seen = {}
        added = 0
        for p, n in by_fragment.items():
            new = int(n) - seen.get(int(p), 0)
            if new > 0:
                self.by_learner[learner_id][int(p)] += new
                seen[int(p)] = int(n)
                added += new
        self._seen[learner_id] = (incarnation, seen)
        return added

    def by_fragment(self) -> dict[str, int]:
        """Fragment -> undeliverable contributions of every learner (JSON keys)."""
        out: dict[int, int] = defaultdict(int)
        for counts in self.by_learner.values():
            for p, n in counts.items():
                out[p] += n
        return {str(p): n for p, n in sorted(out.items())}

    def total(self, fragments: Collection[int]) -> int:
        """Undeliverable contributions of ``fragments`` (a shard's own)."""
        return sum(n for counts in self.by_learner.values() for p, n in counts.items() if p in fragments)

    def learner_total(self, learner_id: str) -> int:
        return sum(self.by_learner.get(learner_id, {}).values())

    def to_json(self) -> dict:
        """The counts and what each learner's incarnation reported last (a checkpoint's ``undeliverable``)."""
        return {"counts": {lid: {str(p): n for p, n in counts.items()} for lid, counts in self.by_learner.items()},
                "seen": {lid: [inc, {str(p): n for p, n in seen.items()}] for lid, (inc, seen) in self._seen.items()}}

    def restore(self, d: Mapping) -> None:
        """The state of a checkpoint: a learner's next heartbeat adds only what it reports beyond what
        its incarnation had reported then."""
        self.by_learner = defaultdict(lambda: defaultdict(int))
        for lid, counts in (d.get("counts") or {}).items():
            for p, n in counts.items():
                self.by_learner[lid][int(p)] = int(n)
        self._seen = {lid: (int(inc), {int(p): int(n) for p, n in seen.items()})
                      for lid, (inc, seen) in (d.get("seen") or {}).items()}
