"""Prefect flows behind the deployments of ``prefect.yaml`` that are not ``train`` or ``resume``.

* ``learner`` — one learner of a run, in this flow run's own process (``diloco_async.learner``).
  The ``train`` flow creates these with ``run.launcher = "deployments"``: one flow run of the
  ``learner/{region}`` deployment per learner, on the region's work pool.
* ``synchronizer`` — the synchronizer server of a run, in this flow run's own process.
* ``checkpoint`` — asks a running synchronizer for a checkpoint and verifies the newest one in
  the store (deployed with an interval schedule).

Secrets never travel as flow parameters: the run's bearer token (``DILOCO_RUN_TOKEN``) and the
storage options (``DILOCO_STORAGE_OPTIONS``, JSON) come from the flow run's environment, i.e. the
``env`` job variable of the work pool or of the flow run.

Why in-process: a learner or synchronizer started by these flows *is* the flow-run process. A
process work pool's worker runs each flow run as the leader of its own process group and, on
cancellation, signals that whole group (SIGTERM, then SIGKILL after its grace period), so
nothing can outlive the flow run; and a learner killed by a fault is a flow run that ends
*Crashed*, which is what the ``train`` flow's supervision looks for.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Optional

from prefect import flow, get_run_logger

# Only Prefect at import time: on cancellation the process worker imports this module again in a
# separate process to run on_cancellation hooks, and the flow run reads Cancelled only after that.
# torch and the rest load inside the flows.
TOKEN_ENV = "DILOCO_RUN_TOKEN"  # = diloco_async.server.TOKEN_ENV
STORAGE_OPTIONS_ENV = "DILOCO_STORAGE_OPTIONS"  # = diloco_async.server.STORAGE_OPTIONS_ENV

__all__ = ["learner", "synchronizer", "checkpoint", "request_checkpoint", "SYNC_URL_ENV", "STORE_URL_ENV"]

SYNC_URL_ENV = "DILOCO_SYNC_URL"
STORE_URL_ENV = "DILOCO_STORE_URL"


def _require_token() -> str:
    token = os.environ.get(TOKEN_ENV, "")
    if not token:
        raise ValueError(f"{TOKEN_ENV} is not set in this flow run's environment: pass it as the `env` job "
                         "variable of the flow run or of the work pool")
    return token


def _storage_options() -> dict[str, Any]:
    try:
        options = json.loads(os.environ.get(STORAGE_OPTIONS_ENV, "{}") or "{}")
    except json.JSONDecodeError as err:
        raise ValueError(f"{STORAGE_OPTIONS_ENV} is not valid JSON: {err}") from None
    if not isinstance(options, dict):
        raise ValueError(f"{STORAGE_OPTIONS_ENV} must be a JSON object")
    return options


@flow(name="learner", log_prints=True)
def learner(region: str, learner_id: str, index: int, sync_url: str, store_url: str, incarnation: int = 0,
            run_id: Optional[str] = None, give_up_after_s: float = 120.0) -> dict:
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
        give_up_after_s: seconds without reaching the synchronizer before the learner gives up.

    Raises:
        ValueError: ``DILOCO_RUN_TOKEN`` missing from the environment, or bad storage options.
        RuntimeError: the learner exited with a non-zero code (the flow run ends Failed).
    """
    from diloco_async.learner import main as learner_main

    logger = get_run_logger()
    _require_token()
    _storage_options()
    logger.info("%s (incarnation %d) of run %s in region %s: pid %d, synchronizer %s, store %s", learner_id,
                incarnation, run_id or "?", region, os.getpid(), sync_url, store_url)
    t0 = time.monotonic()
    code = learner_main(["--learner-id", learner_id, "--index", str(index), "--sync-url", sync_url,
                         "--store", store_url, "--incarnation", str(incarnation),
                         "--give-up-after-s", str(give_up_after_s)])
    if code != 0:
        raise RuntimeError(f"{learner_id} (incarnation {incarnation}) exited with code {code}")
    wall = time.monotonic() - t0
    logger.info("%s finished cleanly after %.1fs", learner_id, wall)
    return {"learner_id": learner_id, "incarnation": incarnation, "region": region, "wall_s": wall,
            "pid": os.getpid()}


