"""Shared fixtures and the suite's rules. Services are started by the tests that need them and stopped after.

The suite has three tiers, chosen by where a test file lives (``docs/testing.md``):

- ``tests/unit/``: no process, no socket, no real sleep (``tests/unit/conftest.py`` fails a test
  that does any of them); ``make test-unit``.
- ``tests/contract/``: in-process servers on loopback, storage backends against moto's S3 server
  and the GCS emulator.
- ``tests/system/``: real synchronizer and learner processes, Prefect and MLflow servers, ptys.

Each test gets its tier's marker from its location (``-m unit`` and so on), a test of a tier other
than ``system`` fails when its call runs over :data:`TIER_TEST_LIMIT_S`, and a session fails when a
process started under it is still alive once it is over (``tests/session_guard.py``).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from storage_servers import gcs_endpoint, s3_endpoint  # noqa: F401  (session fixtures: moto S3, fake GCS)

pytest_plugins = ["session_guard"]  # a session fails when a process it started outlives it

ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
TIERS = ("unit", "contract", "system")

#: a call of a unit or contract test that takes longer fails its tier (a system test has only the
#: pytest-timeout of its module): a slow test there is a misplaced test or a hidden wait
TIER_TEST_LIMIT_S = 60.0

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")


def tier_of(path: Path) -> str | None:
    """``unit``, ``contract`` or ``system`` for a test file under that folder of ``tests/``; None elsewhere."""
    try:
        first = Path(path).resolve().relative_to(TESTS).parts[0]
    except (ValueError, IndexError):
        return None
    return first if first in TIERS else None


def pytest_configure(config: pytest.Config) -> None:
    for tier in TIERS:
        config.addinivalue_line("markers", f"{tier}: set by location (tests/{tier}/), never by hand")
    if not hasattr(config, "workerinput"):  # the controller (or a run without xdist), not an xdist worker
        config.stash[_tier_seconds_key] = {}


_tier_seconds_key = pytest.StashKey[dict]()


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the xdist_group markers set here
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        tier = tier_of(item.path)
        if tier is None:
            raise pytest.UsageError(f"{item.nodeid}: a test lives in tests/unit/, tests/contract/ or tests/system/")
        item.add_marker(getattr(pytest.mark, tier))
        # `--dist loadgroup` keeps such a module on one worker: its fixture is set up once
        if config.pluginmanager.hasplugin("xdist") and _uses_a_module_fixture(item):
            item.add_marker(pytest.mark.xdist_group(item.path.stem))
    items.sort(key=_run_order)  # stable: a module's tests keep their order


#: the system modules with the longest tests (30-50 s each on the 2-core machine), started first so
#: that the session does not end on one worker running one of them while the other has nothing left
SLOW_FIRST = ("test_wheel_install", "test_deployments", "test_chaos", "test_wan_cli", "test_ablate", "test_install",
              "test_models_system", "test_stop", "test_flow", "test_ui", "test_ui_prefect", "test_parent_death",
              "test_poison")


def _run_order(item: pytest.Item) -> tuple[int, int]:
    """Unit tests first, then contract, then system tests, the :data:`SLOW_FIRST` modules first among them."""
    tier = tier_of(item.path)
    stem = item.path.stem
    slow = SLOW_FIRST.index(stem) if tier == "system" and stem in SLOW_FIRST else len(SLOW_FIRST)
    return TIERS.index(tier), slow


def _uses_a_module_fixture(item: pytest.Item) -> bool:
    """Whether ``item`` uses a module-scoped fixture (a server, a virtualenv) of its own module: split
    over two workers, each would set it up once."""
    info = getattr(item, "_fixtureinfo", None)
    return info is not None and any(d.scope == "module" and Path(d.baseid.split("::")[0]).stem == item.path.stem
                                    for defs in info.name2fixturedefs.values() for d in defs)


_lost_groups: set[str] = set()


def pytest_collection_finish(session: pytest.Session) -> None:
    """On an xdist worker under ``--dist loadgroup``: notes the tests whose group (set above) did not
    reach the scheduler, which then fail at set-up (pytest 9.2 with pytest-xdist 3.8, pytest-xdist#1386:
    each test of a group runs on any worker and a module's server starts once per worker, silently)."""
    if getattr(session.config.option, "loadgroup", False):
        _lost_groups.update(item.nodeid for item in session.items if item.get_closest_marker("xdist_group")
                            is not None and "@" not in item.nodeid.rsplit("]", 1)[-1])


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.nodeid in _lost_groups:
        pytest.fail("--dist loadgroup lost this test's xdist_group: pytest and pytest-xdist do not agree on "
                    "node ids (pytest-xdist#1386); install the pins of constraints.txt", pytrace=False)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    tier = tier_of(item.path)
    if (call.when == "call" and tier != "system" and report.passed and call.duration > TIER_TEST_LIMIT_S):
        report.outcome = "failed"
        report.longrepr = (f"{item.nodeid} took {call.duration:.1f} s: a {tier} test runs in under "
                           f"{TIER_TEST_LIMIT_S:.0f} s (move it to tests/system/, or find what it waits for)")
    return report


_config: pytest.Config | None = None


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    global _config
    _config = session.config


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Adds up, in the controller, each tier's test seconds (setup, call and teardown)."""
    seconds = _config.stash.get(_tier_seconds_key, None) if _config is not None else None
    if seconds is not None:
        tier = tier_of(ROOT / report.location[0]) or "other"
        seconds[tier] = seconds.get(tier, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter, exitstatus, config: pytest.Config) -> None:
    seconds = config.stash.get(_tier_seconds_key, None)
    if seconds:
        parts = ", ".join(f"{tier} {s:.0f} s" for tier, s in sorted(seconds.items()))
        terminalreporter.write_line(f"test seconds by tier (summed over workers): {parts}")


@pytest.fixture(autouse=True)
def _run_from_repo_root(monkeypatch):
    """Tests use repo-relative paths (configs/, data/)."""
    monkeypatch.chdir(ROOT)


@pytest.fixture(scope="session")
def prefect_server():
    """A real Prefect API server (temporary sqlite database) for the whole session."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield
