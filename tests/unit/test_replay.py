"""Replayable asynchrony (issue 44 item 2; DESIGN §3.2): the seeded step-time model, the virtual
clock, the release rule of the conservative schedule, the replay gate on a fake actor, and the
recipes a replay refuses. Pure: no process, no wall clock."""

from __future__ import annotations

import asyncio
import itertools
import random
from types import SimpleNamespace

import pytest

from diloco_async.config.schema import Config, config_hash, load_config
from diloco_async.policy.replay import (
    JITTER_CLIP,
    ReplayScheduler,
    VirtualClock,
    VirtualSteps,
    VirtualTimeline,
    learner_index,
)
from diloco_async.protocol.messages import AnnouncementAck, Heartbeat, HeartbeatResponse
from diloco_async.sync.errors import Refused
from diloco_async.sync.replay_gate import ReplayGate, ReplayHooks
from diloco_async.sync.state import Request

# -- the step-time model ---------------------------------------------------------------------


def test_step_times_are_a_function_of_seed_learner_and_step_alone():
    a = VirtualSteps(7, "learner-1", 0.5, jitter=0.2, speed_spread=0.3)
    b = VirtualSteps(7, "learner-1", 0.5, jitter=0.2, speed_spread=0.3)
    assert [a.duration_s(k) for k in range(50)] == [b.duration_s(k) for k in reversed(range(50))][::-1]
    other_seed = VirtualSteps(8, "learner-1", 0.5, jitter=0.2, speed_spread=0.3)
    other_learner = VirtualSteps(7, "learner-2", 0.5, jitter=0.2, speed_spread=0.3)
    assert [a.duration_s(k) for k in range(5)] != [other_seed.duration_s(k) for k in range(5)]
    assert a.speed != other_learner.speed


def test_step_times_follow_the_speed_factors_and_the_clipped_jitter():
    fast, slow = (VirtualSteps(0, f"learner-{i}", 1.0, speed_factors=[1.0, 0.25]) for i in range(2))
    assert fast.duration_s(3) == 1.0 and slow.duration_s(3) == 4.0
    unlisted = VirtualSteps(0, "learner-5", 1.0, speed_factors=[1.0, 0.25])  # no spread: speed 1
    assert unlisted.speed == 1.0 and VirtualSteps(0, "scripted", 2.0).duration_s(0) == 2.0
    noisy = VirtualSteps(3, "learner-0", 1.0, jitter=0.5)
    durations = [noisy.duration_s(k) for k in range(2000)]
    assert all(1.0 <= d <= 1.0 + JITTER_CLIP * 0.5 for d in durations)
    assert max(durations) <= noisy.slowest_s() and len(set(durations)) > 1000


def test_bad_step_time_models_are_refused_naming_the_value():
    with pytest.raises(ValueError, match=r"step time .* got 0\.0"):
        VirtualSteps(0, "learner-0", 0.0)
    with pytest.raises(ValueError, match=r"-0\.1"):
        VirtualSteps(0, "learner-0", 1.0, jitter=-0.1)
    assert learner_index("learner-12") == 12 and learner_index("worker-1") is None


def test_the_timeline_adds_the_step_times_up_and_can_be_asked_again():
    steps = VirtualSteps(1, "learner-0", 1.0, jitter=0.3)
    line = VirtualTimeline(steps, start_step=2, start_s=10.0)
    assert line.at(2) == 10.0
    expected = 10.0 + steps.duration_s(2) + steps.duration_s(3) + steps.duration_s(4)
    assert line.at(5) == pytest.approx(expected, abs=0)
    assert line.at(3) == 10.0 + steps.duration_s(2)  # back: computed again from the start
    assert line.at(5) == pytest.approx(expected, abs=0)
    with pytest.raises(ValueError, match="step 1 comes before"):
        line.at(1)


def test_the_virtual_clock_only_goes_forward():
    clock = VirtualClock()
    clock.advance(2.5)
    assert clock() == 2.5
    with pytest.raises(ValueError, match=r"now 2\.5 s, asked for 1\.0 s"):
        clock.advance(1.0)


