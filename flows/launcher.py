"""Launchers start the synchronizer and the learners as separate OS processes.

:class:`LocalProcessLauncher` (the embedded default) runs each one as a subprocess in its own
process group, with its output in a log file; stopping a handle signals the whole group, so no
descendant is left behind.

:class:`DeploymentLauncher` (``run.launcher = "deployments"``) starts each learner as a flow run
of a Prefect deployment (``learner/{region}``) on its region's work pool; its handle follows the
flow run's state, and stopping it cancels the flow run (the pool's worker then kills the flow
run's process group).

:class:`Supervisor` restarts learners that died while the run goes on, whatever launched them.
"""

from __future__ import annotations

import importlib
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Protocol

__all__ = ["ProcessHandle", "Launcher", "LocalProcessLauncher", "ForkServerLauncher", "ForkedProcess", "wait_for_ready_file", "FlowRunHandle",
           "DeploymentLauncher", "Supervisor", "Restart"]


class ProcessHandle(Protocol):
    name: str

    def poll(self) -> Optional[int]: ...
    def failure(self) -> Optional[str]: ...
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

    def failure(self) -> Optional[str]:
        """Why the process died (``"exit code N"``, ``"killed by SIGKILL"``), or None while it runs
        or after a clean exit (code 0)."""
        code = self.proc.poll()
        if code is None or code == 0:
            return None
        if code < 0:
            try:
                return f"killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"killed by signal {-code}"
        return f"exit code {code}"

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


# ---------------------------------------------------------------------------------------------
# Prefect deployments


_TERMINAL_CODES = {"COMPLETED": 0, "FAILED": 1, "CRASHED": 2, "CANCELLED": 3}


class FlowRunHandle:
    """A learner running as a Prefect flow run of a deployment, followed through the Prefect API.

    ``poll()`` maps the flow run's state to an exit code: None while it is scheduled, pending,
    running or cancelling; 0 Completed, 1 Failed, 2 Crashed, 3 Cancelled.
    """

    def __init__(self, name: str, flow_run_id: uuid.UUID, flow_run_name: str, deployment: str,
                 incarnation: int) -> None:
        self.name = name
        self.flow_run_id = flow_run_id
        self.flow_run_name = flow_run_name
        self.deployment = deployment
        self.incarnation = incarnation
        self.state_type: Optional[str] = "SCHEDULED"
        self.state_message: Optional[str] = None
        self._cancel_requested = False

    def refresh(self) -> Optional[str]:
        """Read the flow run's state from the Prefect API; returns the state type name.

        API errors leave the last known state (a transient API outage is not a learner failure).
        """
        from prefect.client.orchestration import get_client

        if self.state_type in _TERMINAL_CODES:
            return self.state_type
        try:
            with get_client(sync_client=True) as client:
                fr = client.read_flow_run(self.flow_run_id)
        except Exception:  # noqa: BLE001 - the API may be briefly unreachable; try again next poll
            return self.state_type
        if fr.state is not None:
            self.state_type = fr.state.type.value
            self.state_message = fr.state.message
        return self.state_type

    def poll(self) -> Optional[int]:
        return _TERMINAL_CODES.get(self.refresh() or "")

    def failure(self) -> Optional[str]:
        """``"flow run CRASHED: <message>"`` when the flow run crashed or failed, else None.

        A cancelled flow run is not a failure: somebody stopped it on purpose."""
        state = self.refresh()
        if state in ("CRASHED", "FAILED"):
            return f"flow run {self.flow_run_name} {state}: {self.state_message or ''}".strip()
        return None

    def request_cancel(self) -> None:
        """Ask Prefect to cancel the flow run (state Cancelling, as ``prefect flow-run cancel`` does).

        The work pool's worker then signals the flow run's process group. Does nothing once the
        flow run is terminal; API errors are swallowed (the Prefect server's cancellation
        clean-up cancels subflow runs of a cancelled parent anyway)."""
        from prefect.client.orchestration import get_client
        from prefect.states import Cancelling

        if self._cancel_requested or self.refresh() in _TERMINAL_CODES:
            return
        try:
            with get_client(sync_client=True) as client:
                client.set_flow_run_state(self.flow_run_id, Cancelling(message="the train flow run stopped"))
            self._cancel_requested = True
        except Exception:  # noqa: BLE001
            pass

    def terminate(self, grace_s: float = 10.0) -> Optional[int]:
        """Cancel the flow run and wait up to ``grace_s`` seconds for a terminal state.

        Returns the exit code of :meth:`poll`, None when it is still not terminal."""
        self.request_cancel()
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            code = self.poll()
            if code is not None:
                return code
            time.sleep(0.5)
        return self.poll()

    def kill(self) -> None:
        """Same as :meth:`terminate` with a short wait: a flow run is only reachable through its worker."""
        self.terminate(grace_s=2.0)


