"""A pytest plugin: a session fails when a process started under it is still alive once it is over.

Every process started under a session (by a test, a fixture, a server it started, a worker of
pytest-xdist) inherits :data:`SESSION_ENV` valued by that session, also when it is reparented to
init or starts a session of its own. After the last test the controller gives such processes
:data:`LEFTOVER_GRACE_S` (``DILOCO_TEST_LEFTOVER_GRACE_S`` overrides it) to exit, then names each
one still alive, kills it and fails the session. A process whose environment was built from
scratch (``env={...}`` without ``os.environ``) is not seen; the fixtures of this suite copy
``os.environ``.

Loaded by ``tests/conftest.py``; ``tests/system/test_session_guard.py`` runs it on purpose-made leaks.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Callable

import psutil
import pytest

__all__ = ["LEFTOVER_GRACE_S", "SESSION_ENV", "leftover_processes"]

#: every process started under a pytest session inherits this variable, valued by the session
SESSION_ENV = "DILOCO_TEST_SESSION"

#: how long a session's leftover processes get to exit on their own after the last test, in seconds
LEFTOVER_GRACE_S = 20.0

_marker_key = pytest.StashKey[str]()


def session_processes(wanted: Callable[[str], bool]) -> list[tuple[psutil.Process, str]]:
    """``(process, its SESSION_ENV value)`` for every process other than this one and its ancestors
    whose environment has a ``SESSION_ENV`` value for which ``wanted`` holds (zombies left out: they
    hold nothing but a pid). Also used by ``scripts/leftover_test_processes.py``."""
    mine = {os.getpid(), *(p.pid for p in psutil.Process().parents())}
    found = []
    for proc in psutil.process_iter(["pid", "status"]):
        if proc.info["pid"] in mine or proc.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        try:
            value = proc.environ().get(SESSION_ENV)
        except (psutil.Error, OSError):  # gone, or not ours to read
            continue
        if value is not None and wanted(value):
            found.append((proc, value))
    return found


def leftover_processes(marker: str) -> list[psutil.Process]:
    """The processes of :func:`session_processes` started under the session ``marker``."""
    return [proc for proc, _ in session_processes(lambda value: value == marker)]


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):  # the controller, or a run without xdist; not an xdist worker
        os.environ[SESSION_ENV] = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
        config.stash[_marker_key] = os.environ[SESSION_ENV]


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    marker = session.config.stash.get(_marker_key, None)
    if marker is None:
        return
    grace_s = float(os.environ.get("DILOCO_TEST_LEFTOVER_GRACE_S", LEFTOVER_GRACE_S))
    deadline = time.monotonic() + grace_s
    while (left := leftover_processes(marker)) and time.monotonic() < deadline:
        time.sleep(0.25)
    if not left:
        return
    lines = []
    for proc in left:
        try:
            lines.append(f"  pid {proc.pid}: {' '.join(proc.cmdline())[:300]}")
            proc.send_signal(signal.SIGKILL)
        except psutil.Error:
            continue
    text = (f"{len(lines)} process(es) started by this test session outlived it by {grace_s:g} s "
            f"(killed now); the fixture that started each must stop it and wait for it:\n" + "\n".join(lines))
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(text, red=True, bold=True)
    else:
        print(text)
    if session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
