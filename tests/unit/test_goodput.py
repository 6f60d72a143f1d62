import pytest

from diloco_async.metrics.goodput import LearnerLedger, compute_goodput, token_goodput, totals, uptime


def test_scripted_two_learners():
    # 2 learners for 100 s. Learner A computes the whole time, all merged. Learner B is down
    # 0-20 s, then computes; one 1-second step of its work is thrown away (late contribution).
    a = LearnerLedger(provisioned_s=100.0, useful_s=100.0, tokens_processed=1000, tokens_merged=1000)
    b = LearnerLedger(provisioned_s=100.0, useful_s=80.0 - 1.0, tokens_processed=800, tokens_merged=790)
    t = totals({"a": a, "b": b})
    assert t["compute_goodput"] == pytest.approx(179.0 / 200.0)
    assert t["token_goodput"] == pytest.approx(1790 / 1800)
    assert b.compute_goodput == pytest.approx(0.79)


def test_compute_goodput_edges():
    assert compute_goodput(0, 0) == 0.0
    assert compute_goodput(5, 10) == 0.5
    with pytest.raises(ValueError):
        compute_goodput(11, 10)
    with pytest.raises(ValueError):
        compute_goodput(-1, 10)
    assert token_goodput(0, 0) == 0.0


def test_uptime_gaps_beyond_bound_count_as_down():
    # merges every 1 s from 0 to 10 except a 5 s gap (3..8); bound 2 s -> 3 s down of 10.
    merges = [1, 2, 3, 8, 9, 10]
    assert uptime(merges, 0.0, 10.0, 2.0) == pytest.approx(0.7)
    assert uptime([], 0.0, 10.0, 20.0) == 1.0
    assert uptime([], 0.0, 10.0, 0.0) == 0.0


def test_window_goodput_is_the_goodput_of_what_came_in_between():
    from diloco_async.metrics.goodput import window_goodput

    before = {"useful_s": 10.0, "provisioned_s": 20.0, "tokens_merged": 100, "tokens_processed": 200}
    after = {"useful_s": 19.0, "provisioned_s": 30.0, "tokens_merged": 190, "tokens_processed": 300}
    got = window_goodput(before, after)
    assert got["compute_goodput"] == pytest.approx(0.9) and got["token_goodput"] == pytest.approx(0.9)
    assert window_goodput(after, after) == {"compute_goodput": None, "token_goodput": None}  # nothing new
    # a ledger whose useful seconds ran ahead of the window is capped at 1, never above
    assert window_goodput(before, dict(after, useful_s=40.0))["compute_goodput"] == 1.0


def test_badput_fractions_and_goodput_sum_to_one():
    from diloco_async.metrics.goodput import BADPUT_CAUSES, badput_fractions

    got = badput_fractions(50.0, 100.0, {"down": 10.0, "starting": 5.0, "thrown_away": 15.0})
    assert got == pytest.approx({"down": 0.1, "starting": 0.05, "restarting": 0.0, "stalled": 0.0, "blocked": 0.0,
                                 "thrown_away": 0.15, "other": 0.2})
    assert tuple(got) == BADPUT_CAUSES
    # measured apart, the causes may overlap: they are scaled to fit beside the useful time, none is left over
    over = badput_fractions(60.0, 100.0, {"down": 30.0, "stalled": 30.0})
    assert over["down"] == pytest.approx(0.2) and over["stalled"] == pytest.approx(0.2) and over["other"] == 0.0
    for useful, causes in ((0.0, {}), (100.0, {"blocked": 3.0}), (20.0, {"down": 500.0, "blocked": 1.0})):
        shares = badput_fractions(useful, 100.0, causes)
        assert compute_goodput(min(useful, 100.0), 100.0) + sum(shares.values()) == pytest.approx(1.0, abs=1e-12)
    assert set(badput_fractions(0.0, 0.0, {}).values()) == {0.0}
    with pytest.raises(ValueError, match="unknown badput"):
        badput_fractions(1.0, 2.0, {"other": 1.0})  # the rest is computed, never given
    with pytest.raises(ValueError):
        badput_fractions(1.0, 2.0, {"down": -1.0})


