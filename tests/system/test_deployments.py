"""Prefect deployments end to end: a real Prefect server, one process worker per region pool,
the deployments of prefect.yaml, `prefect deployment run 'train/train'` with two learners
provisioned on two region pools (issue 6; bug case C15).

Everything runs as real processes on loopback; the fixture stops workers before the server
(a worker whose server is gone can hang on SIGTERM, see ecosystem notes).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from diloco_async.protocol.client import TOKEN_ENV, fetch_status

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
REGIONS = ("region-a", "region-b")
TERMINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}
RUN_SECRET = "operator-secret-of-the-deployments-test"  # in the pools' environment, as an operator sets it

TINY = ["model.n_layer=1", "model.d_model=32", "model.n_head=2", "model.context=32", "learners.count=2",
        "learners.batch_size=8", "synchronizer.num_fragments=3", "synchronizer.sync_every=12",
        "synchronizer.checkpoint_every_s=5", "tracking.poll_s=0.5", "run.launcher=deployments",
        "run.regions=['region-a', 'region-b']", "learners.restart_delay_s=1.0"]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: every process this module starts (server, workers) carries this variable in its environment, and so
#: does every process those start (flow runs, learners, synchronizers: Prefect's process worker and
#: the learner launcher pass their environment on), valued once per stack
STACK_ENV = "DILOCO_DEPLOYMENTS_TEST_STACK"


def _popen(argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    """A process in a session (and process group) of its own, SIGKILLed by the kernel if this
    process dies without stopping it (a crashed or killed pytest worker runs no finalizer)."""
    from diloco_async.runtime.parent_death import die_with_parent

    with open(log, "ab") as out:
        return subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True,
                                preexec_fn=lambda: die_with_parent(signal.SIGKILL))


def _stop(*procs: subprocess.Popen, grace_s: float = 15.0) -> None:
    """SIGTERM to the process groups of processes started by :func:`_popen`, all at once, wait for
    them together (``grace_s`` in all), then SIGKILL to each group, and reap the leaders."""
    def signal_group(proc: subprocess.Popen, sig: int) -> None:
        try:
            os.killpg(proc.pid, sig)  # the leader's pid is its group's id (start_new_session)
        except (ProcessLookupError, PermissionError):
            pass

    for proc in procs:
        if proc.poll() is None:
            signal_group(proc, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for proc in procs:
        signal_group(proc, signal.SIGKILL)  # what is left of the group, leader included
        proc.wait(timeout=30)


def _pids_with_env(name: str, value: str) -> list[int]:
    """Live processes other than this one whose environment holds ``name=value``."""
    needle = f"{name}={value}".encode()
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            if needle in (d / "environ").read_bytes().split(b"\0") and _alive(int(d.name)):
                found.append(int(d.name))
        except OSError:
            continue
    return found


def _stop_all_with_env(name: str, value: str, grace_s: float = 10.0) -> None:
    """SIGTERM to every live process whose environment holds ``name=value`` (in whatever session:
    Prefect starts flow runs, and the launcher learners, in sessions of their own), then SIGKILL to
    those left after ``grace_s``; returns once none is left (AssertionError after a minute)."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 60.0)):
        for pid in _pids_with_env(name, value):
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + wait_s
        while _pids_with_env(name, value) and time.monotonic() < deadline:
            time.sleep(0.2)
    left = _pids_with_env(name, value)
    assert not left, f"processes of the deployments test still alive after SIGKILL: {left}"


