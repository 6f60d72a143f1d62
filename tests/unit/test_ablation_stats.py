"""Ablation statistics, suite files and analysis on synthetic inputs with known answers."""

from __future__ import annotations

import glob
import math

import pytest

from diloco_async.ablation.analysis import analyse
from diloco_async.ablation.stats import (
    Claim,
    Interval,
    bootstrap_interval,
    difference_interval,
    t_cdf,
    t_interval,
    t_quantile,
    verdict,
)
from diloco_async.ablation.suite import Suite, arm_overrides, figures_of, load_suite, run_config, run_fields
from diloco_async.config.schema import load_config
from diloco_async.flows.resolve import check_arms

# two-sided 95% (p = 0.975) and 90% (p = 0.95) Student t quantiles from printed tables
T_TABLE = [(1, 0.975, 12.706), (2, 0.975, 4.303), (3, 0.975, 3.182), (4, 0.975, 2.776), (5, 0.975, 2.571),
           (9, 0.975, 2.262), (10, 0.975, 2.228), (20, 0.975, 2.086), (30, 0.975, 2.042), (120, 0.975, 1.980),
           (1, 0.95, 6.314), (4, 0.95, 2.132), (10, 0.95, 1.812), (2, 0.995, 9.925)]


@pytest.mark.parametrize("df,p,expected", T_TABLE)
def test_t_quantile_matches_the_printed_table(df, p, expected):
    assert t_quantile(p, df) == pytest.approx(expected, abs=6e-4)
    assert t_quantile(1 - p, df) == pytest.approx(-expected, abs=6e-4)
    assert t_cdf(t_quantile(p, df), df) == pytest.approx(p, abs=1e-9)


def test_t_cdf_known_points_and_bad_input():
    assert t_cdf(0.0, 3) == 0.5
    assert t_cdf(1.0, 1) == pytest.approx(0.75)  # Cauchy: 1/2 + atan(1)/pi
    assert t_cdf(-2.0, 2) == pytest.approx(0.5 - 2 / (2 * math.sqrt(6)))  # df = 2: 1/2 + t / (2 sqrt(2 + t^2))
    with pytest.raises(ValueError, match="p must be in"):
        t_quantile(1.0, 3)
    with pytest.raises(ValueError, match="degrees of freedom"):
        t_cdf(1.0, 0)


def test_t_interval_known_answer():
    iv = t_interval([1.0, 2.0, 3.0, 4.0, 5.0])
    half = 2.776445 * math.sqrt(2.5) / math.sqrt(5)
    assert (iv.mean, iv.n, iv.method) == (3.0, 5, "t")
    assert iv.sd == pytest.approx(math.sqrt(2.5))
    assert (iv.low, iv.high) == (pytest.approx(3 - half, rel=1e-5), pytest.approx(3 + half, rel=1e-5))
    one = t_interval([7.0])
    assert one.mean == 7.0 and one.low == -math.inf and one.high == math.inf
    with pytest.raises(ValueError, match="non-finite"):
        t_interval([1.0, float("nan")])
    with pytest.raises(ValueError, match="no values"):
        t_interval([])


def test_bootstrap_is_seeded_and_brackets_the_mean():
    xs = [0.9, 1.1, 1.0, 1.3, 0.8, 1.05]
    a, b = bootstrap_interval(xs, seed=3), bootstrap_interval(xs, seed=3)
    assert a == b
    assert min(xs) <= a.low < a.mean < a.high <= max(xs)
    assert bootstrap_interval(xs, seed=4) != a  # another seed, other resamples
    const = bootstrap_interval([2.0, 2.0, 2.0], seed=0)
    assert (const.low, const.high) == (2.0, 2.0)
    with pytest.raises(ValueError, match="resamples"):
        bootstrap_interval(xs, seed=0, resamples=10)


def _arms(diffs: list[float], base: float = 3.0) -> tuple[dict, dict]:
    a = {seed: base + 0.1 * seed for seed in range(len(diffs))}
    return a, {seed: a[seed] + d for seed, d in enumerate(diffs)}


def test_an_interval_that_must_exclude_zero():
    a, b = _arms([-0.20, -0.22, -0.19, -0.21])  # b lower on every seed by ~0.2, small spread
    d = difference_interval(a, b)
    assert d.method == "paired-t" and d.n == 4
    assert d.high < 0 and d.mean == pytest.approx(-0.205)
    assert verdict(d, Claim("lower")) == "reproduced"
    assert verdict(d, Claim("higher")) == "not reproduced"


