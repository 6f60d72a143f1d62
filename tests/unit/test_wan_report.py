"""WAN scenarios and the report's figures (issue 13), from files and synthetic method results: pure, fast."""

from __future__ import annotations

import io
import math
from pathlib import Path

import pytest

from benchmarks.wan_bars import wan_bars
from benchmarks.wan_tokens import abba_order, steady_tokens_per_s, summarize
from diloco_async.config.schema import load_config
from diloco_async.metrics.timeline import Step, Timeline
from diloco_async.wan.report import WireRun, figures, json_row, ring_allreduce_bytes, target_loss, time_to_target_s
from diloco_async.wan.scenario import ddp_max_steps, load_wan_scenario, wan_config

ROOT = Path(__file__).resolve().parents[2]


def test_the_shipped_scenarios_parse_with_their_links_and_budget():
    sc = load_wan_scenario(ROOT / "configs/wan/wan-4-regions.toml")
    assert sc.scenario.slots == 4 and [sc.region_of(i) for i in range(4)] == ["r0", "r1", "r2", "r3"]
    assert sc.link_settings() == [(r, 7.5, 7.5, 0.0) for r in ("r0", "r1", "r2", "r3")]
    assert sc.target.rule == "ddp-final" and sc.budget.tokens == 1_200_000
    cfg = wan_config(sc, "decoupled", load_config(sc.scenario.config, sc.scenario.overrides), seed=2)
    assert (cfg.budget.tokens, cfg.run.seed, cfg.synchronizer.min_quorum) == (1_200_000, 2, 1)
    assert ddp_max_steps(sc, 16, 64) == math.ceil(1_200_000 / (4 * 16 * 64))
    ci = load_wan_scenario(ROOT / "configs/wan/wan-ci.toml")
    assert ci.scenario.methods == ["ddp", "decoupled"] and len(ci.links.regions) == 2


@pytest.mark.parametrize("edit, reason", [
    ("slots = 4", "scenario.slots = 4 but links has 2 regions x 1 learners = 2"),
    ('regions = ["r0", "R1"]', "'R1' is not a region name"),
    ('regions = ["r0", "r0"]', "a region is named twice"),
    ("up_mbit = 0.0", "links.up_mbit"),
    ('[target]\nrule = "fixed"', "target.rule = 'fixed' needs target.loss"),
    ("bogus = 1", "bogus"),
])
def test_a_bad_scenario_is_refused_with_the_reason(tmp_path, edit, reason):
    text = (ROOT / "configs/wan/wan-ci.toml").read_text()
    key = edit.split(" =")[0].split("\n")[0]
    if key == "bogus":
        text = text.replace("[links]", "[links]\nbogus = 1")
    elif key == "[target]":
        text += "\n" + edit + "\n"
    else:
        lines = [ln for ln in text.splitlines() if not ln.startswith(key + " ")]
        text = "\n".join(lines).replace("[links]", "[links]\n" + edit) if key != "slots" else \
            text.replace("slots = 2", edit)
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ValueError) as err:
        load_wan_scenario(path)
    assert reason in str(err.value)


def test_time_to_target_interpolates_between_snapshots_and_says_never():
    curve = [(0.0, 0, 5.0), (10.0, 100, 3.0), (20.0, 200, 2.0)]
    assert time_to_target_s(curve, 2.5) == pytest.approx(15.0)
    assert time_to_target_s(curve, 5.0) == 0.0
    assert time_to_target_s(curve, 2.0) == pytest.approx(20.0)
    assert time_to_target_s(curve, 1.9) is None


def test_ring_allreduce_bytes_is_two_n_minus_one_over_n():
    assert ring_allreduce_bytes(1_751_040, 4) == pytest.approx(2_626_560)
    assert ring_allreduce_bytes(1000, 1) == 0.0


def _run(method: str, up: int, down: int, tokens: float, steps: int, curve, compute_s: float = 0.1) -> WireRun:
    return WireRun(method=method, curve=curve, eval_loss_equal_tokens=2.5, tokens=tokens, learner_steps=steps,
                   compute_s_per_step=compute_s, tokens_per_s_per_learner=1000.0, link_s=100.0,
                   counters={"r0": {"up_bytes": up, "down_bytes": down}, "r1": {"up_bytes": up, "down_bytes": down}},
                   rates={"r0": {"up_mbit": 8.0, "down_mbit": 4.0}, "r1": {"up_mbit": 8.0, "down_mbit": 4.0}},
                   verified={"r0": {"up_mbit_set": 8.0, "up_mbit_measured": 7.9, "down_mbit_set": 4.0,
                                    "down_mbit_measured": 4.1, "up_error": -0.01, "down_error": 0.02}})


