"""The heterogeneity scenario of the chaos harness (issue 47), its pure parts: the scenario's
per-slot storage faults, shaped link and full-speed baseline; each learner's merged share against
its compute share; compute goodput in compute available; the placement's names; the bars. The
runs themselves: tests/system/test_chaos.py::test_heterogeneous_ci_every_learner_in_the_report."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest

from benchmarks.het_bars import het_bars, main
from diloco_async.chaos import Scenario, load_scenario, method_config
from diloco_async.chaos.measure import learner_shares, speed_weighted_goodput
from diloco_async.config.schema import load_config
from diloco_async.metrics.timeline import Interval, Step, Timeline, account
from diloco_async.runtime.link_delay import LINK_DELAY_ENV

RAW = {"scenario": {"name": "x", "slots": 3, "wall_s": 10.0, "eval_tokens": 1, "methods": ["decoupled"]}}


def test_heterogeneous_scenario_reaches_the_learners_as_faults():
    sc = load_scenario("configs/chaos/heterogeneous.toml")
    base = load_config(sc.scenario.config, sc.scenario.overrides)
    f = method_config(sc, "decoupled", base).faults
    assert f.speed_factors == [1.0, 0.5, 0.1, 1.0, 1.0]
    assert f.storage_faults == {"p_transient": 0.0, "p_slow": 1.0, "slow_s": 3.0, "ops": ["read"]}
    assert f.storage_fault_learners == [3]  # only slot 3's store is slow
    assert sc.link is not None and (sc.link.slot, sc.link.up_mbit, sc.link.shaped) == (4, 4.0, True)
    full = sc.at_full_speed()
    g = method_config(full, "decoupled", base).faults
    assert g.speed_factors == [1.0] * 5 and g.step_jitter == f.step_jitter
    assert g.storage_faults == {} and g.storage_fault_learners == []
    assert full.link is not None and full.link.shaped is False and full.link.slot == 4
    assert full.scenario == sc.scenario  # the same run otherwise
    # faults every slot has are not part of the heterogeneity: the baseline keeps them
    every = Scenario.model_validate({**RAW, "storage": {"p_transient": 0.1}})
    assert every.at_full_speed().storage == every.storage
    assert method_config(every, "decoupled", base).faults.storage_fault_learners == []  # every slot's store


@pytest.mark.parametrize(("extra", "match"), [
    ({"storage": {"slots": [3]}}, r"\[storage\] slots: \[3\] not in 0..2"),
    ({"storage": {"ops": ["reed"]}}, "Input should be 'put'"),
    ({"link": {"slot": 5, "up_mbit": 4, "down_mbit": 4}}, "link.slot = 5"),
    ({"link": {"slot": 0, "up_mbit": 0, "down_mbit": 4}}, "link.up_mbit"),
    ({"link": {"slot": 0, "up_mbit": 4, "down_mbit": 4, "mbit": 1}}, "link.mbit"),
])
def test_bad_heterogeneity_sections_name_the_field(extra, match):
    with pytest.raises(ValueError, match=match):
        Scenario.model_validate({**RAW, **extra})


def test_a_link_is_for_diloco_methods_and_not_for_wan_scenarios(tmp_path):
    from diloco_async.wan.scenario import load_wan_scenario

    raw = {"scenario": {**RAW["scenario"], "methods": ["ddp", "decoupled"]},
           "link": {"slot": 0, "up_mbit": 4, "down_mbit": 4}}
    with pytest.raises(ValueError, match="DiLoCo methods only"):
        Scenario.model_validate(raw)
    from diloco_async.chaos.scenario import with_user_overrides

    with pytest.raises(ValueError, match="DiLoCo methods only"):  # nor when the command line asks for it
        with_user_overrides(load_scenario("configs/chaos/heterogeneous-ci.toml"), None, ["decoupled", "ddp"])
    text = open("configs/wan/wan-ci.toml").read() + "\n[link]\nslot = 0\nup_mbit = 4\ndown_mbit = 4\n"
    (tmp_path / "w.toml").write_text(text)
    with pytest.raises(ValueError, match=r"\[link\] \(one shaped slot\) is for chaos scenarios"):
        load_wan_scenario(tmp_path / "w.toml")


def test_learner_shares_against_compute_shares():
    ledgers = {"learner-0": {"tokens_merged": 600.0, "tokens_processed": 700, "contributions": {"merged": 6}},
               "learner-1": {"tokens_merged": 100.0, "tokens_processed": 300, "contributions": {"late": 2}},
               "learner-2": {"tokens_merged": 0.0, "tokens_processed": 0}}
    rows = learner_shares([1.0, 0.5, 1.0, 0.1], [100.0, 100.0, 50.0, 100.0], ledgers, {3: "needs root"})
    # compute: 100, 50, 50, skipped -> 0 (of 200); merged: 600, 100, 0, none (of 700)
    assert [r["compute_share"] for r in rows] == pytest.approx([0.5, 0.25, 0.25, 0.0])
    assert [r["merged_share"] for r in rows] == pytest.approx([6 / 7, 1 / 7, 0.0, 0.0])
    assert rows[0]["merged_over_compute"] == pytest.approx(12 / 7)
    assert rows[1]["merged_over_compute"] == pytest.approx(4 / 7)
    assert rows[2]["merged_over_compute"] == 0.0
    assert rows[3]["merged_over_compute"] is None and rows[3]["skipped"] == "needs root" and rows[3]["up_s"] == 0.0
    assert rows[1]["contributions"] == {"late": 2} and rows[2]["contributions"] == {}
    assert rows[0]["tokens_processed"] == 700
    # what each did: 700, 300, 0, 0 of 1000 processed; merged 600/700 and 100/700 of the merged tokens
    assert [r["processed_share"] for r in rows] == pytest.approx([0.7, 0.3, 0.0, 0.0])
    assert rows[0]["merged_over_processed"] == pytest.approx(6 / 7 / 0.7)
    assert rows[1]["merged_over_processed"] == pytest.approx(1 / 7 / 0.3)
    assert rows[2]["merged_over_processed"] is None and rows[3]["merged_over_processed"] is None
    nothing = learner_shares([1.0], [10.0], {})
    assert nothing[0]["merged_share"] is None and nothing[0]["merged_over_compute"] is None
    with pytest.raises(ValueError, match="2 speeds but 1 up-times"):
        learner_shares([1.0, 1.0], [1.0], {})
    with pytest.raises(ValueError, match=">= 0"):
        learner_shares([1.0], [-1.0], {})


def test_measured_compute_shares_from_the_steps_rates():
    from diloco_async.chaos.measure import step_stats
    from diloco_async.metrics.timeline import Interval, Step, Timeline

    steps = [Step("slot-0", 0.0, 1.0, 100), Step("slot-0", 1.0, 2.0, 100),  # 100 tokens/s
             Step("slot-1", 0.0, 4.0, 100),  # 25 tokens/s (an emulated slowdown's sleep counts)
             Step("slot-1", 9.0, 13.0, 100),  # cut by the window's end: 1 s and 25 tokens of it count
             Step("slot-2", 2.0, 6.0, 100),  # frozen 2 s of its 4 s (SIGSTOP): 100 tokens in 2 s of compute
             Step("learner-9", 0.0, 1.0, 100), Step("slot-7", 0.0, 1.0, 100)]  # not a slot of 3: ignored
    tl = Timeline(["slot-0", "slot-1", "slot-2"], 0.0, 10.0, [Interval("slot-2", "stalled", 3.0, 5.0)], steps)
    stats = step_stats(tl, 3)
    assert stats == [(100.0, 2.0), (25.0, 5.0), (50.0, 2.0)]
    stats = stats[:2] + [(None, 0.0)]
    ledgers = {"learner-0": {"tokens_merged": 800.0, "tokens_processed": 1000},
               "learner-1": {"tokens_merged": 100.0, "tokens_processed": 125}}
    rows = learner_shares([1.0, 0.5, 1.0], [10.0, 10.0, 10.0], ledgers, None, stats)
    # compute it had: 1000, 250, 0 tokens (of 1250); merged 800, 100 (of 900)
    assert [r["capacity_tokens"] for r in rows] == pytest.approx([1000.0, 250.0, 0.0])
    assert [r["capacity_share"] for r in rows] == pytest.approx([0.8, 0.2, 0.0])
    assert rows[1]["merged_over_capacity"] == pytest.approx((100 / 900) / 0.2)
    assert rows[1]["stepping_over_up"] == pytest.approx(0.5) and rows[0]["stepping_over_up"] == pytest.approx(0.2)
    assert rows[1]["capacity_over_compute"] == pytest.approx(0.2 / 0.2)  # nominal: 0.5 of 2.5
    assert rows[2]["merged_over_capacity"] is None and rows[2]["stepping_over_up"] == 0.0
    assert "capacity_share" not in learner_shares([1.0], [1.0], {})[0]  # no rates: the nominal shares only
    with pytest.raises(ValueError, match="3 slots but 2 step rates"):
        learner_shares([1.0] * 3, [1.0] * 3, {}, None, [(1.0, 1.0), (1.0, 1.0)])
    with pytest.raises(ValueError, match="must be >= 0"):
        learner_shares([1.0], [1.0], {}, None, [(-1.0, 0.0)])


def test_speed_weighted_goodput_counts_the_compute_available():
    tl = Timeline(["slot-0", "slot-1"], 0.0, 10.0,
                  steps=[Step("slot-0", 0.0, 8.0, 10, useful=1.0), Step("slot-1", 0.0, 10.0, 10, useful=0.0)])
    acc = account(tl, 5.0)
    assert speed_weighted_goodput(acc, {}) == pytest.approx(acc.compute_goodput) == pytest.approx(0.4)
    # slot-1 (nothing merged) at a tenth of the speed: little of the compute available was lost
    assert speed_weighted_goodput(acc, {"slot-1": 0.1}) == pytest.approx(8.0 / 11.0)
    # a slow slot's merged compute counts at its speed: 8 s + 10 s x 0.1 of 10 s + 10 s x 0.1
    both = Timeline(["slot-0", "slot-1"], 0.0, 10.0,
                    steps=[Step("slot-0", 0.0, 8.0, 10, useful=1.0), Step("slot-1", 0.0, 10.0, 10, useful=1.0)])
    assert speed_weighted_goodput(account(both, 5.0), {"slot-1": 0.1}) == pytest.approx(9.0 / 11.0)
    down = Timeline(["slot-0"], 0.0, 10.0, intervals=[Interval("slot-0", "down", 0.0, 5.0)],
                    steps=[Step("slot-0", 5.0, 10.0, 10, useful=1.0)])
    assert speed_weighted_goodput(account(down, 5.0), {}) == pytest.approx(1.0)  # time down is not available
    assert speed_weighted_goodput(account(Timeline([], 0.0, 1.0), 5.0), {}) == 0.0


def test_slot_link_placement_puts_only_the_link_learner_behind_the_link():
    from diloco_async.wan.slot_link import LINK_REGION, SlotLinkPlacement, link_skip_reason

    sc = load_scenario("configs/chaos/heterogeneous-ci.toml")
    assert sc.link is not None
    net = SimpleNamespace(hub_ns="dlw-hub", hub_addr="10.77.255.1",
                          ns_of=lambda region: {LINK_REGION: "dlw-link"}[region])
    place = SlotLinkPlacement(sc, sc.link, net, "http://10.77.255.1:9000", "b")
    assert place.ns_for("learner-4") == "dlw-link"
    assert [place.ns_for(n) for n in ("synchronizer", "learner-0", "learner-3")] == ["dlw-hub"] * 3
    assert place.env_for("learner-4") == {LINK_DELAY_ENV: "25"} and place.env_for("learner-0") == {}
    cfg = place.diloco_config("decoupled", load_config(sc.scenario.config, sc.scenario.overrides), 2, "run-a")
    assert (cfg.synchronizer.host, cfg.run.store, cfg.run.seed) == ("10.77.255.1", "s3://b/run-a", 2)
    assert cfg.learners.checkpoint_every_s == 0.0 and cfg.faults.storage_fault_learners == [3]
    here = SlotLinkPlacement(sc, sc.link, None, "http://127.0.0.1:9000", "b")
    assert here.ns_for("learner-4") is None and here.env_for("learner-4") == {}
    assert link_skip_reason(None) is None and link_skip_reason(sc.at_full_speed().link) is None


def _doc(seed: int, full: bool, merged_over: list[float | None], weighted: float, skipped: str | None = None,
         processed: list[float] | None = None, capacity: list[float] | None = None) -> dict:
    """A chaos --out document of four slots (speeds 1, 0.5, 0.1, 1; 100 s up each) whose slot i
    processed ``processed[i]`` tokens (100 by default) and had ``merged_over[i]`` of them merged; its
    steps ran at ``capacity[i]`` / 100 tokens per second (default: its processed tokens, never
    stalled). The shares are :func:`learner_shares`'s own."""
    processed = list(processed or [100.0] * 4)
    if skipped:
        processed[3] = 0.0
    capacity = list(capacity or processed)
    ledgers = {f"learner-{i}": {"tokens_processed": t, "tokens_merged": (m or 0.0) * t}
               for i, (m, t) in enumerate(zip(merged_over, processed, strict=True))}
    learners = learner_shares([1.0, 0.5, 0.1, 1.0], [100.0] * 4, ledgers, {3: skipped} if skipped else None,
                              [(c / 100.0 if c else None, 100.0 * t / c if c else 0.0)
                               for c, t in zip(capacity, processed, strict=True)])
    for ln in learners:
        ln["note"] = ""
    return {"scenario": "heterogeneous", "seed": seed, "full_speed": full,
            "rows": [{"method": "decoupled", "learners": learners, "speed_weighted_compute_goodput": weighted,
                      "token_goodput": 0.9}]}


