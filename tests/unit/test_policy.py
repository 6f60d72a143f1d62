"""Quorum, grace window and schedule policies on a fake clock (times in seconds)."""

import pytest

from diloco_async.config.schema import BudgetConfig
from diloco_async.policy.admission import AnnouncementRules, FragmentFacts, admit_announcement, folds_into_next
from diloco_async.policy.rounds import (
    Ema,
    GraceDecision,
    RoundStage,
    RoundState,
    budget_stop_reason,
    global_step,
    grace_window,
    round_due_step,
    schedule_rounds,
)
from diloco_async.protocol.messages import Announcement


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


# -- admission of an announcement (pure; the clock is a plain number) ------------------------

PREFIX = "run1/contrib/p000/r00000001/"


def announcement(**kw) -> Announcement:
    body = dict(learner_id="a", fragment=0, round_n=1, base_version=0, c_steps=4, c_tokens=100, compute_s=1.0,
                key=PREFIX + "a-1.safetensors", nbytes=10, sha256="0" * 64, codec="fp32", update_id="u1")
    return Announcement(**{**body, **kw})


FRAGMENT_0 = FragmentFacts(version=0, next_round=2, kept_versions=frozenset({0}))


def admit(ann, *, now_s=0.0, known=True, fragment=FRAGMENT_0, rnd=None, settled=None):
    return admit_announcement(ann, now_s=now_s, learner_known=known, fragment=fragment, round_state=rnd,
                              settled_key=settled, rules=AnnouncementRules(PREFIX, ("fp32", "bf16"), 4))


@pytest.mark.parametrize("kw, code", [
    (dict(known=False), "unknown_learner"),
    (dict(fragment=None), "bad_fragment"),
    (dict(rnd="open", ann=dict(c_steps=0)), "no_progress"),
    (dict(rnd="open", ann=dict(base_version=3)), "too_stale"),
    (dict(rnd="open", ann=dict(key="run1/contrib/p000/r00000002/a-1.safetensors")), "bad_key"),
    (dict(rnd="open", ann=dict(codec="int8")), "bad_codec"),
    (dict(ann=dict(round_n=5, key="k")), "unknown_round"),
])
def test_admission_rejects_with_a_counted_reason(kw, code):
    rnd = RoundState(0, 1, opened_s=0.0, min_quorum=1) if kw.pop("rnd", None) else None
    adm = admit(announcement(**kw.pop("ann", {})), rnd=rnd, **kw)
    assert adm.status == "rejected" and adm.code == code and adm.reason.startswith(code + ": ")
    assert rnd is None or not rnd.entries  # nothing registered


def test_admission_registers_at_the_injected_time_and_acknowledges_repeats_once():
    rnd = RoundState(0, 1, opened_s=10.0, min_quorum=1)
    first = admit(announcement(), now_s=10.25, rnd=rnd)
    assert first.status == "accepted" and first.code == ""
    assert rnd.entries["a"].at_s == 10.25
    again = admit(announcement(), now_s=10.5, rnd=rnd)
    assert again.status == "duplicate" and rnd.entries["a"].at_s == 10.25
    other = admit(announcement(key=PREFIX + "a-2.safetensors"), now_s=10.5, rnd=rnd)
    assert (other.status, other.code) == ("rejected", "duplicate_learner")
    assert other.reason == "duplicate_learner: a different contribution for this round"


def test_admission_after_the_round_closed():
    # round 1 of fragment 0 is over (next round 2): the settled key is a duplicate, anything else late
    assert admit(announcement(), settled=PREFIX + "a-1.safetensors").status == "duplicate"
    late = admit(announcement(), settled=None)
    assert late.status == "late" and late.reason == "round p0 r1 is closed"
    rnd = RoundState(0, 1, opened_s=0.0, min_quorum=1)
    rnd.announce("b", "kb", 0.0)
    rnd.settle("b", True)
    rnd.start_grace(0.0, GraceDecision(0.0, "none"))
    rnd.start_merge()
    merging = admit(announcement(), now_s=0.1, rnd=rnd)
    assert merging.status == "late" and "merging" in merging.reason and rnd.late == ["a"]


