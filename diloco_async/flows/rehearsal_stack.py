"""The machines of the multi-host rehearsal (docs/multi-host.md), emulated on one machine.

* **Network**: a :class:`~diloco_async.wan.netns.WanNet` (no shaping to speak of: 1 Gbit/s, not
  verified) with three "regions": ``host-a`` and ``host-b`` (the learner hosts) and ``sync`` (the
  host of the ``train`` flow run, and so of its synchronizer). The hub namespace holds the shared
  services: moto's S3 server (the store), a Prefect server and an MLflow tracking server.
* **Disks**: under the rehearsal's folder, one folder per machine (``hub``, ``host-a``, ``host-b``,
  ``sync``). A host has its own copy of the checkout, at a different path on each host
  (:data:`CHECKOUT_PATHS`), with its own ``data/``; its own ``HOME``, ``TMPDIR`` and
  ``PREFECT_HOME``. Its Prefect worker runs through :mod:`diloco_async.wan.hostns`: in its own
  mount namespace, where every other machine's folder is covered by an empty read-only tmpfs, in
  its own network namespace, with ``DILOCO_CHECKOUT`` and ``PYTHONPATH`` naming its own checkout.
* **Work pools**: ``region-a`` on host-a, ``region-b`` on host-b (the learner deployments of
  prefect.yaml), :data:`SYNC_POOL` on sync.

:class:`Rehearsal` builds all this (``__enter__``) and removes it (``__exit__``: workers, servers,
every process still carrying the rehearsal's marker, the namespaces; the mounts live only in the
workers' own mount namespaces and go with their last process).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

from diloco_async.wan.hostns import hostns_argv
from diloco_async.wan.launch import start_moto_server
from diloco_async.wan.netns import LinkSpec, WanNet, enter_netns

__all__ = ["HOSTS", "SYNC", "POOLS", "SYNC_POOL", "CHECKOUT_PATHS", "MARKER_ENV", "HOST_ENV", "S3_ENV",
           "Machine", "Rehearsal", "copy_checkout", "ProcessWatch"]

ROOT = Path(__file__).resolve().parents[2]  # the checkout: diloco_async/flows/ is two folders down
BIN = Path(sys.executable).parent
HOSTS = ("host-a", "host-b")
SYNC = "sync"
SYNC_POOL = "hosts-sync"
POOLS = {"host-a": "region-a", "host-b": "region-b", SYNC: SYNC_POOL}
#: each host keeps its checkout somewhere else (nothing may assume one path on every host)
CHECKOUT_PATHS = {"host-a": "checkout", "host-b": "opt/diloco-async", SYNC: "srv/checkout"}
MARKER_ENV = "DILOCO_REHEARSAL"  # every process of one rehearsal carries it (value: the rehearsal's id)
HOST_ENV = "DILOCO_REHEARSAL_HOST"  # and the machine it belongs to
S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_SESSION_TOKEN": "testing",
          "AWS_DEFAULT_REGION": "us-east-1"}
BUCKET = "rehearsal"
LINK_MBIT = 1000.0
SERVER_START_S = 180.0


def copy_checkout(src: Path, dest: Path) -> Path:
    """Copy the repository at ``src`` to ``dest`` as a fresh checkout would hold it: the files git
    tracks plus untracked files it does not ignore (``git ls-files``; without git, every file but
    ``.git``, ``.venv``, ``.local`` and caches), and ``data/`` (what ``make data`` put there)."""
    try:
        out = subprocess.run(["git", "-C", str(src), "ls-files", "-z", "-co", "--exclude-standard"],
                             capture_output=True, check=True, timeout=60).stdout
        names = [n for n in out.decode().split("\0") if n]
    except (OSError, subprocess.SubprocessError):
        skip = {".git", ".venv", ".local", "__pycache__", "data", ".ruff_cache", ".pytest_cache"}
        names = [str(p.relative_to(src)) for p in src.rglob("*")
                 if p.is_file() and not skip & set(p.relative_to(src).parts)]
    for name in names:
        if (src / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src / name, dest / name)
    data = (src / "data").resolve()
    if not (data / "shakespeare" / ".complete").is_file():
        raise FileNotFoundError(f"no corpus under {data}: run `make data` first")
    shutil.copytree(data / "shakespeare", dest / "data" / "shakespeare")
    return dest


@dataclass
class Machine:
    """One emulated machine: its folder, namespace, address and (for a host) checkout and worker."""

    name: str
    folder: Path
    ns: str = ""
    addr: str = ""
    checkout: Path | None = None
    worker: subprocess.Popen | None = None
    env: dict[str, str] = field(default_factory=dict)

    def ns_inodes(self) -> tuple[int, int]:
        """(mount, network) namespace inodes of this machine's worker."""
        assert self.worker is not None
        return (os.stat(f"/proc/{self.worker.pid}/ns/mnt").st_ino, os.stat(f"/proc/{self.worker.pid}/ns/net").st_ino)