class PrefectStack:
    """`prefect server start` on a free port (temporary PREFECT_HOME, sqlite) plus one
    `prefect worker start` per region pool, and the deployments of prefect.yaml."""

    def __init__(self, home: Path) -> None:
        self.home = home
        self.port = _free_port()
        self.api_url = f"http://127.0.0.1:{self.port}/api"
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
        self.env.update(PREFECT_HOME=str(home), PREFECT_API_URL=self.api_url, PREFECT_SERVER_ANALYTICS_ENABLED="false",
                        PREFECT_UI_ENABLED="false", DO_NOT_TRACK="1", MLFLOW_DISABLE_TELEMETRY="true",
                        PREFECT_WORKER_QUERY_SECONDS="1", PREFECT_RUNNER_AUTO_INSTALL_DEPENDENCIES="false",
                        PREFECT_SERVER_SERVICES_CANCELLATION_CLEANUP_LOOP_SECONDS="5",
                        PREFECT_LOGGING_LEVEL="INFO", OMP_NUM_THREADS="1", **{TOKEN_ENV: RUN_SECRET})
        self.env[STACK_ENV] = self.marker = uuid.uuid4().hex
        self.server: subprocess.Popen | None = None
        self.workers: dict[str, subprocess.Popen] = {}

    def _cli(self, *args: str, timeout: float = 120.0) -> str:
        out = subprocess.run([str(BIN / "prefect"), "--no-prompt", *args], cwd=ROOT, env=self.env,
                             capture_output=True, text=True, timeout=timeout)
        assert out.returncode == 0, f"prefect {' '.join(args)} failed:\n{out.stdout}\n{out.stderr}"
        return out.stdout

    def start(self) -> None:
        self.server = _popen([str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port",
                              str(self.port)], self.env, self.home / "server.log")
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{self.api_url}/health", timeout=2) as resp:
                    if resp.read().strip() == b"true":
                        break
            except OSError:
                pass
            assert self.server.poll() is None, (self.home / "server.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "Prefect server not healthy after 120 s"
            time.sleep(0.3)
        from prefect.client.schemas.actions import WorkPoolCreate
        from prefect.workers.process import ProcessWorker

        with self.client() as c:  # what `prefect work-pool create region-a --type process` does
            for pool in REGIONS:
                c.create_work_pool(WorkPoolCreate(name=pool, type="process",
                                                  base_job_template=ProcessWorker.get_default_base_job_template()))
        for pool in REGIONS:  # workers start up while the deployments are created
            self.workers[pool] = _popen(
                [str(BIN / "prefect"), "worker", "start", "--pool", pool, "--name", f"worker-{pool}"],
                self.env, self.home / f"worker-{pool}.log")
        self._cli("deploy", "--prefect-file", "prefect.yaml", "--name", "train", "--name", "region-a",
                  "--name", "region-b")

    def stop(self) -> None:
        """Workers first (no new flow run starts), then every flow run, learner and synchronizer
        they left, then the server; each step runs even if the one before failed, and none
        returns while a process of this stack is alive."""
        try:
            _stop(*self.workers.values())
        finally:
            try:
                _stop_all_with_env(STACK_ENV, self.marker)  # the workers' flow runs and their children
            finally:
                if self.server is not None:
                    _stop(self.server)
                _stop_all_with_env(STACK_ENV, self.marker)

    def client(self):
        from prefect.client.orchestration import get_client
        from prefect.settings import PREFECT_API_URL, temporary_settings

        class _Ctx:
            def __enter__(s):
                s.settings = temporary_settings({PREFECT_API_URL: self.api_url})
                s.settings.__enter__()
                s.client = get_client(sync_client=True)
                return s.client.__enter__()

            def __exit__(s, *exc):
                s.client.__exit__(*exc)
                s.settings.__exit__(*exc)

        return _Ctx()

    def run_train(self, overrides: list[str]) -> str:
        """`prefect deployment run 'train/train'`; returns the flow run id."""
        out = self._cli("deployment", "run", "train/train", "--params", json.dumps({"overrides": overrides}))
        match = re.search(r"UUID:\s*([0-9a-f-]{36})", out)
        assert match, out
        return match.group(1)

    def flow_run(self, flow_run_id: str):
        with self.client() as c:
            return c.read_flow_run(flow_run_id)

    def learner_runs(self, train_run_id: str) -> list:
        from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags

        with self.client() as c:
            runs = c.read_flow_runs(flow_run_filter=FlowRunFilter(
                tags=FlowRunFilterTags(all_=[f"train-flow-run:{train_run_id}"])))
        return sorted(runs, key=lambda r: (r.parameters.get("index", 0), r.parameters.get("incarnation", 0)))

    def wait_state(self, flow_run_id: str, states: set[str], timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while True:
            fr = self.flow_run(flow_run_id)
            state = fr.state.type.value if fr.state else "?"
            if state in states:
                return state
            if time.monotonic() > deadline:
                raise AssertionError(f"flow run {fr.name} is {state} after {timeout_s}s, expected one of {states}\n"
                                     + self.logs_tail())
            time.sleep(0.5)

    def logs_tail(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-2500:]}"
                         for p in sorted(self.home.glob("worker-*.log")))


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[PrefectStack]:
    s = PrefectStack(tmp_path_factory.mktemp("prefect-home"))
    try:
        s.start()
        yield s
    finally:
        s.stop()


def _overrides(tmp: Path, *extra: str) -> list[str]:
    return [f"run.store=file://{tmp}/store", f"run.workdir={tmp}/runs", f"tracking.mlflow_uri=sqlite:///{tmp}/mlflow.db",
            f"tracking.artifact_location={tmp}/art", *TINY, *extra]


