"""A pace guard calibrated to the learner, and a grace window no single learner controls (issue 47,
parts 2 and 3): the pace policy, the learner registry that feeds it, and the grace decisions that
read it, on a fake clock (no server, no sleeps).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
from test_guard import _HonestLearner

from diloco_async.config.schema import load_config
from diloco_async.policy.pace import RECENT_S, PaceLimits, PaceMeter, clamp_step_times, implausible_contribution
from diloco_async.policy.rounds import RoundState, grace_window
from diloco_async.protocol.messages import Heartbeat, JoinRequest
from diloco_async.sync.learners import LearnerRegistry


def default_limits() -> PaceLimits:
    """The default recipe's pace policy (initial 1000 steps/s, tolerance 4, floor 10, warm-up 3 s),
    64 tokens a step (the drivers below report 64 tokens a step)."""
    return dataclasses.replace(PaceLimits.from_config(load_config(None)), max_tokens_per_step=64)


# -- the meter and the bound ------------------------------------------------------------------

def test_the_meter_starts_at_the_first_step_and_credits_what_its_credit_allows():
    m = PaceMeter()
    m.record(0, 5.0, math.inf)  # loading its model: not measured
    assert not m.started and m.steps_per_s() is None and m.step_time_s() is None
    m.record(10, 0.25, math.inf)  # the first step: the measurement starts here
    assert m.started and m.heard_s == 0.0
    m.record(75, 0.25, 1000.0)
    m.record(75, 0.25, 1000.0)
    assert m.steps_per_s() == pytest.approx(300.0) and m.step_time_s() == pytest.approx(1 / 300)
    assert m.credit == pytest.approx(2 * 250 - 150)  # what the two beats left unused
    m.record(10_000, 0.25, 1000.0)  # a claim beyond the credit: what is left of it (350 + 250) counts
    assert m.steps == pytest.approx(750.0) and m.credit == 0.0
    m.record(300, 0.05, 1000.0)  # a heartbeat late in transit: its steps come with the next one
    m.record(75, 0.45, 1000.0)
    assert m.steps == pytest.approx(750.0 + 50 + 75)  # the credit of 0.5 s covers the 0.25 s of steps
    for _ in range(40):  # 10 s without a step: the credit holds at most CREDIT_S (2 s) of the rate
        m.record(0, 0.25, 1000.0)
    assert m.credit == pytest.approx(2000.0)
    m.silence()  # lost: the heartbeat after the silence counts for nothing
    steps, heard_s = m.steps, m.heard_s
    m.record(3000, 10.0, 1000.0)
    assert (m.steps, m.heard_s) == (steps, heard_s)
    back = PaceMeter.from_json(m.to_json())
    assert (back.started, back.steps_per_s(), back.step_time_s()) == (True, m.steps_per_s(), heard_s / steps)
    assert PaceMeter.from_json(None) == PaceMeter()  # a checkpoint of before issue 47


def test_the_recent_step_time_follows_a_learner_that_slowed_down():
    m = PaceMeter()
    m.record(1, 0.25, math.inf)
    for _ in range(400):  # 100 s at 100 steps/s
        m.record(25, 0.25, math.inf)
    for _ in range(4 * int(RECENT_S)):  # then RECENT_S seconds at 10 steps/s
        m.record(25, 2.5, math.inf)  # one heartbeat in 2.5 s (its loop starved by training)
    assert m.steps_per_s() > 30.0  # the whole measurement still remembers the fast part
    assert 0.06 < m.step_time_s() < 0.1  # the recent pace has mostly turned to 0.1 s a step


def test_the_bound_is_initial_until_measured_then_a_multiple_of_the_measured_pace_at_least_the_floor():
    lim = default_limits()
    assert lim.bound(None).steps_per_s == 1000.0 and lim.bound(None).reason == "initial, pace not measured yet"
    m = PaceMeter(started=True, steps=600.0, heard_s=2.0)  # 300 steps/s, but under the 3 s warm-up
    assert lim.bound(m).steps_per_s == 1000.0
    m.heard_s, m.steps = 4.0, 1200.0
    b = lim.bound(m)
    assert (b.steps_per_s, b.reason) == (1200.0, "4 x measured 300.0 steps/s")
    assert b.steps_within(0.5) == 64 + 600 and b.tokens_within(0.5) == (64 + 600) * 64
    slow = PaceMeter(started=True, steps=4.0, heard_s=4.0)  # 1 step/s: the floor, 10 steps/s
    assert (lim.bound(slow).steps_per_s, lim.bound(slow).reason) == (10.0, "floor; measured 1.0 steps/s")
    for bad in ({"tolerance": 0.5}, {"floor_steps_per_s": 0.0}, {"warmup_s": 0.0}, {"burst_steps": -1}):
        with pytest.raises(ValueError, match="pace"):
            dataclasses.replace(lim, **bad)


def test_the_old_max_steps_per_s_is_refused_with_its_replacement_named():
    with pytest.raises(ValueError, match=r"guard\.max_steps_per_s was removed: .*guard\.pace_initial_steps_per_s"):
        load_config(None, ["guard.max_steps_per_s=100"])
    cfg = load_config(None, ["guard.pace_initial_steps_per_s=50", "guard.pace_tolerance=2"])
    assert (PaceLimits.from_config(cfg).initial_steps_per_s, PaceLimits.from_config(cfg).tolerance) == (50.0, 2.0)


# -- an honest fast learner, a jump, a liar that ratchets ----------------------------------------

@pytest.mark.parametrize("rate", [300.0, 900.0])
@pytest.mark.parametrize("delays_s", [[0.001] * 240, [0.001] * 20 + [0.6, 0.001, 2.0, 0.4, 0.001] * 40])
def test_an_honest_fast_learner_is_never_clamped_or_refused(rate, delays_s):
    """Issue 47: a real learner on a tiny model runs ~300 inner steps/s; with the fixed bound of
    100 steps/s (+ 64) its heartbeats were clamped and its contributions refused as
    implausible_steps. Here at 300 and 900 steps/s for a minute, heartbeats sometimes seconds late,
    a contribution of all its steps at each heartbeat and 0.1 s later: none is."""
    learner = _HonestLearner(rate, delays_s, pace=default_limits())
    learner.run()
    assert learner.clamped == [] and learner.refusals == []
    assert learner.registry.learners["a"].meter.steps_per_s() == pytest.approx(rate, rel=0.2)


def test_the_old_fixed_bound_refused_a_learner_at_300_steps_per_s():
    """The same learner as above under the bound of before issue 47 (100 steps/s, never measured):
    refused as implausible_steps (why the test above is needed)."""
    fixed = PaceLimits(initial_steps_per_s=100.0, tolerance=1.0, floor_steps_per_s=100.0, warmup_s=1e9,
                       burst_steps=64, max_tokens_per_step=64)
    learner = _HonestLearner(300.0, [0.001] * 20 + [0.6, 0.001, 2.0, 0.4, 0.001] * 4, pace=fixed)
    learner.run()
    assert learner.refusals and learner.refusals[0].startswith("implausible_steps")


def honest_then(rate: float, seconds: float) -> tuple[LearnerRegistry, float, int]:
    """A registry with learner "a" after ``seconds`` at ``rate`` steps/s (heartbeats every 0.25 s,
    answered at once): (registry, the clock now, a's true step now)."""
    learner = _HonestLearner(rate, [0.0] * int(seconds / 0.25), pace=default_limits())
    learner.run()
    assert learner.clamped == [] and learner.refusals == []
    now_s = 0.25 * int(seconds / 0.25)
    return learner.registry, now_s, learner.step_at(now_s)


def test_a_jump_beyond_the_measured_pace_is_clamped_and_refused():
    """The old fuzz case, after the warm-up: a learner measured at 300 steps/s that suddenly claims
    10,000 steps more (a heartbeat) or a contribution of 10,000 steps, or 10^9 of them, is clamped
    and refused; the bound names the measurement. Its next heartbeats add at most the bound's
    share, and its bound does not move with the claim."""
    reg, now_s, step = honest_then(300.0, 20.0)
    info = reg.learners["a"]
    bound = reg.pace_bound("a")
    assert bound.reason.startswith("4 x measured") and 1100 < bound.steps_per_s < 1300
    for c_steps in (step + 10_000, 10**9):
        why = implausible_contribution(c_steps=c_steps, c_tokens=c_steps * 64, learner_step=info.step,
                                       since_anchor_s=now_s + 0.1 - info.anchor_s, bound=bound)
        assert why is not None and why.startswith("implausible_steps") and "(4 x measured 3" in why
    _, _, clamped = reg.heartbeat(Heartbeat(learner_id="a", step=step + 10_000, tokens_total=(step + 10_000) * 64),
                                  now_s + 0.25)
    assert clamped == ["implausible_steps", "implausible_tokens"]
    assert info.step - step <= bound.steps_within(0.5) < 10_000
    assert reg.pace_bound("a").steps_per_s < 1.1 * bound.steps_per_s  # the jump did not raise it


def test_a_sustained_tenfold_speed_up_is_clamped():
    """A learner measured at 300 steps/s that claims 3000 steps/s from then on: each heartbeat adds
    at most the bound (4 x the measured pace) x the seconds since the previous one, so its
    heartbeats are clamped."""
    reg, now_s, step = honest_then(300.0, 20.0)
    clamped_count = 0
    for k in range(1, 9):  # two more seconds at 3000 steps/s
        claimed = step + 3000 * 0.25 * k
        _, _, clamped = reg.heartbeat(Heartbeat(learner_id="a", step=int(claimed), tokens_total=int(claimed) * 64),
                                      now_s + 0.25 * k)
        clamped_count += "implausible_steps" in clamped
    assert clamped_count == 8 and reg.learners["a"].step < step + 3000 * 2


@pytest.mark.parametrize(("period_s", "seconds", "claim"), [(0.25, 300.0, 10**6), (0.001, 10.0, 64)])
def test_a_learner_that_claims_the_most_it_may_raises_its_bound_only_slowly(period_s, seconds, claim):
    """A liar that claims more than it may at every heartbeat (10^6 steps more every 0.25 s, or 64
    more every millisecond, the burst the old rule granted each heartbeat) is clamped, but what is
    credited is measured only up to growth (1.25) x its measured pace: its measured pace grows as
    (seconds heard / warm-up)^0.25 from the initial 1000 steps/s, about 3.2x in five minutes, not
    as the 4th power of time (the bound's own tolerance)."""
    limits = default_limits()
    reg = LearnerRegistry(limits)
    reg.join(JoinRequest(learner_id="a"), 0.0, None)
    step = 0
    for k in range(1, int(seconds / period_s) + 1):
        step = reg.learners["a"].step + claim
        reg.heartbeat(Heartbeat(learner_id="a", step=step, tokens_total=step * 64), k * period_s)
    meter = reg.learners["a"].meter
    most = limits.initial_steps_per_s * (meter.heard_s / limits.warmup_s) ** (limits.growth - 1)
    assert meter.steps_per_s() <= most * 1.01
    assert reg.pace_bound("a").steps_per_s <= 4 * most * 1.01


def flood(limits: PaceLimits, seconds: float, *, rejoin: bool) -> tuple[LearnerRegistry, list[tuple[float, int, int]]]:
    """A liar that sends a heartbeat every 1 ms claiming 64 steps (and 64 x 64 tokens) more than it
    was credited, each the burst the old rule granted per heartbeat; with ``rejoin`` it also joins
    as a new incarnation 0.5 ms before each. Returns the registry and, per heartbeat, (receipt time,
    step credited, tokens credited since the start, over every incarnation)."""
    reg = LearnerRegistry(limits)
    reg.join(JoinRequest(learner_id="a"), 0.0, None)
    seen, tokens_before = [(0.0, 0, 0)], 0
    for k in range(1, round(seconds * 1000) + 1):
        now_s = k / 1000
        if rejoin:
            tokens_before += reg.learners["a"].tokens_seen
            reg.join(JoinRequest(learner_id="a", incarnation=k), now_s - 0.0005, None)
        info = reg.learners["a"]
        step, tokens = info.step + 64, info.tokens_seen + 64 * 64
        reg.heartbeat(Heartbeat(learner_id="a", incarnation=info.incarnation, step=step, tokens_total=tokens), now_s)
        seen.append((now_s, info.step, tokens_before + info.tokens_seen))
    return reg, seen


@pytest.mark.parametrize("rejoin", [False, True])
def test_the_burst_does_not_renew_with_each_message(rejoin):
    """Each heartbeat could add burst_steps (64) beyond the rate, and heartbeats are not rate-limited:
    one every 1 ms had 64,000 steps/s more credited (and a contribution of that many steps
    accepted). The burst is now a token bucket the rate refills: over any run of heartbeats a
    learner is credited at most burst_steps + r x the seconds their windows cover (the run and the
    two intervals before it, 2 ms here), tokens likewise, whether it sends heartbeats or rejoins as
    a new incarnation before each; the largest contribution it may announce is what a heartbeat
    would be credited at the same moment."""
    limits = default_limits()  # initial 1000 steps/s for the 3 s warm-up, then 4 x measured
    reg, seen = flood(limits, 10.0, rejoin=rejoin)
    assert seen[1000][1] <= 64 + 1000 * 1.0  # the first second, from its join: burst + r x 1 s
    assert seen[1000][2] <= (64 + 1000 * 1.0) * 64
    most_r = 4 * limits.initial_steps_per_s * (10.0 / limits.warmup_s) ** (limits.growth - 1)  # in 10 s
    for i in range(0, len(seen) - 1000, 250):  # every 1 s span, and every 0.25 s one
        for j in (i + 250, i + 1000):
            span_s = seen[j][0] - seen[max(i - 1, 0)][0]  # from the message before the first credited
            assert seen[j][1] - seen[i][1] <= 64 + most_r * span_s + 1, (i, j)
            assert seen[j][2] - seen[i][2] <= (64 + most_r * span_s + 1) * 64, (i, j)
    info, bound = reg.learners["a"], reg.pace_bound("a")  # a contribution announced 1 ms after the last heartbeat:
    kw = {"c_tokens": 64, "learner_step": info.step, "bound": bound, "since_anchor_s": 10.001 - info.anchor_s}
    most = next(c for c in range(info.step, 10**6) if implausible_contribution(c_steps=c + 1, **kw))
    assert implausible_contribution(c_steps=most + 1, **kw).startswith("implausible_steps")
    # the most it may announce is what a heartbeat received then is credited (the same burst left)
    reg.heartbeat(Heartbeat(learner_id="a", incarnation=info.incarnation, step=10**9, tokens_total=info.tokens_seen),
                  10.001)
    assert info.step == most and most - seen[-1001][1] <= 64 + bound.steps_per_s * (10.001 - seen[-1002][0]) + 1


def test_the_burst_left_is_spent_and_kept_by_a_checkpoint():
    """An honest learner that used none of its burst has all of it; one that claimed the most it
    may has spent it (what it has left is negative: the next window counts the last interval again)
    and a checkpoint and a rejoin keep that (a rejoin forgives the debt, not more)."""
    reg, now_s, step = honest_then(300.0, 5.0)
    assert reg.pace_bound("a").burst_left() == 64.0
    reg.heartbeat(Heartbeat(learner_id="a", step=step + 10**6, tokens_total=(step + 10**6) * 64), now_s + 0.25)
    left = reg.pace_bound("a").burst_left()
    assert -reg.pace_bound("a").steps_per_s * 0.25 - 1 <= left < 0
    ledgers, learners = reg.to_manifest(now_s + 0.25)
    reg.restore(ledgers, learners, 100.0, checkpoint_age_s=0.0)
    assert reg.pace_bound("a").burst_left() == pytest.approx(left)
    reg.join(JoinRequest(learner_id="a", incarnation=1), 100.0, None)
    assert reg.pace_bound("a").burst_left() == 0.0


def test_a_silence_is_not_measured_and_a_restore_keeps_the_measurement():
    """A learner lost for 20 s (not heard) and back: its pace is measured over the seconds it was
    heard, not lowered by its silence; a registry restored from a checkpoint keeps its measured
    bound (not the initial one), and does not measure the gap."""
    reg, now_s, step = honest_then(300.0, 10.0)
    before = reg.learners["a"].meter.steps_per_s()
    assert [i.learner_id for i in reg.mark_lost(now_s + 20.0, 5.0)] == ["a"]
    back = step + 300 * 20
    reg.heartbeat(Heartbeat(learner_id="a", step=back, tokens_total=back * 64), now_s + 20.0)
    assert reg.learners["a"].meter.steps_per_s() == pytest.approx(before)
    ledgers, learners = reg.to_manifest(now_s + 20.0)
    reg.restore(ledgers, learners, 5000.0, checkpoint_age_s=1.0)
    assert reg.pace_bound("a").reason.startswith("4 x measured 3")
    reg.heartbeat(Heartbeat(learner_id="a", step=back + 600, tokens_total=(back + 600) * 64), 5001.0)
    assert reg.learners["a"].meter.steps_per_s() == pytest.approx(before)


# -- the grace window ---------------------------------------------------------------------------

FLEET_S = 20.0  # seconds every learner of a fleet heartbeats before the round


def fleet(learners: dict[str, tuple[float, float | None]]) -> LearnerRegistry:
    """A registry after FLEET_S seconds of heartbeats every 0.25 s: learner id -> (steps/s it
    really takes, the step time it reports or None)."""
    reg = LearnerRegistry(default_limits(), max_step_time_s=600.0, step_time_multiple=8.0)
    for lid in learners:
        reg.join(JoinRequest(learner_id=lid), 0.0, None)
    for k in range(1, int(FLEET_S / 0.25) + 1):
        for lid, (rate, claim) in learners.items():
            step = math.floor(rate * 0.25 * k)
            reg.heartbeat(Heartbeat(learner_id=lid, step=step, tokens_total=step * 64, step_time_s=claim), 0.25 * k)
    return reg


def merged_after_s(reg: LearnerRegistry, announcing: tuple[str, ...] = ("a", "c")) -> float:
    """Seconds from the quorum to the merge of a round whose quorum of 2 is met by ``announcing``
    (the others never announce), on a fake clock in 1 ms steps, as the synchronizer decides it:
    paper Eq. 3 with tau 2, gamma 0.8, no cap set (one step time of the slowest), 0.5 s initial."""
    now = FLEET_S
    rnd = RoundState(fragment=0, round_n=1, opened_s=now, min_quorum=2)
    for lid in announcing:
        rnd.announce(lid, f"k/{lid}", now)
        rnd.settle(lid, True)
    decision = grace_window(step_time_s=reg.slowest_step_s(), quorum_wait_s=0.0, sync_time_s=0.001, tau=2,
                            gamma=0.8, cap_s=None, initial_s=0.5)
    rnd.start_grace(now, decision)
    live = reg.live_ids()
    for ms in range(1, 700_001):  # up to 700 s
        if rnd.should_merge(now + ms / 1000, live) is not None:
            return ms / 1000
    raise AssertionError(f"still in grace after 700 s ({decision.reason})")


@pytest.mark.parametrize("honest_claim", [None, 1 / 300])
def test_one_learner_claiming_a_step_time_of_1e6_s_does_not_hold_the_round_in_grace(honest_claim):
    """Issue 47: when only one learner reported a step time (1e6 s, the largest accepted) it set the
    median on its own, and a round with the honest quorum verified sat in grace up to 600 s. The
    step time is now what the synchronizer measured from each learner's heartbeats: the liar,
    stepping as the honest learners do, leaves the grace exactly as the honest fleet's own."""
    honest = {"a": (300.0, honest_claim), "c": (250.0, honest_claim)}
    own = merged_after_s(fleet({**honest, "b": (250.0, honest_claim)}))
    with_liar = merged_after_s(fleet({**honest, "b": (250.0, 1e6)}))
    assert with_liar == own <= 1 / 250 + 0.001
    # before issue 47, with the honest learners sending no step time, the liar's alone set it
    assert clamp_step_times([1e6], max_s=600.0, multiple=8.0) == [600.0]


def test_a_learner_that_really_steps_slowly_is_waited_for_only_within_the_fleets_bounds():
    """A learner that also steps slowly (or claims to: one step in 10 s) is a straggler as far as
    heartbeats tell; it stretches the grace only to step_time_multiple (8) x the lower median of
    the measured step times, not to its own 10 s (nor 600 s)."""
    reg = fleet({"a": (300.0, None), "c": (250.0, None), "b": (0.1, 1e6)})
    assert reg.learners["b"].meter.step_time_s() > 5.0
    assert merged_after_s(reg) <= 8 / 250 + 0.001


def test_a_learner_that_stops_stepping_does_not_stretch_the_grace_while_it_stalls():
    """A learner that steps as the others for FLEET_S / 2, then only heartbeats (a stall, or a liar
    holding its step): the seconds without a step are not its step time until it steps again, so
    the round's grace stays the honest fleet's own (it was 8 x theirs before)."""
    reg = LearnerRegistry(default_limits(), max_step_time_s=600.0, step_time_multiple=8.0)
    for lid in "abc":
        reg.join(JoinRequest(learner_id=lid), 0.0, None)
    for k in range(1, int(FLEET_S / 0.25) + 1):
        for lid, rate in (("a", 300.0), ("c", 250.0), ("b", 250.0)):
            step = math.floor(rate * 0.25 * min(k, 40 if lid == "b" else k))
            reg.heartbeat(Heartbeat(learner_id=lid, step=step, tokens_total=step * 64), 0.25 * k)
    assert reg.learners["b"].meter.step_time_s() == pytest.approx(1 / 250, rel=0.05)
    assert reg.learners["b"].meter.stalled_s == pytest.approx(FLEET_S / 2)
    own = merged_after_s(fleet({"a": (300.0, None), "c": (250.0, None), "b": (250.0, None)}))
    assert merged_after_s(reg) == own
    # once it steps again, the stall counts in its step time (decayed over RECENT_S like any other)
    reg.heartbeat(Heartbeat(learner_id="b", step=2501, tokens_total=2501 * 64), FLEET_S + 0.25)
    assert reg.learners["b"].meter.stalled_s == 0.0 and reg.learners["b"].meter.step_time_s() > 2 / 250


def test_a_minority_of_measured_learners_gives_the_initial_grace():
    """While only one learner of three was measured (the others have just started), its step time
    (one step in 10 s) would be the lower median on its own, and 8 x that the cap: the initial
    grace holds until more than half of the live learners were measured."""
    reg = LearnerRegistry(default_limits(), max_step_time_s=600.0, step_time_multiple=8.0)
    for lid in "abc":
        reg.join(JoinRequest(learner_id=lid), 0.0, None)
    for k in range(1, int(FLEET_S / 0.25) + 1):
        step = math.floor(0.1 * 0.25 * k)
        reg.heartbeat(Heartbeat(learner_id="b", step=step, tokens_total=step * 64), 0.25 * k)
    for lid in "ac":
        reg.heartbeat(Heartbeat(learner_id=lid, step=5, tokens_total=5 * 64), FLEET_S)
    assert reg.learners["b"].meter.step_time_s() > 5.0 and reg.slowest_step_s() is None
    assert merged_after_s(reg) == pytest.approx(0.5)
    reg.heartbeat(Heartbeat(learner_id="a", step=80, tokens_total=80 * 64), FLEET_S + 0.25)
    assert reg.slowest_step_s() == pytest.approx(8 * 0.25 / 75)  # 2 of 3 measured: b clamped to 8 x a's


def test_no_measurement_yet_gives_the_initial_grace_whatever_is_claimed():
    reg = LearnerRegistry(default_limits(), max_step_time_s=600.0, step_time_multiple=8.0)
    for lid in "abc":
        reg.join(JoinRequest(learner_id=lid), 0.0, None)
        reg.heartbeat(Heartbeat(learner_id=lid, step=5, step_time_s=1e6 if lid == "b" else None), 0.25)
    assert reg.slowest_step_s() is None
    assert merged_after_s(reg) == pytest.approx(0.5)


def test_a_new_incarnation_keeps_the_pace_its_slot_was_measured_at():
    """A learner measured at 100 steps/s that restarts (a new incarnation) keeps that measurement:
    its bound stays 4 x 100, not the initial 1000 steps/s, so rejoining every few seconds buys a
    liar nothing; the heartbeat after the restart is not measured (the gap is no pace)."""
    limits = default_limits()
    reg = LearnerRegistry(limits)
    reg.join(JoinRequest(learner_id="a"), 0.0, None)
    now_s, step = 0.0, 0
    for _ in range(40):  # 10 s at 100 steps/s, heartbeats every 0.25 s
        now_s, step = now_s + 0.25, step + 25
        reg.heartbeat(Heartbeat(learner_id="a", step=step, tokens_total=step * 64), now_s)
    before = reg.pace_bound("a").steps_per_s
    assert before == pytest.approx(4 * 100, rel=0.05)
    reg.join(JoinRequest(learner_id="a", incarnation=1), now_s + 2.0, None)
    assert reg.pace_bound("a").steps_per_s == pytest.approx(before)
    meter = reg.learners["a"].meter
    heard_s = meter.heard_s
    info = reg.learners["a"]
    reg.heartbeat(Heartbeat(learner_id="a", incarnation=1, step=info.step + 10, tokens_total=640), now_s + 2.25)
    assert meter.heard_s == heard_s  # the first heartbeat after the restart adds nothing