def test_a_late_announcement_folds_into_the_next_open_round_only():
    late = announcement()  # for round 1 of fragment 0, which closed
    nxt = RoundState(0, 2, opened_s=0.0, min_quorum=1)
    assert folds_into_next(late, nxt, settled_key=None)
    assert not folds_into_next(late, None, settled_key=None)  # no next round open
    assert not folds_into_next(late, nxt, settled_key=late.key)  # it settled in round 1: a replay, a duplicate
    assert not folds_into_next(late, nxt, settled_key=PREFIX + "a-0.safetensors")  # a answered round 1 already
    nxt.announce("a", PREFIX + "a-2.safetensors", 0.0)
    assert not folds_into_next(late, nxt, settled_key=None)  # the learner answered round 2 already
    other = RoundState(0, 2, opened_s=0.0, min_quorum=1)
    other.refuse("a", "k", 0.0)
    assert not folds_into_next(late, other, settled_key=None)  # refused there: its entry stands
    for stage in ("grace", "merging"):
        rnd = RoundState(0, 2, opened_s=0.0, min_quorum=1)
        rnd.announce("b", "kb", 0.0)
        rnd.settle("b", True)
        rnd.start_grace(0.0, GraceDecision(0.0, "none"))
        if stage == "merging":
            rnd.start_merge()
        assert folds_into_next(late, rnd, settled_key=None) is (stage == "grace")
    # folded, the admission checks apply to round 2 with the key under round 1's prefix
    adm = admit(late.model_copy(update={"round_n": 2}), rnd=RoundState(0, 2, 0.0, 1),
                fragment=FragmentFacts(version=1, next_round=3, kept_versions=frozenset({0, 1})))
    assert adm.status == "accepted"


# -- due rounds ------------------------------------------------------------------------------

def schedule(g, next_rounds, busy=(), waiting=(), open_count=0, tau=2, h=4):
    return schedule_rounds(g=g, next_rounds=next_rounds, busy=set(busy), waiting=list(waiting),
                           free_slots=tau - open_count, sync_every=h)


def test_schedule_follows_the_fragment_offsets():
    # P = 2, H = 4: offsets 0 and 2; round 1 is due at g = 4 (p0) and g = 6 (p1)
    assert schedule(3, [1, 1]).open_now == ()
    d = schedule(4, [1, 1])
    assert d.open_now == ((0, 1),) and d.waiting == ()
    assert schedule(6, [2, 1], busy=[0]).open_now == ((1, 1),)
    assert "opened" in d.reason


def test_schedule_orders_by_due_step_and_waits_for_a_free_slot():
    # tau = 1, one round open: both due rounds wait, ordered by due step (p1 r1 at 6 before p0 r2 at 8)
    d = schedule(8, [2, 1], open_count=1, tau=1)
    assert d.open_now == () and d.waiting == ((1, 1), (0, 2))
    d = schedule(8, [2, 1], waiting=d.waiting, open_count=0, tau=1)
    assert d.open_now == ((1, 1),) and d.waiting == ((0, 2),)


def test_schedule_skips_ahead_to_the_newest_due_round():
    # the learners ran ahead to g = 40: fragment 0 opens round 10, not round 1
    assert schedule(40, [1, 1], tau=2).open_now == ((1, 9), (0, 10))


def test_schedule_keeps_the_number_of_a_round_late_contributions_wait_for():
    # late contributions wait for round 3 of fragment 0 (DESIGN §3.5): it opens as round 3, not 10,
    # so that they join it instead of being abandoned with a skipped round; fragment 1 skips ahead
    d = schedule_rounds(g=40, next_rounds=[3, 1], busy=set(), waiting=[], free_slots=2,
                        sync_every=4, awaited={0})
    assert d.open_now == ((0, 3), (1, 9))
    # a round already queued under a newer number is renumbered when contributions start waiting
    d = schedule_rounds(g=40, next_rounds=[3, 1], busy=set(), waiting=[(0, 10)], free_slots=0,
                        sync_every=4, awaited={0})
    assert d.open_now == () and d.waiting == ((0, 3), (1, 9))
    assert schedule(40, [3, 1], busy=[0]).open_now == ((1, 9),)  # a busy fragment waits either way


