"""Goodput accounting on scripted timelines with answers computed by hand (DESIGN §7), the
DiLoCo step attribution, the timeline plot, and the chaos scenario files and schedules."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from diloco_async.chaos import Scenario, load_scenario, make_schedule, method_config
from diloco_async.config.schema import load_config
from diloco_async.metrics.timeline import (
    Interval,
    Recorder,
    Step,
    Timeline,
    account,
    availability,
    diloco_timeline_steps,
    read_records,
)


def _steps(lid: str, t0: float, t1: float, dur: float = 1.0, tokens: int = 100, thrown: tuple[int, ...] = ()):
    n = int(round((t1 - t0) / dur))
    return [Step(lid, t0 + i * dur, t0 + (i + 1) * dur, tokens, 0.0 if i in thrown else 1.0) for i in range(n)]


def test_two_learners_one_down_and_one_step_thrown_away():
    # A computes 100 one-second steps, all merged. B is down 0-20 s, then computes 80 steps of which
    # one is thrown away. Useful: 100 + 79 = 179 learner-seconds of 200 provisioned.
    tl = Timeline(["a", "b"], 0.0, 100.0, intervals=[Interval("b", "down", 0.0, 20.0)],
                  steps=_steps("a", 0, 100) + _steps("b", 20, 100, thrown=(5,)),
                  merges_s=[float(t) for t in range(5, 100, 5)])
    acc = account(tl, max_gap_s=10.0)
    assert acc.compute_goodput == pytest.approx(179 / 200)
    assert acc.learners["a"].compute_goodput == pytest.approx(1.0)
    assert acc.learners["b"].compute_goodput == pytest.approx(79 / 100)
    assert acc.learners["b"].down_s == pytest.approx(20.0)
    assert acc.learners["b"].thrown_away_s == pytest.approx(1.0)
    assert acc.token_goodput == pytest.approx((100 + 79) * 100 / (180 * 100))
    assert acc.availability == pytest.approx((1.0 + 0.8) / 2)
    assert acc.uptime == pytest.approx(1.0)


def test_stalls_waits_and_partial_merges():
    # One learner, 10 s. Steps of 2 s: [0,2] merged; [2,4] with 0.5 s waiting on peers; [4,6]
    # spans a stall 5-6 s; [6,8] only half merged (fragments); restarting 8-10 s.
    steps = [Step("a", 0, 2, 10, 1.0), Step("a", 2, 4, 10, 1.0, wait_s=0.5), Step("a", 4, 6, 10, 1.0),
             Step("a", 6, 8, 10, 0.5)]
    tl = Timeline(["a"], 0.0, 10.0, steps=steps,
                  intervals=[Interval("a", "stalled", 5.0, 6.0), Interval("a", "restarting", 8.0, 10.0)],
                  merges_s=[2.0, 4.0, 6.0, 8.0])
    a = account(tl, max_gap_s=1.0).learners["a"]
    # useful: 2 + 1.5 + 1 (stall removed) + 1 = 5.5 ; thrown: 1 ; blocked: 0.5 ; stalled 1 ; restarting 2
    assert a.useful_s == pytest.approx(5.5)
    assert a.thrown_away_s == pytest.approx(1.0)
    assert a.blocked_s == pytest.approx(0.5)
    assert a.stalled_s == pytest.approx(1.0)
    assert a.restarting_s == pytest.approx(2.0)
    assert a.overhead_s == pytest.approx(0.0)
    assert a.compute_goodput == pytest.approx(0.55)
    assert a.tokens_merged == pytest.approx(35.0)
    # uptime: gaps 2,2,2,2,2 each exceed 1 s by 1 s -> 5 s of 10 down
    assert account(tl, max_gap_s=1.0).uptime == pytest.approx(0.5)


def test_account_clips_to_the_window_and_rejects_bad_input():
    tl = Timeline(["a"], 10.0, 20.0, steps=[Step("a", 8.0, 12.0, 4)], intervals=[Interval("a", "down", 0.0, 11.0)])
    a = account(tl, 100.0).learners["a"]
    assert a.down_s == pytest.approx(1.0)
    assert a.useful_s == pytest.approx(1.0)  # 10-12 inside the window, minus 10-11 down
    with pytest.raises(ValueError, match="unknown learner"):
        account(Timeline(["a"], 0, 1, steps=[Step("b", 0, 1, 1)]), 1.0)
    with pytest.raises(ValueError, match="unknown state"):
        Interval("a", "sleeping", 0, 1)
    with pytest.raises(ValueError, match="before it starts"):
        Step("a", 2, 1, 1)
    with pytest.raises(ValueError, match="before start_s"):
        account(Timeline(["a"], 5, 1), 1.0)


def test_availability_of_down_intervals():
    assert availability({"a": [(0, 25)], "b": []}, 0, 100) == pytest.approx(0.875)
    assert availability({"a": [(-10, 10), (90, 120)]}, 0, 100) == pytest.approx(0.8)


def test_diloco_steps_follow_merged_contributions_across_a_restart(tmp_path):
    rec0 = Recorder(tmp_path / "l.jsonl", inc=0)
    rec0.record("ready", step=0)
    for s in range(1, 9):
        rec0.record("step", t0=float(s), t1=s + 0.5, step=s, tokens=10)
    rec0.record("contribution", fragment=0, round=1, last_step=4, c_steps=4, update_id="u1")  # merged
    rec0.record("contribution", fragment=1, round=1, last_step=6, c_steps=6, update_id="u2")  # late
    rec0.close()
    rec1 = Recorder(tmp_path / "l.jsonl", inc=1)  # restarted from an inner checkpoint at step 5
    rec1.record("ready", step=5)
    for s in range(6, 9):
        rec1.record("step", t0=20.0 + s, t1=20.5 + s, step=s, tokens=10)
    rec1.record("contribution", fragment=0, round=2, last_step=8, c_steps=4, update_id="u3")  # merged: 5..8
    rec1.close()
    with open(tmp_path / "l.jsonl", "a") as fh:
        fh.write('{"kind": "step", "t0": 1')  # a line cut by a SIGKILL is skipped
    recs = read_records(tmp_path / "l.jsonl")
    steps = diloco_timeline_steps("x", recs, {"u1", "u3"}, [0.25, 0.75])
    useful = {(st.t0 >= 20, round(st.t0) - (20 if st.t0 >= 20 else 0)): st.useful for st in steps}
    assert useful[(False, 1)] == useful[(False, 4)] == pytest.approx(0.25)  # u1 only
    assert useful[(False, 5)] == pytest.approx(0.25)  # owned by incarnation 0, merged through u3
    assert useful[(False, 6)] == useful[(False, 8)] == 0.0  # lost in the crash (u2 was not merged)
    assert useful[(True, 6)] == useful[(True, 8)] == pytest.approx(0.25)
    assert len(steps) == 11


def test_plot_timeline_writes_a_png(tmp_path):
    import matplotlib.image as mpimg
    import numpy as np

    from diloco_async.flows.timeline_report import plot_timeline

    tl = Timeline(["a", "b"], 0.0, 100.0, intervals=[Interval("b", "down", 0.0, 20.0),
                                                      Interval("b", "restarting", 20.0, 25.0)],
                  steps=_steps("a", 0, 100) + _steps("b", 25, 100, thrown=(3, 4)), merges_s=[10.0, 20.0, 30.0])
    path = tmp_path / "t.png"
    plot_timeline(tl, path, title="test")
    img = mpimg.imread(path)
    assert img.shape[0] > 100 and img.shape[1] > 500
    assert len(np.unique((img[..., :3] * 255).astype(int).reshape(-1, 3), axis=0)) > 5


def test_goodput_subtitle_says_which_number_and_why_it_differs():
    from diloco_async.flows.timeline_report import goodput_subtitle

    # slot b started 20 s late: down here for 20 s, not provisioned at all in the ledger
    tl = Timeline(["a", "b"], 0.0, 100.0, intervals=[Interval("b", "down", 0.0, 20.0),
                                                      Interval("b", "starting", 20.0, 25.0)],
                  steps=_steps("a", 0, 100) + _steps("b", 25, 100), merges_s=[10.0, 20.0, 30.0])
    acc = account(tl, 100.0)
    ledger = {"compute_goodput": 175.0 / 180.0, "useful_s": 175.0, "provisioned_s": 180.0}
    text = goodput_subtitle(acc, ledger)
    assert f"compute goodput {acc.compute_goodput:.3f} = 175.0 useful / 200.0 provisioned" in text
    assert "the run's compute goodput (summary, DESIGN §7): 0.972 = 175.0 / 180.0" in text
    assert "started later is down" in text and "own process start" in text
    assert goodput_subtitle(acc, None).endswith("is down until then).")


def test_scenario_files_load_and_schedules_repeat():
    for path in sorted(Path("configs/chaos").glob("*.toml")):
        sc = load_scenario(path)
        s1, s2 = make_schedule(sc), make_schedule(sc)
        assert s1 == s2, path
        base = load_config(sc.scenario.config, sc.scenario.overrides)
        for m in sc.scenario.methods:
            cfg = method_config(sc, m, base)  # every method's config is valid
            assert cfg.learners.count == sc.scenario.slots
            expected = {"sync-diloco": (True, sc.scenario.slots), "decoupled": (False, 1)}
            assert (cfg.learners.barrier, cfg.synchronizer.min_quorum) == expected.get(
                m, (False, base.synchronizer.min_quorum))
    storm = load_scenario("configs/chaos/storm.toml")
    assert storm.scenario.slots == 8 and storm.failures.mtbf_s == 120 and storm.failures.recovery_mean_s == 30
    assert storm.speed_factors().count(0.5) == 1


def test_schedule_statistics_match_the_failure_model():
    raw = {"scenario": {"name": "x", "slots": 200, "wall_s": 3000.0, "eval_tokens": 1, "seed": 3},
           "failures": {"mtbf_s": 120.0, "recovery": "exponential", "recovery_mean_s": 30.0}}
    sched = make_schedule(Scenario.model_validate(raw))
    fails = [e for e in sched.events if e.kind == "fail"]
    mean_down = sum(e.duration_s for e in fails) / len(fails)
    assert mean_down == pytest.approx(30.0, rel=0.1)
    assert sched.availability() == pytest.approx(120 / 150, abs=0.02)
    other = make_schedule(Scenario.model_validate({**raw, "scenario": {**raw["scenario"], "seed": 4}}))
    assert other != sched


def test_bad_scenarios_name_the_field(tmp_path):
    p = tmp_path / "bad.toml"
    p.write_text('[scenario]\nname = "x"\nslots = 2\nwall_s = 10\neval_tokens = 5\n'
                 '[stragglers]\nspeed = { "5" = 0.5 }\n')
    with pytest.raises(ValueError, match="slot '5'"):
        load_scenario(p)
    p.write_text('[scenario]\nname = "x"\nslots = 2\nwall_s = 10\neval_tokens = 5\nmethods = ["ddp", "magic"]\n')
    with pytest.raises(ValueError, match="scenario.methods"):
        load_scenario(p)
    p.write_text('[scenario]\nname = "x"\nslots = 2\nwall_s = 10\neval_tokens = 5\n[failures]\nmtbf = 3\n')
    with pytest.raises(ValueError, match="failures.mtbf"):
        load_scenario(p)
    with pytest.raises(ValueError, match="unknown method"):
        method_config(load_scenario("configs/chaos/storm.toml"), "allreduce", load_config())


def test_recorder_lines_are_json(tmp_path):
    r = Recorder(tmp_path / "x" / "r.jsonl", inc=2)
    r.record("step", t0=1.0, t1=2.0, step=1, tokens=3)
    r.close()
    line = json.loads((tmp_path / "x" / "r.jsonl").read_text())
    assert line["kind"] == "step" and line["inc"] == 2 and math.isfinite(line["t"])
    Recorder(None).record("step")  # records nothing, raises nothing


def test_diloco_steps_after_a_restore_and_a_jump_to_the_global_step(tmp_path):
    # incarnation 0 ran steps 1..10 and saved its inner state at step 6; it was killed; the
    # restart resumed that state but continues numbering at the global step 20.
    rec = Recorder(tmp_path / "l.jsonl", inc=0)
    rec.record("ready", step=0, restored=0)
    for s in range(1, 11):
        rec.record("step", t0=float(s), t1=s + 0.5, step=s, tokens=10)
    rec.close()
    rec = Recorder(tmp_path / "l.jsonl", inc=1)
    rec.record("ready", step=20, restored=6)
    for s in range(21, 25):
        rec.record("step", t0=100.0 + s, t1=100.5 + s, step=s, tokens=10)
    # 6 restored steps (1..6 of incarnation 0) + 4 new ones (21..24)
    rec.record("contribution", fragment=0, round=3, last_step=24, c_steps=10, update_id="u")
    rec.close()
    steps = diloco_timeline_steps("x", read_records(tmp_path / "l.jsonl"), {"u"}, [1.0])
    useful = {round(st.t0): st.useful for st in steps}
    assert [useful[s] for s in range(1, 7)] == [1.0] * 6
    assert [useful[s] for s in range(7, 11)] == [0.0] * 4  # lost: after the saved state
    assert [useful[100 + s] for s in range(21, 25)] == [1.0] * 4


def test_timeline_from_records_finds_restarts_and_downtime(tmp_path):
    from diloco_async.metrics.run_timeline import timeline_from_records

    r0 = Recorder(tmp_path / "a.jsonl", inc=0)
    r0.record("start", t=0.0)
    r0.record("ready", t=2.0, step=0)
    for s in range(1, 5):
        r0.record("step", t=float(s + 2), t0=s + 1.0, t1=s + 2.0, step=s, tokens=10)
    r0.record("contribution", t=6.0, fragment=0, round=1, last_step=4, c_steps=4, update_id="u1")
    r0.close()  # killed at ~6 s: no "stopped" record
    r1 = Recorder(tmp_path / "a.jsonl", inc=1)
    r1.record("start", t=10.0)
    r1.record("ready", t=11.0, step=4)
    r1.record("step", t=12.0, t0=11.0, t1=12.0, step=5, tokens=10)
    r1.record("stopped", t=12.0, code=0)
    r1.close()
    tl = timeline_from_records({"a": read_records(tmp_path / "a.jsonl")}, [{"t": 6.5, "update_ids": ["u1"]}], [1.0])
    a = account(tl, 100.0).learners["a"]
    assert (tl.start_s, tl.end_s) == (0.0, 12.0)
    # the first start-up (0-2 s) is starting, not restarting; the start-up after the kill (10-11 s) is
    assert a.starting_s == pytest.approx(2.0) and a.restarting_s == pytest.approx(1.0)
    assert [iv.state for iv in tl.intervals if iv.state in ("starting", "restarting")] == ["starting", "restarting"]
    assert a.down_s == pytest.approx(4.0)  # last record at 6 s, next start at 10 s
    assert a.useful_s == pytest.approx(4.0) and a.thrown_away_s == pytest.approx(1.0)


class _FakeClock:
    """``clock()`` and ``sleep(s)`` of :func:`diloco_async.chaos.driver.drive` without waiting."""

    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s


class _Recording:
    """A fault target that writes down what the driver asked of it, and when."""

    def __init__(self, clock: _FakeClock) -> None:
        self.clock, self.calls, self.ticks = clock, [], 0

    def on_fail(self, slot, duration_s):
        self.calls.append((round(self.clock(), 3), "fail", slot))

    def on_recover(self, slot):
        self.calls.append((round(self.clock(), 3), "recover", slot))

    def on_stall(self, slot):
        self.calls.append((round(self.clock(), 3), "stall", slot))

    def on_cont(self, slot):
        self.calls.append((round(self.clock(), 3), "cont", slot))

    def tick(self, now):
        self.ticks += 1


def test_driver_applies_a_schedule_on_a_fake_clock():
    from diloco_async.chaos.driver import drive
    from diloco_async.chaos.scenario import FaultEvent

    clock = _FakeClock(1000.0)
    target = _Recording(clock)
    events = [FaultEvent(2.0, 1, "stall", 1.0), FaultEvent(1.0, 0, "fail", 5.0), FaultEvent(9.5, 1, "fail", 3.0)]
    drive(events, 1000.0, 10.0, target, poll_s=0.25, clock=clock, sleep=clock.sleep)
    # events at their time, in time order; recovery and stall end after their duration; the
    # failure at 9.5 s recovers after the wall time: never
    assert target.calls == [(1001.0, "fail", 0), (1002.0, "stall", 1), (1003.0, "cont", 1),
                            (1006.0, "recover", 0), (1009.5, "fail", 1)]
    assert target.ticks == 40 and clock() == 1010.0


def test_slot_book_closes_open_intervals():
    from diloco_async.chaos.driver import SlotBook, restarting_intervals

    book = SlotBook(2)
    book.open_down(0, 10.0)
    book.open_down(0, 11.0)  # already down: the first time counts
    book.stalled_since[1] = 12.0
    book.close("down", 0, 15.0)
    book.close("down", 1, 15.0)  # nothing open: nothing recorded
    book.close_all(20.0)
    assert book.intervals == [Interval("slot-0", "down", 10.0, 15.0), Interval("slot-1", "stalled", 12.0, 20.0)]
    # launched at 0 (ready at 3), at 10 (killed at 12 before ready), at 20 (ready at 21)
    recs = [{"kind": "ready", "t": 3.0}, {"kind": "ready", "t": 21.0}]
    assert restarting_intervals("slot-0", [0.0, 10.0, 20.0], recs, [5.0, 12.0], 30.0) == [
        Interval("slot-0", "starting", 0.0, 3.0), Interval("slot-0", "restarting", 10.0, 12.0),
        Interval("slot-0", "restarting", 20.0, 21.0)]


def test_ddp_steps_survive_up_to_the_step_the_next_incarnation_resumed_from():
    from diloco_async.chaos.targets import ddp_timeline_steps

    recs = [{"kind": "ready", "incarnation": 0, "step": 0}]
    recs += [{"kind": "step", "step": s, "t0": s - 1.0, "t1": float(s), "tokens": 10, "wait_s": 0.25}
             for s in (1, 2, 3)]
    recs += [{"kind": "ready", "incarnation": 1, "step": 2}]  # resumed from the checkpoint at step 2
    recs += [{"kind": "step", "step": s, "t0": s + 9.0, "t1": s + 10.0, "tokens": 10} for s in (3, 4, 5)]
    steps = ddp_timeline_steps("slot-0", recs, final_step=4)
    assert [(st.t1, st.useful) for st in steps] == [(1.0, 1.0), (2.0, 1.0), (3.0, 0.0),
                                                    (13.0, 1.0), (14.0, 1.0), (15.0, 0.0)]
    assert steps[0].wait_s == 0.25 and steps[3].wait_s == 0.0


def test_goodput_window_starts_when_every_first_process_is_up():
    from diloco_async.chaos.measure import eval_at, goodput_window_start, uptime_max_gap_s

    tl = Timeline(["a", "b"], 0.0, 100.0, intervals=[Interval("a", "restarting", 0.0, 4.0),
                                                      Interval("b", "restarting", 0.0, 6.0),
                                                      Interval("b", "restarting", 50.0, 70.0)],
                  steps=_steps("a", 4, 100, dur=2.0))
    assert goodput_window_start(tl) == 6.0  # b's first process, not its restart
    assert goodput_window_start(Timeline(["a"], 0.0, 3.0, intervals=[Interval("a", "restarting", 0.0, 9.0)])) == 3.0
    cfg = load_config("configs/default.toml", ["synchronizer.sync_every=10", "synchronizer.num_fragments=2"])
    assert uptime_max_gap_s(tl, cfg) == 4 * 2.0 * 10 / 2
    assert uptime_max_gap_s(Timeline(["a"], 0.0, 1.0), cfg) == 20.0  # no steps: 1 s per step
    curve = [(0.0, 0.0, 5.0), (10.0, 100.0, 3.0), (20.0, 200.0, 2.0)]
    assert eval_at(curve, 0) == (2.0, 5.0)


def test_rounds_table_groups_contributions_by_round_with_the_published_version():
    from diloco_async.metrics.run_timeline import rounds_table

    contribs = [
        {"fragment": 1, "round": 1, "learner": "b", "fate": "merged", "reason": "", "c_tokens": 10, "c_steps": 2,
         "compute_s": 1.0, "staleness_versions": 0},
        {"fragment": 0, "round": 2, "learner": "a", "fate": "rejected", "reason": "digest: sha256 ...",
         "c_tokens": 10, "c_steps": 2, "compute_s": 1.0, "staleness_versions": 1},
        {"fragment": 1, "round": 1, "learner": "a", "fate": "late", "reason": "round closed", "c_tokens": 12,
         "c_steps": 3, "compute_s": 1.5, "staleness_versions": 1},
        {"fragment": 1, "round": 1, "learner": "c", "fate": "zero_weight", "reason": "direction factor 0"},
    ]
    merges = [{"t": 5.0, "fragment": 1, "round": 1, "version": 1, "update_ids": ["u"]},
              {"t": 9.0, "fragment": 0, "round": 1, "version": 1, "update_ids": ["v"]}]
    rows = rounds_table(contribs, merges)
    assert [(r["fragment"], r["round"], r["version"]) for r in rows] == [(0, 1, 1), (0, 2, None), (1, 1, 1)]
    assert rows[1]["fates"] == {"rejected": 1} and rows[1]["merged_t"] is None
    assert rows[2]["fates"] == {"merged": 1, "late": 1, "zero_weight": 1} and rows[2]["merged_t"] == 5.0
    assert [c["learner"] for c in rows[2]["contributions"]] == ["b", "a", "c"]
    assert rows[2]["contributions"][1] == {"learner": "a", "fate": "late", "reason": "round closed", "c_tokens": 12,
                                           "c_steps": 3, "compute_s": 1.5, "staleness_versions": 1}
    assert rows[0]["contributions"] == []  # merged, but its contributions were decided in another epoch


def test_shipped_scenarios_and_suites_find_their_recipe_from_any_folder(tmp_path, monkeypatch):
    """``config = "configs/default.toml"`` in a shipped file works when the command runs in
    another folder (it resolved against the current one); a recipe that is nowhere is named."""
    from diloco_async.ablation.suite import load_suite
    from diloco_async.wan.scenario import load_wan_scenario

    root = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(tmp_path)
    chaos, wan = root / "configs/chaos/straggler-ci.toml", root / "configs/wan/wan-ci.toml"
    for sc in (load_scenario(chaos), load_wan_scenario(wan)):
        assert Path(sc.scenario.config).is_absolute() and Path(sc.scenario.config).is_file()
    suite = load_suite(root / "configs/ablations/merge.toml")
    assert Path(suite.suite.config).is_file()
    bad = tmp_path / "bad.toml"
    bad.write_text((root / "configs/chaos/straggler-ci.toml").read_text().replace(
        'config = "configs/default.toml"', 'config = "configs/no-such-recipe.toml"'))
    with pytest.raises(ValueError, match="no-such-recipe"):
        load_scenario(bad)
    never_stops, n = re.subn(r"(?m)^wall_s = .*$", "wall_s = inf", chaos.read_text())
    assert n == 1
    bad.write_text(never_stops)
    with pytest.raises(ValueError, match=r"scenario\.wall_s: Input should be a finite number"):
        load_scenario(bad)


def test_the_loss_curve_starts_at_theta0_when_every_learner_is_up_never_before():
    """A snapshot taken during start-up (before the goodput window) gave the WAN report a first
    point at a negative time; the curve is Θ^0 at 0 s, then the snapshots from then on."""
    import torch

    from diloco_async.chaos.measure import Snapshot, initial_model, measure
    from diloco_async.metrics.timeline import Interval, Step, Timeline

    cfg = load_config(None, ["model.n_layer=1", "model.d_model=16", "model.n_head=2", "model.context=8"])
    x = torch.randint(0, 256, (2, 8))
    tl = Timeline(["a"], 100.0, 130.0, steps=[Step("a", 111.0, 112.0, 64)],
                  intervals=[Interval("a", "starting", 100.0, 110.0)])
    snaps = [Snapshot(t, tokens, lambda: initial_model(cfg)) for t, tokens in ((105.0, 0.0), (120.0, 64.0))]
    m = measure(tl, snaps, cfg, [(x, x)], eval_tokens=64)
    assert m.window_start_s == 110.0
    assert [(t, tokens) for t, tokens, _ in m.curve] == [(0.0, 0.0), (10.0, 64.0)]
