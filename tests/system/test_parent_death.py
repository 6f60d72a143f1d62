"""Children in sessions of their own die with the command that started them (SIGKILL, OOM killer):
the temporary Prefect server (diloco_async/flows/prefect_server.py) and any
``python -m diloco_async.runtime.parent_death``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(PR_SET_PDEATHSIG) is Linux's")


def _gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.1)
    return False


def _start_parent(code: str, tmp_path: Path) -> tuple[subprocess.Popen, int]:
    """A parent that starts a child (per ``code``), prints ``child <pid>`` and waits forever."""
    parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, stdout=subprocess.PIPE,
                              text=True, env={**os.environ, "PREFECT_HOME": str(tmp_path / "prefect")})
    line = parent.stdout.readline()  # type: ignore[union-attr]
    assert line.startswith("child "), line
    return parent, int(line.split()[1])


def test_a_guarded_child_in_its_own_session_dies_with_its_sigkilled_parent(tmp_path):
    parent, child = _start_parent("""
        import subprocess, sys, time
        from diloco_async.runtime.parent_death import guarded_argv
        p = subprocess.Popen([sys.executable, *guarded_argv("http.server", ["0", "--bind", "127.0.0.1"])],
                             start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        print("child", p.pid, flush=True)
        time.sleep(600)
    """, tmp_path)
    try:
        assert not _gone_within(child, 1.0)  # it runs while its parent lives
        parent.send_signal(signal.SIGKILL)
        parent.wait(30)
        assert _gone_within(child, 60.0)  # a failure mode, not a bound: a child left alive never goes
    finally:
        for pid in (parent.pid, child):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_the_temporary_prefect_server_stops_when_its_command_is_sigkilled(tmp_path):
    parent, server = _start_parent(f"""
        import os, time
        os.environ.pop("PREFECT_API_URL", None)
        from pathlib import Path
        from diloco_async.flows.prefect_server import temporary_server
        with temporary_server(Path({str(tmp_path / 'server.log')!r})) as srv:
            print("child", srv.server_process.pid, flush=True)
            time.sleep(600)
    """, tmp_path)
    try:
        assert psutil.pid_exists(server) and not _gone_within(server, 1.0)
        parent.send_signal(signal.SIGKILL)
        parent.wait(30)
        assert _gone_within(server, 60.0)  # SIGTERM: uvicorn shuts down (60 s: the failure mode, not a bound)
    finally:
        for pid in (parent.pid, server):
            try:
                os.killpg(pid, signal.SIGKILL) if pid == server else os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
