"""Admission of a contribution's announcement into its round (DESIGN §3.4-§3.5, §10). Pure: the
time is passed in (seconds on any clock).

:func:`admit_announcement` checks an :class:`~diloco_async.protocol.messages.Announcement` against
the learner registry, the fragment's :class:`FragmentFacts`, the round's
:class:`~diloco_async.policy.rounds.RoundState` and the :class:`AnnouncementRules` of the run, and
says what becomes of it: an :class:`~diloco_async.policy.rounds.Admission` (``admitted``, ``duplicate``, ``late`` or
``rejected``, with the reason).
"""

from __future__ import annotations

from collections.abc import Collection, Container
from dataclasses import dataclass

from diloco_async.policy.rounds import DUPLICATE_REASON, Admission, RoundStage, RoundState
from diloco_async.protocol.messages import Announcement

__all__ = ["AnnouncementRules", "FragmentFacts", "admit_announcement", "folds_into_next", "parks_for_next"]


@dataclass(frozen=True)
class AnnouncementRules:
    """What every announcement of a round must meet: its key under ``key_prefix`` (the round's
    contribution prefix, ending in ``/``), a codec among ``codecs``, and a base version within
    ``max_staleness`` (S, paper §3.2) of the current one (named in the too-stale reason)."""

    key_prefix: str
    codecs: Collection[str]
    max_staleness: int


@dataclass(frozen=True)
class FragmentFacts:
    """What admission needs to know of one fragment: its current version, its next round
    number and the versions kept as possible bases (the last S + 1)."""

    version: int
    next_round: int
    kept_versions: frozenset[int]


def folds_into_next(ann: Announcement, next_round: RoundState | None, settled_key: str | None) -> bool:
    """Whether a late announcement (its round ``ann.round_n`` closed) joins round ``ann.round_n + 1`` of
    its fragment instead of being answered ``late`` (DESIGN §3.5, ``synchronizer.fold_late``).

    It does when that round is open or in its grace window, its learner has no entry there (no
    announcement, no refusal) and had none settled in the closed round (``settled_key`` None: a
    replay of a merged contribution stays a duplicate, and a second contribution to a round the
    learner already answered stays late). Only the round right after: garbage collection keeps the
    contributions of the round before the open one (DESIGN §5), so the folded object is still there.
    The admission checks then apply to the round it joins (:func:`admit_announcement`; the key may lie
    under the announced round's prefix).
    """
    return (next_round is not None and next_round.stage in (RoundStage.OPEN, RoundStage.GRACE)
            and ann.learner_id not in next_round.entries and settled_key is None)


def parks_for_next(ann: Announcement, parked: Container[str], settled_key: str | None,
                   progress_kept: bool = False, late_before: bool = True) -> bool:
    """Whether a late announcement waits for round ``ann.round_n + 1`` of its fragment, the round that
    opens next (none is open: round ``ann.round_n`` is merging, or merged and the next one waits for a
    slot), instead of being answered ``late`` (DESIGN §3.5, ``synchronizer.fold_late``). It does when
    its learner has none waiting there yet (``parked``: the learners that have) and had none settled in
    the closed round; the admission checks run at once against a fresh round and again when it opens.

    A learner that keeps its progress on adoption (``progress_kept``: ``learners.adopt = "rebase"``)
    still holds the progress of a contribution answered ``late`` in θ, and its next contribution
    carries it, measured from the newer version. Merged a round later instead, the waiting outer
    gradient is measured from an older base than the rest of its round (its anchored value also
    takes back the outer step published since). So such a learner's contribution waits only when
    its previous one to this fragment was late too (``late_before``): one late every time, a slow
    learner, would otherwise never be merged. One that overwrites on adoption would lose that
    progress: its contribution waits whenever it may.
    """
    return ann.learner_id not in parked and settled_key is None and (late_before or not progress_kept)


def admit_announcement(
    ann: Announcement,
    *,
    now_s: float,
    learner_known: bool,
    fragment: FragmentFacts | None,
    round_state: RoundState | None,
    settled_key: str | None,
    rules: AnnouncementRules,
) -> Admission:
    """Admit a contribution's announcement into its round, or say why not (DESIGN §3.4-§3.5, §10).

    Checks, in order: the learner joined; the fragment exists; the round is open (a closed round
    answers ``duplicate`` for the same key already settled there, ``late`` otherwise; a round
    never opened is rejected); a repeat of the same key is a duplicate; c_steps ≥ 1; the base
    version is still kept; the key lies under ``rules.key_prefix`` (the round's contribution
    prefix); the codec is known. Then :meth:`RoundState.announce` registers it at ``now_s`` (s).

    Args:
        ann: the announcement.
        learner_known: the learner has joined.
        fragment: the facts of fragment ``ann.fragment``; None when it does not exist.
        round_state: the open round ``(ann.fragment, ann.round_n)``; None when not open.
        settled_key: the key this learner had settled in that round once it closed, if any.
        rules: where the round's contributions must live, the known codecs, S.
    """
    key_prefix, codecs, max_staleness = rules.key_prefix, rules.codecs, rules.max_staleness
    p, n = ann.fragment, ann.round_n
    if not learner_known:
        return Admission("rejected", "unknown_learner: join first")
    if fragment is None:
        return Admission("rejected", f"bad_fragment: fragment {p} does not exist")
    if round_state is None:
        if settled_key == ann.key:
            return Admission("duplicate", DUPLICATE_REASON)
        if n < fragment.next_round:  # a replay of an old message, or one that arrived too late
            return Admission("late", f"round p{p} r{n} is closed")
        return Admission("rejected", f"unknown_round: round p{p} r{n} is not open")
    prior = round_state.entries.get(ann.learner_id)
    if prior is not None and prior.key == ann.key:
        return Admission("duplicate", DUPLICATE_REASON)
    if ann.c_steps < 1:
        return Admission("rejected", "no_progress: c_steps = 0 carries no weight")
    if ann.base_version not in fragment.kept_versions:
        return Admission("rejected", f"too_stale: base version {ann.base_version}, current {fragment.version}, "
                         f"keeping {max_staleness}")
    outside = [k for k in [ann.key, *(s.key for s in ann.shards or ())] if not k.startswith(key_prefix)]
    if outside:
        return Admission("rejected", f"bad_key: key {outside[0]!r} is outside this round's prefix")
    if ann.codec not in codecs:
        return Admission("rejected", f"bad_codec: {ann.codec}")
    return round_state.announce(ann.learner_id, ann.key, now_s)
