"""The synchronizer's slice desk: the one owner of the run's slice ledger (issue 45 items 2-3; DESIGN §5.2).

A component of the actor (docs/architecture.md, "The synchronizer's components"): it answers
``lease`` requests, checks the slices each announcement names, turns merges into *trained* slices,
returns the leases of learners that are lost or restarted, and carries the ledger through
checkpoints. The decisions are :class:`~diloco_async.policy.slices.SliceLedger`'s (pure); this class
adds the clock, the counts and the log lines. With ``data.slices`` off it holds no ledger and every
method is a no-op (``enabled`` False).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING

from diloco_async.config.schema import Config
from diloco_async.policy.slices import SliceLedger, slice_count
from diloco_async.protocol.messages import Announcement, LeaseRequest, LeaseResponse

if TYPE_CHECKING:
    from diloco_async.sync.learners import LearnerRegistry
    from diloco_async.sync.reporting import Reporter
    from diloco_async.sync.state import Contribution, Round

__all__ = ["SliceDesk", "NOT_HELD"]

log = logging.getLogger("diloco.synchronizer")

#: rejection reason of an announcement that names slices its learner does not hold
NOT_HELD = "slices_not_held"


def training_tokens(cfg: Config) -> int:
    """Tokens of the run's training split (the corpus the flow built; mapped, not read)."""
    from diloco_async.data.tokens import open_corpus  # only for data.slices: the synchronizer reads no data else

    return len(open_corpus(cfg.data, cfg.model.context, model_vocab=cfg.model.vocab_size).train)