# -- the release rule ------------------------------------------------------------------------


def test_nothing_is_released_before_every_learner_is_known():
    s: ReplayScheduler[str] = ReplayScheduler(2)
    s.join("a")
    s.hold("a", 0.0, "a0")
    assert s.next_release() is None and s.horizon_s() == 0.0  # b may still send an event at t=0
    s.join("b")  # b's first event comes at t=0 at the earliest; a < b breaks the tie: a goes first
    rel = s.next_release()
    assert rel is not None and (rel.t_s, rel.learner_id, rel.payload) == (0.0, "a", "a0")
    s.release("a", 1.0)
    assert s.next_release() is None and s.waiting_for() == ["b"]


def test_an_event_waits_for_every_learner_that_could_still_come_before_it():
    s: ReplayScheduler[str] = ReplayScheduler(3)
    for lid in "abc":
        s.join(lid)
    s.hold("c", 5.0, "c5")
    s.hold("a", 0.0, "a0")
    s.hold("b", 0.0, "b0")
    order = []
    while (rel := s.next_release()) is not None:
        order.append(rel.payload)
        s.release(rel.learner_id, {"a": 3.0, "b": 6.0, "c": 9.0}[rel.learner_id])
    assert order == ["a0", "b0"]  # c at 5 waits: a runs, its next event comes at 3
    assert s.waiting_for() == ["a"] and s.horizon_s() == 3.0
    s.hold("a", 3.0, "a3")
    assert s.next_release().payload == "a3"
    s.release("a", 5.0)  # a's next event ties with c's at t=5: a < c, so c waits for it
    assert s.next_release() is None and s.waiting_for() == ["a"]
    s.hold("a", 5.0, "a5")
    assert s.next_release().payload == "a5"
    s.release("a", 7.0)
    assert s.next_release().payload == "c5"  # b's bound 6 and a's 7 come after (5, c)


def test_a_learner_that_leaves_holds_nothing_back():
    s: ReplayScheduler[str] = ReplayScheduler(2)
    s.join("a")
    s.join("b")
    s.hold("b", 1.0, "b1")
    assert s.next_release() is None
    assert s.leave("a") is None
    assert s.next_release().payload == "b1"
    assert s.leave("b") == "b1" and s.horizon_s() == float("inf")


def test_events_that_would_change_the_past_are_refused_naming_the_values():
    s: ReplayScheduler[str] = ReplayScheduler(1)
    with pytest.raises(ValueError, match="'x' is not known"):
        s.hold("x", 0.0, "x")
    s.join("a")
    s.hold("a", 1.0, "a1")
    with pytest.raises(ValueError, match=r"already has an event held at t=1\.0"):
        s.hold("a", 2.0, "a2")
    s.release("a", 4.0)
    with pytest.raises(ValueError, match=r"t=3\.0 s, before its bound 4\.0 s"):
        s.hold("a", 3.0, "a3")
    with pytest.raises(ValueError, match="no event held"):
        s.release("a", 5.0)
    with pytest.raises(ValueError, match="at least one learner"):
        ReplayScheduler(0)


def _replayed_order(arrival_seed: int) -> list[tuple[float, str]]:
    """Three learners of seeded step times whose boundaries reach the scheduler in an order drawn
    from ``arrival_seed`` (the wall clock's part); returns the order of release."""
    lines = {lid: VirtualTimeline(VirtualSteps(11, lid, 1.0, jitter=0.4, speed_spread=0.5))
             for lid in ("learner-0", "learner-1", "learner-2")}
    s: ReplayScheduler[int] = ReplayScheduler(3)
    step = dict.fromkeys(lines, 0)
    running = set(lines)
    wall = random.Random(arrival_seed)
    released: list[tuple[float, str]] = []
    for lid in sorted(lines, key=lambda _: wall.random()):
        s.join(lid)
    while len(released) < 60:
        if running and wall.random() < 0.7:  # some learner's boundary arrives
            lid = wall.choice(sorted(running))
            s.hold(lid, lines[lid].at(step[lid]), step[lid])
            running.discard(lid)
            continue
        rel = s.next_release()
        if rel is None:
            continue
        released.append((rel.t_s, rel.learner_id))
        step[rel.learner_id] += 1
        s.release(rel.learner_id, lines[rel.learner_id].at(step[rel.learner_id]))
        running.add(rel.learner_id)
    return released


