"""The update guard's memory on the synchronizer (docs/threat-model.md, the update guard).

:class:`UpdateGuard` is the actor's component that holds what the guard remembers across rounds:
the recent norms of every tensor of the fragments held (:class:`~diloco_async.policy.guard.NormGuard`),
the recent cosines of each fragment's merges (:class:`~diloco_async.policy.guard.DirectionGuard`)
and of each learner (:class:`~diloco_async.policy.guard.LearnerDirections`). The decisions are the
pure policies' of :mod:`diloco_async.policy.guard`; this component feeds them and keeps their state.
Used by the round table, on the actor's task.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING

from diloco_async.policy.guard import DirectionCheck, DirectionGuard, LearnerDirections, NormGuard
from diloco_async.sync.state import Merged, Round, Verified

if TYPE_CHECKING:
    from diloco_async.config.guard import GuardConfig
    from diloco_async.sync.fragment_book import FragmentBook
    from diloco_async.sync.reporting import Reporter

__all__ = ["UpdateGuard"]

log = logging.getLogger("diloco.synchronizer")


class UpdateGuard:
    """The guard's memory over the fragments of ``book`` (``cfg``: the ``[guard]`` section); clipped
    contributions are counted by ``report``."""

    def __init__(self, cfg: GuardConfig, book: FragmentBook, report: Reporter) -> None:
        self.report = report
        self.norms = NormGuard(cfg, book.numel())
        self.directions = {p: DirectionGuard(cfg) for p in book.indices}
        self.learners = LearnerDirections(cfg.direction_memory)

    def screen(self, msg: Verified, rnd: Round) -> Verified:
        """The norm guard on a verified contribution of round ``rnd``: reject it (``delta`` None,
        reason ``norm_outlier``), or mark its outlier tensors to be clipped, or record its norms."""
        contrib = rnd.contributions.get(msg.learner)
        lr_warmup = contrib.lr_warmup if contrib is not None else True
        steps = contrib.ann.c_steps if contrib is not None else 1
        verdict = self.norms.check(msg.norms, lr_warmup, steps)
        if verdict.status == "reject":
            return Verified(msg.fragment, msg.round_n, msg.learner, None, verdict.reason, msg.nbytes)
        if verdict.status == "clip":
            rnd.contributions[msg.learner].scales = verdict.scales
            self.report.count("contributions_clipped")
            log.warning("clipped contribution learner=%s fragment=%d round=%d: %s", msg.learner, msg.fragment,
                        msg.round_n, verdict.reason)
        elif not lr_warmup:
            self.norms.record(msg.norms, steps)
        return msg

    def direction_check(self, p: int) -> DirectionCheck:
        """What the direction guard of a merge of fragment ``p`` starting now needs."""
        return self.directions[p].check(self.learners)

    def record_merge(self, res: Merged, c_tokens: Mapping[str, int]) -> None:
        """The cosines of a merge: the merged ones (with their ``c_tokens``) feed their fragment's
        guard, every judged one (merged or left out) its learner's record."""
        guard = self.directions[res.fragment]
        for lid in res.merged:
            guard.record(res.cosines.get(lid), res.factors.get(lid, 1.0), c_tokens.get(lid))
        for lid, cosine in res.cosines.items():
            self.learners.record(lid, cosine)
