"""Exit 1 naming every process still alive that a pytest session of this suite started.

Every process started under a session of ``tests/`` carries ``DILOCO_TEST_SESSION`` in its
environment (tests/session_guard.py), valued ``<pid of the session's pytest>-<random>``. ``.ci/run``
runs this after ``make test``: a process found here belongs to a session whose pytest has exited,
so it outlived that session's own check (e.g. it was started while the session was torn down).
Found processes are killed after they are named. Sessions still running are left alone.
"""

from __future__ import annotations

import sys
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from session_guard import session_processes  # noqa: E402 (the suite's own scan, from tests/)


def _session_running(session: str) -> bool:
    pid = session.split("-", 1)[0]
    try:
        return pid.isdigit() and "pytest" in " ".join(psutil.Process(int(pid)).cmdline())
    except (psutil.Error, OSError):
        return False


def main() -> int:
    left = []
    for proc, session in session_processes(lambda value: not _session_running(value)):
        try:
            cmdline = " ".join(proc.cmdline())[:300]
            proc.kill()
        except (psutil.Error, OSError):
            continue  # gone meanwhile
        left.append(f"  pid {proc.pid} (session {session}): {cmdline}")
    if left:
        print(f"{len(left)} process(es) started by the test suite are still alive (killed now):", *left,
              sep="\n", file=sys.stderr)
        return 1
    print("no process started by the test suite is alive")
    return 0


if __name__ == "__main__":
    sys.exit(main())