def test_the_release_order_is_the_same_whatever_order_the_boundaries_arrive_in():
    orders = [_replayed_order(seed) for seed in range(8)]
    assert all(o == orders[0] for o in orders)
    assert orders[0] == sorted(orders[0])  # (virtual time, learner id) order
    assert len({lid for _, lid in orders[0]}) == 3


# -- the gate on a fake actor ----------------------------------------------------------------


class _FakeActor:
    """What the gate calls, recording it: the clock-driven pass's times, the boundaries registered."""

    def __init__(self, clock: VirtualClock) -> None:
        self.clock = clock
        self.log: list[tuple] = []
        self.stopped = False

    def hooks(self) -> ReplayHooks:
        return ReplayHooks(
            register=lambda hb: self.log.append(("step", hb.learner_id, hb.step, self.clock(), hb.step_time_s)),
            announce=lambda ann: AnnouncementAck(status="accepted", reason=f"round {ann.round_n}"),
            answer=lambda lid, stop: HeartbeatResponse(open_rounds=[], versions=[], stop=stop, epoch="e"),
            timed_parts=lambda now: None, deadlines=lambda: [], quiet=lambda: True,
            stopped=lambda: self.stopped, stop=lambda why: self.log.append(("stop", why)))


def _gate(count: int, **replay: float) -> tuple[ReplayGate, _FakeActor, SimpleNamespace]:
    cfg = load_config(None, ["run.schedule=replay", f"learners.count={count}", "synchronizer.min_quorum=1",
                             *(f"replay.{k}={v}" for k, v in replay.items())])
    clock = VirtualClock()
    actor = _FakeActor(clock)
    infos = {f"learner-{i}": SimpleNamespace(incarnation=0, stop_sent=False) for i in range(count)}
    registry = SimpleNamespace(get=infos.get)
    report = SimpleNamespace(reject=lambda reason: actor.log.append(("reject", reason)),
                             count=lambda name: actor.log.append(("count", name)))
    wall = itertools.count(0.0, 1.0)
    gate = ReplayGate(cfg, clock, ("run", "e"), actor.hooks(), registry=registry, report=report,
                      wall=lambda: next(wall))
    for lid in infos:
        gate.joined(lid, 0)
    return gate, actor, registry


def _boundary(lid: str, step: int, announcements: list | None = None) -> Request:
    body = Heartbeat(learner_id=lid, step=step, replay_announcements=announcements or [])
    return Request("heartbeat", body, asyncio.get_running_loop().create_future())


def test_the_gate_answers_boundaries_in_virtual_time_order_and_a_resend_alike():
    async def scenario() -> None:
        gate, actor, _ = _gate(2, step_s=1.0, speed_spread=0.0)
        late = _boundary("learner-1", 0)
        gate.request(late)
        gate.pump(0.0)
        assert not late.reply.done()  # learner-0 may still send a boundary at t=0, and comes first
        first = _boundary("learner-0", 0)
        gate.request(first)
        gate.pump(0.0)
        assert first.reply.done() and late.reply.done()
        assert [e[:4] for e in actor.log] == [("step", "learner-0", 0, 0.0), ("step", "learner-1", 0, 0.0)]
        again = _boundary("learner-0", 0)  # the answer was lost: sent again, answered alike
        gate.request(again)
        assert again.reply.result() is first.reply.result()
        a1, b1 = _boundary("learner-0", 1), _boundary("learner-1", 1)
        gate.request(b1)
        gate.request(a1)
        gate.pump(0.0)
        assert a1.reply.result().virtual_s == 1.0 and actor.log[-1][:4] == ("step", "learner-1", 1, 1.0)
        assert actor.log[-1][4] == 1.0  # the step time registered is the virtual one
        assert gate.events == 4

    asyncio.run(scenario())


