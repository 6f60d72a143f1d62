"""Start, signal and stop the M rank processes of the data-parallel baseline.

:class:`DdpGroup` runs one incarnation at a time: ``start(i)`` launches the ranks of incarnation
``i`` (a fresh rendezvous port each time) through :class:`diloco_async.runtime.procs.LocalProcessLauncher`,
each rank in its own process group. ``torchrun`` semantics are the caller's: when any rank dies,
kill the rest (:meth:`DdpGroup.kill_all`), wait until every slot is available again, then
``start(i + 1)``; the new incarnation resumes from the newest checkpoint.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diloco_async.config.resolved import write_resolved
from diloco_async.config.schema import Config
from diloco_async.runtime.procs import ForkedProcess, LocalProcess, LocalProcessLauncher
from diloco_async.storage.options import STORAGE_OPTIONS_ENV

__all__ = ["DdpGroup", "RankSchedule", "RankPlacement", "free_port"]

_REPO_ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class RankSchedule:
    """How the ranks of a :class:`DdpGroup` train and stop.

    Args:
        speeds: relative speed per rank (len M; None: the ranks take ``faults.speed_factors``
            of the config, 1.0 where unset).
        jitter: per-step jitter as a fraction of the step time (None: ``faults.step_jitter``).
        checkpoint_every_steps: rank 0 checkpoints every this many steps (0: only at the stop).
        stop_at_unix: every rank stops at this unix time (None: on SIGTERM or ``max_steps`` only).
        max_steps: the group stops when its step reaches this (None: no limit).
        gloo_timeout_s: timeout of one collective; a rank whose peer is gone exits after at most this.
        init_timeout_s: timeout of the rendezvous.
    """

    speeds: Sequence[float] | None = None
    jitter: float | None = None
    checkpoint_every_steps: int = 0
    stop_at_unix: float | None = None
    max_steps: int | None = None
    gloo_timeout_s: float = 30.0
    init_timeout_s: float = 120.0


@dataclass(frozen=True)
class RankPlacement:
    """Where the ranks of a :class:`DdpGroup` run, and their environment.

    Args:
        storage_options: fsspec options of the store (passed in the environment, never on the command line).
        env: extra environment of the ranks.
        master_addr: where rank 0 listens (loopback; in WAN runs rank 0's address in its region's
            namespace, and the launcher places each rank there). Off loopback the ranks pick their
            gloo interface from ``rank_env`` (``GLOO_SOCKET_IFNAME``), not ``lo``.
        rank_env: extra environment of single ranks (rank -> variables), after ``env``.
    """

    storage_options: dict[str, Any] | None = None
    env: dict[str, str] | None = None
    master_addr: str = "127.0.0.1"
    rank_env: dict[int, dict[str, str]] | None = None


class DdpGroup:
    """The rank processes of one data-parallel run.

    Args:
        cfg: the run's resolved config; written to ``workdir/resolved-config.json``, which every rank
            reads (:mod:`diloco_async.config.resolved`).
        world_size: M, the number of ranks.
        run_id: checkpoints go to ``{store}/{run_id}/ddp/checkpoints/``.
        store: object store root URL (absolute ``file://`` paths recommended: the ranks run in
            this process's working directory).
        workdir: ``timeline/ddp-rank-{r}.jsonl`` (appended over incarnations) and ``logs/`` go here.
        schedule: speeds, jitter, checkpoints, stop and timeouts of the ranks (:class:`RankSchedule`).
        placement: the ranks' store options, environment and master address (:class:`RankPlacement`).

    Raises:
        ValueError: ``world_size`` < 1 or ``schedule.speeds`` of another length.
    """

    def __init__(self, cfg: Config, world_size: int, run_id: str, store: str, workdir: str | os.PathLike,
                 schedule: RankSchedule = RankSchedule(), placement: RankPlacement = RankPlacement()) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        speeds = list(schedule.speeds) if schedule.speeds is not None else None
        if speeds is not None and len(speeds) != world_size:
            raise ValueError(f"speeds has {len(speeds)} entries for {world_size} ranks")
        self.cfg = cfg
        self.world_size = world_size
        self.run_id = run_id
        self.store = store
        self.workdir = Path(workdir)
        self.config_file = write_resolved(cfg, self.workdir)
        self.speeds = speeds
        self.jitter = schedule.jitter
        self.checkpoint_every_steps = schedule.checkpoint_every_steps
        self.stop_at_unix = schedule.stop_at_unix
        self.max_steps = schedule.max_steps
        self.gloo_timeout_s = schedule.gloo_timeout_s
        self.init_timeout_s = schedule.init_timeout_s
        self.launcher = LocalProcessLauncher(self.workdir / "logs")
        pythonpath = os.pathsep.join(p for p in (str(_REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)
        self.master_addr = placement.master_addr
        self.rank_env = dict(placement.rank_env or {})
        loopback = {"GLOO_SOCKET_IFNAME": "lo"} if self.master_addr.startswith("127.") else {}
        self.env = {"PYTHONPATH": pythonpath, **loopback,
                    STORAGE_OPTIONS_ENV: json.dumps(placement.storage_options or {}), **(placement.env or {})}
        self.handles: dict[int, LocalProcess | ForkedProcess] = {}
        self.incarnation: int | None = None
        self.port: int | None = None

    def timeline_path(self, rank: int) -> Path:
        """``workdir/timeline/ddp-rank-{rank}.jsonl``."""
        return self.workdir / "timeline" / f"ddp-rank-{rank}.jsonl"

    def argv(self, rank: int, incarnation: int, port: int) -> list[str]:
        """The command line (after the interpreter) of one rank."""
        argv = ["-m", "diloco_async.baselines.ddp", "--rank", str(rank), "--world-size", str(self.world_size),
                "--master-addr", self.master_addr, "--master-port", str(port), "--run-id", self.run_id,
                "--store", self.store,
                "--timeline", str(self.timeline_path(rank)), "--incarnation", str(incarnation),
                "--checkpoint-every-steps", str(self.checkpoint_every_steps),
                "--gloo-timeout-s", repr(float(self.gloo_timeout_s)),
                "--init-timeout-s", repr(float(self.init_timeout_s))]
        if self.speeds is not None:
            argv += ["--speed", repr(float(self.speeds[rank]))]
        if self.jitter is not None:
            argv += ["--jitter", repr(float(self.jitter))]
        argv += ["--resolved-config", str(self.config_file)]
        if self.stop_at_unix is not None:
            argv += ["--stop-at-unix", repr(float(self.stop_at_unix))]
        if self.max_steps is not None:
            argv += ["--max-steps", str(self.max_steps)]
        return argv

    def start(self, incarnation: int) -> None:
        """Launch the M ranks of ``incarnation`` on a fresh rendezvous port.

        Raises:
            RuntimeError: a rank of the previous incarnation is still running 15 s later.
        """
        deadline = time.monotonic() + 15.0  # killed ranks are reaped asynchronously (fork server): let them go
        running = [r for r, code in self.poll().items() if code is None]
        for r in running:  # a rank of the last incarnation still here is killed again, itself if need be
            self.handles[r].signal_group(signal.SIGKILL)
        while running and time.monotonic() < deadline:
            time.sleep(0.1)
            running = [r for r, code in self.poll().items() if code is None]
        if running:
            raise RuntimeError(f"ranks {running} of incarnation {self.incarnation} are still running")
        self.timeline_path(0).parent.mkdir(parents=True, exist_ok=True)
        port = free_port()
        self.handles = {r: self.launcher.start(f"ddp-rank-{r}", self.argv(r, incarnation, port),
                                               {**self.env, **self.rank_env.get(r, {})})
                        for r in range(self.world_size)}
        self.incarnation, self.port = incarnation, port

    def poll(self) -> dict[int, int | None]:
        """rank -> exit code, or None while it runs (empty before the first start)."""
        return {r: h.poll() for r, h in self.handles.items()}

    def _signal(self, rank: int, sig: int) -> None:
        h = self.handles[rank]
        if h.poll() is None:
            h.signal_group(sig)

    def kill_rank(self, rank: int) -> None:
        """SIGKILL one rank's process group and reap it. Raises KeyError: no such rank started."""
        self.handles[rank].kill()

    def kill_all(self) -> None:
        """SIGKILL every rank's process group (stopped ones too) and reap them."""
        for h in self.handles.values():
            h.kill()

    def stop_rank(self, rank: int) -> None:
        """Freeze one rank (SIGSTOP to its process group); its peers time out after ``gloo_timeout_s``."""
        self._signal(rank, signal.SIGSTOP)

    def cont_rank(self, rank: int) -> None:
        """Resume a frozen rank (SIGCONT to its process group)."""
        self._signal(rank, signal.SIGCONT)

    def terminate_all(self, grace_s: float = 30.0) -> dict[int, int | None]:
        """SIGTERM every rank (all stop after the same step; rank 0 writes a final checkpoint), wait
        up to ``grace_s`` in all, SIGKILL what is left. Returns rank -> exit code: 0 for a clean
        stop; -15 for a rank still importing (its handler not installed yet; it had done no step);
        4 for a rank whose peer died first."""
        for r in self.handles:
            self._signal(r, signal.SIGCONT)  # a frozen rank could not act on SIGTERM
            self._signal(r, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for h in self.handles.values():
            try:  # one SIGTERM only: a second could land while the rank's interpreter shuts down
                h.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            h.kill()  # what is left, and any descendant of a rank that exited
        return self.poll()

    def wait(self, timeout: float | None = None) -> dict[int, int | None]:
        """Wait until every rank has exited or ``timeout`` seconds have passed (None: forever).
        Returns rank -> exit code, None for a rank still running."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while any(code is None for code in self.poll().values()):
            if deadline is not None and time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        return self.poll()
