"""The processes of one run: the synchronizer, the learners, the environment they share and the
synchronizer's metric stream.

:class:`RunProcesses` starts the synchronizer (``python -m diloco_async.server``; one process per
shard with ``synchronizer.shards`` > 1, DESIGN §2.2) and waits until it listens, starts learner
``i`` as incarnation ``j`` (``python -m diloco_async.learner``) under
a :class:`~diloco_async.runtime.supervisor.Supervisor`, reads new metric points and the run's status
over HTTP, and stops everything. The ``train`` flow (``diloco_async/flows/train.py``) adds MLflow, Prefect
deployments and the report; the chaos harness (:mod:`diloco_async.chaos.targets`) drives one
under a fault schedule.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from diloco_async.config.resolved import write_resolved
from diloco_async.config.schema import Config
from diloco_async.inner.optimizers import check_inner_optimizer
from diloco_async.learner import TIMELINE_DIR_ENV
from diloco_async.learner.fsdp import check_sharded_run
from diloco_async.learner.fsdp_state import check_saved_group_sizes
from diloco_async.learner.group import torchrun_args
from diloco_async.metrics.shards import aggregate_status, run_points, shard_points
from diloco_async.protocol.auth import check_run_secret, learner_token
from diloco_async.protocol.client import LEARNER_TOKEN_ENV, TOKEN_ENV, ProtocolError, call_blocking, fetch_status
from diloco_async.protocol.tls import client_context_from_env
from diloco_async.runtime.devices import check_devices
from diloco_async.runtime.procs import Launcher, LocalProcessLauncher, wait_for_ready_file
from diloco_async.runtime.supervisor import Restart, Supervisor
from diloco_async.storage import keys
from diloco_async.storage.checkpoint import Checkpoint, latest_checkpoint
from diloco_async.storage.options import STORAGE_OPTIONS_ENV
from diloco_async.storage.run_checkpoints import open_run_checkpoint, write_run_manifest
from diloco_async.storage.store import ObjectStore
from diloco_async.sync import check_network, learner_tls_env, new_run_id, operator_tls_env

__all__ = ["RunProcesses", "next_incarnations"]


def next_incarnations(manifest: dict) -> dict[int, int]:
    """Learner index -> the incarnation a resume starts it as: one past the incarnation the
    checkpoint ``manifest`` recorded for ``learner-{index}`` (learners of other names are skipped)."""
    return {int(lid.rsplit("-", 1)[1]): int(d["incarnation"]) + 1
            for lid, d in manifest["learners"].items() if lid.rsplit("-", 1)[-1].isdigit()}

log = logging.getLogger("diloco.run")


class RunProcesses:
    """The synchronizer and learner processes of one run, started on this machine.

    Args:
        cfg: the run's resolved config (parsed once by the caller); written to
            ``{workdir}/resolved-config.json``, which the synchronizer reads
            (:mod:`diloco_async.config.resolved`).
        run_id: id of a new run (a fresh one when None; the URL's run when resuming).
        resume_url: continue from ``{store}/{run_id}/checkpoints/{seq}`` instead of starting a run.
        run_secret: the run's secret (admin credential); default ``$DILOCO_RUN_TOKEN`` when set
            (so the operator can also request checkpoints), else a fresh random one.
        launcher: how processes start (default: subprocesses, logs in ``{workdir}/logs``).

    Raises:
        ValueError: with ``run.launcher = "local"``, a learner's device is absent on this machine
            (before anything starts; see :func:`diloco_async.runtime.devices.check_devices`);
            ``learners.optimizer = "muon"`` on a model without 2-D hidden weights
            (:func:`diloco_async.inner.optimizers.check_inner_optimizer`).

    Attributes:
        workdir: ``{run.workdir}/{run_id}``: logs, ready file, learner timelines, the resolved config.
        config_file: ``{workdir}/resolved-config.json``, the value every process of the run reads.
        token: the run's secret: only the synchronizer's environment carries it.
        env: environment shared by every process (storage options, timeline folder); no credential.
            The synchronizer also gets ``DILOCO_RUN_TOKEN``, each learner only its own token in
            ``DILOCO_LEARNER_TOKEN`` (:meth:`learner_env`).
        sync: the synchronizer's handle once started (shard 0's with ``synchronizer.shards`` > 1).
        shard_syncs: every shard's handle, in shard order (``[sync]`` with one shard); ``shard_urls``
            their URLs; :attr:`learner_sync_url` what the learners get (the URLs comma-separated).
        finished_cleanly: set by the caller when the synchronizer exited 0; :meth:`stop_all` then
            lets the learners finish on their own for up to ``learner_exit_wait_s`` seconds (30).
        learners: learner id -> handle of its newest incarnation; ``retired``: earlier ones.
    """

    def __init__(self, cfg: Config, run_id: str | None = None, resume_url: str | None = None,
                 launcher: Launcher | None = None, run_secret: str | None = None) -> None:
        if cfg.run.launcher == "local":
            check_devices(cfg.learners)
        check_network(cfg)  # its TLS files, before anything starts (docs/network-modes.md)
        check_inner_optimizer(cfg)  # learners.optimizer = "muon" needs 2-D hidden weights
        check_sharded_run(cfg)  # learners.parallelism = "fsdp" needs a model FSDP2 can shard
        self.cfg = cfg
        if run_id is None and resume_url:
            run_id = keys.split_checkpoint_url(resume_url)[1]
        self.run_id = run_id or new_run_id()
        self.resume_url = resume_url
        self.store = ObjectStore(cfg.run.store, cfg.run.storage_options)
        if resume_url:  # a sharded learner's saved inner state needs a group of its size
            check_saved_group_sizes(self.store, self.run_id, cfg)
        self.epoch: str | None = None
        given = run_secret or os.environ.get(TOKEN_ENV)
        self.token = check_run_secret(given, TOKEN_ENV) if given else secrets.token_urlsafe(32)
        self.workdir = Path(cfg.run.workdir).resolve() / self.run_id
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.config_file = write_resolved(cfg, self.workdir)
        self.launcher = launcher if launcher is not None else LocalProcessLauncher(self.workdir / "logs")
        self.env = {"HF_HUB_OFFLINE": "1",  # models and tokenizers: local files only
                    STORAGE_OPTIONS_ENV: json.dumps(cfg.run.storage_options),
                    TIMELINE_DIR_ENV: str(self.workdir / "timeline")}
        self.sync: Any | None = None
        self.learners: dict[str, Any] = {}  # learner id -> process handle (newest incarnation)
        self.retired: list[Any] = []  # handles of earlier incarnations
        self.sync_url: str | None = None  # shard 0's
        self.shard_syncs: list[Any] = []
        self.shard_urls: list[str] = []
        self.shard_epochs: list[str] = []  # each shard process's epoch (its summary and metrics lie under it)
        tls_env = operator_tls_env(cfg)  # the operator's requests (metrics, status) over HTTPS
        self.operator_ssl = client_context_from_env(tls_env) if tls_env else None
        self.metrics_next = 0
        self.shard_metrics_next: list[int] = []  # with several shards: the metric stream's cursor of each
        self.finished_cleanly = False
        self.learner_exit_wait_s = 30.0
        self.supervisor = Supervisor(start=self._spawn_learner, restart_delay_s=cfg.learners.restart_delay_s,
                                     max_restarts=cfg.learners.max_restarts, log=self._log)

    def _log(self, line: str) -> None:
        """One line per supervision decision (subclasses send it elsewhere)."""
        log.warning("%s", line)

    def learner_env(self, learner_id: str) -> dict[str, str]:
        """The environment of ``learner_id``'s process: :attr:`env`, that learner's own token and, in
        ``tls`` mode, its CA bundle (and with mutual TLS its certificate and key)."""
        index = int(learner_id.rsplit("-", 1)[1])
        return {**self.env, LEARNER_TOKEN_ENV: learner_token(self.token, self.run_id, learner_id),
                **learner_tls_env(self.cfg, index)}

    @property
    def learner_sync_url(self) -> str:
        """The ``--sync-url`` of a learner: the synchronizer's URL, or every shard's, comma-separated
        in shard order (DESIGN §2.2)."""
        return ",".join(self.shard_urls) if self.shard_urls else str(self.sync_url)

    def _shard_argv(self, i: int, which: list[str], ready: Path, port: int | None = None) -> list[str]:
        shards = self.cfg.synchronizer.shards
        return ["-m", "diloco_async.server", "--resolved-config", str(self.config_file), *which,
                "--ready-file", str(ready), *(["--shard", str(i)] if shards > 1 else []),
                *(["--port", str(port)] if port is not None else [])]

    def start_synchronizer(self) -> str:
        """Start the synchronizer (``synchronizer.shards`` processes, one per shard, each with its
        own ready file), wait until every one listens and return the first one's URL.

        Raises:
            RuntimeError: one exited before it was ready. TimeoutError: not ready after 120 s.
        """
        shards = self.cfg.synchronizer.shards
        self.shard_syncs, self.shard_urls, self.shard_epochs = [], [], []
        self.shard_metrics_next = [0] * shards
        for i in range(shards):
            name = "synchronizer" if shards == 1 else f"synchronizer-{i}"
            ready = self.workdir / f"{name}.ready.json"
            ready.unlink(missing_ok=True)
            which = ["--resume", self.resume_url] if self.resume_url else ["--run-id", self.run_id]
            argv = self._shard_argv(i, which, ready)
            self.shard_syncs.append(self.launcher.start(name, argv, {**self.env, TOKEN_ENV: self.token}))
            self.sync = self.shard_syncs[0]
            info = wait_for_ready_file(ready, self.shard_syncs[-1])
            self.shard_urls.append(info["url"])
            self.shard_epochs.append(info["epoch"])
            if i == 0:
                self.sync_url, self.epoch = info["url"], info["epoch"]
        return str(self.sync_url)

    def synchronizer_running(self) -> bool:
        """Is a synchronizer process (any shard) still running?"""
        return any(h.poll() is None for h in self.shard_syncs or ([self.sync] if self.sync else []))

    def signal_synchronizers(self, signum: int) -> None:
        """Send ``signum`` to every shard process still running (its clean stop for SIGTERM, SIGINT)."""
        for handle in self.shard_syncs or ([self.sync] if self.sync else []):
            if handle.poll() is None:
                handle.signal_group(signum)

    def pause_while_running(self, pause_s: float) -> None:
        """Wait ``pause_s`` seconds, less when shard 0 exits meanwhile (at most 0.2 s once it has: another
        shard may still be stopping)."""
        if self.sync is None or self.sync.poll() is not None:
            time.sleep(min(pause_s, 0.2))
            return
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.sync.wait(timeout=pause_s)

    def wait_synchronizers(self) -> int | None:
        """Wait until every shard has exited; its exit code (the first non-zero one, in shard order,
        with several shards; None when none was started)."""
        codes = [h.wait() for h in self.shard_syncs or ([self.sync] if self.sync else [])]
        return next((c for c in codes if c != 0), 0 if codes else None)

    def learner_handle(self, index: int, incarnation: int) -> Any:
        """Start the process of learner ``index`` as ``incarnation`` and return its handle: one
        process, or a torchrun group when ``learners.nproc_per_learner`` or ``nnodes`` > 1."""
        lid = f"learner-{index}"
        lc = self.cfg.learners
        entry = ["-m", "diloco_async.learner"]
        if lc.ranks_per_learner > 1:
            entry = torchrun_args(lc, f"{self.run_id}-{lid}-{incarnation}")
        argv = [*entry, "--learner-id", lid, "--index", str(index), "--sync-url", self.learner_sync_url,
                "--store", self.store.url, "--incarnation", str(incarnation),
                "--group-timeout-s", str(lc.group_timeout_s)]
        return self.launcher.start(lid, argv, self.learner_env(lid))

    def _spawn_learner(self, index: int, incarnation: int) -> Any:
        lid = f"learner-{index}"
        if lid in self.learners:
            self.retired.append(self.learners[lid])
        handle = self.learner_handle(index, incarnation)
        self.learners[lid] = handle
        return handle

    def start_learner(self, index: int, incarnation: int = 0) -> Any:
        """Start learner ``index`` and supervise it: if it dies while the synchronizer runs it is
        restarted (see :meth:`supervise`). Returns its handle."""
        return self.supervisor.launch(index, incarnation)

    def supervise(self) -> list[Restart]:
        """Restart learners that died (non-zero exit, signal, crashed or failed flow run) after
        ``learners.restart_delay_s`` seconds, as their next incarnation, and (with
        ``synchronizer.shards`` > 1) shards that died (:meth:`restart_dead_shards`). Call it while
        the synchronizer runs; returns the learner restarts made by this call."""
        if self.cfg.synchronizer.shards > 1:
            self.restart_dead_shards()
        return self.supervisor.check()

    def restart_dead_shards(self) -> list[int]:
        """Restart every shard process that died (a non-zero exit or a signal; 0 is a finished
        shard) with ``--resume {store}/{run_id} --shard I`` (its newest verified checkpoint) on the
        port it had, so the learners' URLs stay valid; waits until each listens. The other shards
        run on meanwhile. Returns the shards restarted.

        Raises:
            RuntimeError: a restarted shard exited before it was ready (e.g. no checkpoint yet).
        """
        restarted = []
        for i, handle in enumerate(self.shard_syncs):
            code = handle.poll()
            if code is None or code == 0:
                continue
            port = int(self.shard_urls[i].rsplit(":", 1)[1])
            self._log(f"synchronizer shard {i} exited with code {code}: restarting it from its newest checkpoint "
                      f"on port {port}")
            ready = self.workdir / f"synchronizer-{i}.ready.json"
            ready.unlink(missing_ok=True)
            argv = self._shard_argv(i, ["--resume", f"{self.store.url}/{self.run_id}"], ready, port)
            self.retired.append(handle)
            self.shard_syncs[i] = self.launcher.start(f"synchronizer-{i}", argv, {**self.env, TOKEN_ENV: self.token})
            self.shard_epochs[i] = wait_for_ready_file(ready, self.shard_syncs[i])["epoch"]
            self.shard_metrics_next[i] = 0  # a new process: a new metric stream
            if i == 0:
                self.sync = self.shard_syncs[0]
            restarted.append(i)
        return restarted

    def pull_metrics(self) -> list[dict]:
        """New metric points from the synchronizer; [] when it is not answering. With several shards,
        each shard's new points as the run logs them (:func:`~diloco_async.metrics.shards.shard_points`)
        and the run's aggregated figures (:func:`~diloco_async.metrics.shards.run_points`)."""
        if len(self.shard_urls) <= 1:
            points, self.metrics_next = self._pull_from(str(self.sync_url), self.metrics_next)
            return points
        points = []
        for i, url in enumerate(self.shard_urls):
            new, self.shard_metrics_next[i] = self._pull_from(url, self.shard_metrics_next[i])
            points.extend(shard_points(i, new))
        st = self.status()
        return points + (run_points(st, int(time.time() * 1000)) if st is not None else [])

    def _pull_from(self, url: str, start: int) -> tuple[list[dict], int]:
        points: list[dict] = []
        while True:
            try:
                body = call_blocking(url, self.token, "metrics", start, request_timeout_s=5.0,
                                     ssl_context=self.operator_ssl)
            except (OSError, ValueError, ProtocolError):
                return points, start
            points.extend(body["metrics"])
            start = body["next"]
            if start >= body["total"]:
                return points, start

    def status(self) -> dict | None:
        """The run's ``GET /status``, or None when no synchronizer answers: the synchronizer's, or
        with several shards every shard's aggregated (:func:`~diloco_async.metrics.shards.aggregate_status`,
        with a row per shard; a shard that does not answer is a row marked unreachable)."""
        docs = []
        for url in self.shard_urls or [str(self.sync_url)]:
            try:
                docs.append(fetch_status(url, ssl_context=self.operator_ssl))
            except (OSError, ValueError):
                docs.append(None)
        if all(d is None for d in docs):
            return None
        return aggregate_status(docs, self.shard_urls or None)

    def owner_roots(self) -> list[str]:
        """The key root of each shard's checkpoints and epochs (the run id with one shard)."""
        shards = self.cfg.synchronizer.shards
        return [keys.synchronizer_root(self.run_id, i, shards) for i in range(shards)]

    def final_summary(self) -> dict:
        """The run's summary from the store: the synchronizer's ``summary.json``, or with several
        shards each shard's (of its newest process) aggregated, with a row per shard.

        Raises:
            FileNotFoundError: a shard wrote no summary (the message names it).
        """
        docs = []
        for i, (root, epoch) in enumerate(zip(self.owner_roots(), self.shard_epochs or [str(self.epoch)], strict=True)):
            try:
                docs.append(self.store.get_json(keys.summary_key(root, epoch)))
            except FileNotFoundError:
                raise FileNotFoundError(f"synchronizer shard {i} wrote no summary at "
                                        f"{keys.summary_key(root, epoch)}") from None
        return aggregate_status(docs, self.shard_urls if len(docs) > 1 else None)

    def final_checkpoint(self) -> Checkpoint | None:
        """The checkpoint holding the run's final model (call it once every shard has exited): the
        newest that verifies, or with several shards a run checkpoint naming each shard's newest,
        written now (each shard writes one after its own checkpoints, but two shards finishing
        together may each name the other's previous one) and loaded whole
        (:meth:`~diloco_async.storage.run_checkpoints.RunCheckpoint.combined`); None when there is none.

        Raises:
            ValueError: the run checkpoint does not verify (the message names the shard).
        """
        shards = self.cfg.synchronizer.shards
        if shards == 1:
            return latest_checkpoint(self.store, self.run_id)
        seq = write_run_manifest(self.store, self.run_id, shards)
        return None if seq is None else open_run_checkpoint(self.store, self.run_id, shards, seq, load=True).combined()

    def remaining_metrics_from_store(self) -> list[dict]:
        """Metric points the final poll missed, from each shard's metrics.jsonl."""
        if len(self.shard_urls) <= 1:
            rest, self.metrics_next = self._rest_of(self.run_id, str(self.epoch), self.metrics_next)
            return rest
        points = []
        for i, (root, epoch) in enumerate(zip(self.owner_roots(), self.shard_epochs, strict=True)):
            rest, self.shard_metrics_next[i] = self._rest_of(root, epoch, self.shard_metrics_next[i])
            points.extend(shard_points(i, rest))
        return points

    def _rest_of(self, root: str, epoch: str, start: int) -> tuple[list[dict], int]:
        try:
            lines = self.store.get_unverified(keys.metrics_log_key(root, epoch)).decode().splitlines()
        except FileNotFoundError:
            return [], start
        return [json.loads(line) for line in lines[start:] if line.strip()], len(lines)

    def stop_all(self) -> None:
        """Stop every learner and the synchronizer.

        After a clean end (the synchronizer exited 0) learners get up to ``learner_exit_wait_s``
        seconds to finish on their own; otherwise (failure, cancellation) learner flow runs are
        cancelled at once, then the synchronizer gets SIGTERM (final checkpoint) and 10 s before
        SIGKILL. With local learners, a synchronizer still running then is first told to stop twice
        (the second stop skips its drain: the learners being stopped cannot close its last rounds), so
        it writes its final checkpoint while they go rather than after waiting out ``drain_s``
        (learner flow runs are left to their cancellation: told to stop, they would end Completed)."""
        handles = self.retired + list(self.learners.values())
        if self.finished_cleanly:
            deadline = time.monotonic() + self.learner_exit_wait_s
            while time.monotonic() < deadline and any(h.poll() is None for h in handles):
                time.sleep(0.5)
        elif self.sync is not None and self.sync.poll() is None and hasattr(self.sync, "signal_group") \
                and not any(hasattr(h, "request_cancel") for h in handles):  # flow runs: cancelled, below
            live = [h for h in self.shard_syncs or [self.sync] if h.poll() is None]
            for _ in range(2):
                for shard in live:
                    shard.signal_group(signal.SIGTERM)
                time.sleep(0.2)  # two signals, not one coalesced: the first starts the drain, the second ends it
        for handle in handles:  # cancel every learner flow run first: their workers stop them in parallel
            if hasattr(handle, "request_cancel"):
                handle.request_cancel()
        syncs = self.shard_syncs or ([self.sync] if self.sync else [])
        for handle in list(self.learners.values()) + syncs:
            if hasattr(handle, "request_cancel"):
                continue  # a flow run is stopped by its worker; nothing to wait for here
            handle.terminate(grace_s=10.0)