def test_ledger_badput_round_trips_and_silence_counts_as_down():
    a = LearnerLedger(provisioned_s=100.0, useful_s=70.0)
    a.add_badput("starting", 4.0)
    a.add_badput("thrown_away", 6.0)
    a.add_badput("blocked", -1.0)  # nothing
    with pytest.raises(ValueError, match="unknown badput"):
        a.add_badput("restart", 1.0)
    back = LearnerLedger.from_json(a.to_json())
    assert back.badput_s == {"starting": 4.0, "thrown_away": 6.0}
    assert LearnerLedger.from_json({k: v for k, v in a.to_json().items() if k != "badput_s"}).badput_s == {}
    t = totals({"a": a, "b": LearnerLedger(provisioned_s=100.0, useful_s=80.0)}, silent_s={"b": 10.0, "gone": 5.0})
    assert t["badput_s"]["down"] == 10.0  # b's silence so far; an unknown id is ignored
    assert t["badput"]["starting"] == pytest.approx(4.0 / 200.0)
    assert t["badput"]["other"] == pytest.approx((200.0 - 150.0 - 20.0) / 200.0)
    assert t["compute_goodput"] + sum(t["badput"].values()) == pytest.approx(1.0)


def test_a_badput_cause_that_never_occurred_is_not_logged_as_a_series_of_zeros(tmp_path):
    """issue 46 item 3: only causes with seconds get a series; one that occurs later starts then,
    and a logged cause stays logged (its share may fall back to 0: ``other`` is what is left)."""
    from diloco_async.metrics.goodput import LearnerLedger
    from diloco_async.sync.reporting import Reporter

    rep = Reporter(0.0, "t", spill_dir=tmp_path, clock=lambda: 0.0)
    led = LearnerLedger(provisioned_s=10.0, useful_s=6.0)
    led.add_badput("starting", 2.0)

    def logged() -> set[str]:
        return {p["key"] for p in rep.metrics if p["key"].startswith("badput/")}

    rep.goodput_series({"learner-0": led}, 1.0)
    assert logged() == {"badput/starting", "badput/other"}  # 2 s other: 10 - 6 - 2
    led.add_badput("down", 1.0)
    led.provisioned_s = 11.0
    rep.goodput_series({"learner-0": led}, 1.0)
    assert logged() == {"badput/starting", "badput/other", "badput/down"}


def test_a_merge_credits_what_its_direction_factor_let_through():
    led = LearnerLedger(provisioned_s=100.0)
    led.credit_merge(c_tokens=1000, compute_s=10.0, share=0.25)  # whole weight
    assert (led.tokens_merged, led.useful_s, led.badput_s) == (250.0, 2.5, {})
    led.credit_merge(c_tokens=1000, compute_s=10.0, share=0.25, factor=0.4)  # down-weighted
    assert led.tokens_merged == pytest.approx(350.0) and led.useful_s == pytest.approx(3.5)
    assert led.badput_s == {"thrown_away": pytest.approx(1.5)}
    led.credit_merge(c_tokens=1000, compute_s=10.0, share=0.25, factor=0.0)  # merged at zero weight: moved nothing
    led.credit_merge(c_tokens=1000, compute_s=10.0, share=0.25, factor=-3.0)  # clamped to 0
    assert led.tokens_merged == pytest.approx(350.0) and led.badput_s["thrown_away"] == pytest.approx(6.5)
    led.credit_merge(c_tokens=1000, compute_s=10.0, share=0.25, factor=7.0)  # clamped to 1
    assert led.tokens_merged == pytest.approx(600.0)
    assert led.contributions == {"merged": 5}
