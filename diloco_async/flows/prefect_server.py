"""The temporary Prefect server of one command, owned by that command.

With no ``PREFECT_API_URL`` Prefect starts a temporary API server (uvicorn, sqlite database in
``PREFECT_HOME``) as a child of the first process that needs a client. That child shares the
terminal's foreground process group, so a Ctrl-C reaches it as well as the command: the server dies
at once and the flow can no longer report its final state (websocket errors, a traceback, a flow
run left ``Running`` for good).

:func:`temporary_server` starts the same server itself, in its own session (the terminal's
SIGINT does not reach it), registers it as the one Prefect's clients use when no API URL is set,
and stops it only after the logs and events of the flow run (its final state among them) were
sent.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import closing, contextmanager
from pathlib import Path

import prefect
from prefect.events.worker import EventsWorker
from prefect.logging.handlers import APILogWorker
from prefect.server.api.server import SubprocessASGIServer
from prefect.settings import PREFECT_API_URL, get_current_settings

from diloco_async.runtime.parent_death import guarded_argv

__all__ = ["temporary_server", "OwnSessionServer", "drain_prefect_workers", "DRAIN_TIMEOUT_S", "STOP_GRACE_S"]

#: at most this long (s) to send the flow run's last logs and events before the server stops
DRAIN_TIMEOUT_S = 10.0
#: the server's time (s) to exit after SIGTERM before SIGKILL; by then the flow run's final state
#: is in its database (every write is committed before the API answers)
STOP_GRACE_S = 2.0


def _free_port() -> int:
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class OwnSessionServer(SubprocessASGIServer):
    """Prefect's temporary API server (``prefect.server.api.server:create_app`` under uvicorn,
    ephemeral mode, no UI), started in a session of its own, its output in ``log_path``.

    Prefect's own start logic (health polling, a new port when the one chosen is taken, the
    startup timeout ``PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS``) and stop (SIGTERM, 5 s,
    SIGKILL) are kept; only how the process starts differs.

    Args:
        port: TCP port on 127.0.0.1.
        log_path: the server's stdout and stderr.
    """

    def __init__(self, port: int | None = None, log_path: Path | None = None) -> None:
        # Prefect's clients call ``SubprocessASGIServer()`` and get this instance back (registered
        # under the key None), which runs ``__init__`` again without arguments: keep the first ones
        first = not hasattr(self, "_initialized")
        super().__init__(port)
        if first:
            self.log_path = Path(log_path or "prefect-temporary-server.log")

    def _run_uvicorn_command(self) -> subprocess.Popen:
        env = {
            **os.environ,
            "PREFECT_UI_ENABLED": "0",
            "PREFECT__SERVER_EPHEMERAL": "1",
            "PREFECT__SERVER_FINAL": "1",
            **get_current_settings().to_environment_variables(exclude_unset=True),
        }
        # SIGTERM when this command dies without stopping it (SIGKILL, the OOM killer): its own
        # session spares it the terminal's Ctrl-C, and would otherwise leave it running for good
        argv = [sys.executable, *guarded_argv("uvicorn", [
            "--app-dir", str(Path(prefect.__file__).parent.parent), "--factory", "prefect.server.api.server:create_app",
            "--host", "127.0.0.1", "--port", str(self.port), "--log-level", "error", "--lifespan", "on"])]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            return subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)

    def stop(self) -> None:
        """SIGTERM the server's process group, SIGKILL it after :data:`STOP_GRACE_S`, then
        Prefect's own bookkeeping of a stopped server."""
        proc = self.server_process
        if proc is not None and proc.poll() is None:
            _signal_group(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                _signal_group(proc.pid, signal.SIGKILL)
                proc.wait()
        super().stop()


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


def drain_prefect_workers(timeout_s: float = DRAIN_TIMEOUT_S) -> None:
    """Send the logs and events Prefect still holds (waits at most ``timeout_s`` for each)."""
    APILogWorker.drain_all(timeout=timeout_s)
    EventsWorker.drain_all(timeout=timeout_s)


@contextmanager
def temporary_server(log_path: Path) -> Iterator[OwnSessionServer | None]:
    """Own Prefect's temporary server for the length of the block, when no ``PREFECT_API_URL`` is
    set (yields None and does nothing otherwise: the configured server is used).

    On leaving the block (normally or by an exception) the logs and events of the flow runs are
    sent first, then the server is stopped.

    Raises:
        RuntimeError: the server did not answer ``/health`` within the startup timeout (the
            message names ``log_path``).
    """
    if PREFECT_API_URL.value():
        yield None
        return
    server = OwnSessionServer(_free_port(), log_path)
    previous = SubprocessASGIServer._instances.get(None)
    SubprocessASGIServer._instances[None] = server  # what Prefect's clients start when no API URL is set
    try:
        try:
            server.start()
        except RuntimeError as err:
            raise RuntimeError(f"{err} (server log: {log_path})") from None
        yield server
    finally:
        try:
            if server.running:
                drain_prefect_workers()
        finally:
            server.stop()
            if previous is not None:
                SubprocessASGIServer._instances[None] = previous
            else:
                SubprocessASGIServer._instances.pop(None, None)