def test_an_interval_that_must_not_exclude_zero():
    a, b = _arms([-1.0, 1.0, -0.5, 0.5])
    d = difference_interval(a, b)
    assert d.low < 0 < d.high
    assert verdict(d, Claim("lower")) == "inconclusive"
    assert verdict(d, Claim("higher")) == "inconclusive"


def test_pairing_removes_the_seed_effect():
    # seeds differ a lot (0, 1, 2 units) but b - a is a steady -0.1: paired, the interval excludes zero;
    # unpaired (Welch, no seed in common) it does not.
    a = {0: 1.0, 1: 2.0, 2: 3.0}
    b = {0: 0.9, 1: 1.91, 2: 2.89}
    assert difference_interval(a, b).high < 0
    welch = difference_interval(a, {s + 10: v for s, v in b.items()})
    assert welch.method == "welch-t" and welch.low < 0 < welch.high


def test_welch_known_answer():
    a = {0: 1.0, 1: 2.0, 2: 3.0}
    b = {10: 4.0, 11: 5.0, 12: 6.0, 13: 7.0}
    d = difference_interval(a, b)
    va, vb = 1.0 / 3, (5.0 / 3) / 4
    df = (va + vb) ** 2 / (va ** 2 / 2 + vb ** 2 / 3)
    assert df == pytest.approx(4.959, abs=1e-3)
    half = t_quantile(0.975, df) * math.sqrt(va + vb)
    assert d.mean == 3.5 and d.high - d.mean == pytest.approx(half)
    assert 2.2 < half < 2.25  # t(0.975, 4.96) ~ 2.575 x 0.866


def test_equivalence_inside_and_outside_the_margin():
    inside = difference_interval(*_arms([0.01, -0.01, 0.005, -0.004]))
    outside = difference_interval(*_arms([1.0, 1.1, 0.9, 1.05]))
    straddle = difference_interval(*_arms([0.05, 0.15, 0.1, 0.12]))
    claim = Claim("equivalent", margin=0.1)
    assert verdict(inside, claim) == "reproduced"
    assert verdict(outside, claim) == "not reproduced"
    assert straddle.low < 0.1 < straddle.high and verdict(straddle, claim) == "inconclusive"


def test_non_inferiority():
    worse = difference_interval(*_arms([0.3, 0.35, 0.32]))
    same = difference_interval(*_arms([0.0, 0.01, -0.01]))
    assert verdict(same, Claim("not-higher", 0.05)) == "reproduced"
    assert verdict(worse, Claim("not-higher", 0.05)) == "not reproduced"
    assert verdict(worse, Claim("not-lower", 0.05)) == "reproduced"


@pytest.mark.filterwarnings("error")  # SciPy warns of a catastrophic cancellation on data without spread
def test_no_spread_gives_a_point_interval():
    paired = difference_interval({0: 1.0, 1: 2.0, 2: 5.0}, {0: 1.5, 1: 2.5, 2: 5.5})
    welch = difference_interval({0: 1.0, 1: 1.0}, {2: 3.0, 3: 3.0})
    same = t_interval([0.25, 0.25, 0.25])
    assert (paired.method, paired.low, paired.high, paired.sd) == ("paired-t", 0.5, 0.5, 0.0)
    assert (welch.method, welch.low, welch.high) == ("welch-t", 2.0, 2.0)
    assert (same.low, same.high) == (0.25, 0.25)


def test_an_infinite_interval_is_inconclusive_whatever_the_claim():
    inf = Interval(-5.0, 0.0, 1, -math.inf, math.inf, "t")
    for claim in (Claim("lower"), Claim("higher"), Claim("equivalent", 1.0), Claim("not-higher", 0.0)):
        assert verdict(inf, claim) == "inconclusive"


def test_claims_are_checked():
    with pytest.raises(ValueError, match="margin > 0"):
        Claim("equivalent")
    with pytest.raises(ValueError, match="unknown"):
        Claim("better")
    with pytest.raises(ValueError, match=">= 0"):
        Claim("not-higher", -1.0)


