"""Every benchmark module imports and has a ``main``: a benchmark that rots unnoticed between
measurements (an import renamed by another change) fails here, not on the day it is needed."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import benchmarks

MODULES = sorted(m.name for m in pkgutil.iter_modules(benchmarks.__path__) if m.name not in ("stats",))


def test_the_benchmarks_are_found():
    assert {"poison", "hf_learner", "fuzz", "kill_matrix"} <= set(MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_benchmark_imports_and_has_main(name):
    module = importlib.import_module(f"benchmarks.{name}")
    assert callable(getattr(module, "main", None)), f"benchmarks.{name} has no main()"


def test_mean_interval():
    from benchmarks.stats import mean_interval

    assert mean_interval([2.0]) == (2.0, 0.0)
    mean, half = mean_interval([1.0, 2.0, 3.0])
    assert mean == 2.0 and half == pytest.approx(4.303 * 1.0 / 3 ** 0.5)