def test_figures_of_one_method():
    run = _run("decoupled", up=10_000_000, down=25_000_000, tokens=1_000_000, steps=1000,
               curve=[(0.0, 0, 5.0), (50.0, 1e6, 2.0)])
    f = figures(run, 3.5)
    assert f["up_bytes"] == 20_000_000 and f["down_bytes"] == 50_000_000
    assert f["bytes_per_token"] == pytest.approx(70.0)
    assert f["time_to_target_s"] == pytest.approx(25.0)
    # utilisation: up 80 Mbit / (8 Mbit/s x 100 s) = 0.1; down 200 Mbit / (4 x 100) = 0.5; mean over 4 link-directions
    assert f["link_utilisation"] == pytest.approx(0.3)
    # needed: 50 MB down / 1000 learner steps = 50 KB per step, in 0.1 s = 4 Mbit/s
    assert f["needed_down_mbit"] == pytest.approx(4.0) and f["needed_mbit"] == pytest.approx(4.0)
    assert f["needed_up_mbit"] == pytest.approx(1.6)


def test_json_row_has_the_cli_keys_and_the_verified_rates():
    row = json_row(_run("ddp", 1, 1, 10.0, 1, [(0.0, 0, 5.0), (9.0, 10, 3.0)]), None)
    assert list(row)[:5] == ["method", "time_to_target_s", "bytes_per_token", "eval_loss_equal_tokens", "link_rates"]
    assert row["time_to_target_s"] is None and row["bytes_per_token"] == pytest.approx(0.4)
    assert row["link_rates"]["r0"] == {"up_mbit_set": 8.0, "up_mbit_measured": 7.9, "down_mbit_set": 4.0,
                                       "down_mbit_measured": 4.1}


def test_target_is_ddps_final_loss_or_fixed():
    runs = {"ddp": _run("ddp", 1, 1, 1, 1, [(0.0, 0, 5.0), (9.0, 10, 2.7)])}
    assert target_loss("ddp-final", runs) == 2.7
    assert target_loss("ddp-final", {}) is None
    assert target_loss("fixed", runs, 3.0) == 3.0
    with pytest.raises(ValueError, match="unknown target rule"):
        target_loss("best", runs)


def _report(rows: list[dict], ring: float = 5130.0) -> dict:
    return {"scenario": "s", "links": [{"region": "r0", "up_mbit": 7.5, "down_mbit": 7.5, "delay_ms": 0.0}],
            "verified": {}, "ddp_ring_bytes_per_token": ring, "rows": rows}


def _row(method: str, **kw) -> dict:
    base = {"method": method, "time_to_target_s": 20.0, "bytes_per_token": 30.0, "target_loss": 2.4,
            "tokens_per_s_per_learner": 1000.0, "needed_mbit": 1.0,
            "eval_curve": [[0.0, 0.0, 5.0], [10.0, 1_000_000.0, 2.4], [20.0, 2_000_000.0, 2.2]]}
    return {**base, **kw}


