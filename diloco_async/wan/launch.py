"""Place a run's processes in the namespaces of a :class:`~diloco_async.wan.netns.WanNet`.

* :class:`NetnsLauncher` wraps any :class:`~diloco_async.runtime.procs.Launcher`: the process named
  ``name`` starts inside namespace ``ns_for(name)`` (through :mod:`diloco_async.wan.nsexec`, so a
  fork server keeps its speed: the fork enters the namespace, then runs the preloaded module).
* :func:`start_moto_server`: moto's S3 server in the hub namespace, on the hub's address.

How a run is placed: the synchronizer in the hub with ``synchronizer.host = net.hub_addr`` (the
URL it advertises is then ``http://{hub_addr}:{port}``, which every region reaches); the store is
``s3://bucket/...`` on the moto server of :func:`start_moto_server` (``run.storage_options``
``{"client_kwargs": {"endpoint_url": url}}``, credentials in ``AWS_*`` variables as for any moto);
learner ``i`` in the namespace of its region. The process that drives the run (status polls,
metrics, the store) must reach the hub too: it enters the hub with
:func:`~diloco_async.wan.netns.enter_netns` from its main thread before it starts other threads.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from diloco_async.runtime.procs import Launcher, ProcessHandle
from diloco_async.wan.netns import WanNet, call_in_netns
from diloco_async.wan.nsexec import nsexec_argv

__all__ = ["NetnsLauncher", "start_moto_server"]

MOTO_START_TIMEOUT_S = 60.0


class NetnsLauncher:
    """A :class:`~diloco_async.runtime.procs.Launcher` that starts each process inside a network namespace.

    Args:
        inner: the launcher that really starts processes (``LocalProcessLauncher``,
            ``ForkServerLauncher``); its handles are returned unchanged.
        ns_for: process name (``"synchronizer"``, ``"learner-3"``, ...) -> namespace, or None to
            start it in the caller's namespace.
        env_for: process name -> extra environment of that process (after the caller's ``env``),
            e.g. its link's added latency (:data:`~diloco_async.runtime.link_delay.LINK_DELAY_ENV`).

    ``start(name, argv, env)`` passes ``["-m", "diloco_async.wan.nsexec", ns, *argv]`` to the inner
    launcher, which runs ``python argv...`` inside ``ns`` (see :mod:`diloco_async.wan.nsexec`).
    """

    def __init__(self, inner: Launcher, ns_for: Callable[[str], str | None],
                 env_for: Callable[[str], dict[str, str]] = lambda name: {}) -> None:
        self.inner = inner
        self.ns_for = ns_for
        self.env_for = env_for

    def start(self, name: str, argv: list[str], env: dict[str, str]) -> ProcessHandle:
        env = {**env, **self.env_for(name)}
        ns = self.ns_for(name)
        if ns is None:
            return self.inner.start(name, argv, env)
        if not os.path.exists(os.path.join("/var/run/netns", ns)):
            raise FileNotFoundError(f"cannot start {name} in network namespace {ns}: no such namespace")
        return self.inner.start(name, nsexec_argv(ns, list(argv)), env)


def _free_port(addr: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((addr, 0))
        return int(s.getsockname()[1])


def _answers(url: str) -> bool:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never via a proxy
    try:
        with opener.open(f"{url}/moto-api/", timeout=1):
            return True
    except OSError:
        return False


def _stopper(proc: subprocess.Popen, log_path: Path) -> Callable[[], None]:
    def stop() -> None:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
            except ProcessLookupError:
                pass
        log_path.unlink(missing_ok=True)
    return stop


def start_moto_server(net: WanNet, port: int = 0) -> tuple[str, Callable[[], None]]:
    """Start moto's S3 server as a child process inside the hub namespace, listening on
    ``net.hub_addr`` (``port`` 0: a free one), and wait until it answers (from inside the hub).

    Returns:
        ``(endpoint_url, stop)``: ``http://{hub_addr}:{port}`` and a function that stops the server
        (SIGTERM to its process group, SIGKILL after 10 s). The namespace teardown also kills it.

    Raises:
        RuntimeError: it exited or did not answer within 60 s (the message has its log's tail).
    """
    if port == 0:
        port = call_in_netns(net.hub_ns, _free_port, net.hub_addr, timeout_s=10)
    url = f"http://{net.hub_addr}:{port}"
    fd, log_name = tempfile.mkstemp(prefix=f"moto-{net.name}-", suffix=".log")
    log_path = Path(log_name)
    code = "import sys; from moto.server import main; main(sys.argv[1:])"
    argv = [sys.executable, *nsexec_argv(net.hub_ns, ["-c", code, "-H", net.hub_addr, "-p", str(port)])]
    with os.fdopen(fd, "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    stop = _stopper(proc, log_path)
    deadline = time.monotonic() + MOTO_START_TIMEOUT_S
    while not call_in_netns(net.hub_ns, _answers, url, timeout_s=10):
        if proc.poll() is not None or time.monotonic() > deadline:
            tail = log_path.read_text(errors="replace")[-2000:]
            stop()
            raise RuntimeError(f"moto server in {net.hub_ns} did not start on {url} "
                               f"(exit {proc.poll()}): {tail}")
        time.sleep(0.2)
    return url, stop