class DeploymentLauncher:
    """Start learners as flow runs of the ``learner`` deployments, one work pool per region.

    Each call of :meth:`start_learner` is one ``run_deployment(..., timeout=0)``: it returns as
    soon as the flow run exists (scheduled now); a worker of the region's pool picks it up. Called
    inside a flow run, the learner's flow run is linked to it as a subflow run.

    Args:
        deployment_template: ``"flow name/deployment name"`` with ``{region}`` (``learner/{region}``).
        regions: learner ``i`` runs in ``regions[i % len(regions)]``.
        env: environment for the learner's flow-run process (the run's token and storage
            options), passed as the ``env`` job variable.
        tags: Prefect tags of every learner flow run.
    """

    def __init__(self, deployment_template: str, regions: list[str], env: dict[str, str],
                 tags: Optional[list[str]] = None) -> None:
        if not regions:
            raise ValueError("DeploymentLauncher needs at least one region")
        self.deployment_template = deployment_template
        self.regions = list(regions)
        self.env = dict(env)
        self.tags = list(tags or [])

    def region_of(self, index: int) -> str:
        return self.regions[index % len(self.regions)]

    def start_learner(self, index: int, incarnation: int, parameters: dict[str, Any]) -> FlowRunHandle:
        """Create the learner's flow run on its region's pool and return its handle.

        Raises:
            RuntimeError: the deployment does not exist (run ``prefect deploy`` first) or the
                Prefect API refused the flow run.
        """
        from prefect.deployments import run_deployment
        from prefect.exceptions import ObjectNotFound

        region = self.region_of(index)
        name = f"learner-{index}"
        deployment = self.deployment_template.format(region=region)
        run_name = f"{name}-i{incarnation}-{parameters.get('run_id', '')}".rstrip("-")
        try:
            fr = run_deployment(deployment, parameters={**parameters, "region": region, "learner_id": name,
                                                        "index": index, "incarnation": incarnation},
                                timeout=0, flow_run_name=run_name, job_variables={"env": self.env},
                                tags=[*self.tags, name, f"region:{region}"])
        except ObjectNotFound:
            raise RuntimeError(f"Prefect deployment {deployment!r} not found: deploy it with "
                               "`prefect deploy --all` (see prefect.yaml)") from None
        return FlowRunHandle(name, fr.id, run_name, deployment, incarnation)


# ---------------------------------------------------------------------------------------------
# Supervision


@dataclass
class Restart:
    """One restart decision: learner ``index`` died (``reason``) and came back as ``incarnation``."""

    index: int
    incarnation: int
    reason: str
    at: float


@dataclass
class _Slot:
    handle: Any
    incarnation: int
    restarts: int = 0
    due: Optional[float] = None  # when a restart is due (monotonic seconds)
    reason: str = ""
    given_up: bool = False


