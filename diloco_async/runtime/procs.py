"""Start, signal and stop the processes of a run (the synchronizer, learners, DDP ranks) on this
machine.

Credentials are never inherited: a child gets ``DILOCO_RUN_TOKEN`` or ``DILOCO_LEARNER_TOKEN``
only when the caller passes it in ``env`` (the run secret goes to the synchronizer alone, each
learner gets only its own token).

Every process started here leads its own session and process group, with its output in
``{log_dir}/{name}.log``; signalling a handle signals the whole group, so no descendant is left
behind. :class:`LocalProcessLauncher` runs ``python argv...`` as a subprocess;
:class:`ForkServerLauncher` forks ``-m module`` entry points from a server process that has
already imported them (a restart then costs a fork, not seconds of imports). Launchers that
start processes elsewhere (Prefect deployments: ``diloco_async.flows.deployments.DeploymentLauncher``) give
handles with the same :class:`ProcessHandle` surface.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from diloco_async.protocol.client import LEARNER_TOKEN_ENV, TOKEN_ENV
from diloco_async.protocol.tls import CERT_ENV, KEY_ENV

__all__ = ["ProcessHandle", "Launcher", "LocalProcess", "LocalProcessLauncher", "ForkedProcess",
           "ForkServerLauncher", "stop_process", "wait_for_ready_file"]


_NOT_INHERITED = (TOKEN_ENV, LEARNER_TOKEN_ENV, CERT_ENV, KEY_ENV)  # reach a child only through its ``env``


def _inherited(environ: dict[str, str]) -> dict[str, str]:
    """``environ`` without the credentials of :data:`_NOT_INHERITED`."""
    return {k: v for k, v in environ.items() if k not in _NOT_INHERITED}


class ProcessHandle(Protocol):
    """What supervision needs of a started learner, wherever it runs."""

    name: str

    def poll(self) -> int | None: ...
    def failure(self) -> str | None: ...
    def terminate(self, grace_s: float = 10.0) -> int | None: ...
    def kill(self) -> None: ...


class Launcher(Protocol):
    def start(self, name: str, argv: list[str], env: dict[str, str]) -> ProcessHandle: ...


class _GroupLeader:
    """A child process that leads its own process group; subclasses say how to poll and wait."""

    name: str
    log_path: Path

    @property
    def pid(self) -> int:
        raise NotImplementedError

    def poll(self) -> int | None:
        raise NotImplementedError

    def wait(self, timeout: float | None = None) -> int:
        raise NotImplementedError

    def failure(self) -> str | None:
        """Why the process died (``"exit code N"``, ``"killed by SIGKILL"``), or None while it runs
        or after a clean exit (code 0)."""
        code = self.poll()
        if code is None or code == 0:
            return None
        if code < 0:
            try:
                return f"killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"killed by signal {-code}"
        return f"exit code {code}"

    def signal_group(self, sig: int) -> None:
        """Send ``sig`` to the process group; nothing when the process and its group are gone. A
        process that has no group of its own yet (forked, not yet past its ``setsid``: a kill right
        after a start on a loaded machine) gets ``sig`` itself: the group's signal missed it."""
        try:
            os.killpg(self.pid, sig)
            return
        except PermissionError:
            return
        except ProcessLookupError:
            pass
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(self.pid, sig)

    def terminate(self, grace_s: float = 10.0) -> int | None:
        """SIGTERM the process group, wait up to ``grace_s``, then SIGKILL it. Returns the exit code.

        Raises:
            subprocess.TimeoutExpired: still running 10 s after the SIGKILL.
        """
        if self.poll() is None:
            self.signal_group(signal.SIGTERM)
            try:
                self.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self.signal_group(signal.SIGKILL)
                self.wait(timeout=10)
        self.signal_group(signal.SIGKILL)  # any descendant that outlived its parent
        return self.poll()

    def kill(self) -> None:
        """SIGKILL the process group at once and reap the process (waits up to 10 s)."""
        self.signal_group(signal.SIGKILL)
        try:
            self.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


@dataclass
class LocalProcess(_GroupLeader):
    """A running subprocess (its own session / process group) and its log file."""

    name: str
    proc: subprocess.Popen
    log_path: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def poll(self) -> int | None:
        return self.proc.poll()

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the process to exit and return its exit code.

        Raises:
            subprocess.TimeoutExpired: still running after ``timeout`` seconds.
        """
        return self.proc.wait(timeout=timeout)


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
        full_env = _inherited(dict(os.environ))
        full_env.update(env)
        full_env.setdefault("OMP_NUM_THREADS", "1")
        full_env.setdefault("PYTHONUNBUFFERED", "1")
        with open(log_path, "ab") as log:
            proc = subprocess.Popen([sys.executable, *argv], stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env=full_env, start_new_session=True)
        return LocalProcess(name=name, proc=proc, log_path=log_path)


def stop_process(proc: subprocess.Popen, grace_s: float = 10.0) -> int | None:
    """SIGTERM one process (not its group), wait up to ``grace_s`` s, then SIGKILL and reap it.
    Returns its exit code; nothing happens to a process that already exited."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


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


def _forked_main(module: str, args: list[str], env: dict[str, str], log_path: str) -> None:
    """Body of a process forked by :class:`ForkServerLauncher`: own session, output to the log,
    the given environment, then ``module.main(args)``; exits with its return code."""
    os.setsid()
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    for name in _NOT_INHERITED:
        os.environ.pop(name, None)
    os.environ.update(env)
    sys.argv = [module, *args]
    code = 1
    try:
        code = int(importlib.import_module(module).main(args) or 0)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


@dataclass
class ForkedProcess(_GroupLeader):
    """A process forked from the fork server (its own session / process group) and its log."""

    name: str
    proc: multiprocessing.process.BaseProcess
    log_path: Path

    @property
    def pid(self) -> int:
        return int(self.proc.pid or 0)

    def poll(self) -> int | None:
        return self.proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the exit code.

        Raises:
            subprocess.TimeoutExpired: still running after ``timeout`` seconds.
        """
        self.proc.join(timeout)
        if self.proc.exitcode is None:
            raise subprocess.TimeoutExpired(self.name, timeout or 0)
        return self.proc.exitcode


class ForkServerLauncher:
    """Start ``python -m module ...`` entry points as forks of a server process that has already
    imported ``preload`` (``multiprocessing``'s forkserver): a start then costs a fork instead of
    seconds of imports, as on a machine whose runtime is warm. Each child gets its own session
    (killpg reaches it and its descendants) and a log file, like :class:`LocalProcessLauncher`.

    Args:
        log_dir: one ``{name}.log`` per process.
        preload: modules the fork server imports once (e.g. ``diloco_async.learner``).

    Raises:
        ValueError (from :meth:`start`): ``argv`` is not ``["-m", module, ...]``.
    """

    def __init__(self, log_dir: str | os.PathLike, preload: list[str]) -> None:
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.ctx = multiprocessing.get_context("forkserver")
        self.ctx.set_forkserver_preload(list(preload))

    def start(self, name: str, argv: list[str], env: dict[str, str]) -> ForkedProcess:
        if len(argv) < 2 or argv[0] != "-m":
            raise ValueError(f"ForkServerLauncher starts '-m module ...' entry points, got {argv[:2]}")
        log_path = self.log_dir / f"{name}.log"
        full_env = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **env}
        proc = self.ctx.Process(target=_forked_main, args=(argv[1], list(argv[2:]), full_env, str(log_path)),
                                name=name, daemon=False)
        proc.start()
        return ForkedProcess(name=name, proc=proc, log_path=log_path)
