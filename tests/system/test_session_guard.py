"""The session guard (tests/session_guard.py) run on purpose-made leaks: a pytest session whose test
leaves a process behind fails, names the process and kills it; one whose test stops its process passes."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from polling import wait_until

TESTS = Path(__file__).resolve().parents[1]

LEAKY = '''
import os, subprocess, sys

def test_starts_a_process_and_leaves_it():
    # a session of its own, as a server started by a fixture often has: still inherits the environment
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)  # " + os.environ["LEAK_TAG"]],
                            start_new_session=True)
    with open(os.environ["LEAKED_PID_FILE"], "w") as f:
        f.write(str(proc.pid))
'''

TIDY = '''
import subprocess, sys

def test_starts_a_process_and_stops_it():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    proc.kill()
    proc.wait()
'''


def _run_session(tmp_path: Path, body: str, *args: str) -> subprocess.CompletedProcess:
    """An inner pytest session of ``body``; its leak, if any, is tagged by ``tmp_path``
    (``_tag``, from its full path), so that tests running beside it on other workers neither see nor kill it."""
    (tmp_path / "inner").mkdir()
    (tmp_path / "inner" / "test_inner.py").write_text(body)
    (tmp_path / "inner" / "pytest.ini").write_text("[pytest]\nasyncio_default_fixture_loop_scope = function\n")
    env = {**os.environ, "PYTHONPATH": str(TESTS), "DILOCO_TEST_LEFTOVER_GRACE_S": "2",
           "LEAKED_PID_FILE": str(tmp_path / "leaked.pid"), "LEAK_TAG": _tag(tmp_path)}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "session_guard", "-p", "no:cacheprovider",
                           *args, "test_inner.py"],
                          cwd=tmp_path / "inner", env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("xdist", [[], ["-n", "1"]], ids=["one-process", "xdist-worker"])
def test_a_process_left_behind_fails_the_session_and_is_killed(tmp_path, xdist):
    try:
        _check_leak_caught(tmp_path, _run_session(tmp_path, LEAKY, *xdist))
    finally:  # a broken guard must not leave this test's own leak behind
        for proc in psutil.process_iter(["cmdline"]):
            if _tag(tmp_path) in " ".join(proc.info["cmdline"] or []):
                proc.kill()


def _check_leak_caught(tmp_path: Path, out: subprocess.CompletedProcess) -> None:
    text = out.stdout + out.stderr
    assert out.returncode == 1, text
    pid = int((tmp_path / "leaked.pid").read_text())
    assert "1 process(es) started by this test session outlived it" in text, text
    assert _tag(tmp_path) in text  # named by its command line
    assert "1 passed" in text  # the test itself passed: the session failed for the leak alone
    assert f"pid {pid}:" in text
    wait_until(lambda: not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE,
               60, f"the leaked process {pid} to be killed")
    assert not [p for p in psutil.process_iter(["cmdline"]) if _tag(tmp_path) in " ".join(p.info["cmdline"] or [])]


def _tag(tmp_path: Path) -> str:
    return f"leaked-by-test-{hashlib.sha256(str(tmp_path).encode()).hexdigest()[:12]}"


def test_a_session_whose_processes_are_stopped_passes(tmp_path):
    out = _run_session(tmp_path, TIDY)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "outlived" not in out.stdout


def test_the_ci_check_names_and_kills_a_process_of_a_finished_session(tmp_path):
    """scripts/leftover_test_processes.py (run by .ci/run after `make test`): a process whose
    session's pytest is gone is named and killed, exit 1; this session's own processes are left alone."""
    tag = _tag(tmp_path)
    mine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)  # mine"])
    orphan = subprocess.Popen([sys.executable, "-c", f"import time; time.sleep(600)  # {tag}"], start_new_session=True,
                              env={**os.environ, "DILOCO_TEST_SESSION": f"gone-{tag}"})
    try:
        out = subprocess.run([sys.executable, str(TESTS.parent / "scripts" / "leftover_test_processes.py")],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 1, out.stdout + out.stderr
        assert f"pid {orphan.pid} (session gone-{tag})" in out.stderr and tag in out.stderr, out.stderr
        assert orphan.wait(timeout=60) == -9
        assert mine.poll() is None  # this session's pytest is alive: its processes are not the check's
    finally:
        for proc in (mine, orphan):
            proc.kill()
            proc.wait()
