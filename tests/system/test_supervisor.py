"""Supervision of learners (diloco_async.runtime.supervisor.Supervisor) with real local processes."""

from __future__ import annotations

import signal
import time

from diloco_async.runtime.procs import LocalProcessLauncher
from diloco_async.runtime.supervisor import Supervisor

# incarnation 0 of learner 0 fails at once; every later one runs until killed; learner 1 exits cleanly
SCRIPTS = {(0, 0): "import sys; sys.exit(3)", (1, 0): "pass"}
RUNS = "import time; time.sleep(60)"


def _check_until(sup: Supervisor, cond, timeout_s: float = 60.0) -> list:
    deadline = time.monotonic() + timeout_s
    made = []
    while not cond(made):
        assert time.monotonic() < deadline, f"supervisor did not get there: {made}"
        made += sup.check()
        time.sleep(0.02)
    return made


def test_supervisor_restarts_failed_learners_after_the_delay(tmp_path):
    launcher = LocalProcessLauncher(tmp_path / "logs")
    started: list[tuple[int, int, float]] = []

    def start(index: int, incarnation: int):
        started.append((index, incarnation, time.monotonic()))
        return launcher.start(f"learner-{index}-{incarnation}", ["-c", SCRIPTS.get((index, incarnation), RUNS)], {})

    lines: list[str] = []
    sup = Supervisor(start=start, restart_delay_s=0.5, max_restarts=2, log=lines.append)
    try:
        sup.launch(0, 0)
        sup.launch(1, 0)
        for h in sup.handles():
            h.wait(timeout=30)
        # learner-0 exited with code 3: restarted once, as incarnation 1, no sooner than the delay
        t_seen = time.monotonic()
        made = _check_until(sup, lambda m: len(m) == 1)
        assert (made[0].index, made[0].incarnation, made[0].reason) == (0, 1, "exit code 3")
        assert made[0].at - t_seen >= 0.45
        assert [(i, n) for i, n, _ in started] == [(0, 0), (1, 0), (0, 1)]  # learner-1's clean exit: no restart
        assert sup.slots[0].handle.poll() is None  # incarnation 1 runs
        # SIGKILL of the running incarnation: incarnation 2
        sup.slots[0].handle.kill()
        made = _check_until(sup, lambda m: len(m) == 1)
        assert (made[0].incarnation, made[0].reason) == (2, "killed by SIGKILL")
        # max_restarts = 2 reached: the next death is logged, not restarted, however long after
        sup.slots[0].handle.proc.send_signal(signal.SIGTERM)
        sup.slots[0].handle.wait(timeout=30)
        now = time.monotonic()
        assert sup.check(now) == []  # the death is seen ...
        assert sup.slots[0].given_up and "max_restarts=2" in lines[-1]
        assert sup.check(now + 100 * sup.restart_delay_s) == []  # ... and nothing is due, ever
        assert [r.incarnation for r in sup.restarts] == [1, 2]
        assert sup.next_due() is None
    finally:
        for h in sup.handles():
            h.terminate(grace_s=5)


def test_supervisor_waits_for_the_delay_before_restarting(tmp_path):
    launcher = LocalProcessLauncher(tmp_path / "logs")

    def start(index: int, incarnation: int):
        code = "import sys; sys.exit(1)" if incarnation == 0 else RUNS
        return launcher.start(f"l{index}-{incarnation}", ["-c", code], {})

    sup = Supervisor(start=start, restart_delay_s=30.0, max_restarts=1, log=lambda _: None)
    try:
        sup.launch(0)
        sup.handles()[0].wait(timeout=30)
        now = time.monotonic()
        assert sup.check(now) == []  # failure noticed, restart due in 30 s
        assert sup.next_due() == now + 30.0
        assert sup.check(now + 29.0) == []
        made = sup.check(now + 30.0)
        assert [(r.index, r.incarnation) for r in made] == [(0, 1)]
    finally:
        for h in sup.handles():
            h.terminate(grace_s=5)


def test_supervisor_retries_a_restart_that_failed_to_start(tmp_path):
    launcher = LocalProcessLauncher(tmp_path / "logs")
    attempts: list[int] = []

    def start(index: int, incarnation: int):
        if incarnation == 1:
            attempts.append(incarnation)
            if len(attempts) == 1:
                raise RuntimeError("Prefect API unreachable")
        code = "import sys; sys.exit(1)" if incarnation == 0 else RUNS
        return launcher.start(f"l{index}-{incarnation}", ["-c", code], {})

    lines: list[str] = []
    sup = Supervisor(start=start, restart_delay_s=0.0, max_restarts=3, log=lines.append)
    try:
        sup.launch(0)
        sup.handles()[0].wait(timeout=30)
        now = time.monotonic()
        assert sup.check(now) == []  # first attempt raised: logged, tried again a second later
        assert "failed (Prefect API unreachable)" in lines[-1]
        assert sup.check(now + 0.5) == []
        made = sup.check(now + 1.0)
        assert [(r.index, r.incarnation) for r in made] == [(0, 1)] and attempts == [1, 1]
        assert sup.slots[0].restarts == 1
    finally:
        for h in sup.handles():
            h.terminate(grace_s=5)


def test_a_kill_reaches_a_process_that_has_no_group_of_its_own_yet(tmp_path):
    """A forked rank or learner makes its own session first thing; killed before that (a chaos
    failure right after a start, on a loaded machine), the SIGKILL to its group found no group and
    was dropped, and the process ran on: the DDP group's restart then refused ("ranks [1] of
    incarnation 0 are still running")."""
    import subprocess
    import sys

    from diloco_async.runtime.procs import LocalProcess

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])  # in our group, not its own
    handle = LocalProcess(name="no-session-yet", proc=proc, log_path=tmp_path / "x.log")
    try:
        handle.kill()
        assert proc.wait(timeout=10) == -9
    finally:
        if proc.poll() is None:
            proc.kill()