class SliceDesk:
    """The run's slice ledger and what the actor does with it (see the module docstring).

    Args:
        ledger: the ledger, or None when ``data.slices`` is off.
        clock: the actor's clock (seconds), for the lease times.
        report: the actor's reporter (counts and metrics).
        lapse_s: a holder silent this long (``synchronizer.heartbeat_timeout_s``) loses its leases.
    """

    def __init__(self, ledger: SliceLedger | None, clock: Callable[[], float], report: Reporter,
                 lapse_s: float = 10.0) -> None:
        self.ledger, self.clock, self.report, self.lapse_s = ledger, clock, report, lapse_s
        self.incarnations: dict[str, int] = {}  # the incarnation each holder leased under

    @classmethod
    def build(cls, cfg: Config, clock: Callable[[], float], report: Reporter,
              train_tokens: int | None = None) -> SliceDesk:
        """A desk for ``cfg``: with ``data.slices``, a fresh ledger over ``train_tokens`` training tokens
        (default: the corpus's, :func:`training_tokens`).

        Raises:
            ValueError: fewer training tokens than one slice (naming ``data.slice_tokens``).
        """
        if not cfg.data.slices:
            return cls(None, clock, report)
        tokens = train_tokens if train_tokens is not None else training_tokens(cfg)
        n = slice_count(tokens, cfg.data.slice_tokens)
        log.info("slice ledger: %d slices of %d tokens over %d training tokens", n, cfg.data.slice_tokens, tokens)
        return cls(SliceLedger(n, cfg.data.slice_tokens), clock, report, cfg.synchronizer.heartbeat_timeout_s)

    @property
    def enabled(self) -> bool:
        return self.ledger is not None

    # -- requests -----------------------------------------------------------------------------

    def on_lease(self, req: LeaseRequest, registry: LearnerRegistry, running: bool) -> LeaseResponse:
        """A learner's lease request: releases first, then ``req.want`` new slices (none when the
        learner is not in ``registry`` as this incarnation, or the run is no longer ``running``); the
        slices of ``req.held`` it no longer holds come back as ``revoked``."""
        led = self.ledger
        if led is None:
            return LeaseResponse(revoked=list(req.held))
        lid, info = req.learner_id, registry.get(req.learner_id)
        if info is None or info.incarnation != req.incarnation or not info.live:
            return LeaseResponse(revoked=list(req.held), epoch=led.epoch)
        if self.incarnations.setdefault(lid, req.incarnation) != req.incarnation:
            self.learner_gone(lid, f"restarted as incarnation {req.incarnation}")
            self.incarnations[lid] = req.incarnation
        ended = led.release(lid, req.release)
        revoked = led.not_held(lid, req.held)
        new = led.lease(lid, req.want, self.clock()) if running else []
        if new:
            self.report.counters["slices_leased"] += len(new)
        if revoked:
            log.info("learner %s holds no more slices %s (lease lapsed or returned)", lid, revoked[:8])
        log.debug("learner %s leased %s, released %s (epoch %d)", lid, new, ended, led.epoch)
        return LeaseResponse(slices=[(s, *led.tokens_of(s)) for s in new], revoked=revoked, epoch=led.epoch)

    def check_announcement(self, ann: Announcement) -> tuple[Announcement, str | None]:
        """(the announcement to admit, a refusal or None). Refused: it names a slice its learner
        does not hold (``slices_not_held``, with the slices). Clamped: ``c_tokens`` above the tokens
        of the slices it names (counted ``clamped_by_reason.c_tokens_over_slices``, logged); its
        token weight then rests on what the leases hold."""
        led = self.ledger
        if led is None:
            return ann, None
        lid = ann.learner_id
        missing = led.not_held(lid, ann.slices)
        if missing:
            return ann, f"slices {missing[:8]}{' ...' if len(missing) > 8 else ''} are not leased to {lid}"
        cap = len(ann.slices) * led.slice_tokens
        if ann.c_tokens > cap:
            if self.report.clamp("c_tokens_over_slices"):
                log.warning("announcement of learner=%s fragment=%d round=%d claims c_tokens=%d over %d slice(s) of "
                            "%d tokens: clamped to %d (%d so far)", lid, ann.fragment, ann.round_n, ann.c_tokens,
                            len(ann.slices), led.slice_tokens, cap,
                            self.report.clamped_by_reason["c_tokens_over_slices"])
            ann = ann.model_copy(update={"c_tokens": cap})
        led.named(lid, ann.slices)
        return ann, None

    def merged(self, learner: str, slices: Iterable[int]) -> None:
        """A merged contribution of ``learner`` named ``slices``: they are trained."""
        led = self.ledger
        if led is not None and led.merged(learner, slices):
            self.report.metric("sync/tokens_trained", led.counts["trained"] * led.slice_tokens)

    def lease_epochs(self, slices: Iterable[int]) -> list[int] | None:
        """The ledger epoch each of ``slices`` is leased in (the current epoch for one not leased),
        for the merge log; None when leases are off."""
        led = self.ledger
        if led is None:
            return None
        return [lease.epoch if (lease := led.leases.get(s)) is not None else led.epoch for s in slices]

    # -- ends of leases -----------------------------------------------------------------------

    def learner_gone(self, learner: str, why: str) -> None:
        """``learner`` was lost or restarted: its leases end (:meth:`SliceLedger.learner_lost`)."""
        if self.ledger is not None:
            ended = self.ledger.learner_lost(learner)
            if ended:
                log.info("learner %s %s: its %d lease(s) end %s", learner, why, len(ended), ended[:8])

    def sweep(self, rounds: Mapping[tuple[int, int], Round], stopped: bool, registry: LearnerRegistry,
              waiting: Iterable[Contribution] = ()) -> None:
        """End the leases of holders that ``registry`` no longer has live as the incarnation they
        leased under (silent for ``lapse_s``: heartbeat lapsed; restarted), or of every holder once
        the run is ``stopped`` and no round is left (the run's last accounting); then return the
        ended leases no contribution in flight names (in the open ``rounds``, the round table's, or
        ``waiting`` for the next round of its fragment to open, DESIGN §3.5).
        A learner restored from a checkpoint is not live until it heartbeats: its leases wait
        ``lapse_s`` from the restore for it."""
        led = self.ledger
        if led is None:
            return
        for lid in {lease.learner for lease in led.leases.values() if not lease.releasing}:
            info = registry.get(lid)
            if stopped and not rounds:
                self.learner_gone(lid, "stopped with the run")
            elif info is None or (not info.live and self.clock() - info.last_seen_s > self.lapse_s):
                self.learner_gone(lid, "lost")
            elif info.incarnation != self.incarnations.get(lid, info.incarnation):
                self.learner_gone(lid, f"restarted as incarnation {info.incarnation}")
        if not led.releasing():
            return
        in_flight = {s for rnd in rounds.values() for c in rnd.contributions.values() for s in c.ann.slices}
        in_flight.update(s for c in waiting for s in c.ann.slices)
        back = led.sweep(in_flight)
        if back:
            self.report.metric("sync/slices_requeued", led.counts["returned"])
            log.info("slices %s back in the pool (epoch %d)", back[:8], led.epoch)

    # -- figures, checkpoints -----------------------------------------------------------------

    def figures(self) -> dict:
        """The ledger's accounting for the summary and ``/status`` (empty when off)."""
        return {} if self.ledger is None else self.ledger.figures()

    def to_json(self) -> dict | None:
        """The ledger and its holders' incarnations, for a checkpoint (None when off)."""
        return None if self.ledger is None else {**self.ledger.to_json(), "incarnations": dict(self.incarnations)}

    def restore(self, doc: dict | None, trained_since: Iterable[int] = ()) -> None:
        """The ledger of a checkpoint (``doc``), plus the slices merged into versions published after
        it (``trained_since``, from those versions' headers). A checkpoint without a ledger (leases
        were off when it was written) keeps the fresh one.

        Raises:
            ValueError: the checkpoint's ledger has another slice size or count than this run's.
        """
        if self.ledger is None or doc is None:
            return
        restored = SliceLedger.from_json(doc)
        if (restored.n_slices, restored.slice_tokens) != (self.ledger.n_slices, self.ledger.slice_tokens):
            raise ValueError(f"the checkpoint's slice ledger has {restored.n_slices} slices of "
                             f"{restored.slice_tokens} tokens, this run {self.ledger.n_slices} of "
                             f"{self.ledger.slice_tokens}")
        late = restored.mark_trained(trained_since)
        self.ledger = restored
        self.incarnations = {str(k): int(v) for k, v in doc.get("incarnations", {}).items()}
        log.info("slice ledger restored: epoch %d, %d trained (%d from versions after the checkpoint), %d leased",
                 restored.epoch, restored.counts["trained"], len(late), len(restored.leases))