def _files(tmp_path, docs: list[dict]) -> list[str]:
    paths = []
    for d in docs:
        p = tmp_path / f"{'full' if d['full_speed'] else 'het'}-{d['seed']}.json"
        p.write_text(json.dumps(d))
        paths.append(str(p))
    return paths


def test_het_bars_per_learner_and_goodput_against_the_full_speed_fleet(tmp_path, capsys):
    het = _files(tmp_path, [_doc(s, False, [1.2, 1.0, 0.9, 0.0], 0.85) for s in range(3)])
    full = _files(tmp_path, [_doc(s, True, [1.0, 1.0, 1.0, 1.0], 0.95) for s in range(3)])
    bars = {b.figure: b for b in het_bars(het, full)}
    never = bars["slot 3 (1x): merged share / compute share"]
    assert never.value == 0.0 and not never.ok  # a learner that never got merged misses its bar
    assert bars["slot 2 (0.1x): merged share / compute share"].value == pytest.approx(90 / 310 / 0.25)
    assert bars["slot 2 (0.1x): share of its time up spent stepping"].value == pytest.approx(1.0)
    # the emulation gave slot 2 as much compute as the others (100 tokens each): 6.5x its nominal share
    assert bars["slot 2 (0.1x): compute share / nominal (speed x time up)"].value == pytest.approx(0.25 / (0.1 / 2.6))
    # a learner the system stalled half its time (its steps' rate allowed 100 tokens, it processed
    # 50): its bar is missed, and the shown rows say it stepped half its time and what it did compute
    # was merged
    (tmp_path / "starved").mkdir()
    starved = _files(tmp_path / "starved", [_doc(s, False, [1.0, 1.0, 0.9, 1.0], 0.9, processed=[100, 100, 50, 100],
                                                 capacity=[100] * 4) for s in range(3)])
    slow = {b.figure: b for b in het_bars(starved, full)}
    assert slow["slot 2 (0.1x): merged share / compute share"].value == pytest.approx(45 / 345 / 0.25)
    assert not slow["slot 2 (0.1x): merged share / compute share"].ok
    assert slow["slot 2 (0.1x): merged share / processed share"].value == pytest.approx(45 / 345 / (50 / 350))
    assert slow["slot 2 (0.1x): share of its time up spent stepping"].value == pytest.approx(0.5)
    # the same 50 tokens from hardware that steps at half the others' rate, never stalled: met
    (tmp_path / "slower").mkdir()
    slower = _files(tmp_path / "slower", [_doc(s, False, [1.0, 1.0, 0.9, 1.0], 0.9, processed=[100, 100, 50, 100])
                                          for s in range(3)])
    fine = {b.figure: b for b in het_bars(slower, full)}
    assert fine["slot 2 (0.1x): merged share / compute share"].value == pytest.approx(45 / 345 / (50 / 350))
    assert fine["slot 2 (0.1x): merged share / compute share"].ok
    ratio = bars["compute goodput in compute available / full-speed fleet's"]
    assert ratio.value == pytest.approx(0.85 / 0.95) and not ratio.ok and "mean of 3 runs +- 0.00" in ratio.detail
    assert main(["--het", *het, "--full", *full]) == 1
    out = capsys.readouterr().out
    assert "MISS" in out and "heterogeneous fleet" in out
    good = _files(tmp_path, [_doc(s, False, [1.1, 1.0, 0.9, 0.8], 0.9 - 0.01 * s) for s in range(3)])
    (tmp_path / "old").mkdir()  # a file of the harness before the measured compute share: refused, not misread
    old = _doc(0, False, [1.0] * 4, 0.9)
    for ln in old["rows"][0]["learners"]:
        del ln["capacity_share"]
    assert main(["--het", *_files(tmp_path / "old", [old]), "--full", full[0]]) == 2
    assert "no measured compute share" in capsys.readouterr().err
    assert main(["--het", *good, "--full", *full]) == 0
    assert "MISS" not in capsys.readouterr().out


