"""The current version of every fragment as the learners are told it (join and heartbeat replies),
and the heartbeat replies themselves, shared by the learners in the same state (issue 17), with the
run's tokens processed as the learners' lr schedules are told it
(:func:`~diloco_async.policy.schedules.told_tokens`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from diloco_async.policy.schedules import told_tokens
from diloco_async.protocol.messages import HeartbeatResponse, RoundOpen, VersionInfo
from diloco_async.sync.state import FragmentState

__all__ = ["VersionInfos", "HeartbeatReplies", "REPLIES_CAP"]

REPLIES_CAP = 256
"""Distinct heartbeat replies kept (they differ only by the open rounds a learner has not announced to)."""


class VersionInfos:
    """Every fragment's current :class:`~diloco_async.protocol.messages.VersionInfo`, built again only after
    a fragment's version (or its object) changed: a heartbeat reply costs no model construction."""

    def __init__(self) -> None:
        self._key: tuple = ()
        self._infos: list[VersionInfo] = []

    def __call__(self, fragments: Iterable[FragmentState]) -> list[VersionInfo]:
        """A new list (the caller may keep it) of the fragments' current versions, by fragment."""
        key = self.key(fragments)
        if key != self._key or not self._infos:
            self._infos = [VersionInfo(fragment=f.p, version=f.version, key=f.refs[f.version].key,
                                       nbytes=f.refs[f.version].nbytes, sha256=f.refs[f.version].sha256,
                                       compact=f.compact)
                           for f in fragments]
            self._key = key
        return list(self._infos)

    @staticmethod
    def key(fragments: Iterable[FragmentState]) -> tuple:
        """What the versions told depend on (equal keys: equal version infos)."""
        return tuple((f.version, f.refs[f.version].key, f.refs[f.version].sha256, f.compact) for f in fragments)


class HeartbeatReplies:
    """The reply to a known learner's heartbeat, one model per distinct content (the open rounds it
    has not announced to, the fragments' versions, stop, epoch): the learners in the same state get
    the same model, and the HTTP layer serializes each model once. Replies are never changed after
    they are handed out (callers must not change them either).

    ``tokens_processed`` gives the run's tokens processed now, ``budget_tokens`` is ``budget.tokens``
    (None: unset): replies tell :meth:`run_tokens`, which moves in steps of 0.1% of the budget, so
    a reply stays shared between them."""

    def __init__(self, versions: VersionInfos, tokens_processed: Callable[[], int] = lambda: 0,
                 budget_tokens: int | None = None) -> None:
        self.versions = versions  # the current version infos, shared with the join replies
        self.tokens_processed, self.budget_tokens = tokens_processed, budget_tokens
        self._replies: dict[tuple, HeartbeatResponse] = {}

    def __call__(self, fragments: Iterable[FragmentState], opens: tuple[tuple[int, int, int], ...], stop: bool,
                 epoch: str) -> HeartbeatResponse:
        """The reply; ``opens``: the open rounds to tell, each ``(fragment, round_n, version)``."""
        run_tokens = self.run_tokens()
        key = (VersionInfos.key(fragments), opens, stop, epoch, run_tokens)
        reply = self._replies.get(key)
        if reply is None:
            if len(self._replies) >= REPLIES_CAP:
                self._replies.clear()
            reply = self._replies[key] = HeartbeatResponse(
                open_rounds=[RoundOpen(fragment=p, round_n=n, version=v) for p, n, v in opens],
                versions=self.versions(fragments), stop=stop, epoch=epoch, run_tokens=run_tokens)
        return reply

    def run_tokens(self) -> int:
        """The run's tokens processed as learners are told them (the lr schedules' progress)."""
        return told_tokens(self.tokens_processed(), self.budget_tokens)
