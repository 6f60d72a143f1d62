"""Launchers start the synchronizer and the learners as separate OS processes.

:class:`LocalProcessLauncher` (the embedded default) runs each one as a subprocess in its own
process group, with its output in a log file; stopping a handle signals the whole group, so no
descendant is left behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Protocol

__all__ = ["ProcessHandle", "Launcher", "LocalProcessLauncher", "wait_for_ready_file"]


class ProcessHandle(Protocol):
    name: str

    def poll(self) -> Optional[int]: ...
    def terminate(self, grace_s: float = 10.0) -> Optional[int]: ...
    def kill(self) -> None: ...


class Launcher(Protocol):
    def start(self, name: str, argv: list[str], env: dict[str, str]) -> ProcessHandle: ...


@dataclass
class LocalProcess:
    """A running subprocess (its own session / process group) and its log file."""

    name: str
    proc: subprocess.Popen
    log_path: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def poll(self) -> Optional[int]:
        return self.proc.poll()

    def wait(self, timeout: Optional[float] = None) -> int:
        """Wait for the process to exit and return its exit code.

        Raises:
            subprocess.TimeoutExpired: still running after ``timeout`` seconds.
        """
        return self.proc.wait(timeout=timeout)

    def _signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def terminate(self, grace_s: float = 10.0) -> Optional[int]:
        """SIGTERM the process group, wait up to ``grace_s``, then SIGKILL it. Returns the exit code."""
        if self.proc.poll() is None:
            self._signal_group(signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self._signal_group(signal.SIGKILL)
                self.proc.wait(timeout=10)
        self._signal_group(signal.SIGKILL)  # any descendant that outlived its parent
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL the process group at once (used by tests and chaos runs)."""
        self._signal_group(signal.SIGKILL)
        self.proc.wait(timeout=10)


class LocalProcessLauncher:
    """Start processes on this machine with ``sys.executable``.

    Args:
        log_dir: one ``{name}.log`` per process (stdout and stderr).
    """

    def __init__(self, log_dir: str | os.PathLike) -> None:
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)

    def start(self, name: str, argv: list[str], env: dict[str, str]) -> LocalProcess:
        log_path = self.log_dir / f"{name}.log"
        full_env = dict(os.environ)
        full_env.update(env)
        full_env.setdefault("OMP_NUM_THREADS", "1")
        full_env.setdefault("PYTHONUNBUFFERED", "1")
        with open(log_path, "ab") as log:
            proc = subprocess.Popen([sys.executable, *argv], stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env=full_env, start_new_session=True)
        return LocalProcess(name=name, proc=proc, log_path=log_path)


def wait_for_ready_file(path: Path, handle: ProcessHandle, timeout_s: float = 120.0) -> dict:
    """Wait until a process writes its ready file (JSON) and return it.

    Raises:
        RuntimeError: the process exited first.
        TimeoutError: nothing after ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists():
            return json.loads(path.read_text())
        code = handle.poll()
        if code is not None:
            raise RuntimeError(f"{handle.name} exited with code {code} before it was ready")
        time.sleep(0.1)
    raise TimeoutError(f"{handle.name} not ready after {timeout_s}s")
