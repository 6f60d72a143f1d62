"""The unit tier's guard (tests/unit/conftest.py, tests/tier_guard.py) on purpose-made offenders: a
probe file written into tests/unit/ for the length of one inner pytest run, then removed."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PROBE = '''
import asyncio, socket, subprocess, sys, threading, time


def test_sleeps():
    time.sleep(0.05)


async def test_sleeps_on_the_loop():
    await asyncio.sleep(0.05)


def test_starts_a_process():
    subprocess.run([sys.executable, "-c", "pass"], check=True)


def test_binds_a_socket():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))


def test_sleeps_in_a_background_thread_and_swallows_the_error():
    def nap():
        try:
            time.sleep(0.05)
        except Exception:
            pass
    t = threading.Thread(target=nap)
    t.start()
    t.join()


def test_yields_and_spins_briefly():
    time.sleep(0.001)
    asyncio.run(asyncio.sleep(0))
'''

WANT_FAILED = {"test_sleeps": "sleep: time.sleep(0.05)", "test_sleeps_on_the_loop": "sleep: asyncio.sleep(0.05)",
               "test_starts_a_process": "start a process", "test_binds_a_socket": "use a socket: socket.bind",
               "test_sleeps_in_a_background_thread_and_swallows_the_error": "sleep: time.sleep(0.05)"}


def test_a_unit_test_that_sleeps_starts_a_process_or_binds_a_socket_fails(tmp_path):
    probe = ROOT / "tests" / "unit" / f"test_zz_guard_probe_{uuid.uuid4().hex[:8]}.py"
    probe.write_text(PROBE)
    try:
        out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                              f"--junitxml={tmp_path / 'junit.xml'}", str(probe)],
                             cwd=ROOT, env=dict(os.environ), capture_output=True, text=True, timeout=300)
    finally:
        probe.unlink()
    assert out.returncode == 1, out.stdout[-3000:]
    cases = {c.get("name"): c for c in ET.parse(tmp_path / "junit.xml").getroot().iter("testcase")}
    assert set(cases) == {*WANT_FAILED, "test_yields_and_spins_briefly"}
    for name, reason in WANT_FAILED.items():
        problems = [*cases[name].iter("failure"), *cases[name].iter("error")]
        assert problems, f"{name} passed under the unit guard"
        assert any(reason in (p.get("message", "") + (p.text or "")) for p in problems), (name, problems[0].text)
    ok = cases["test_yields_and_spins_briefly"]
    assert not [*ok.iter("failure"), *ok.iter("error")], "a yield to the loop or a 1 ms spin is allowed"