@dataclass
class Supervisor:
    """Keeps every learner slot running while the synchronizer runs.

    A learner whose handle reports a failure (:meth:`ProcessHandle.failure`: a non-zero exit, a
    signal, a crashed or failed flow run) is started again after ``restart_delay_s`` seconds as
    the next incarnation (it rejoins from the store), at most ``max_restarts`` times per slot.
    A clean exit (code 0) or a cancelled flow run is never restarted.

    Args:
        start: ``start(index, incarnation) -> handle`` starts one learner.
        restart_delay_s: seconds between seeing a failure and the restart.
        max_restarts: restarts per slot; after that the slot stays down (logged once).
        log: called with one line per decision.
    """

    start: Callable[[int, int], Any]
    restart_delay_s: float = 1.0
    max_restarts: int = 10
    log: Callable[[str], None] = print
    slots: dict[int, _Slot] = field(default_factory=dict)
    restarts: list[Restart] = field(default_factory=list)

    def launch(self, index: int, incarnation: int = 0) -> Any:
        """Start learner ``index`` as ``incarnation`` and supervise it from now on."""
        handle = self.start(index, incarnation)
        self.slots[index] = _Slot(handle=handle, incarnation=incarnation)
        return handle

    def handles(self) -> list[Any]:
        return [s.handle for s in self.slots.values()]

    def next_due(self) -> Optional[float]:
        """The earliest pending restart time (monotonic seconds), or None."""
        due = [s.due for s in self.slots.values() if s.due is not None]
        return min(due) if due else None

    def check(self, now: Optional[float] = None) -> list[Restart]:
        """Look at every slot once: note new failures, start the restarts that are due.

        Returns the restarts made by this call. A restart whose ``start`` raises is logged and
        tried again ``max(restart_delay_s, 1)`` seconds later; nothing is raised.
        """
        now = time.monotonic() if now is None else now
        made: list[Restart] = []
        for index, slot in sorted(self.slots.items()):
            if slot.given_up:
                continue
            if slot.due is None:
                reason = slot.handle.failure()
                if reason is None:
                    continue
                if slot.restarts >= self.max_restarts:
                    slot.given_up = True
                    self.log(f"learner-{index} ({reason}) reached learners.max_restarts={self.max_restarts}; "
                             "not restarting it")
                    continue
                slot.due, slot.reason = now + self.restart_delay_s, reason
                self.log(f"learner-{index} incarnation {slot.incarnation} died ({reason}); restarting it "
                         f"in {self.restart_delay_s:.1f}s as incarnation {slot.incarnation + 1}")
            if slot.due is not None and now >= slot.due:
                incarnation = slot.incarnation + 1
                try:
                    handle = self.start(index, incarnation)
                except Exception as err:  # noqa: BLE001 - e.g. the Prefect API briefly unreachable
                    slot.due = now + max(self.restart_delay_s, 1.0)
                    self.log(f"restart of learner-{index} as incarnation {incarnation} failed ({err}); "
                             "trying again")
                    continue
                restart = Restart(index, incarnation, slot.reason, now)
                self.slots[index] = _Slot(handle=handle, incarnation=incarnation, restarts=slot.restarts + 1)
                self.restarts.append(restart)
                made.append(restart)
        return made


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
class ForkedProcess:
    """A process forked from the fork server (its own session / process group) and its log."""

    name: str
    proc: "multiprocessing.process.BaseProcess"
    log_path: Path

    @property
    def pid(self) -> int:
        return int(self.proc.pid or 0)

    def poll(self) -> Optional[int]:
        return self.proc.exitcode

    def wait(self, timeout: Optional[float] = None) -> int:
        """Wait for the exit code.

        Raises:
            subprocess.TimeoutExpired: still running after ``timeout`` seconds.
        """
        self.proc.join(timeout)
        if self.proc.exitcode is None:
            raise subprocess.TimeoutExpired(self.name, timeout or 0)
        return self.proc.exitcode

    def _signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def terminate(self, grace_s: float = 10.0) -> Optional[int]:
        """SIGTERM the process group, wait up to ``grace_s``, then SIGKILL it. Returns the exit code."""
        if self.proc.exitcode is None:
            self._signal_group(signal.SIGTERM)
            self.proc.join(grace_s)
            if self.proc.exitcode is None:
                self._signal_group(signal.SIGKILL)
                self.proc.join(10)
        self._signal_group(signal.SIGKILL)
        return self.proc.exitcode

    def kill(self) -> None:
        """SIGKILL the process group at once and reap the process."""
        self._signal_group(signal.SIGKILL)
        self.proc.join(10)


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
