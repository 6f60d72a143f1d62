"""Goodput simulator: closed forms, the pinned paper Table 1 reproduction, heterogeneity, the
calibration file and the ``diloco-async simulate`` command line (issue 5)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from diloco_async.flows.simulate_cli import main as simulate_main
from diloco_async.metrics.goodput import compute_goodput
from diloco_async.sim import (
    PAPER_TABLE1,
    TABLE1_CHIPS,
    Scenario,
    expected_max_normal,
    heterogeneity_scenarios,
    paper_table1_scenarios,
    sample_recovery_s,
    simulate,
    simulate_many,
)
from diloco_async.sim import simulator as sim_mod
from diloco_async.sim.calibration import Calibration, load_calibration
from diloco_async.sim.draws import make_barrier, sample_max_normal

REPO = Path(__file__).resolve().parents[2]
CALIBRATION = REPO / "configs" / "calibration.toml"


@pytest.fixture(scope="module")
def cal() -> Calibration:
    return load_calibration(CALIBRATION)


def with_(cal: Calibration, **sections: dict) -> Calibration:
    """A copy of ``cal`` with some fields replaced: ``with_(cal, elastic={"reshard_pause_s": 0})``."""
    update = {name: getattr(cal, name).model_copy(update=fields) for name, fields in sections.items()}
    return cal.model_copy(update=update)


def mtbi_years_for(cal: Calibration, job_mtbf_s: float, chips: int) -> float:
    """Chip MTBI (years) giving a job of ``chips`` chips a busy-time MTBF of ``job_mtbf_s``."""
    return job_mtbf_s * chips / cal.failures.seconds_per_year


@pytest.fixture(scope="module")
def table1(cal: Calibration):
    return simulate_many(paper_table1_scenarios(), cal, seed=0)


# ---------------------------------------------------------------------------------------------
# Closed forms


@pytest.mark.parametrize(
    "scenario",
    [Scenario("dp", 1_200_000), Scenario("dp-elastic", 300_000), Scenario("diloco", 600_000, learners=8),
     Scenario("diloco", 600_000, learners=4, quorum=4)],
    ids=lambda s: s.label,
)
def test_no_failures_no_stragglers_is_full_goodput(cal: Calibration, scenario: Scenario) -> None:
    quiet = with_(cal, stragglers={"slice_step_noise": 0.0})
    s = Scenario(scenario.method, scenario.chips, scenario.learners, scenario.quorum, mtbi_years=math.inf)
    r = simulate(s, quiet)
    assert r.failures == 0
    assert r.goodput == pytest.approx(1.0, abs=1e-12)
    assert r.uptime == pytest.approx(1.0, abs=1e-12)


def test_no_failures_loses_only_to_stragglers(cal: Calibration) -> None:
    chips = 2_400_000
    r = simulate(Scenario("dp", chips, mtbi_years=math.inf), cal)
    n_slices = math.ceil(chips / cal.slices.chips_per_slice)
    expected = 1.0 / (1.0 + cal.stragglers.slice_step_noise * expected_max_normal(n_slices))
    assert r.goodput == pytest.approx(expected, rel=1e-12)


def test_expected_max_normal() -> None:
    assert expected_max_normal(1) == 0.0
    assert expected_max_normal(2) == pytest.approx(1 / math.sqrt(math.pi), abs=1e-6)
    values = [expected_max_normal(n) for n in (2, 10, 100, 1000, 10_000)]
    assert values == sorted(values)
    assert values[-1] == pytest.approx(3.8506, abs=2e-3)


@pytest.mark.parametrize("mtbf_s,repair_s", [(1000.0, 250.0), (300.0, 600.0)])
def test_single_job_fixed_repair_is_mtbf_over_mtbf_plus_repair(
    cal: Calibration, mtbf_s: float, repair_s: float
) -> None:
    chips = cal.slices.chips_per_slice  # one slice
    c = with_(
        cal,
        recovery={"scale_s": 1e-9},  # the slice is back at once ...
        non_elastic={"restart_pause_s": repair_s},  # ... and the fixed repair is the restart
        stragglers={"slice_step_noise": 0.0},
        run={"horizon_s": 20_000_000.0},
    )
    r = simulate(Scenario("dp", chips, mtbi_years=mtbi_years_for(cal, mtbf_s, chips)), c, seed=3)
    g = mtbf_s / (mtbf_s + repair_s)
    cycles = c.run.horizon_s / (mtbf_s + repair_s)
    se = (1 - g) * mtbf_s / math.sqrt(cycles) / (mtbf_s + repair_s)
    assert abs(r.goodput - g) < 4 * se, (r.goodput, g, se)
    assert r.uptime == pytest.approx(r.goodput, rel=1e-9)


def test_single_job_random_repair_uses_the_mean(cal: Calibration) -> None:
    """Renewal-reward: any repair distribution gives MTBF / (MTBF + mean repair)."""
    chips, mtbf_s, mean_repair_s = cal.slices.chips_per_slice, 1000.0, 250.0
    c = with_(
        cal,
        recovery={"scale_s": mean_repair_s, "shape_k": 1.0, "shape_alpha": 1.0},  # exponential
        non_elastic={"restart_pause_s": 0.0},
        stragglers={"slice_step_noise": 0.0},
        run={"horizon_s": 20_000_000.0},
    )
    r = simulate(Scenario("dp", chips, mtbi_years=mtbi_years_for(cal, mtbf_s, chips)), c, seed=4)
    g = mtbf_s / (mtbf_s + mean_repair_s)
    cycles = c.run.horizon_s / (mtbf_s + mean_repair_s)
    se = math.hypot((1 - g) * mtbf_s, g * mean_repair_s) / math.sqrt(cycles) / (mtbf_s + mean_repair_s)
    assert abs(r.goodput - g) < 4 * se, (r.goodput, g, se)


def test_elastic_job_loses_one_reshard_per_failure(cal: Calibration) -> None:
    """Slices back within the re-shard: goodput = MTBF / (MTBF + re-shard pause)."""
    slices, mtbf_s, reshard_s = 10, 500.0, 50.0
    chips = slices * cal.slices.chips_per_slice
    c = with_(
        cal,
        recovery={"scale_s": 1e-9},
        elastic={"reshard_pause_s": reshard_s},
        stragglers={"slice_step_noise": 0.0},
        run={"horizon_s": 10_000_000.0},
    )
    r = simulate(Scenario("dp-elastic", chips, mtbi_years=mtbi_years_for(cal, mtbf_s, chips)), c, seed=5)
    g = mtbf_s / (mtbf_s + reshard_s)
    cycles = c.run.horizon_s / (mtbf_s + reshard_s)
    se = (1 - g) * mtbf_s / math.sqrt(cycles) / (mtbf_s + reshard_s)
    assert abs(r.goodput - g) < 4 * se, (r.goodput, g, se)


def test_recovery_sampler_matches_its_cdf(cal: Calibration) -> None:
    p = cal.recovery
    x = sample_recovery_s(np.random.default_rng(0), p, 200_000)
    assert np.isfinite(x).all() and (x >= 0).all()
    for q in (5.0, 26.0, 100.0, 400.0):
        cdf = (1 - math.exp(-((q / p.scale_s) ** p.shape_k))) ** p.shape_alpha
        assert np.mean(x <= q) == pytest.approx(cdf, abs=0.005)


@pytest.mark.parametrize("n", [2, 16, 4096])
def test_max_normal_sampler_matches_its_cdf_and_mean(n: int) -> None:
    x = sample_max_normal(np.random.default_rng(1), n, 200_000)
    assert np.isfinite(x).all()
    for q in (-0.5, 0.5, 1.5, 2.5, 3.5, 4.0):
        cdf = (0.5 * math.erfc(-q / math.sqrt(2.0))) ** n  # Phi(q)^n
        assert np.mean(x <= q) == pytest.approx(cdf, abs=0.005)
    assert x.mean() == pytest.approx(expected_max_normal(n), abs=0.01)


def test_max_normal_sampler_never_draws_an_infinity() -> None:
    class Ends:  # a generator at both ends of [0, 1)
        def random(self, size: int) -> np.ndarray:
            return np.array([0.0, 1.0 - 2.0 ** -53][:size])

    top, bottom = sample_max_normal(Ends(), 8, 2)
    assert top == 12.0 and -9.0 <= bottom < 0.0


# ---------------------------------------------------------------------------------------------
# Decoupled DiLoCo structure


def test_learner_behaves_like_elastic_job_of_n_over_m(cal: Calibration) -> None:
    """Paper §5.3: M learners on N chips ~ one elastic job on N/M chips."""
    diloco = simulate(Scenario("diloco", 1_200_000, learners=8), cal)
    elastic = simulate(Scenario("dp-elastic", 150_000), cal)
    assert diloco.goodput == pytest.approx(elastic.goodput, abs=0.01)
    assert simulate(Scenario("diloco", 300_000, learners=1), cal).goodput == pytest.approx(
        simulate(Scenario("dp-elastic", 300_000), cal).goodput, abs=0.01
    )


@pytest.mark.parametrize("chips", [300_000, 2_400_000])
def test_more_learners_never_lower_goodput(cal: Calibration, chips: int) -> None:
    goodput = [simulate(Scenario("diloco", chips, learners=m), cal).goodput for m in (1, 2, 4, 8, 16)]
    assert all(b >= a - 0.002 for a, b in zip(goodput, goodput[1:], strict=False)), goodput


def test_quorum_of_all_learners_blocks_on_failures(cal: Calibration) -> None:
    k1 = simulate(Scenario("diloco", 600_000, learners=4, quorum=1), cal)
    k4 = simulate(Scenario("diloco", 600_000, learners=4, quorum=4), cal)
    assert k4.goodput < k1.goodput - 0.05
    assert k4.uptime < k1.uptime


def test_goodput_goes_through_the_shared_definition(cal: Calibration, monkeypatch) -> None:
    calls = []

    def spy(useful_s: float, provisioned_s: float) -> float:
        calls.append((useful_s, provisioned_s))
        return compute_goodput(useful_s, provisioned_s)

    monkeypatch.setattr(sim_mod, "compute_goodput", spy)
    r = simulate(Scenario("diloco", 150_000, learners=4), cal)
    assert (r.useful_chip_s, r.provisioned_chip_s) in calls
    assert len(calls) == 1 + 4  # the run, then each learner
    assert r.goodput == compute_goodput(r.useful_chip_s, r.provisioned_chip_s)
    assert r.goodput == pytest.approx(sum(r.learner_goodput) / 4, rel=1e-12)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    method=st.sampled_from(["dp", "dp-elastic", "diloco"]),
    chips=st.integers(1, 40_000),
    learners=st.integers(1, 6),
    quorum_frac=st.floats(0, 1),
    mtbi_hours=st.floats(0.5, 5000),
    window_s=st.sampled_from([0.0, 30.0, 500.0]),
    seed=st.integers(0, 2**16),
)
def test_any_scenario_gives_consistent_figures(
    cal: Calibration, method: str, chips: int, learners: int, quorum_frac: float,
    mtbi_hours: float, window_s: float, seed: int,
) -> None:
    m = min(learners, chips) if method == "diloco" else 1
    k = 1 + int(quorum_frac * (m - 1))
    c = with_(cal, run={"horizon_s": 20_000.0}, elastic={"scale_up_batch_window_s": window_s},
              stragglers={"barrier_samples": 256})
    s = Scenario(method, chips, learners=m, quorum=k, mtbi_years=mtbi_hours / 8760)  # type: ignore[arg-type]
    r = simulate(s, c, seed=seed)
    assert 0 <= r.goodput <= 1 and 0 <= r.uptime <= 1
    assert r.useful_chip_s <= r.provisioned_chip_s == pytest.approx(chips * 20_000.0)
    assert len(r.learner_goodput) == m and all(0 <= g <= 1 for g in r.learner_goodput)
    assert r.goodput == pytest.approx(sum(r.learner_goodput) / m, rel=1e-9, abs=1e-12)
    assert r.goodput <= r.uptime + 1e-9  # no progress, no goodput


def test_a_learner_the_barrier_does_not_hold_is_never_faster_than_its_chips(cal: Calibration) -> None:
    # one slice per learner: the slice noise is a plain normal, and a sampled step can come out
    # shorter than the learner's own compute; its share of time computing must still be <= 1
    barrier = make_barrier(np.random.default_rng(6), (1.0,) * 6, 0.0, 0.002, 1, 1, 256)
    assert max(barrier.factors((True,) * 6)) <= 1.0  # once 1.0001
    c = with_(cal, run={"horizon_s": 20_000.0}, elastic={"scale_up_batch_window_s": 0.0},
              stragglers={"barrier_samples": 256})
    r = simulate(Scenario("diloco", 6, learners=6, quorum=2, mtbi_years=2.0 / 8760), c, seed=6)
    assert r.goodput == pytest.approx(sum(r.learner_goodput) / 6, rel=1e-9)  # once 0.9904730 vs 0.9904676


def test_seeded_and_deterministic(cal: Calibration) -> None:
    s = Scenario("dp-elastic", 600_000)
    a, b, c = simulate(s, cal, seed=7), simulate(s, cal, seed=7), simulate(s, cal, seed=8)
    assert a == b
    assert a.failures != c.failures


def test_scenario_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="quorum"):
        Scenario("diloco", 1000, learners=2, quorum=3)
    with pytest.raises(ValueError, match="learners"):
        Scenario("dp", 1000, learners=2)
    with pytest.raises(ValueError, match="method"):
        Scenario("ring", 1000)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="mtbi_years"):
        Scenario("dp", 1000, mtbi_years=0)


# ---------------------------------------------------------------------------------------------
# Paper numbers


def test_paper_table1_every_cell_within_5_points(table1) -> None:
    assert len(table1) == 30
    bad = [
        (r.scenario.label, r.scenario.chips, round(r.goodput, 3), r.scenario.paper)
        for r in table1
        if abs(r.goodput - r.scenario.paper) > 0.05
    ]
    assert not bad


def test_paper_table1_method_order_per_column(table1) -> None:
    rows = list(PAPER_TABLE1)
    for col, chips in enumerate(TABLE1_CHIPS):
        paper_order = sorted(rows, key=lambda key: PAPER_TABLE1[key][col])
        sim = {(r.scenario.method, r.scenario.learners): r.goodput for r in table1 if r.scenario.chips == chips}
        assert sorted(rows, key=sim.__getitem__) == paper_order, chips


def test_paper_table1_holds_for_another_seed(cal: Calibration) -> None:
    results = simulate_many(paper_table1_scenarios(), cal, seed=1)
    assert max(abs(r.goodput - r.scenario.paper) for r in results) <= 0.05


def test_paper_table1_uptime(table1) -> None:
    """Paper: with M >= 4 the global model (almost) never stops."""
    for r in table1:
        if r.scenario.method == "diloco" and r.scenario.learners >= 8:
            assert r.uptime > 0.999
        elif r.scenario.method == "diloco" and r.scenario.learners == 4:
            assert r.uptime > 0.99
        elif r.scenario.method == "dp":
            assert r.uptime == pytest.approx(r.goodput, rel=0.01)


def test_heterogeneity_matches_paper(cal: Calibration) -> None:
    by_k = {r.scenario.quorum: r for r in simulate_many(heterogeneity_scenarios(cal), cal)}
    assert by_k[8].goodput == pytest.approx(0.84, abs=0.05)
    assert by_k[1].goodput == pytest.approx(1.00, abs=0.01)


@pytest.mark.parametrize("quorum,expected", [(8, (1 / 1.18 + 1) / 2), (5, (1 / 1.18 + 1) / 2), (4, 1.0), (1, 1.0)])
def test_quorum_barrier_closed_form(cal: Calibration, quorum: int, expected: float) -> None:
    """No noise: learners faster than the K-th fastest wait for it, the others never wait."""
    quiet = with_(cal, stragglers={"slice_step_noise": 0.0})
    s = Scenario(
        "diloco", 8 * 256, learners=8, quorum=quorum, mtbi_years=math.inf,
        step_factors=(1.0,) * 4 + (1.18,) * 4,
    )
    assert simulate(s, quiet).goodput == pytest.approx(expected, rel=1e-12)


# ---------------------------------------------------------------------------------------------
# Calibration file


def test_shipped_calibration_loads(cal: Calibration) -> None:
    assert cal.failures.mtbi_chip_years == 1.0
    assert cal.recovery.distribution == "exponentiated_weibull"


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "cal.toml"
    p.write_text(text)
    return p


def test_calibration_rejects_unknown_key(tmp_path: Path) -> None:
    text = CALIBRATION.read_text().replace("[elastic]\n", "[elastic]\nreshard_pause_ms = 3\n")
    with pytest.raises(ValueError, match=r"elastic\.reshard_pause_ms"):
        load_calibration(_write(tmp_path, text))


def test_calibration_names_missing_and_bad_fields(tmp_path: Path) -> None:
    text = CALIBRATION.read_text()
    missing = "\n".join(line for line in text.splitlines() if not line.startswith("scale_s"))
    with pytest.raises(ValueError, match=r"recovery\.scale_s"):
        load_calibration(_write(tmp_path, missing))
    negative = text.replace("restart_pause_s = 26.0", "restart_pause_s = -1.0")
    with pytest.raises(ValueError, match=r"non_elastic\.restart_pause_s"):
        load_calibration(_write(tmp_path, negative))
    with pytest.raises(ValueError, match="not valid TOML"):
        load_calibration(_write(tmp_path, "[elastic"))
    with pytest.raises(ValueError, match="not found"):
        load_calibration(tmp_path / "nope.toml")


# ---------------------------------------------------------------------------------------------
# Command line


def test_cli_paper_table1_json(capsys) -> None:
    assert simulate_main(["--grid", "paper-table1", "--json"]) == 0
    cells = json.loads(capsys.readouterr().out)
    assert len(cells) == 30
    for cell in cells:
        assert {"method", "chips", "learners", "goodput", "paper"} <= cell.keys()
        assert 0 <= cell["goodput"] <= 1 and 0 <= cell["paper"] <= 1
        assert abs(cell["goodput"] - cell["paper"]) <= 0.05
    assert {c["chips"] for c in cells} == set(TABLE1_CHIPS)


def test_cli_prints_table1_side_by_side(capsys) -> None:
    assert simulate_main(["--grid", "paper-table1"]) == 0
    out = capsys.readouterr().out
    assert "sim paper   diff" in out and "DP, no elasticity" in out and "Decoupled M=16" in out
    assert "method order matches the paper in 5/5 columns" in out


def test_cli_single_question(capsys) -> None:
    argv = ["--chips", "150000", "--learners", "2", "4", "--method", "diloco", "--mtbi-years", "2",
            "--quorum", "2", "--seed", "3", "--json"]
    assert simulate_main(argv) == 0
    cells = json.loads(capsys.readouterr().out)
    assert [(c["method"], c["learners"], c["quorum"], c["mtbi_years"]) for c in cells] == [
        ("diloco", 2, 2, 2.0), ("diloco", 4, 2, 2.0)
    ]
    assert all("paper" not in c for c in cells)


def test_cli_question_on_a_table1_cell_shows_the_paper(capsys) -> None:
    assert simulate_main(["--chips", "1200000", "--learners", "8", "--method", "diloco", "--json"]) == 0
    (cell,) = json.loads(capsys.readouterr().out)
    assert cell["paper"] == 0.88 and abs(cell["goodput"] - 0.88) <= 0.05


def test_cli_heterogeneity(capsys) -> None:
    assert simulate_main(["--grid", "heterogeneity", "--json"]) == 0
    cells = {c["quorum"]: c for c in json.loads(capsys.readouterr().out)}
    assert cells[8]["paper"] == 0.84 and cells[1]["paper"] == 1.0


def test_cli_rejects_bad_flags(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        simulate_main(["--chips", "1000", "--learners", "2", "--quorum", "3"])
    assert e.value.code == 2
    assert "--quorum" in capsys.readouterr().err
