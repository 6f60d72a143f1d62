"""Every benchmark command refuses a bad count before it starts anything, run as the real command
(the modules' imports and ``main`` are tests/unit/test_benchmark_modules.py's)."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("argv", [["benchmarks.sync_load", "--learners", "0"],
                                  ["benchmarks.sync_load", "--learners", "8", "--seconds", "-1"],
                                  ["benchmarks.merge", "--repeat", "0"]])
def test_a_benchmark_refuses_a_bad_count_before_it_starts(argv):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert f"argument {argv[-2]}" in done.stderr and "must be" in done.stderr
