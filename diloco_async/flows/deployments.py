"""Prefect flows behind the deployments of ``prefect.yaml`` that are not ``train`` or ``resume``.

* ``learner`` — one learner of a run, in this flow run's own process (``diloco_async.learner``),
  or, with ``nproc_per_learner`` (x ``nnodes``) > 1, as a ``torchrun`` group that is a child of
  this flow run's process (``diloco_async.learner.group``). The ``train`` flow creates these
  with ``run.launcher = "deployments"``: one flow run of the ``learner/{region}`` deployment per
  learner, on the region's work pool. A Prefect work pool runs one flow run as one job (one
  pod): a multi-GPU learner fits in one pod; a multi-node learner needs one such flow run per
  node with the same ``rdzv_endpoint`` (Prefect has no gang scheduling).
* ``synchronizer`` — the synchronizer server of a run, in this flow run's own process.
* ``checkpoint`` — asks a running synchronizer for a checkpoint and verifies the newest one in
  the store (deployed with an interval schedule).

With ``run.launcher = "deployments"``, :class:`DeploymentLauncher` starts the ``train`` flow's
learners as such flow runs; a :class:`FlowRunHandle` follows one (``diloco_async.runtime.procs.ProcessHandle``).

Secrets never travel as flow parameters: credentials and the storage options
(``DILOCO_STORAGE_OPTIONS``, JSON) come from the flow run's environment, i.e. the ``env`` job
variable of the work pool or of the flow run. The synchronizer and checkpoint flows need the run's
secret (``DILOCO_RUN_TOKEN``); a learner flow needs only its own token (``DILOCO_LEARNER_TOKEN``,
see :mod:`diloco_async.protocol.auth`), which the ``train`` flow puts in each learner flow run's ``env``.

Why in-process: a learner or synchronizer started by these flows *is* the flow-run process. A
process work pool's worker runs each flow run as the leader of its own process group and, on
cancellation, signals that whole group (SIGTERM, then SIGKILL after its grace period), so
nothing can outlive the flow run; and a learner killed by a fault is a flow run that ends
*Crashed*, which is what the ``train`` flow's supervision looks for.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prefect import flow, get_run_logger
from pydantic import BaseModel, ConfigDict, Field

from diloco_async.protocol.auth import check_run_secret
from diloco_async.protocol.client import LEARNER_TOKEN_ENV, TOKEN_ENV
from diloco_async.storage.options import STORAGE_OPTIONS_ENV, storage_options_from_env  # noqa: F401  (STORAGE_OPTIONS_ENV: re-exported; no torch)

if TYPE_CHECKING:
    from diloco_async.config.schema import Config

# Only Prefect at import time: on cancellation the process worker imports this module again in a
# separate process to run on_cancellation hooks, and the flow run reads Cancelled only after that.
# torch and the rest load inside the flows.

__all__ = ["learner", "LearnerLaunch", "synchronizer", "checkpoint", "request_checkpoint", "SYNC_URL_ENV",
           "STORE_URL_ENV", "FlowRunHandle", "DeploymentLauncher"]

SYNC_URL_ENV = "DILOCO_SYNC_URL"
STORE_URL_ENV = "DILOCO_STORE_URL"


def _require_token(name: str = TOKEN_ENV) -> str:
    token = os.environ.get(name, "")
    if not token:
        raise ValueError(f"{name} is not set in this flow run's environment: pass it as the `env` job "
                         "variable of the flow run or of the work pool")
    return check_run_secret(token, name) if name == TOKEN_ENV else token


class LearnerLaunch(BaseModel):
    """How the ``learner`` flow starts its learner: the torchrun group (``learners.*`` of the recipe;
    1 x 1 is one process, the flow run's own) and the patience of its comms."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    nproc_per_learner: int = Field(1, ge=1, description="Ranks of the learner's group on each node.")
    nnodes: int = Field(1, ge=1, description="Nodes of the learner's group.")
    rdzv_endpoint: str = Field("", description="host:port of the group's rendezvous when nnodes > 1.")
    group_timeout_s: float = Field(300.0, gt=0, description="Seconds the group's ranks wait for one another.")
    give_up_after_s: float = Field(120.0, gt=0, description="Seconds without reaching the synchronizer before "
                                   "the learner gives up.")


@flow(name="learner", log_prints=True)
def learner(region: str, learner_id: str, index: int, sync_url: str, store_url: str, incarnation: int = 0,
            run_id: str | None = None, launch: LearnerLaunch | None = None) -> dict:
    """Run one learner until the synchronizer tells it to stop; returns what it did.

    The learner runs in this flow run's process, so cancelling the flow run (its worker signals
    the process group) or killing the process stops it; a learner killed by a fault leaves a
    Crashed flow run. With ``incarnation`` > 0 it rejoins from the store (its own inner-state
    checkpoint if any, else the newest published versions).

    Args:
        region: the region (work pool) this learner runs in; logged and tagged, not interpreted.
        learner_id: ``learner-{index}``.
        index: data shard index (0 .. M-1).
        sync_url: the synchronizer's base URL, e.g. ``http://10.0.0.5:8470``.
        store_url: the run's object-store root (``s3://bucket/prefix``, ``file:///...``).
        incarnation: 0 for the first start, +1 for each restart.
        run_id: the run id (for names and logs; the synchronizer is the authority).
        launch: the learner's torchrun group and patience (:class:`LearnerLaunch`; default: one
            process, this one, giving up after 120 s without the synchronizer).

    Raises:
        ValueError: ``DILOCO_LEARNER_TOKEN`` (this learner's own token) missing from the
            environment, or bad storage options.
        RuntimeError: the learner exited with a non-zero code (the flow run ends Failed).
    """
    from diloco_async.learner import main as learner_main

    logger = get_run_logger()
    _require_token(LEARNER_TOKEN_ENV)
    storage_options_from_env()
    logger.info("%s (incarnation %d) of run %s in region %s, pid %d: store %s and synchronizer %s", learner_id,
                incarnation, run_id or "?", region, os.getpid(), store_url, sync_url)
    launch = launch or LearnerLaunch()
    t0 = time.monotonic()
    args = ["--learner-id", learner_id, "--index", str(index), "--sync-url", sync_url, "--store", store_url,
            "--incarnation", str(incarnation), "--give-up-after-s", str(launch.give_up_after_s),
            "--group-timeout-s", str(launch.group_timeout_s)]
    if launch.nproc_per_learner * launch.nnodes > 1:
        from diloco_async.learner.group import torchrun_args
        from diloco_async.runtime.devices import LearnerDeviceFields

        group = LearnerDeviceFields(nproc_per_learner=launch.nproc_per_learner, nnodes=launch.nnodes,
                                    rdzv_endpoint=launch.rdzv_endpoint)
        argv = [sys.executable, *torchrun_args(group, f"{run_id}-{learner_id}-{incarnation}"), *args]
        logger.info("%s runs as a torchrun group: %s", learner_id, " ".join(argv[1:]))
        code = subprocess.run(argv, stdin=subprocess.DEVNULL, check=False).returncode
    else:
        code = learner_main(args)
    if code != 0:
        raise RuntimeError(f"{learner_id} (incarnation {incarnation}) exited with code {code}")
    wall = time.monotonic() - t0
    logger.info("%s finished cleanly after %.1fs", learner_id, wall)
    return {"learner_id": learner_id, "incarnation": incarnation, "region": region, "wall_s": wall,
            "pid": os.getpid()}


def _announce_when_listening(ready: Path, done: threading.Event, info: dict[str, Any], logger: Any) -> None:
    """Log the synchronizer's URL as soon as it writes its ready file (fills ``info`` with it)."""
    while not done.is_set():
        if ready.exists():
            info.update(json.loads(ready.read_text()))
            logger.info("synchronizer of run %s, shard %d of %d, listening on %s", info["run_id"], info.get("shard", 0),
                        info.get("shards", 1), info["url"])
            return
        time.sleep(0.2)


def _synchronizer_config(config: str | None, overrides: list[str], resume_url: str | None) -> Config | None:
    """The synchronizer's config, resolved once here: the recipe with ``overrides``; when resuming,
    :func:`diloco_async.flows.resolve.resume_config` (None: no recipe and no override, the stored config as it is)."""
    from diloco_async.config.schema import load_config
    from diloco_async.flows.resolve import resume_config

    if resume_url:
        return resume_config(resume_url, config, overrides, storage_options_from_env())
    return load_config(config, overrides)


@flow(name="synchronizer", log_prints=True)
def synchronizer(config: str | None = "configs/default.toml", overrides: list[str] | None = None,
                 run_id: str | None = None, resume_url: str | None = None,
                 ready_file: str | None = None, shard: int = 0) -> dict:
    """Run the synchronizer of one run (or one shard of it) in this flow run's process until its
    budget is spent.

    Learners reach it at ``http://{synchronizer.host}:{synchronizer.port}`` (set a routable host
    and a fixed port when learners run elsewhere); the URL is logged once it listens.
    Cancelling the flow run sends SIGTERM: the synchronizer stops cleanly (final checkpoint,
    learners told to stop).

    Args:
        config: TOML recipe (None: defaults); ignored for training fields when resuming.
        overrides: ``section.field=value`` strings.
        run_id: id of a new run (a fresh one when None and not resuming).
        resume_url: continue from ``{store}/{run_id}/checkpoints/{seq}`` or ``{store}/{run_id}``.
        ready_file: where to write ``{"url", "run_id", "pid", "epoch", "shard", "shards"}`` once
            listening (a temporary file when None).
        shard: with ``synchronizer.shards = S > 1``, which shard (0 .. S-1) this flow run serves: a
            flow run per shard, each in its own work pool or host, all given the same ``run_id``
            (or ``resume_url``); shard I listens on ``synchronizer.port + I`` (DESIGN §2.2).

    Raises:
        ValueError: ``DILOCO_RUN_TOKEN`` missing, or both ``run_id`` and ``resume_url`` given.
        RuntimeError: the synchronizer exited with a non-zero code.
    """
    from diloco_async.sync import main as server_main
    from diloco_async.sync import new_run_id

    logger = get_run_logger()
    _require_token()
    if run_id and resume_url:
        raise ValueError("give run_id (a new run) or resume_url (continue a run), not both")
    from diloco_async.config.resolved import write_resolved

    folder = Path(tempfile.mkdtemp(prefix="diloco-sync-"))
    cfg = _synchronizer_config(config, list(overrides or []), resume_url)
    args: list[str] = ["--resolved-config", str(write_resolved(cfg, folder))] if cfg is not None else []
    if resume_url:
        args += ["--resume", resume_url]
    else:
        run_id = run_id or new_run_id()
        args += ["--run-id", run_id]
    ready = Path(ready_file) if ready_file else folder / "ready.json"
    args += ["--ready-file", str(ready), "--shard", str(shard)]
    done = threading.Event()
    info: dict[str, Any] = {}
    threading.Thread(target=_announce_when_listening, args=(ready, done, info, logger), name="sync-ready",
                     daemon=True).start()
    try:
        code = server_main(args)
    finally:
        done.set()
    if code != 0:
        raise RuntimeError(f"synchronizer exited with code {code}")
    if not info and ready.exists():
        info.update(json.loads(ready.read_text()))
    return {"run_id": info.get("run_id", run_id), "url": info.get("url"), "epoch": info.get("epoch"),
            "shard": shard}


def request_checkpoint(sync_url: str, store_url: str, token: str, storage_options: dict | None = None,
                       timeout_s: float = 300.0) -> dict:
    """Ask a running synchronizer for a checkpoint now, then verify the newest one in the store.

    The run id comes from the synchronizer (``GET /health``); the checkpoint is loaded back with
    :func:`diloco_async.storage.checkpoint.latest_checkpoint`, which checks every object's size and sha256
    against the manifest.

    Args:
        sync_url: the synchronizer's base URL.
        store_url: the run's object-store root.
        token: the run's secret (a learner's token is refused: 403).
        storage_options: fsspec options of the store.
        timeout_s: seconds to wait for the synchronizer to write the checkpoint.

    Returns:
        ``{"run_id", "seq", "verified_seq", "versions"}``: the checkpoint written now and the
        newest one that verifies (equal unless a newer one appeared meanwhile).

    Raises:
        RuntimeError: the synchronizer refused or failed the checkpoint (e.g. a wrong token:
            ``diloco_async.protocol.client.ProtocolError`` with 401, or a learner's token: 403), or no
            checkpoint at least as new as the one it reported verifies in the store.
        ConnectionError: the synchronizer is not reachable.
    """
    from diloco_async.protocol.client import call_blocking
    from diloco_async.storage.checkpoint import latest_checkpoint
    from diloco_async.storage.store import ObjectStore

    run_id = call_blocking(sync_url, None, "health")["run_id"]
    result = call_blocking(sync_url, token, "checkpoint", request_timeout_s=timeout_s)
    if not result.get("ok"):
        raise RuntimeError(f"synchronizer of run {run_id} could not write a checkpoint: {result.get('reason')}")
    seq = int(result["seq"])
    ckpt = latest_checkpoint(ObjectStore(store_url, storage_options or {}), run_id)
    if ckpt is None or ckpt.seq < seq:
        raise RuntimeError(f"checkpoint {seq} of run {run_id} was reported written but the newest verified "
                           f"checkpoint in {store_url} is {None if ckpt is None else ckpt.seq}")
    return {"run_id": run_id, "seq": seq, "verified_seq": ckpt.seq, "versions": ckpt.manifest.get("versions")}


@flow(name="checkpoint", log_prints=True)
def checkpoint(sync_url: str | None = None, store_url: str | None = None, timeout_s: float = 300.0) -> dict:
    """Ask a running synchronizer for a checkpoint now and verify the newest one in the store
    (see :func:`request_checkpoint`); the token is ``$DILOCO_RUN_TOKEN``.

    Args:
        sync_url: the synchronizer's base URL; default: ``$DILOCO_SYNC_URL``.
        store_url: the run's object-store root; default: ``$DILOCO_STORE_URL``.
        timeout_s: seconds to wait for the synchronizer to write the checkpoint.

    Raises:
        ValueError: no synchronizer URL or store URL, or ``DILOCO_RUN_TOKEN`` missing.
        RuntimeError: the checkpoint failed or does not verify (see :func:`request_checkpoint`).
        ConnectionError: the synchronizer is not reachable.
    """
    logger = get_run_logger()
    sync_url = sync_url or os.environ.get(SYNC_URL_ENV, "")
    store_url = store_url or os.environ.get(STORE_URL_ENV, "")
    if not sync_url:
        raise ValueError(f"no synchronizer URL: pass sync_url or set {SYNC_URL_ENV}")
    if not store_url:
        raise ValueError(f"no store URL: pass store_url or set {STORE_URL_ENV}")
    out = request_checkpoint(sync_url, store_url, _require_token(), storage_options_from_env(), timeout_s)
    logger.info("run %s: checkpoint %d written and verified (newest verified: %d)", out["run_id"], out["seq"],
                out["verified_seq"])
    return out


# ---------------------------------------------------------------------------------------------
# Launch handles (run.launcher = "deployments")

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
        self.state_type: str | None = "SCHEDULED"
        self.state_message: str | None = None
        self._cancel_requested = False

    def refresh(self) -> str | None:
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

    def poll(self) -> int | None:
        return _TERMINAL_CODES.get(self.refresh() or "")

    def failure(self) -> str | None:
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

    def terminate(self, grace_s: float = 10.0) -> int | None:
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
        env: environment for every learner's flow-run process (storage options; no credential),
            passed as the ``env`` job variable; :meth:`start_learner` adds the learner's own token.
        tags: Prefect tags of every learner flow run.
    """

    def __init__(self, deployment_template: str, regions: list[str], env: dict[str, str],
                 tags: list[str] | None = None) -> None:
        if not regions:
            raise ValueError("DeploymentLauncher needs at least one region")
        self.deployment_template = deployment_template
        self.regions = list(regions)
        self.env = dict(env)
        self.tags = list(tags or [])

    def region_of(self, index: int) -> str:
        return self.regions[index % len(self.regions)]

    def start_learner(self, index: int, incarnation: int, parameters: dict[str, Any],
                      env: dict[str, str] | None = None) -> FlowRunHandle:
        """Create the learner's flow run on its region's pool and return its handle; ``env`` (e.g.
        the learner's own token) is added to the flow run's environment.

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
                                timeout=0, flow_run_name=run_name, job_variables={"env": {**self.env, **(env or {})}},
                                tags=[*self.tags, name, f"region:{region}"])
        except ObjectNotFound:
            raise RuntimeError(f"Prefect deployment {deployment!r} not found: deploy it with "
                               "`prefect deploy --all` (see prefect.yaml)") from None
        return FlowRunHandle(name, fr.id, run_name, deployment, incarnation)