@flow(name="synchronizer", log_prints=True)
def synchronizer(config: Optional[str] = "configs/default.toml", overrides: Optional[list[str]] = None,
                 run_id: Optional[str] = None, resume_url: Optional[str] = None,
                 ready_file: Optional[str] = None) -> dict:
    """Run the synchronizer of one run in this flow run's process until its budget is spent.

    Learners reach it at ``http://{synchronizer.host}:{synchronizer.port}`` (set a routable host
    and a fixed port when learners run elsewhere); the URL is logged once it listens.
    Cancelling the flow run sends SIGTERM: the synchronizer stops cleanly (final checkpoint,
    learners told to stop).

    Args:
        config: TOML recipe (None: defaults); ignored for training fields when resuming.
        overrides: ``section.field=value`` strings.
        run_id: id of a new run (a fresh one when None and not resuming).
        resume_url: continue from ``{store}/{run_id}/checkpoints/{seq}`` or ``{store}/{run_id}``.
        ready_file: where to write ``{"url", "run_id", "pid", "epoch"}`` once listening
            (a temporary file when None).

    Raises:
        ValueError: ``DILOCO_RUN_TOKEN`` missing, or both ``run_id`` and ``resume_url`` given.
        RuntimeError: the synchronizer exited with a non-zero code.
    """
    from diloco_async.server import main as server_main
    from diloco_async.synchronizer import new_run_id

    logger = get_run_logger()
    _require_token()
    if run_id and resume_url:
        raise ValueError("give run_id (a new run) or resume_url (continue a run), not both")
    args: list[str] = ["--config", config] if config else []
    for item in overrides or []:
        args += ["--set", item]
    if resume_url:
        args += ["--resume", resume_url]
    else:
        run_id = run_id or new_run_id()
        args += ["--run-id", run_id]
    ready = Path(ready_file) if ready_file else Path(tempfile.mkdtemp(prefix="diloco-sync-")) / "ready.json"
    args += ["--ready-file", str(ready)]
    done = threading.Event()
    info: dict[str, Any] = {}

    def announce() -> None:  # log the URL as soon as the server listens
        while not done.is_set():
            if ready.exists():
                info.update(json.loads(ready.read_text()))
                logger.info("synchronizer of run %s listening on %s (pid %d)", info["run_id"], info["url"], info["pid"])
                return
            time.sleep(0.2)

    watcher = threading.Thread(target=announce, name="sync-ready", daemon=True)
    watcher.start()
    try:
        code = server_main(args)
    finally:
        done.set()
    if code != 0:
        raise RuntimeError(f"synchronizer exited with code {code}")
    if not info and ready.exists():
        info.update(json.loads(ready.read_text()))
    return {"run_id": info.get("run_id", run_id), "url": info.get("url"), "epoch": info.get("epoch")}


def request_checkpoint(sync_url: str, store_url: str, token: str, storage_options: Optional[dict] = None,
                       timeout_s: float = 300.0) -> dict:
    """Ask a running synchronizer for a checkpoint now, then verify the newest one in the store.

    The run id comes from the synchronizer (``GET /health``); the checkpoint is loaded back with
    :func:`storage.checkpoint.latest_checkpoint`, which checks every object's size and sha256
    against the manifest.

    Args:
        sync_url: the synchronizer's base URL.
        store_url: the run's object-store root.
        token: the run's bearer token.
        storage_options: fsspec options of the store.
        timeout_s: seconds to wait for the synchronizer to write the checkpoint.

    Returns:
        ``{"run_id", "seq", "verified_seq", "versions"}``: the checkpoint written now and the
        newest one that verifies (equal unless a newer one appeared meanwhile).

    Raises:
        RuntimeError: the synchronizer refused or failed the checkpoint (e.g. a wrong token:
            ``diloco_async.client.ProtocolError`` with 401), or no checkpoint at least as new as
            the one it reported verifies in the store.
        ConnectionError: the synchronizer is not reachable.
    """
    from diloco_async.client import call_blocking
    from storage.checkpoint import latest_checkpoint
    from storage.store import ObjectStore

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
def checkpoint(sync_url: Optional[str] = None, store_url: Optional[str] = None, timeout_s: float = 300.0) -> dict:
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
    out = request_checkpoint(sync_url, store_url, _require_token(), _storage_options(), timeout_s)
    logger.info("run %s: checkpoint %d written and verified (newest verified: %d)", out["run_id"], out["seq"],
                out["verified_seq"])
    return out