def _summary(tmp: Path) -> dict:
    """The run's summary.json, as the train flow logged it to MLflow (the only run of the experiment)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp}/mlflow.db")
    exp = client.get_experiment_by_name("diloco-async")
    parents = [r for r in client.search_runs([exp.experiment_id]) if "mlflow.parentRunId" not in r.data.tags]
    assert len(parents) == 1, [r.info.run_id for r in parents]
    path = client.download_artifacts(parents[0].info.run_id, "summary.json", str(tmp))
    return json.loads(Path(path).read_text())


def _pids_of_flow_run(flow_run_id: str) -> list[int]:
    """Live processes whose environment names this Prefect flow run (its flow-run process)."""
    return _pids_with_env("PREFECT__FLOW_RUN_ID", flow_run_id)


def _pids_with_arg(text: str) -> list[int]:
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            if text.encode() in (d / "cmdline").read_bytes() and _alive(int(d.name)):
                found.append(int(d.name))
        except OSError:
            continue
    return found


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _alive(pid: int) -> bool:
    """True unless the process is gone or a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _sync_status(sync_url: str) -> dict | None:
    try:
        return fetch_status(sync_url, timeout_s=2.0)
    except OSError:
        return None


def _wait_training(stack: PrefectStack, train_id: str, who: dict[str, int], timeout_s: float = 180.0) -> list:
    """Wait until the synchronizer reports each learner of ``who`` (id -> incarnation) live with
    steps made; returns the learner flow runs of the train flow run."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        runs = stack.learner_runs(train_id)
        if runs:
            st = _sync_status(runs[0].parameters["sync_url"]) or {"learners": {}}
            ok = [lid for lid, inc in who.items() if (v := st["learners"].get(lid)) and v["live"]
                  and v["incarnation"] == inc and v["step"] > 0]
            if len(ok) == len(who):
                return runs
        assert stack.flow_run(train_id).state.type.value not in TERMINAL, stack.logs_tail()
        time.sleep(0.3)
    raise AssertionError(f"learners {who} not training after {timeout_s}s\n{stack.logs_tail()}")


# Quorum K = 2 with a step budget: the global step g is the smaller of the two learners' steps,
# so the run ends only once both learners trained, however long their flow runs take to start.
BOTH = ["synchronizer.min_quorum=2", "budget.tokens=1000000000", "budget.wall_s=300"]


def test_killed_learner_flow_run_crashes_and_is_reprovisioned(stack, tmp_path):
    """The train deployment provisions learner i on region pool regions[i % 2]; a learner flow run
    SIGKILLed mid-run crashes and the train flow provisions its next incarnation on the same pool; the
    run completes at its step budget with exactly that one restart. (A run of its own without the
    kill was the same path up to the kill, so the provisioning claims are checked here; the cancel
    test checks that two learner flow runs, not more, train while nothing fails.)"""
    train_id = stack.run_train(_overrides(tmp_path, *BOTH, "budget.max_steps=400"))
    runs = _wait_training(stack, train_id, {"learner-0": 0})  # kill it before learner-1 even joined
    victim = runs[0]
    assert victim.parameters["learner_id"] == "learner-0"
    pids = _pids_of_flow_run(str(victim.id))
    assert len(pids) == 1, pids
    os.kill(pids[0], signal.SIGKILL)
    assert stack.wait_state(str(victim.id), TERMINAL, 60) == "CRASHED"
    # the train flow re-provisions learner-0 as incarnation 1, which rejoins and trains
    _wait_training(stack, train_id, {"learner-0": 1, "learner-1": 0})
    assert stack.wait_state(train_id, TERMINAL, 180) == "COMPLETED", stack.logs_tail()
    summary = _summary(tmp_path)
    assert summary["learner_restarts"] == 1
    assert summary["restarts"][0]["learner"] == "learner-0" and "CRASHED" in summary["restarts"][0]["reason"]
    final = {(r.parameters["learner_id"], r.parameters["incarnation"]): r.state.type.value
             for r in stack.learner_runs(train_id)}
    assert final == {("learner-0", 0): "CRASHED", ("learner-0", 1): "COMPLETED", ("learner-1", 0): "COMPLETED"}
    # learner i's flow runs (each incarnation) went to regions[i % 2], on that region's pool, as subflow
    # runs of the train flow run
    runs = stack.learner_runs(train_id)
    assert [(r.parameters["learner_id"], r.parameters["incarnation"], r.parameters["region"], r.work_pool_name)
            for r in runs] == [("learner-0", 0, "region-a", "region-a"), ("learner-0", 1, "region-a", "region-a"),
                               ("learner-1", 0, "region-b", "region-b")]
    assert all(r.parent_task_run_id is not None for r in runs)
    assert summary["launcher"] == "deployments" and summary["stop_reason"].startswith("step budget")
    # it trained: ~2.5 nats below the initial loss at this budget, so 0.5 is a floor, not a measurement
    assert summary["eval_loss_final"] < summary["eval_loss_initial"] - 0.5
    from mlflow.tracking import MlflowClient

    history = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db").get_metric_history(summary["mlflow_run_id"],
                                                                                  "flow/learner_restarts")
    assert [m.value for m in history] == [1.0]
    # the flow runs above ran in this host's checkout, which the deployments do not record
    # (diloco_async/flows/pull.py): their pull step is resolved on the worker, no path of this checkout in it
    with stack.client() as c:
        for name in ("train/train", "learner/region-a", "learner/region-b"):
            steps = c.read_deployment_by_name(name).pull_steps
            assert steps == [{"diloco_async.flows.pull.set_checkout_directory": {}}]
            assert str(ROOT) not in json.dumps(steps)


def test_cancelling_train_flow_run_leaves_no_process(stack, tmp_path):
    """C15: cancel the train flow run; its learner flow runs are cancelled, no process survives.

    The processes are gone within seconds. The flow runs reach Cancelled later: on cancellation
    Prefect 3.9.1's process worker first runs the flow's on_cancellation hooks in a separate
    process that imports the flow's module (``_workspace_runtime_bootstrap.py hook``), and only
    then proposes Cancelled. That short-lived hook process is Prefect's, not a learner's, and is
    not counted below.
    """
    train_id = stack.run_train(_overrides(tmp_path, "budget.tokens=1000000000", "budget.wall_s=300"))
    runs = _wait_training(stack, train_id, {"learner-0": 0, "learner-1": 0})
    assert len(runs) == 2
    run_id = runs[0].parameters["run_id"]
    flow_run_ids = [train_id, *(str(r.id) for r in runs)]
    before = {fid: _pids_of_flow_run(fid) for fid in flow_run_ids}
    sync_pids = _pids_with_arg(run_id)
    assert sync_pids and all(before.values()), (before, sync_pids)
    # while it runs: what the scheduled `checkpoint` deployment does, against the live synchronizer
    from diloco_async.flows.deployments import request_checkpoint
    from diloco_async.protocol.auth import learner_token
    from diloco_async.protocol.client import LEARNER_TOKEN_ENV

    learner_env = runs[0].job_variables["env"]  # a learner's flow run gets its own token, not the run secret
    assert TOKEN_ENV not in learner_env
    assert learner_env[LEARNER_TOKEN_ENV] == learner_token(RUN_SECRET, run_id, runs[0].parameters["learner_id"])
    sync_url, store_url = runs[0].parameters["sync_url"], runs[0].parameters["store_url"]
    ck = request_checkpoint(sync_url, store_url, RUN_SECRET)
    assert ck["run_id"] == runs[0].parameters["run_id"] and ck["verified_seq"] >= ck["seq"] >= 1
    with pytest.raises(RuntimeError, match="403"):  # a learner's token is no admin credential
        request_checkpoint(sync_url, store_url, learner_env[LEARNER_TOKEN_ENV])
    with pytest.raises(RuntimeError, match="401"):
        request_checkpoint(sync_url, store_url, "wrong-token")
    from prefect.states import Cancelling

    with stack.client() as c:  # what `prefect flow-run cancel <id>` does
        c.set_flow_run_state(train_id, Cancelling())
    t0 = time.monotonic()
    watched = set(sync_pids) | {p for pids in before.values() for p in pids}

    def left() -> dict:
        engines = [p for fid in flow_run_ids for p in _pids_of_flow_run(fid)
                   if b"_workspace_runtime_bootstrap.py\0hook" not in _cmdline(p)]
        return {"watched": sorted(p for p in watched if _alive(p)), "with run id": _pids_with_arg(run_id),
                "flow-run processes": sorted(set(engines))}

    deadline = t0 + 60
    while any((now := left()).values()):
        assert time.monotonic() < deadline, f"processes left 60 s after cancel: {now}"
        time.sleep(0.5)
    gone_s = time.monotonic() - t0
    for fid in flow_run_ids:
        assert stack.wait_state(fid, TERMINAL, 180) == "CANCELLED"
    print(f"cancel: every process of run {run_id} gone after {gone_s:.1f}s; "
          f"all flow runs Cancelled after {time.monotonic() - t0:.1f}s")
    assert not any(left().values())


def test_deployments_module_loads_no_torch():
    """A process worker imports diloco_async.flows.deployments again to run cancellation hooks: only Prefect and
    the light client/options modules may load at import time, never torch."""
    code = ("import sys, diloco_async.flows.deployments as d; from diloco_async.protocol import client; "
            "from diloco_async.storage import options; "
            "assert d.TOKEN_ENV is client.TOKEN_ENV and d.STORAGE_OPTIONS_ENV is options.STORAGE_OPTIONS_ENV; "
            "print(sorted(m for m in ('torch', 'diloco_async.sync', 'diloco_async.learner') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
