"""Quorum, grace window and schedule policies on a fake clock (times in seconds)."""

import pytest

from diloco_async.policy import (
    Ema,
    GraceDecision,
    RoundStage,
    RoundState,
    global_step,
    grace_window,
    round_due_step,
)


def test_quorum_then_grace_merges_first_two_and_third_is_late():
    # K = 2 of 4 live learners; announcements at 0 ms, 4 ms and 30 ms; grace window 10 ms.
    live = ["a", "b", "c", "d"]
    rnd = RoundState(fragment=0, round_n=1, opened_s=0.0, min_quorum=2)
    merged_at = None

    def tick(now):
        nonlocal merged_at
        if rnd.stage is RoundStage.OPEN and rnd.quorum_met():
            rnd.start_grace(now, GraceDecision(0.010, "test"))
        if rnd.should_merge(now, live) and merged_at is None:
            rnd.start_merge()
            merged_at = now

    events = {0: "a", 4: "b", 30: "c"}
    admissions = {}
    for ms in range(0, 41):  # a 1 ms fake clock
        now = ms / 1000
        if ms in events:
            lid = events[ms]
            admissions[lid] = rnd.announce(lid, f"key-{lid}", now)
            if admissions[lid].status == "accepted":
                rnd.settle(lid, True)
        tick(now)

    assert admissions["a"].status == "accepted"
    assert admissions["b"].status == "accepted"
    assert rnd.quorum_s == pytest.approx(0.004)
    assert merged_at == pytest.approx(0.014)
    assert sorted(rnd.verified) == ["a", "b"]
    assert admissions["c"].status == "late"
    assert rnd.late == ["c"]


def test_quorum_counts_only_verified_contributions():
    rnd = RoundState(fragment=1, round_n=3, opened_s=0.0, min_quorum=2)
    rnd.announce("a", "k1", 0.0)
    rnd.announce("b", "k2", 0.001)
    rnd.settle("a", True)
    rnd.settle("b", False)  # e.g. NaN: rejected, does not count
    assert not rnd.quorum_met()
    rnd.announce("c", "k3", 0.002)
    rnd.settle("c", True)
    assert rnd.quorum_met()
    assert sorted(rnd.verified) == ["a", "c"]


def test_all_live_learners_announced_closes_early():
    rnd = RoundState(fragment=0, round_n=1, opened_s=0.0, min_quorum=1)
    rnd.announce("a", "k", 0.0)
    rnd.settle("a", True)
    rnd.start_grace(0.0, GraceDecision(5.0, "long"))
    assert rnd.should_merge(0.1, ["a", "b"]) is None
    rnd.announce("b", "k2", 0.2)
    rnd.settle("b", True)
    assert "all 2 live learners" in rnd.should_merge(0.2, ["a", "b"])


def test_announcement_idempotent_and_duplicate_learner_rejected():
    rnd = RoundState(fragment=0, round_n=1, opened_s=0.0, min_quorum=1)
    assert rnd.announce("a", "k", 0.0).status == "accepted"
    assert rnd.announce("a", "k", 0.1).status == "duplicate"
    assert rnd.announce("a", "other", 0.1).status == "rejected"
    assert len(rnd.entries) == 1


def test_stage_transitions_are_checked():
    rnd = RoundState(fragment=0, round_n=1, opened_s=0.0, min_quorum=1)
    with pytest.raises(RuntimeError):
        rnd.start_merge()  # OPEN -> MERGING is not allowed
    rnd.abandon()
    assert rnd.stage is RoundStage.ABANDONED
    with pytest.raises(RuntimeError):
        rnd.finish()


@pytest.mark.parametrize(
    "kw, expected",
    [
        # gamma * (tau*step - quorum - sync) = 0.8 * (2*1.0 - 0.5 - 0.25) = 1.0 -> capped at one step (1.0)
        (dict(step_time_s=1.0, quorum_wait_s=0.5, sync_time_s=0.25), 1.0),
        # 0.8 * (2*1.0 - 1.0 - 0.5) = 0.4
        (dict(step_time_s=1.0, quorum_wait_s=1.0, sync_time_s=0.5), 0.4),
        # no slack -> 0
        (dict(step_time_s=1.0, quorum_wait_s=2.5, sync_time_s=0.0), 0.0),
        # no estimate yet -> initial grace
        (dict(step_time_s=None, quorum_wait_s=0.0, sync_time_s=None), 0.3),
    ],
)
def test_grace_window_eq3(kw, expected):
    d = grace_window(tau=2, gamma=0.8, cap_s=None, initial_s=0.3, **kw)
    assert d.grace_s == pytest.approx(expected)
    assert d.reason


def test_grace_window_explicit_cap_and_errors():
    d = grace_window(step_time_s=10.0, quorum_wait_s=0.0, sync_time_s=0.0, tau=2, gamma=0.8, cap_s=2.0, initial_s=0.0)
    assert d.grace_s == 2.0 and "capped" in d.reason
    with pytest.raises(ValueError):
        grace_window(step_time_s=1.0, quorum_wait_s=0.0, sync_time_s=0.0, tau=0, gamma=0.8, cap_s=None, initial_s=0)
    with pytest.raises(ValueError):
        grace_window(step_time_s=1.0, quorum_wait_s=0.0, sync_time_s=0.0, tau=2, gamma=1.5, cap_s=None, initial_s=0)


def test_global_step_is_kth_largest():
    assert global_step([10, 30, 20, 5], 1) == 30
    assert global_step([10, 30, 20, 5], 2) == 20
    assert global_step([10, 30, 20, 5], 4) == 5
    assert global_step([10], 2) is None


def test_round_due_step():
    assert round_due_step(offset=6, round_n=1, sync_every=24) == 30
    assert round_due_step(offset=0, round_n=3, sync_every=24) == 72
    with pytest.raises(ValueError):
        round_due_step(0, 0, 24)


def test_ema():
    e = Ema(0.5)
    assert e.value is None
    assert e.update(2.0) == 2.0
    assert e.update(4.0) == 3.0