def test_the_gate_refuses_what_it_cannot_order_and_foreign_announcements():
    async def scenario() -> None:
        gate, actor, _ = _gate(1)
        ann = Request("announce", None, asyncio.get_running_loop().create_future())
        gate.request(ann)
        assert isinstance(ann.reply.exception(), Refused) and ann.reply.exception().reason == "replay_order"
        plain = Request("heartbeat", Heartbeat(learner_id="learner-0", step=9),
                        asyncio.get_running_loop().create_future())
        gate.request(plain)  # an ordinary heartbeat: nothing registered, nothing told
        assert plain.reply.result().open_rounds == [] and actor.log == [("reject", "replay_order")]
        stranger = Request("heartbeat", Heartbeat(learner_id="learner-9", step=0, replay_announcements=[]),
                           asyncio.get_running_loop().create_future())
        gate.request(stranger)
        assert stranger.reply.result().known is False
        foreign = {"learner_id": "learner-0", "fragment": 0, "round_n": 1, "base_version": 0, "c_steps": 1,
                   "c_tokens": 8, "compute_s": 0.1, "key": "run/contrib/p000/r00000001/learner-3-ab.safetensors",
                   "nbytes": 1, "sha256": "0" * 64, "codec": "bf16", "update_id": "u1"}
        req = _boundary("learner-0", 0, [foreign])
        gate.request(req)
        gate.pump(0.0)
        assert req.reply.result().acks[0].status == "rejected" and "forbidden" in req.reply.result().acks[0].reason

    asyncio.run(scenario())


def test_a_learner_that_stops_sending_boundaries_stalls_the_replay_and_stops_the_run():
    async def scenario() -> None:
        gate, actor, _ = _gate(2, stall_timeout_s=5.0)
        req = _boundary("learner-1", 0)
        gate.request(req)
        gate.pump(0.0)
        assert not req.reply.done()  # learner-0 may still send a boundary at t=0 and comes first
        while not any(e[0] == "stop" for e in actor.log):  # each pump reads the fake wall clock: seconds pass
            gate.pump(0.0)
        assert ("count", "replay_stalls") in actor.log
        assert [e for e in actor.log if e[0] == "stop"] == [("stop", "replay stalled: learner-0 silent for 5s")]
        gate.pump(0.0)
        assert req.reply.result().virtual_s == 0.0  # learner-0 left the replay: the others go on

    asyncio.run(scenario())


# -- the recipes a replay refuses ------------------------------------------------------------


@pytest.mark.parametrize(("fields", "named"), [
    (["synchronizer.num_fragments=2", "synchronizer.shards=2"], "synchronizer.shards=2"),
    (["learners.barrier=true"], "learners.barrier=true"),
    (["learners.link_codecs=['int8']"], "learners.link_codecs=['int8']"),
    (["faults.control_drop_prob=0.1"], "faults.control_drop_prob=0.1"),
    (["faults.storage_faults={p_transient=0.1}"], "faults.storage_faults="),
    (["faults.unreachable_shard=[0]"], "faults.unreachable_shard=[0]"),
    (["replay.step_s=20.0", "synchronizer.heartbeat_timeout_s=10.0"], "replay.step_s=20.0"),
    (["learners.device='cuda'", "learners.nproc_per_learner=2"], "learners.nproc_per_learner x nnodes=2"),
])
def test_what_a_replay_cannot_run_yet_is_refused_before_anything_starts(fields, named):
    load_config(None, fields)  # a free run takes it
    with pytest.raises(ValueError, match="run.schedule='replay' cannot run this recipe") as err:
        load_config(None, ["run.schedule=replay", *fields])
    assert named in str(err.value)


def test_a_free_run_hashes_as_before_the_replay_existed_and_a_replay_does_not():
    free = config_hash(Config())
    assert free == config_hash(load_config(None, ["run.schedule=free"]))
    replay = config_hash(load_config(None, ["run.schedule=replay"]))
    assert replay != free
    assert replay != config_hash(load_config(None, ["run.schedule=replay", "replay.step_s=2.0"]))
