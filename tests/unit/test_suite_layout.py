"""The suite's own layout: every test file's basename is unique across the tiers. The test folders
are not packages, so pytest imports a file by its basename, and two files of one name (one in
tests/unit, one in tests/system) stop the collection of the second with an "import file mismatch"
error, only when both are collected in one session (``make test``, not a tier alone)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_no_two_test_files_share_a_basename():
    seen: dict[str, list[str]] = defaultdict(list)
    for path in sorted(TESTS.rglob("test_*.py")):
        seen[path.name].append(str(path.relative_to(TESTS)))
    assert {name: paths for name, paths in seen.items() if len(paths) > 1} == {}