def _free_port(addr: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((addr, 0))
        return int(s.getsockname()[1])


def _popen(argv: list[str], env: dict[str, str], log: Path, cwd: Path | None = None) -> subprocess.Popen:
    """A process in a session of its own, SIGKILLed by the kernel when this process dies first."""
    from diloco_async.runtime.parent_death import die_with_parent

    with open(log, "ab") as out:
        return subprocess.Popen(argv, cwd=cwd or ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True,
                                preexec_fn=lambda: die_with_parent(signal.SIGKILL))


def _wait_http(url: str, proc: subprocess.Popen, log: Path, ok: bytes) -> None:
    """Wait until ``url`` answers ``ok`` (RuntimeError with the log's tail if ``proc`` exits or
    :data:`SERVER_START_S` passes)."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    deadline = time.monotonic() + SERVER_START_S
    while True:
        try:
            with opener.open(url, timeout=2) as resp:
                if resp.read().strip() == ok:
                    return
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{url} did not answer (exit {proc.poll()}):\n{log.read_text(errors='replace')[-3000:]}")
        time.sleep(0.3)


def _pids_with(marker: str) -> list[int]:
    """Live processes (not zombies, not this one) whose environment holds ``MARKER_ENV=marker``."""
    needle = f"{MARKER_ENV}={marker}".encode()
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            if needle in (d / "environ").read_bytes().split(b"\0") and \
                    (d / "stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X"):
                found.append(int(d.name))
        except (OSError, IndexError):
            continue
    return found


def _read_env(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode(errors="replace").split("=", 1) for item in raw if b"=" in item)


class ProcessWatch:
    """Samples, every ``interval_s``, every process of the rehearsal (``MARKER_ENV``): its machine
    (``HOST_ENV``), mount and network namespace inodes, working directory, Prefect flow run and
    command. :attr:`seen` maps pid -> that record (the first sample of each process)."""

    def __init__(self, marker: str, interval_s: float = 0.5) -> None:
        self.marker = marker
        self.interval_s = interval_s
        self.seen: dict[int, dict] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rehearsal-watch", daemon=True)

    def sample(self) -> None:
        for pid in _pids_with(self.marker):
            if pid in self.seen:
                continue
            try:
                env = _read_env(pid)
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
                self.seen[pid] = {
                    "pid": pid, "host": env.get(HOST_ENV, ""), "flow_run_id": env.get("PREFECT__FLOW_RUN_ID", ""),
                    "mnt": os.stat(f"/proc/{pid}/ns/mnt").st_ino, "net": os.stat(f"/proc/{pid}/ns/net").st_ino,
                    "cwd": os.readlink(f"/proc/{pid}/cwd"),
                    "cmd": cmd.decode(errors="replace")[:160]}
            except OSError:
                continue  # it exited meanwhile

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def start(self) -> ProcessWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


class Rehearsal:
    """The hub, two learner hosts and the synchronizer's host (see the module docstring).

    Args:
        folder: an empty folder for every machine's disk (created).
        prefix: namespace prefix (``[a-z][a-z0-9]{0,5}``; :func:`diloco_async.wan.netns_core.cleanup` takes it).

    Attributes:
        machines: ``hub``, ``host-a``, ``host-b``, ``sync`` -> :class:`Machine`.
        marker: the value of :data:`MARKER_ENV` in every process of this rehearsal.
        prefect_api / mlflow_uri / s3_endpoint / store: the shared services, addressed from the hosts.
    """

    def __init__(self, folder: Path, prefix: str = "dlh") -> None:
        self.folder = Path(folder).resolve()
        self.prefix = prefix
        self.marker = uuid.uuid4().hex
        self.machines = {name: Machine(name, self.folder / name) for name in ("hub", *HOSTS, SYNC)}
        self.net: WanNet | None = None
        self.servers: list[subprocess.Popen] = []
        self.prefect_api = self.mlflow_uri = self.s3_endpoint = ""
        self.store = f"s3://{BUCKET}/runs"
        self._stack = ExitStack()

    @property
    def storage_options(self) -> dict:
        return {"client_kwargs": {"endpoint_url": self.s3_endpoint}}

    def __enter__(self) -> Rehearsal:
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _build(self) -> None:
        for m in self.machines.values():
            m.folder.mkdir(parents=True, exist_ok=False)
        for name in (*HOSTS, SYNC):
            m = self.machines[name]
            m.checkout = copy_checkout(ROOT, m.folder / CHECKOUT_PATHS[name])
            for sub in ("home", "tmp", "prefect"):
                (m.folder / sub).mkdir()
        links = [LinkSpec(name, LINK_MBIT, LINK_MBIT) for name in (*HOSTS, SYNC)]
        self.net = self._stack.enter_context(WanNet(links, prefix=self.prefix, verify=False))
        self.machines["hub"].ns, self.machines["hub"].addr = self.net.hub_ns, self.net.hub_addr
        for name in (*HOSTS, SYNC):
            rn = self.net.regions[name]
            self.machines[name].ns, self.machines[name].addr = rn.ns, rn.addr
        enter_netns(self.net.hub_ns)  # this process drives from the hub (main thread, before any other thread)
        os.environ.update(S3_ENV)
        self.s3_endpoint, stop_moto = start_moto_server(self.net)
        self._stack.callback(stop_moto)
        import fsspec

        fsspec.filesystem("s3", **self.storage_options).mkdir(BUCKET)
        self._start_servers()
        self._create_pools()
        for name in (*HOSTS, SYNC):
            self._start_worker(self.machines[name])

    def base_env(self) -> dict[str, str]:
        """What every process of the rehearsal gets: no Prefect or MLflow setting of the caller, the
        shared services' addresses, the store's credentials and options, the marker."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_", "DILOCO_"))}
        env.update(S3_ENV, PREFECT_API_URL=self.prefect_api, PREFECT_SERVER_ANALYTICS_ENABLED="false",
                   DO_NOT_TRACK="1", MLFLOW_DISABLE_TELEMETRY="true", OMP_NUM_THREADS="1",
                   PREFECT_WORKER_QUERY_SECONDS="1", PREFECT_RUNNER_AUTO_INSTALL_DEPENDENCIES="false",
                   PREFECT_LOGGING_LEVEL="INFO", PYTHONUNBUFFERED="1", MLFLOW_S3_ENDPOINT_URL=self.s3_endpoint,
                   DILOCO_STORAGE_OPTIONS=json.dumps(self.storage_options), **{MARKER_ENV: self.marker})
        return env

    def _start_servers(self) -> None:
        hub = self.machines["hub"]
        port = _free_port(hub.addr)
        self.prefect_api = f"http://{hub.addr}:{port}/api"
        # this process's Prefect client (run_deployment, reads): set before Prefect is first imported
        os.environ.update(PREFECT_API_URL=self.prefect_api, PREFECT_HOME=str(hub.folder / "prefect-client"))
        env = {**self.base_env(), "PREFECT_HOME": str(hub.folder / "prefect"), HOST_ENV: "hub",
               "PREFECT_UI_API_URL": self.prefect_api}
        log = hub.folder / "prefect-server.log"
        server = _popen([str(BIN / "prefect"), "server", "start", "--host", hub.addr, "--port", str(port)], env, log)
        self.servers.append(server)
        mport = _free_port(hub.addr)
        self.mlflow_uri = f"http://{hub.addr}:{mport}"
        mlog = hub.folder / "mlflow-server.log"
        mlflow = _popen([str(BIN / "mlflow"), "server", "--backend-store-uri", f"sqlite:///{hub.folder}/mlflow.db",
                         "--default-artifact-root", f"{self.store}/mlartifacts", "--no-serve-artifacts",
                         "--host", hub.addr, "--port", str(mport), "--workers", "1",
                         "--allowed-hosts", f"{hub.addr}:{mport}"],
                        {**env, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}, mlog)
        self.servers.append(mlflow)
        _wait_http(f"{self.prefect_api}/health", server, log, b"true")
        _wait_http(f"{self.mlflow_uri}/health", mlflow, mlog, b"OK")

    def client(self):
        """A synchronous Prefect client of the rehearsal's server (a context manager)."""
        from prefect.client.orchestration import get_client
        from prefect.settings import get_current_settings

        api = get_current_settings().api.url
        assert api == self.prefect_api, f"Prefect was imported before its server started (API {api})"
        return get_client(sync_client=True)

    def _create_pools(self) -> None:
        from prefect.client.schemas.actions import WorkPoolCreate
        from prefect.workers.process import ProcessWorker

        with self.client() as c:  # what `prefect work-pool create NAME --type process` does
            for pool in POOLS.values():
                c.create_work_pool(WorkPoolCreate(name=pool, type="process",
                                                  base_job_template=ProcessWorker.get_default_base_job_template()))

    def hidden_from(self, name: str) -> list[str]:
        """Every other machine's folder: what ``name``'s processes cannot see."""
        return [str(m.folder) for other, m in self.machines.items() if other != name]

    def _start_worker(self, m: Machine) -> None:
        assert m.checkout is not None
        m.env = {**self.base_env(), HOST_ENV: m.name, "HOME": str(m.folder / "home"), "TMPDIR": str(m.folder / "tmp"),
                 "PREFECT_HOME": str(m.folder / "prefect"), "DILOCO_CHECKOUT": str(m.checkout),
                 "PYTHONPATH": str(m.checkout)}
        program = [str(BIN / "prefect"), "worker", "start", "--pool", POOLS[m.name], "--name", f"worker-{m.name}"]
        argv = [sys.executable, *hostns_argv(m.ns, self.hidden_from(m.name), str(m.checkout), program)]
        m.worker = _popen(argv, m.env, m.folder / "worker.log")

    def deploy(self, name: str, pool: str | None = None) -> None:
        """``prefect deploy --name NAME [--pool POOL]`` from prefect.yaml (AssertionError with its output)."""
        argv = [str(BIN / "prefect"), "--no-prompt", "deploy", "--prefect-file", "prefect.yaml", "--name", name,
                *(["--pool", pool] if pool else [])]
        env = {**self.base_env(), "PREFECT_HOME": str(self.folder / "hub" / "prefect")}
        out = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        if out.returncode != 0:
            raise RuntimeError(f"prefect deploy --name {name} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")

    def in_host(self, name: str, argv: list[str], timeout_s: float = 300.0) -> subprocess.CompletedProcess:
        """Run ``argv`` inside the namespaces of ``name``'s worker (``nsenter``: its mounts, its
        network), in its checkout, with its environment."""
        m = self.machines[name]
        assert m.worker is not None and m.checkout is not None
        cmd = ["nsenter", "-t", str(m.worker.pid), "-m", "-n", f"--wd={m.checkout}", *argv]
        return subprocess.run(cmd, env=m.env, capture_output=True, text=True, timeout=timeout_s)

    def logs_tail(self, chars: int = 2500) -> str:
        logs = sorted(self.folder.glob("*/*.log"))
        return "\n".join(f"--- {p.relative_to(self.folder)}\n{p.read_text(errors='replace')[-chars:]}" for p in logs)

    def close(self) -> list[str]:
        """Stop the workers, every process of the rehearsal, the servers; remove the namespaces.
        Returns what the namespace teardown removed; never raises for one item that would not go."""
        workers = [m.worker for m in self.machines.values() if m.worker is not None]
        _stop_all(workers, 15.0)
        _stop_all([], 10.0, self.marker)
        _stop_all(self.servers, 15.0, self.marker)
        self._stack.close()  # moto, then the namespaces (and anything still inside them)
        return [f"pid {p}" for p in _pids_with(self.marker)]


def _stop_all(procs: list[subprocess.Popen], grace_s: float, marker: str | None = None) -> None:
    """SIGTERM to ``procs``' process groups (and every process carrying ``marker``), wait up to
    ``grace_s`` for them together, then SIGKILL what is left."""
    def targets() -> list[tuple[str, int]]:
        return [("group", p.pid) for p in procs if p.poll() is None] + \
            [("pid", pid) for pid in (_pids_with(marker) if marker else [])]

    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 30.0)):
        for kind, pid in targets():
            try:
                os.killpg(pid, sig) if kind == "group" else os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + wait_s
        while targets() and time.monotonic() < deadline:
            time.sleep(0.2)
    for p in procs:
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