def _suite(**comparison) -> Suite:
    return Suite.model_validate({
        "suite": {"name": "t", "seeds": [0, 1, 2], "tokens": 1000, "tokens_why": "test", "wall_s": 60.0,
                  "figures": ["eval_loss", "bytes_per_token"]},
        "arms": [{"name": "a", "set": ["synchronizer.merge=mean"]}, {"name": "b", "set": []}],
        "comparisons": [{"name": "c", "figure": "eval_loss", "a": "a", "b": "b", "expect": "lower", **comparison}]})


def test_suite_checks_name_the_problem():
    with pytest.raises(ValueError, match="names arm 'z'"):
        _suite(b="z")
    with pytest.raises(ValueError, match="not in suite.figures"):
        _suite(figure="uptime")
    with pytest.raises(ValueError, match="margin > 0"):
        _suite(expect="equivalent")
    s = _suite()
    assert arm_overrides(s, s.arm("a"), ["learners.lr=0.01"]) == ["synchronizer.merge=mean", "learners.lr=0.01"]
    cfg = run_config(s, s.arm("a"), 2, load_config(None, arm_overrides(s, s.arm("a"))))
    assert (cfg.synchronizer.merge, cfg.run.seed, cfg.budget.tokens, cfg.budget.wall_s, cfg.run.name) == (
        "mean", 2, 1000, 60.0, "ablate-t-a")


def test_a_synchronous_arm_is_synchronous_diloco():
    """``synchronous = true`` is the one named baseline (K = M, no grace, barrier), after the arm's set,
    and its fields belong to the suite (a user override of them is refused)."""
    s = Suite.model_validate({
        "suite": {"name": "t", "seeds": [0], "tokens": 1000, "tokens_why": "test", "wall_s": 60.0,
                  "figures": ["eval_loss"], "overrides": ["learners.count=3"]},
        "arms": [{"name": "k3", "synchronous": True}, {"name": "k1", "set": ["synchronizer.min_quorum=1"]}]})
    arms = check_arms(s)
    k3 = arms["k3"]
    assert (k3.synchronizer.min_quorum, k3.synchronizer.grace_enabled, k3.learners.barrier) == (3, False, True)
    assert (arms["k1"].synchronizer.min_quorum, arms["k1"].learners.barrier) == (1, False)
    with pytest.raises(ValueError, match="learners.barrier"):
        check_arms(s, ["learners.barrier=false"])


def test_figures_of_a_summary():
    summary = {"tokens_processed": 2000, "bytes_in": 3000, "bytes_out": 1000, "compute_goodput": 0.5,
               "stop_reason": "x", "peak": float("nan")}
    f = figures_of(summary, 2.5, ["eval_loss", "bytes_per_token", "compute_goodput", "stop_reason", "peak", "nope"])
    assert f == {"eval_loss": 2.5, "bytes_per_token": 2.0, "compute_goodput": 0.5, "stop_reason": None,
                 "peak": None, "nope": None}


def test_analyse_rows_verdicts_and_missing_runs():
    s = _suite()
    recs = [{"arm": "a", "seed": k, "figures": {"eval_loss": 3.0 + k, "bytes_per_token": 10.0}} for k in range(3)]
    recs += [{"arm": "b", "seed": k, "figures": {"eval_loss": 2.8 + k + 0.01 * k, "bytes_per_token": 10.0}}
             for k in range(2)]
    an = analyse(s, recs)
    assert an.missing == [("b", 2)]
    row = an.rows[0]
    assert row.diff.n == 2 and row.diff.high < 0 and row.verdict == "reproduced"
    an1 = analyse(s, recs[:4])
    assert an1.rows[0].verdict == "inconclusive" and "fewer than 2 runs" in an1.rows[0].why


SUITES = sorted(glob.glob("configs/ablations/*.toml"))
_NEEDS = {"precision": ("learners", "codec", "int2"), "outer-optimizer": ("synchronizer", "outer_optimizer", None),
          "fragmentation": ("synchronizer", "fragmentation", None)}


