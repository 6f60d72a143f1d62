"""Where a late contribution goes (diloco_async/sync/late.py, ``synchronizer.fold_late``; DESIGN §3.5):
into round n + 1 when it is open, waiting for it when it opens next (round n merging, or merged and
round n + 1 not opened yet) while the run runs, late otherwise; the waiting ones are taken when their
round opens, and those of a round the schedule skipped come out then too."""

from __future__ import annotations

from types import SimpleNamespace

from diloco_async.policy.rounds import GraceDecision, RoundState
from diloco_async.protocol.messages import Announcement
from diloco_async.sync.late import LateDesk
from diloco_async.sync.state import Contribution, Round


def _ann(lid: str = "a", n: int = 1) -> Announcement:
    return Announcement(learner_id=lid, fragment=0, round_n=n, base_version=0, c_steps=4, c_tokens=100,
                        compute_s=1.0, key=f"run1/contrib/p000/r{n:08d}/{lid}", nbytes=10, sha256="0" * 64,
                        codec="fp32", update_id=f"u{lid}{n}", slices=[7])


def _merging(*learners: str) -> Round:
    rnd = Round(RoundState(0, 1, opened_s=0.0, min_quorum=1))
    for lid in learners:
        rnd.state.announce(lid, f"k{lid}", 0.0)
        rnd.state.settle(lid, True)
    rnd.state.start_grace(0.0, GraceDecision(0.0, "none"))
    rnd.state.start_merge()
    return rnd


def test_a_late_contribution_waits_for_the_round_that_opens_next() -> None:
    desk, f = LateDesk(enabled=True), SimpleNamespace(next_round=2)  # round 1 is the last one opened
    merging = _merging("b")
    assert desk.joins(_ann("a"), f, merging, {(0, 1): merging}, None, True) == 2  # round 1 merging without it
    assert desk.joins(_ann("b"), f, merging, {(0, 1): merging}, None, True) is None  # b is in round 1: late there
    assert desk.joins(_ann("a"), f, None, {}, None, True) == 2  # round 1 merged, round 2 not open yet
    assert desk.joins(_ann("a"), f, None, {}, None, False) is None  # the run stopped: no round opens, it is late
    assert desk.joins(_ann("a"), f, None, {}, "run1/contrib/p000/r00000001/a", True) is None  # settled in round 1
    assert desk.joins(_ann("a", n=2), f, None, {}, None, True) is None  # round 2 never opened: not late
    assert desk.joins(_ann("a"), SimpleNamespace(next_round=3), None, {}, None, True) is None  # round 2 came and went
    assert LateDesk(enabled=False).joins(_ann("a"), f, None, {}, None, True) is None
    open2 = Round(RoundState(0, 2, opened_s=0.0, min_quorum=1))
    assert desk.joins(_ann("a"), SimpleNamespace(next_round=3), None, {(0, 2): open2}, None, False) == 2  # folds in
    waiting = Contribution(_ann("a").model_copy(update={"round_n": 2}))
    desk.park(waiting)
    assert desk.joins(_ann("a"), f, None, {}, None, True) is None  # one waits for round 2 already
    assert desk.joins(_ann("c"), f, None, {}, None, True) == 2
    assert [c.ann.slices for c in desk.waiting_contributions()] == [[7]]  # its slices are in flight
    assert desk.awaited({0: 2, 1: 2}) == {0}  # the schedule opens round 2 of fragment 0 under its number
    assert desk.awaited({0: 3}) == set()  # (round 2 is no longer the next one: nothing to keep)
    assert desk.take(1, 2) == ([], []) and desk.take(0, 2) == ([waiting], []) and desk.take(0, 2) == ([], [])
    desk.park(waiting)
    assert desk.take(0, 3) == ([], [waiting])  # round 2 was skipped: it never opens
    desk.park(waiting)
    assert desk.take_all() == [waiting] and list(desk.waiting_contributions()) == []
    desk.joined[("a", 0, 1)] = 2  # a retry of the one that joined round 2 learns that round
    assert desk.joined_round(_ann("a"), settled_key=_ann("a").key) == 2
    assert desk.joined_round(_ann("a"), settled_key="another key") is None


def test_a_rebasing_learners_late_contribution_waits_only_when_its_last_one_was_late() -> None:
    """With progress kept on adoption (``learners.adopt = "rebase"``) a late contribution waits only
    when its learner's previous one to the fragment was answered late too; one taken on time
    resets that. Without it (overwrite) every late one may wait, as before."""
    f = SimpleNamespace(next_round=2)
    rebasing = LateDesk(enabled=True, progress_kept=True)
    assert rebasing.joins(_ann("a"), f, None, {}, None, True) is None  # its progress stays in θ: late
    rebasing.answered("a", 0, late=True)
    assert rebasing.joins(_ann("a"), f, None, {}, None, True) == 2  # late twice running: it waits
    assert rebasing.joins(_ann("b"), f, None, {}, None, True) is None  # another learner's record is its own
    rebasing.answered("a", 1, late=True)
    rebasing.answered("a", 0, late=False)  # taken on time since
    assert rebasing.joins(_ann("a"), f, None, {}, None, True) is None
    assert LateDesk(enabled=True).joins(_ann("a"), f, None, {}, None, True) == 2  # overwriting learners wait