def test_budget_stop_reason():
    assert budget_stop_reason(BudgetConfig(tokens=100), tokens=99, g=5, elapsed_s=1e6) is None
    assert "token budget" in budget_stop_reason(BudgetConfig(tokens=100), tokens=100, g=None, elapsed_s=0)
    assert "g = 7" in budget_stop_reason(BudgetConfig(max_steps=7), tokens=0, g=7, elapsed_s=0)
    assert budget_stop_reason(BudgetConfig(max_steps=7), tokens=0, g=None, elapsed_s=0) is None
    assert "wall-time" in budget_stop_reason(BudgetConfig(wall_s=2.0), tokens=0, g=None, elapsed_s=2.0)


def test_budget_spent_at_checkpoint_names_the_figure_and_the_override():
    from diloco_async.config.schema import BudgetConfig
    from diloco_async.policy.rounds import budget_spent_at_checkpoint

    manifest = {"global_step": 40, "ledgers": {"a": {"tokens_processed": 600}, "b": {"tokens_processed": 500}}}
    assert budget_spent_at_checkpoint(BudgetConfig(tokens=2000), manifest) is None
    spent = budget_spent_at_checkpoint(BudgetConfig(tokens=1100), manifest)
    assert spent.startswith("token budget reached (1100 >= 1100)") and "--set budget.tokens=<more than 1100>" in spent
    assert "g = 40" in budget_spent_at_checkpoint(BudgetConfig(tokens=None, max_steps=40), manifest)
    assert budget_spent_at_checkpoint(BudgetConfig(tokens=None, max_steps=41, wall_s=1.0), manifest) is None


def test_round_counts_follow_announce_and_settle_and_the_checks_read_only_what_they_need():
    # issue 17: the actor asks these after every verification and in every sweep, at 1,000 learners
    rnd = RoundState(fragment=0, round_n=1, opened_s=0.0, min_quorum=2)
    for lid in "abc":
        rnd.announce(lid, f"k-{lid}", 0.0)
    rnd.announce("a", "k-a", 0.1)  # a duplicate: not counted twice
    assert rnd.pending_count == 3 == len(rnd.pending)
    rnd.settle("a", True)
    rnd.settle("b", False)
    rnd.settle("zz", True)  # never announced: nothing to count
    assert rnd.pending_count == 1 == len(rnd.pending) and not rnd.quorum_met()
    rnd.settle("c", True)
    assert rnd.pending_count == 0 and rnd.quorum_met() and sorted(rnd.verified) == ["a", "c"]

    def live(ids):  # the live learners, read lazily: an exhausted check would read them all
        for i, lid in enumerate(ids):
            if i >= 4:  # a, b (announced), c and d make the quorum of 3 with a
                raise AssertionError("quorum_reachable read more live learners than it needed")
            yield lid

    quorum = RoundState(fragment=0, round_n=2, opened_s=0.0, min_quorum=3)
    quorum.announce("a", "k", 0.0)
    quorum.announce("b", "k", 0.0)
    quorum.settle("b", False)
    assert quorum.quorum_reachable(live(["a", "b", "c", "d"] + [f"l{i}" for i in range(1000)]))
    assert not quorum.quorum_reachable(iter(["a", "b", "c"]))


def test_a_learner_refused_before_admission_no_longer_counts_towards_the_quorum():
    """An honest fast learner's first contribution refused as implausible_steps (a heartbeat ~1 s
    stale) left its round waiting for it at 1/2 until the step budget ended the run with no merge:
    the refusal happened before admission, so the round still counted it as able to announce."""
    from diloco_async.policy.rounds import RoundStage, RoundState

    rnd = RoundState(fragment=0, round_n=1, opened_s=0.0, min_quorum=2)
    rnd.announce("a", "ka", 0.0)
    rnd.settle("a", True)
    assert rnd.quorum_reachable(["a", "b"])
    rnd.refuse("b", "kb", 1.0)
    assert not rnd.quorum_reachable(["a", "b"]) and rnd.counts == {None: 0, True: 1, False: 1}
    assert rnd.announce("b", "kb2", 2.0).status == "rejected"  # it cannot answer this round again
    rnd.refuse("a", "ka", 3.0)  # an admitted contribution keeps its verification outcome
    assert rnd.counts[True] == 1 and rnd.verified == ["a"]
    rnd.stage = RoundStage.MERGING
    rnd.refuse("c", "kc", 4.0)  # the round is closed: neither an entry nor a late one
    assert "c" not in rnd.entries and rnd.late == []
