"""Bytes on the wire per direction, per learner and per fragment (issue 13 item 3).

Up: the bytes of every contribution the synchronizer fetched and verified (its announced size),
by learner and fragment. Down: the bytes of versions each learner downloaded, by fragment, as it
reports them in its heartbeats (``bytes_down_by_fragment``, counted since its process started: a
new incarnation starts from 0). Per token: divided by the tokens the learners processed
(``tokens_total`` of their heartbeats), so ``net/bytes_up_per_token + net/bytes_down_per_token``
compares with DDP's all-reduce bytes per token per worker. Owned by the actor.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Mapping

__all__ = ["WireBytes", "per_token"]


def per_token(nbytes: float, tokens: float) -> float | None:
    """``nbytes / tokens``; None before any token."""
    return nbytes / tokens if tokens > 0 else None


class WireBytes:
    """Running byte totals by (direction, learner) and (direction, fragment)."""

    def __init__(self) -> None:
        self.by_learner: dict[str, dict[str, int]] = defaultdict(lambda: {"up": 0, "down": 0})
        self.by_fragment: dict[int, dict[str, int]] = defaultdict(lambda: {"up": 0, "down": 0})
        self._down_seen: dict[str, tuple[int, dict[int, int]]] = {}  # learner -> (incarnation, reported)

    def up(self, learner_id: str, fragment: int, nbytes: int) -> None:
        """A verified contribution of ``nbytes`` bytes."""
        self.by_learner[learner_id]["up"] += nbytes
        self.by_fragment[fragment]["up"] += nbytes

    def heartbeat(self, learner_id: str, incarnation: int, down_by_fragment: Mapping[int, int]) -> int:
        """Take in a heartbeat's ``bytes_down_by_fragment``; returns the new bytes it adds (a
        count lower than the last one seen from that incarnation adds nothing)."""
        inc, seen = self._down_seen.get(learner_id, (incarnation, {}))
        if inc != incarnation:
            seen = {}
        added = 0
        for p, n in down_by_fragment.items():
            new = n - seen.get(p, 0)
            if new > 0:
                self.by_fragment[int(p)]["down"] += new
                self.by_learner[learner_id]["down"] += new
                added += new
                seen[p] = n
        self._down_seen[learner_id] = (incarnation, seen)
        return added

    def learner_json(self, learner_id: str, tokens: float) -> dict:
        """``bytes_up``, ``bytes_down`` and their per-token figures of one learner."""
        b = self.by_learner.get(learner_id, {"up": 0, "down": 0})
        return {"bytes_up": b["up"], "bytes_down": b["down"], "bytes_up_per_token": per_token(b["up"], tokens),
                "bytes_down_per_token": per_token(b["down"], tokens)}

    def fragments_json(self, tokens: float) -> dict[str, dict]:
        """Per fragment: bytes up and down, and per token of the whole run."""
        return {str(p): {"bytes_up": b["up"], "bytes_down": b["down"],
                         "bytes_up_per_token": per_token(b["up"], tokens),
                         "bytes_down_per_token": per_token(b["down"], tokens)}
                for p, b in sorted(self.by_fragment.items())}

    def metrics(self, tokens_total: float, learner_tokens: Mapping[str, float],
                learners: Collection[str] | None = None) -> dict[str, float]:
        """The ``net/...`` metric points: run totals, per learner (only ``learners``, when given)
        and per fragment, per token."""
        out: dict[str, float] = {}
        up = sum(b["up"] for b in self.by_fragment.values())
        down = sum(b["down"] for b in self.by_fragment.values())
        for name, value in (("net/bytes_up_per_token", per_token(up, tokens_total)),
                            ("net/bytes_down_per_token", per_token(down, tokens_total))):
            if value is not None:
                out[name] = value
        for lid, b in self.by_learner.items():
            if learners is not None and lid not in learners:
                continue
            for d in ("up", "down"):
                v = per_token(b[d], learner_tokens.get(lid, 0))
                if v is not None:
                    out[f"net/learner/{lid}/bytes_{d}_per_token"] = v
        for p, b in self.by_fragment.items():
            for d in ("up", "down"):
                v = per_token(b[d], tokens_total)
                if v is not None:
                    out[f"net/fragment/{p}/bytes_{d}_per_token"] = v
        return out

    def to_json(self) -> dict:
        """What a checkpoint keeps (the totals; what each learner reported restarts)."""
        return {"by_learner": dict(self.by_learner), "by_fragment": {str(p): b for p, b in self.by_fragment.items()}}

    def restore(self, d: Mapping) -> None:
        """Continue from :meth:`to_json`'s output."""
        for lid, b in d.get("by_learner", {}).items():
            self.by_learner[lid] = {"up": int(b["up"]), "down": int(b["down"])}
        for p, b in d.get("by_fragment", {}).items():
            self.by_fragment[int(p)] = {"up": int(b["up"]), "down": int(b["down"])}