@pytest.mark.parametrize("path", SUITES)
def test_every_shipped_suite_loads_and_its_arms_validate(path):
    suite = load_suite(path)
    if suite.suite.name != "ci":
        assert len(suite.suite.seeds) >= 3, "paper suites: at least 3 seeds per arm"
        assert suite.comparisons, "a paper suite compares something"
    need = _NEEDS.get(suite.suite.name)
    if need is not None:
        from diloco_async.config import schema as config

        section = {"learners": config.LearnerConfig, "synchronizer": config.SynchronizerConfig}[need[0]]
        if need[1] not in section.model_fields or (need[2] and need[2] not in str(section.model_fields[need[1]])):
            pytest.skip(f"{need[0]}.{need[1]}{' = ' + need[2] if need[2] else ''} is not in this build yet")
    assert set(check_arms(suite)) == {a.name for a in suite.arms}


@pytest.mark.parametrize("low,high,kind,margin,expected", [
    (-0.5, -0.01, "lower", 0.0, "reproduced"), (-0.5, 0.01, "lower", 0.0, "inconclusive"),
    (0.01, 0.5, "lower", 0.0, "not reproduced"), (0.01, 0.5, "higher", 0.0, "reproduced"),
    (-0.01, 0.5, "higher", 0.0, "inconclusive"), (-0.5, -0.01, "higher", 0.0, "not reproduced"),
    (-0.09, 0.09, "equivalent", 0.1, "reproduced"), (-0.09, 0.11, "equivalent", 0.1, "inconclusive"),
    (0.11, 0.3, "equivalent", 0.1, "not reproduced"), (-0.3, -0.11, "equivalent", 0.1, "not reproduced"),
    (-0.3, 0.04, "not-higher", 0.05, "reproduced"), (0.0, 0.06, "not-higher", 0.05, "inconclusive"),
    (0.06, 0.2, "not-higher", 0.05, "not reproduced"), (-0.2, -0.06, "not-lower", 0.05, "not reproduced"),
])
def test_verdict_boundaries(low, high, kind, margin, expected):
    iv = Interval((low + high) / 2, 0.1, 3, low, high, "paired-t")
    assert verdict(iv, Claim(kind, margin)) == expected


def test_user_overrides_of_fields_the_suite_owns_are_refused():
    """`ablate --set` must not override the seed, the budget or a field an arm varies: every "seed"
    would be one run, or every arm the same one."""
    suite = load_suite("configs/ablations/merge.toml")
    for item in ("run.seed=5", "synchronizer.merge=rda", "budget.tokens=10"):
        with pytest.raises(ValueError, match="sets .* itself"):
            check_arms(suite, [item])
    assert set(check_arms(suite, ["synchronizer.outer_lr=0.5"])) == {"mean", "rda"}


def test_suite_path_that_is_a_folder_or_bad_toml_is_a_clear_error(tmp_path):
    """``ablate --suite configs/ablations`` names the problem (it was a traceback, exit 1)."""
    with pytest.raises(ValueError, match=r"is a directory; give a suite file such as .*/merge\.toml"):
        load_suite(tmp_path)
    bad = tmp_path / "bad.toml"
    bad.write_text("[suite\n")
    with pytest.raises(ValueError, match=r"bad\.toml: not valid TOML: .*line 1"):
        load_suite(bad)
    bad.write_text('[suite]\nname = "x"\nbogus = 1\n')
    with pytest.raises(ValueError, match=r"invalid suite: .*suite\.bogus: Extra inputs are not permitted"):
        load_suite(bad)


def test_saved_records_are_reused_only_for_the_same_runs_and_figures(tmp_path):
    """A suite restarted after an edit re-runs what changed: other overrides, or a figure the
    saved record does not hold (it was reused with the figure missing from the table)."""
    import json

    from diloco_async.flows.ablate import load_records, record_path

    suite = load_suite("configs/ablations/merge.toml")
    arm, seed = suite.arms[0], suite.suite.seeds[0]
    path = record_path(tmp_path, arm.name, seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"overrides": arm_overrides(suite, arm, []), "fields": run_fields(suite, arm, seed),
              "figures": {f: 1.0 for f in suite.suite.figures}}
    path.write_text(json.dumps(record))
    assert set(load_records(tmp_path, suite, [])) == {(arm.name, seed)}
    assert load_records(tmp_path, suite, ["learners.lr=0.001"]) == {}  # other overrides: stale
    more = suite.model_copy(update={"suite": suite.suite.model_copy(
        update={"figures": [*suite.suite.figures, "token_goodput"]})})
    assert load_records(tmp_path, more, []) == {}  # a figure it lacks: run again
    path.write_text("{half")  # a torn record is not one
    assert load_records(tmp_path, suite, []) == {}