def test_het_bars_show_a_skipped_slot_and_refuse_files_that_do_not_pair(tmp_path, capsys):
    het = _files(tmp_path, [_doc(s, False, [1.0, 1.0, 1.0, None], 0.9, skipped="needs root") for s in range(2)])
    full = _files(tmp_path, [_doc(s, True, [1.0, 1.0, 1.0, None], 0.9, skipped="needs root") for s in range(2)])
    bars = {b.figure: b for b in het_bars(het, full)}
    skipped = bars["slot 3 (1x): merged share / compute share"]
    assert skipped.shown and skipped.value is None and skipped.detail == "skipped: needs root"
    assert main(["--het", *het, "--full", *full]) == 0
    assert main(["--het", *het, "--full", full[0]]) == 2
    assert "seeds differ" in capsys.readouterr().err
    assert main(["--het", *het, "--full", *het]) == 2
    assert "full_speed is False, expected True" in capsys.readouterr().err
    half = _files(tmp_path, [{**_doc(0, False, [1.0] * 4, 0.9), "rows": [{"method": "ddp"}]}])
    assert main(["--het", *half, "--full", full[0]]) == 2
    assert "no 'decoupled' row" in capsys.readouterr().err
    assert math.isfinite(bars["mixed fleet: token goodput"].value)