def test_bars_pass_and_miss_on_synthetic_reports():
    main = _report([_row("ddp", time_to_target_s=300.0, bytes_per_token=6000.0, needed_mbit=150.0),
                    _row("decoupled")])
    curve_b = [[0.0, 0.0, 5.0], [10.0, 1_000_000.0, 2.38], [20.0, 2_000_000.0, 2.2]]
    base = [_report([_row("decoupled", eval_curve=curve_b)]) for _ in range(3)]
    comp = [_report([_row("decoupled", bytes_per_token=b)]) for b in (30.0, 32.0, 34.0)]
    unshaped = _ab([1000.0, 990.0], [1020.0, 1010.0])
    by = {b.figure: b for b in wan_bars(main, comp, base, unshaped, 1_000_000)}
    assert by["time to DDP's final loss: DDP / decoupled"].value == pytest.approx(15.0)
    assert by["bytes/token up+down: DDP fp32 ring / decoupled"].value == pytest.approx(5130.0 / 32.0)
    assert by["held-out loss @ 1,000,000 tokens: compressed / bf16-fp32"].value == pytest.approx(2.4 / 2.38)
    assert by["learner tokens/s: shaped / unshaped (ABBA, 2 pairs)"].value == pytest.approx(995 / 1015)
    assert "shaped 1000, 990; unshaped 1020, 1010" in by["learner tokens/s: shaped / unshaped (ABBA, 2 pairs)"].detail
    assert all(b.ok for b in by.values())
    # a slower decoupled, fatter bytes, a worse loss, a link-bound learner: every bar misses
    main2 = _report([_row("ddp", time_to_target_s=300.0, bytes_per_token=6000.0), _row("decoupled",
                                                                                        time_to_target_s=40.0)])
    comp2 = [_report([_row("decoupled", bytes_per_token=40.0, eval_curve=[[0.0, 0.0, 5.0],
                                                                          [10.0, 2e6, 2.6]])])]
    unshaped2 = _ab([1000.0, 1000.0], [1100.0, 1090.0])
    out = io.StringIO()
    from benchmarks.bars import print_bars

    bars2 = wan_bars(main2, comp2, base, unshaped2, 1_000_000)
    assert print_bars(bars2, out) == 1
    assert [b.ok for b in bars2 if not b.shown] == [False, False, False, False]
    assert out.getvalue().count("MISS") == 4


def test_a_run_that_never_reached_the_tokens_is_a_miss_not_a_pass():
    main = _report([_row("ddp", time_to_target_s=300.0, bytes_per_token=6000.0), _row("decoupled")])
    short = [_report([_row("decoupled", eval_curve=[[0.0, 0.0, 5.0], [10.0, 5e5, 2.0]])])]
    by = {b.figure: b for b in wan_bars(main, short, short, None, 1_000_000)}
    assert by["held-out loss @ 1,000,000 tokens: compressed / bf16-fp32"].value is None
    assert not by["learner tokens/s: shaped / unshaped (ABBA)"].ok  # no ABBA report: a miss


def _ab(shaped: list[float], unshaped: list[float]) -> dict:
    runs = [{"kind": k, "pair": i // 2, "tokens_per_s": None} for i, k in enumerate(abba_order(len(shaped)))]
    for kind, values in (("shaped", shaped), ("unshaped", unshaped)):
        for r, v in zip((r for r in runs if r["kind"] == kind), values, strict=True):
            r["tokens_per_s"] = v
    return {"pairs": len(shaped), **summarize(runs)}


def test_abba_order_alternates_which_kind_goes_first():
    assert abba_order(2) == ["shaped", "unshaped", "unshaped", "shaped"]
    assert abba_order(3)[4:] == ["shaped", "unshaped"]
    with pytest.raises(ValueError):
        abba_order(0)


def test_ratio_of_means_and_per_pair_interval_and_a_missing_figure():
    ab = _ab([900.0, 2200.0], [1000.0, 2000.0])
    assert ab["ratio_of_means"] == pytest.approx(3100 / 3000)  # not the mean of the pair ratios (1.0)
    assert ab["pair_ratios"] == pytest.approx([0.9, 1.1]) and ab["pair_ratio_mean"] == pytest.approx(1.0)
    assert ab["pair_ratio_halfwidth"] > 0.5  # two pairs that disagree: a wide interval
    runs = [{"kind": "shaped", "pair": 0, "tokens_per_s": 900.0}, {"kind": "unshaped", "pair": 0, "tokens_per_s": None}]
    assert summarize(runs)["ratio_of_means"] is None  # a run too short to measure is no figure, not a pass


def test_steady_tokens_per_s_leaves_out_start_up_and_the_tail():
    # a spends 5 s in its first step (start-up), then 30 steps of 0.1 s; b steps every 0.1 s from
    # the start to 8 s, then once more alone at 12 s (after a stopped: more CPU, left out)
    steps = [Step("a", 0.0, 5.0, 100)] + [Step("a", 5.0 + i * 0.1, 5.0 + (i + 1) * 0.1, 100) for i in range(30)]
    steps += [Step("b", i * 0.1, (i + 1) * 0.1, 100) for i in range(80)] + [Step("b", 12.0, 12.01, 100)]
    tl = Timeline(start_s=0.0, end_s=20.0, learners=["a", "b"], steps=steps)
    assert steady_tokens_per_s(tl, skip=0.25) == pytest.approx(1000.0, rel=1e-6)  # 100 tokens per 0.1 s
    assert steady_tokens_per_s(Timeline(start_s=0.0, end_s=1.0, learners=[], steps=[])) is None
