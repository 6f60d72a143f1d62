"""Every benchmark module imports and has a ``main``: a benchmark that rots unnoticed between
measurements (an import renamed by another change) fails here, not on the day it is needed."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import benchmarks

#: modules that other benchmarks import, not benchmarks themselves
HELPERS = ("stats", "bars", "args", "sizes", "sync_load_learners", "end_trace", "paired_runs")
MODULES = sorted(m.name for m in pkgutil.iter_modules(benchmarks.__path__) if m.name not in HELPERS)


def test_the_benchmarks_are_found():
    assert {"poison", "hf_learner", "fuzz", "kill_matrix"} <= set(MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_benchmark_imports_and_has_main(name):
    module = importlib.import_module(f"benchmarks.{name}")
    assert callable(getattr(module, "main", None)), f"benchmarks.{name} has no main()"


@pytest.mark.parametrize("name", MODULES)
def test_benchmark_usage_names_the_command_that_runs_it(name):
    """`python -m benchmarks.merge --help` said `usage: merge.py`: argparse's default program name
    under ``-m`` is the file's, which cannot be run from the repository root."""
    import re
    from pathlib import Path

    source = (Path(benchmarks.__path__[0]) / f"{name}.py").read_text()
    for call in re.findall(r"ArgumentParser\(([^\n]*)", source):
        assert f'prog="python -m benchmarks.{name}"' in call, f"benchmarks/{name}.py: ArgumentParser({call}"


def test_mean_interval():
    from benchmarks.stats import mean_interval

    assert mean_interval([2.0]) == (2.0, 0.0)
    mean, half = mean_interval([1.0, 2.0, 3.0])
    assert mean == 2.0 and half == pytest.approx(4.303 * 1.0 / 3 ** 0.5, rel=1e-4)  # t table: 3 decimals


def test_bars_table_misses_a_missed_or_unmeasured_goal():
    import io

    from benchmarks.bars import Bar, print_bars

    out = io.StringIO()
    assert print_bars([Bar("a ratio", 0.3, 0.25), Bar("a peak", 1.5, 2.0, "max")], out) == 0
    assert "MISS" not in out.getvalue() and out.getvalue().count(" ok") == 2
    out = io.StringIO()
    assert print_bars([Bar("a ratio", 0.2, 0.25), Bar("context", 0.0, 1.0, shown=True)], out) == 1
    assert "MISS" in out.getvalue() and "shown" in out.getvalue()
    assert print_bars([Bar("never measured", None, 1.0)], io.StringIO()) == 1


def test_bars_are_merged_into_the_results_file_per_table_and_figure(tmp_path, monkeypatch):
    import io
    import json

    from benchmarks.bars import RESULTS_ENV, Bar, print_bars, record_bars

    path = tmp_path / "sub" / "figures.json"
    record_bars(path, "make bench: bars", [Bar("a ratio", 0.3, 0.25), Bar("a peak", None, 2.0, "max", "no run")],
                commit="abc1234", date="2026-12-06")
    record_bars(path, "merge bars", [Bar("speed-up", 3.0, 2.0, shown=True)], commit="abc1234", date="2026-12-06")
    data = record_bars(path, "make bench: bars", [Bar("a ratio", 0.2, 0.25)], commit="def5678", date="2026-12-07")
    assert data == json.loads(path.read_text())
    assert data["make bench: bars"] == {
        "a ratio": {"value": 0.2, "goal": 0.25, "kind": "min", "result": "MISS", "detail": "", "commit": "def5678",
                    "date": "2026-12-07"},
        "a peak": {"value": None, "goal": 2.0, "kind": "max", "result": "MISS", "detail": "no run",
                   "commit": "abc1234", "date": "2026-12-06"}}
    assert data["merge bars"]["speed-up"]["result"] == "shown"
    assert [p.name for p in path.parent.iterdir()] == ["figures.json"]  # no temporary file left
    monkeypatch.delenv(RESULTS_ENV, raising=False)
    print_bars([Bar("a ratio", 1.0, 0.25)], io.StringIO(), title="make bench: bars")  # no file named: none written
    assert json.loads(path.read_text()) == data


@pytest.mark.parametrize("value", ["0", "-3", "2.5", "x"])
def test_positive_int_refuses_what_is_not_a_count(value):
    import argparse

    from benchmarks.args import positive_int

    with pytest.raises(argparse.ArgumentTypeError):
        positive_int(value)


def test_positive_float_refuses_zero_negative_and_non_finite():
    import argparse

    from benchmarks.args import non_negative_int, positive_float

    assert positive_float("0.25") == 0.25 and non_negative_int("0") == 0
    for value in ("0", "-1", "inf", "nan", "x"):
        with pytest.raises(argparse.ArgumentTypeError):
            positive_float(value)


def test_a_speed_factor_is_in_zero_to_one():
    import argparse

    from benchmarks.args import speed_factor

    assert speed_factor("0.03") == 0.03 and speed_factor("1") == 1.0
    for value in ("0", "2", "-0.5", "nan"):
        with pytest.raises(argparse.ArgumentTypeError):
            speed_factor(value)


@pytest.mark.parametrize("name", MODULES)
def test_benchmark_help_describes_it_in_a_whole_sentence(name):
    """`--help` showed the docstring's first line, which for hf_learner stopped mid-sentence
    ("... inside a run, against the"): the description is the first paragraph."""
    from benchmarks.args import description

    text = description(importlib.import_module(f"benchmarks.{name}").__doc__)
    assert text.endswith("."), f"benchmarks.{name}: {text[-80:]!r}"


@pytest.mark.parametrize("setting", ["nonsense", "foo.bar=1"])
def test_hf_learner_refuses_a_bad_setting_before_it_starts(setting, capsys):
    from benchmarks import hf_learner

    with pytest.raises(SystemExit) as stop:
        hf_learner.main(["--set", setting, "--repeats", "1"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "python -m benchmarks.hf_learner: error:" in err and ("section.field=value" in err or "foo" in err)
