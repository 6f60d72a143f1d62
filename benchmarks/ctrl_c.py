"""How soon the prompt is back after Ctrl-C ("Ctrl-C stops a run cleanly within seconds", docs/running.md; the
bound is 10 s), measured over repeats. ``make bench-kill`` runs it after the kill matrix (benchmarks/kill_matrix.py,
``--ctrl-c-repeats``); ``python -m benchmarks.ctrl_c`` runs it alone.

Each repeat types Ctrl-C into real pseudo-terminals, as an operator does (the tty driver SIGINTs
the whole foreground process group), with no ``PREFECT_API_URL`` (Prefect's temporary server, as a
newcomer runs it):

* ``diloco-async train`` on a tiny recipe, Ctrl-C once it merges with both learners live;
* before that, ``diloco-async status URL --watch`` on that run, Ctrl-C once its tables are up;
* then ``diloco-async resume`` of the interrupted run, Ctrl-C once its synchronizer restored the
  checkpoint.

Each time: seconds from the Ctrl-C to the command's exit (the prompt back), and exit status 130
without a traceback. Bars: the median over the repeats of each <= 10 s (the slowest shown), every
stop exited 130 without a traceback. tests/system/test_stop.py checks what each stop leaves behind
(counters, checkpoints, flow runs, no process); the time is judged here.

Exit status 1 when a bar is missed, 0 otherwise.

Usage: python -m benchmarks.ctrl_c [--repeats 5] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import fcntl
import os
import pty
import re
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import termios
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from benchmarks.args import description, positive_int

__all__ = ["ANSI", "STOP_WITHIN_S", "Terminal", "command_env", "train_overrides", "CtrlCTimes", "measure_ctrl_c",
           "ctrl_c_bars", "main"]

ROOT = Path(__file__).resolve().parents[1]
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
STOP_WITHIN_S = 10.0  # the bound: the prompt back this soon after Ctrl-C
SYNC_URL = re.compile(r"synchronizer at (http://127\.0\.0\.1:\d+)")


class Terminal:
    """A command on a pseudo-terminal of its own (its controlling terminal, its process group in
    the foreground), with everything it prints collected by a thread."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 160, 0, 0))
        # setsid --ctty: a new session whose controlling terminal is this pty (stdin)
        self.proc = subprocess.Popen(["setsid", "--ctty", *argv], stdin=slave, stdout=slave, stderr=slave,
                                     env=env, cwd=ROOT)
        os.close(slave)
        self.master = master
        self._chunks: list[bytes] = []
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while True:
            try:
                data = os.read(self.master, 65536)
            except OSError:  # EIO: every process holding the terminal closed it
                return
            if not data:
                return
            with self._lock:
                self._chunks.append(data)

    def text(self) -> str:
        """Everything printed so far, without colours and cursor moves."""
        with self._lock:
            raw = b"".join(self._chunks)
        return ANSI.sub("", raw.decode(errors="replace")).replace("\r", "")

    def ctrl_c(self) -> float:
        """Type Ctrl-C; returns when (monotonic s)."""
        os.write(self.master, b"\x03")
        return time.monotonic()

    def stop(self, timeout_s: float = 120.0) -> tuple[int, float]:
        """Type Ctrl-C and wait for the command to exit: (exit status, seconds from the Ctrl-C to
        the exit). Raises subprocess.TimeoutExpired after ``timeout_s``."""
        sent = self.ctrl_c()
        code = self.proc.wait(timeout_s)
        took = time.monotonic() - sent
        self._reader.join(10)
        return code, took

    def processes(self) -> list[psutil.Process]:
        """The command and every process under it now."""
        try:
            me = psutil.Process(self.proc.pid)
            return [me, *me.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def close(self) -> None:
        if self.proc.poll() is None:
            for p in reversed(self.processes()):
                try:
                    p.kill()
                except psutil.NoSuchProcess:
                    pass
            self.proc.wait(30)
        self._reader.join(10)
        os.close(self.master)


def train_overrides(tmp: Path) -> list[str]:
    """``--set`` arguments of a small model that trains until stopped (budget far away), its store,
    process logs and MLflow database under ``tmp``."""
    sets = [f"run.store=file://{tmp}/store", f"run.workdir={tmp}/runs", "model.n_layer=1", "model.d_model=32",
            "model.n_head=2", "model.context=32", "learners.count=2", "learners.batch_size=8",
            "synchronizer.num_fragments=3", "synchronizer.sync_every=12", "synchronizer.checkpoint_every_s=5",
            "budget.tokens=50000000", "budget.wall_s=300", f"tracking.mlflow_uri=sqlite:///{tmp}/mlflow.db",
            f"tracking.artifact_location={tmp}/art", "tracking.poll_s=1", "tracking.system_metrics_s=0"]
    return [a for s in sets for a in ("--set", s)]


def command_env(prefect_home: Path, api_url: str | None = None) -> dict[str, str]:
    """The environment of a command in a terminal: no ``PREFECT_API*`` of ours unless ``api_url``
    (then that server; else Prefect's temporary one), its own ``PREFECT_HOME``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env.update(PREFECT_HOME=str(prefect_home), COLUMNS="160", TERM="xterm-256color")
    if api_url:
        env["PREFECT_API_URL"] = api_url
    return env


def _wait(pred, timeout_s: float, what: str, term: Terminal, interval_s: float = 0.2):
    """``pred()`` once truthy; RuntimeError naming ``what`` after ``timeout_s`` or when the command exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        if term.proc.poll() is not None:
            raise RuntimeError(f"exited {term.proc.returncode} before {what}:\n{term.text()[-3000:]}")
        time.sleep(interval_s)
    raise RuntimeError(f"timed out waiting for {what}:\n{term.text()[-3000:]}")


def _merging(url: str) -> bool:
    from diloco_async.protocol.client import fetch_status

    try:
        st = fetch_status(url, timeout_s=10.0)
    except OSError:
        return False
    return st["merges"] >= 2 and sum(1 for v in st["learners"].values() if v["live"]) == 2


@dataclass
class CtrlCTimes:
    """Seconds from Ctrl-C to exit of each command, one per repeat, and the stops that went wrong
    (an exit status other than 130, or a traceback)."""

    train_s: list[float] = field(default_factory=list)
    watch_s: list[float] = field(default_factory=list)
    resume_s: list[float] = field(default_factory=list)
    bad_stops: list[str] = field(default_factory=list)


def _stopped(term: Terminal, name: str, out: CtrlCTimes) -> float:
    code, took = term.stop()
    text = term.text()
    if code != 130 or "Traceback" in text:
        out.bad_stops.append(f"{name}: exit {code}\n{text[-2000:]}")
    return took


def _one_repeat(tmp: Path, out: CtrlCTimes) -> None:
    env = command_env(tmp / "prefect")
    cli = [sys.executable, "-m", "diloco_async.flows.cli"]
    train = Terminal([*cli, "train", *train_overrides(tmp)], env)
    try:
        url = _wait(lambda: SYNC_URL.search(train.text()), 300, "the synchronizer's URL", train).group(1)
        _wait(lambda: _merging(url), 180, "merges with both learners live", train, interval_s=0.5)
        watch = Terminal([*cli, "status", url, "--watch"], env)
        try:
            _wait(lambda: "open rounds" in watch.text(), 120, "the live tables", watch, interval_s=0.1)
            out.watch_s.append(_stopped(watch, "status --watch", out))
        finally:
            watch.close()
        out.train_s.append(_stopped(train, "train", out))
        text = train.text()
    finally:
        train.close()
    resume_url = re.search(r"diloco-async resume (\S+)", text)
    if resume_url is None:
        out.bad_stops.append(f"train: no resume command printed\n{text[-2000:]}")
        return
    run_id = resume_url.group(1).rsplit("/", 1)[1]
    log = tmp / "runs" / run_id / "logs" / "synchronizer.log"
    before = len(log.read_text()) if log.exists() else 0
    resume = Terminal([*cli, "resume", resume_url.group(1)], env)
    try:
        _wait(lambda: "resumed counts:" in log.read_text()[before:], 240, "the resumed synchronizer", resume)
        out.resume_s.append(_stopped(resume, "resume", out))
    finally:
        resume.close()


def measure_ctrl_c(repeats: int, workdir: Path) -> CtrlCTimes:
    """``repeats`` repeats (module docstring), each in a folder of its own under ``workdir``; a
    repeat that fails before its Ctrl-C is a bad stop (its times are missing from the medians)."""
    out = CtrlCTimes()
    for i in range(repeats):
        n = (len(out.train_s), len(out.watch_s), len(out.resume_s))
        try:
            _one_repeat(workdir / f"ctrl-c-{i}", out)
        except (RuntimeError, subprocess.TimeoutExpired) as err:
            out.bad_stops.append(f"repeat {i + 1}: {err}")
        took = [f"{name} {values[-1]:.1f} s" if len(values) > k else f"{name} -"
                for name, values, k in zip(("train", "status --watch", "resume"),
                                           (out.train_s, out.watch_s, out.resume_s), n, strict=True)]
        print(f"Ctrl-C repeat {i + 1}/{repeats}: " + ", ".join(took), flush=True)
    return out


def ctrl_c_bars(times: CtrlCTimes, repeats: int) -> list[tuple[str, float, str, bool]]:
    """``(figure, value, goal, ok)`` rows, as benchmarks/fuzz.py's ``print_bars`` prints them."""
    rows = []
    for name, values in (("train", times.train_s), ("status --watch", times.watch_s), ("resume", times.resume_s)):
        median = statistics.median(values) if values else -1.0
        rows.append((f"Ctrl-C on {name} -> prompt, median of {len(values)} (s)", median, f"<= {STOP_WITHIN_S:g}",
                     len(values) == repeats and median <= STOP_WITHIN_S))
        rows.append((f"Ctrl-C on {name} -> prompt, slowest (s)", max(values, default=-1.0), "shown", True))
    rows.append(("Ctrl-C stops not exiting 130 without a traceback", len(times.bad_stops), "== 0",
                 not times.bad_stops))
    return rows


def main(argv: list[str] | None = None) -> int:
    from benchmarks.fuzz import print_bars

    ap = argparse.ArgumentParser(prog="python -m benchmarks.ctrl_c", description=description(__doc__))
    ap.add_argument("--repeats", type=positive_int, default=5)
    ap.add_argument("--workdir", default=None, help="stores and logs (default: a temporary folder, removed)")
    args = ap.parse_args(argv)
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="bench-ctrl-c-"))
    try:
        times = measure_ctrl_c(args.repeats, workdir)
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    for stop in times.bad_stops:
        print(stop)
    return 0 if print_bars(ctrl_c_bars(times, args.repeats)) else 1


if __name__ == "__main__":
    sys.exit(main())
