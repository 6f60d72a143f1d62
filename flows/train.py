"""Prefect flow ``train``: a whole Decoupled DiLoCo run.

Starts the synchronizer (a subprocess of the flow run) and M learners through a launcher, pulls
the synchronizer's metric stream into MLflow while they train, restarts learners that die
(supervision), evaluates the final global model on held-out text and prints a summary.

Launchers (``run.launcher``): ``local`` (default) runs each learner as a subprocess of this flow
run; ``deployments`` creates one flow run of the ``learner/{region}`` deployment per learner on
its region's work pool (see prefect.yaml). Cancelling or failing the flow stops every process it
started and cancels every learner flow run it created.
"""

from __future__ import annotations

import json
import logging
import secrets
import sys
import time
from pathlib import Path
from typing import Any, Optional

from prefect import flow, get_run_logger, task
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from diloco_async.client import ProtocolError, call_blocking, fetch_status
from diloco_async.config import Config, config_hash, load_config
from diloco_async.data import corpus_urls
from diloco_async.evaluation import heldout_batches, heldout_loss, model_from_checkpoint
from diloco_async.model import ByteGPT
from diloco_async.learner import TIMELINE_DIR_ENV
from diloco_async.server import STORAGE_OPTIONS_ENV, TOKEN_ENV
from diloco_async.synchronizer import initial_parameters, new_run_id
from flows.artifacts import log_run_artifacts
from flows.timeline_report import write_run_timeline
from flows.launcher import (DeploymentLauncher, LocalProcess, LocalProcessLauncher, Restart, Supervisor,
                            wait_for_ready_file)
from flows.tracking import MlflowSink, flatten_params
from diloco_async.server import open_checkpoint
from storage import keys
from storage.checkpoint import latest_checkpoint
from storage.store import ObjectStore

__all__ = ["train", "resume", "run_train_cli", "run_resume_cli", "TrainingRun"]

log = logging.getLogger("diloco.flows.train")


@task(name="prepare-corpus", retries=2, retry_delay_seconds=5)
def prepare_corpus(cfg: Config) -> list[str]:
    """Make sure the corpus is on disk (downloads Shakespeare once) before learners start."""
    return corpus_urls(cfg.data)


@task(name="evaluate")
def evaluate(cfg: Config, model: ByteGPT) -> float:
    return heldout_loss(model, heldout_batches(cfg))


class TrainingRun:
    """The processes, metric stream and MLflow run of one training run."""

    def __init__(self, cfg: Config, config_path: Optional[str], overrides: list[str],
                 run_id: Optional[str] = None, resume_url: Optional[str] = None) -> None:
        self.cfg = cfg
        self.config_path = config_path
        self.overrides = overrides
        self.run_id = run_id or new_run_id()
        self.resume_url = resume_url
        self.epoch: Optional[str] = None
        self.token = secrets.token_urlsafe(32)
        self.workdir = Path(cfg.run.workdir).resolve() / self.run_id
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.store = ObjectStore(cfg.run.store, cfg.run.storage_options)
        self.launcher = LocalProcessLauncher(self.workdir / "logs")
        self.env = {TOKEN_ENV: self.token, STORAGE_OPTIONS_ENV: json.dumps(cfg.run.storage_options),
                    TIMELINE_DIR_ENV: str(self.workdir / "timeline")}
        self.sync: Optional[LocalProcess] = None
        self.learners: dict[str, Any] = {}  # learner id -> LocalProcess or FlowRunHandle (newest incarnation)
        self.retired: list[Any] = []  # handles of earlier incarnations
        self.sync_url: Optional[str] = None
        self.metrics_next = 0
        self.finished_cleanly = False
        self.deployer: Optional[DeploymentLauncher] = None
        if cfg.run.launcher == "deployments":
            from prefect.runtime import flow_run

            tags = ["diloco", f"diloco-run:{self.run_id}"]
            if flow_run.id:
                tags.append(f"train-flow-run:{flow_run.id}")
            self.deployer = DeploymentLauncher(cfg.run.learner_deployment, cfg.run.regions, self.env, tags)
        self.supervisor = Supervisor(start=self._spawn_learner, restart_delay_s=cfg.learners.restart_delay_s,
                                     max_restarts=cfg.learners.max_restarts, log=self._log)

    @staticmethod
    def _log(line: str) -> None:
        try:
            get_run_logger().warning("%s", line)
        except Exception:  # noqa: BLE001 - outside a flow run
            log.warning("%s", line)

    def _config_args(self) -> list[str]:
        args = ["--config", str(Path(self.config_path).resolve())] if self.config_path else []
        for item in self.overrides:
            args += ["--set", item]
        return args

    def start_synchronizer(self) -> str:
        ready = self.workdir / "synchronizer.ready.json"
        ready.unlink(missing_ok=True)
        which = ["--resume", self.resume_url] if self.resume_url else ["--run-id", self.run_id]
        argv = ["-m", "diloco_async.server", *self._config_args(), *which, "--ready-file", str(ready)]
        self.sync = self.launcher.start("synchronizer", argv, self.env)
        info = wait_for_ready_file(ready, self.sync)
        self.sync_url, self.epoch = info["url"], info["epoch"]
        return self.sync_url

    def _spawn_learner(self, index: int, incarnation: int) -> Any:
        lid = f"learner-{index}"
        if lid in self.learners:
            self.retired.append(self.learners[lid])
        if self.deployer is not None:
            handle = self.deployer.start_learner(index, incarnation, {
                "sync_url": str(self.sync_url), "store_url": self.store.url, "run_id": self.run_id})
        else:
            argv = ["-m", "diloco_async.learner", "--learner-id", lid, "--index", str(index),
                    "--sync-url", str(self.sync_url), "--store", self.store.url, "--incarnation", str(incarnation)]
            handle = self.launcher.start(lid, argv, self.env)
        self.learners[lid] = handle
        return handle

    def start_learner(self, index: int, incarnation: int = 0) -> Any:
        """Start learner ``index`` (a subprocess, or a flow run with ``run.launcher = "deployments"``)
        and supervise it: if it dies while the synchronizer runs it is restarted (see :meth:`supervise`).

        Raises:
            RuntimeError: with the deployments launcher, the learner deployment does not exist.
        """
        return self.supervisor.launch(index, incarnation)

    def supervise(self) -> list[Restart]:
        """Restart learners that died (non-zero exit, signal, crashed or failed flow run) after
        ``learners.restart_delay_s`` seconds, as their next incarnation. Call it while the
        synchronizer runs; returns the restarts made by this call."""
        return self.supervisor.check()

    def pull_metrics(self) -> list[dict]:
        """New metric points from the synchronizer; [] when it is not answering."""
        points: list[dict] = []
        while True:
            try:
                body = call_blocking(self.sync_url, self.token, "metrics", self.metrics_next, request_timeout_s=5.0)
            except (OSError, ValueError, ProtocolError):
                return points
            points.extend(body["metrics"])
            self.metrics_next = body["next"]
            if self.metrics_next >= body["total"]:
                return points

    def status(self) -> Optional[dict]:
        try:
            return fetch_status(self.sync_url)
        except (OSError, ValueError):
            return None

    def remaining_metrics_from_store(self) -> list[dict]:
        """Metric points the final poll missed, from the synchronizer's metrics.jsonl."""
        try:
            lines = self.store.get_unverified(keys.metrics_log_key(self.run_id, str(self.epoch))).decode().splitlines()
        except FileNotFoundError:
            return []
        rest = [json.loads(line) for line in lines[self.metrics_next:] if line.strip()]
        self.metrics_next = len(lines)
        return rest

    def stop_all(self) -> None:
        """Stop every learner and the synchronizer.

        After a clean end (the synchronizer exited 0) learners get up to 30 s to finish on their
        own; otherwise (failure, cancellation) learner flow runs are cancelled at once, then the
        synchronizer gets SIGTERM (final checkpoint) and 10 s before SIGKILL."""
        handles = self.retired + list(self.learners.values())
        if self.finished_cleanly:
            deadline = time.monotonic() + 30.0
            while time.monotonic() < deadline and any(h.poll() is None for h in handles):
                time.sleep(0.5)
        for handle in handles:  # cancel every learner flow run first: their workers stop them in parallel
            if hasattr(handle, "request_cancel"):
                handle.request_cancel()
        for handle in list(self.learners.values()) + ([self.sync] if self.sync else []):
            if hasattr(handle, "request_cancel"):
                continue  # a flow run is stopped by its worker; nothing to wait for here
            handle.terminate(grace_s=10.0)

    def learner_flow_runs(self) -> list[dict]:
        """Every learner flow run this run created (deployments launcher), oldest first."""
        out = []
        for h in self.retired + list(self.learners.values()):
            if hasattr(h, "flow_run_id"):
                out.append({"learner_id": h.name, "incarnation": h.incarnation, "flow_run_id": str(h.flow_run_id),
                            "flow_run_name": h.flow_run_name, "deployment": h.deployment, "state": h.refresh()})
        return out


def _log_restarts(run: TrainingRun, sink: MlflowSink, restarts: list[Restart]) -> None:
    for r in restarts:
        n = len(run.supervisor.restarts)
        sink.log_metric("flow/learner_restarts", n, n)
        get_run_logger().warning("learner-%d restarted as incarnation %d (%s); %d restarts so far",
                                 r.index, r.incarnation, r.reason, n)


def _watch(run: TrainingRun, sink: MlflowSink, console: Console) -> None:
    """Pull metrics into MLflow until the synchronizer exits; restart learners that die; show progress."""
    cfg = run.cfg
    total_tokens = cfg.budget.tokens
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("{task.fields[info]}"), TimeElapsedColumn(), console=console,
                  transient=False, disable=not console.is_terminal) as progress:
        tokens_bar = progress.add_task("tokens", total=total_tokens, info="")
        merges_bar = progress.add_task("merges", total=None, info="")
        last_print = 0.0
        while run.sync is not None and run.sync.poll() is None:
            sink.log_points(run.pull_metrics())
            st = run.status()
            if st is not None:
                progress.update(tokens_bar, completed=st["tokens_processed"],
                                info=f"goodput {st['compute_goodput']:.2f}")
                live = sum(1 for v in st["learners"].values() if v["live"])
                progress.update(merges_bar, completed=st["merges"],
                                info=f"{live} live learners, versions {min(st['versions'].values())}+")
                if not console.is_terminal and time.monotonic() - last_print > 15:
                    last_print = time.monotonic()
                    print(f"[{st['wall_s']:.0f}s] tokens {st['tokens_processed']}, merges {st['merges']}, "
                          f"live learners {live}, compute goodput {st['compute_goodput']:.3f}", flush=True)
            if run.sync.poll() is None:  # supervise only while the synchronizer is still running
                _log_restarts(run, sink, run.supervise())
            pause = cfg.tracking.poll_s
            due = run.supervisor.next_due()
            if due is not None:
                pause = min(pause, max(0.05, due - time.monotonic()))
            time.sleep(pause)
    sink.log_points(run.pull_metrics())


def _summary_table(summary: dict) -> Table:
    table = Table(title=f"diloco-async run {summary['run_id']}")
    table.add_column("figure")
    table.add_column("value", justify="right")
    rows = [
        ("eval loss, initial (nats/byte)", f"{summary['eval_loss_initial']:.4f}"),
        ("eval loss, final (nats/byte)", f"{summary['eval_loss_final']:.4f}"),
        ("wall time of this synchronizer (s)", f"{summary['wall_s']:.1f}"),
        ("merges", str(summary["merges"])),
        ("contributions merged / late / rejected",
         f"{summary['contributions_merged']} / {summary['contributions_late']} / {summary['contributions_rejected']}"),
        ("compute goodput", f"{summary['compute_goodput']:.3f}"),
        ("token goodput", f"{summary['token_goodput']:.3f}"),
        ("uptime", f"{summary['uptime']:.3f}"),
        ("tokens processed", str(summary["tokens_processed"])),
        ("bytes in / out", f"{summary['bytes_in']} / {summary['bytes_out']}"),
        ("stop reason", str(summary["stop_reason"])),
        ("MLflow run", summary["mlflow_run_id"]),
    ]
    for k, v in rows:
        table.add_row(k, v)
    return table


def _log_goodput_timeline(run: TrainingRun, sink: MlflowSink, summary: dict) -> None:
    """The per-learner goodput timeline of this epoch as a PNG and its accounting as JSON, when
    the learners' records are on this machine (local launcher, or deployments on this host)."""
    png = run.workdir / f"goodput_timeline-{run.epoch}.png"
    try:
        acc = write_run_timeline(run.cfg, run.store, run.run_id, str(run.epoch), run.workdir / "timeline", png,
                                 float(summary.get("uptime_max_gap_s", 30.0)))
    except (OSError, ValueError) as err:
        log.warning("no goodput timeline: %s", err)
        return
    if acc is None:
        return
    sink.log_artifact(png)
    sink.log_dict(acc, f"goodput_timeline-{run.epoch}.json")
    summary["timeline_compute_goodput"] = acc["compute_goodput"]


def _execute(run: TrainingRun, sink: MlflowSink, eval_start: float, incarnations: dict[int, int]) -> dict:
    """Start the synchronizer and the learners, watch them, evaluate the final model."""
    logger = get_run_logger()
    cfg = run.cfg
    console = Console(stderr=False, width=None if sys.stdout.isatty() else 110)
    t0 = time.monotonic()
    sink.start_children(f"learner-{i}" for i in range(cfg.learners.count))
    url = run.start_synchronizer()
    logger.info("synchronizer at %s; starting %d learners", url, cfg.learners.count)
    for i in range(cfg.learners.count):
        run.start_learner(i, incarnations.get(i, 0))
    _watch(run, sink, console)
    code = run.sync.wait() if run.sync else None
    run.finished_cleanly = code == 0
    if code != 0:
        raise RuntimeError(f"synchronizer exited with code {code}; log: {run.sync.log_path if run.sync else '?'}")
    sink.log_points(run.remaining_metrics_from_store())
    summary = run.store.get_json(keys.summary_key(run.run_id, str(run.epoch)))
    ckpt = latest_checkpoint(run.store, run.run_id)
    if ckpt is None:
        raise RuntimeError("no verified checkpoint at the end of the run")
    final_model = model_from_checkpoint(cfg, ckpt)
    eval_final = evaluate(cfg, final_model)
    summary.update(eval_loss_initial=eval_start, eval_loss_final=eval_final,
                   flow_wall_s=time.monotonic() - t0, mlflow_run_id=sink.run_id,
                   checkpoint_seq=ckpt.seq, logs=str(run.workdir / "logs"), launcher=cfg.run.launcher,
                   learner_restarts=len(run.supervisor.restarts),
                   restarts=[{"learner": f"learner-{r.index}", "incarnation": r.incarnation, "reason": r.reason}
                             for r in run.supervisor.restarts])
    step = int(summary["merges"])
    sink.log_metric("eval/loss", eval_final, step)
    sink.log_metric("eval/final_loss", eval_final, step)
    sink.log_metric("goodput/uptime", summary["uptime"], step)
    summary["model_uri"] = log_run_artifacts(sink, final_model)
    _log_goodput_timeline(run, sink, summary)
    sink.log_dict(summary, f"summary-{run.epoch}.json" if run.resume_url else "summary.json")
    console.print(_summary_table(summary))
    logger.info("run %s finished: eval loss %.4f -> %.4f nats/byte, compute goodput %.3f",
                run.run_id, eval_start, eval_final, summary["compute_goodput"])
    return summary


def _with_flow_runs(run: TrainingRun, summary: dict) -> dict:
    """Add the learner flow runs (deployments launcher) and their final states to a summary."""
    if run.deployer is not None:
        summary["learner_flow_runs"] = run.learner_flow_runs()
    return summary


@flow(name="train", log_prints=True)
def train(config: Optional[str] = "configs/default.toml", overrides: Optional[list[str]] = None) -> dict:
    """Run one training job end to end and return its summary (also logged to MLflow).

    Args:
        config: path of a TOML recipe (None: built-in defaults).
        overrides: ``section.field=value`` strings applied on top of the recipe.
    """
    logger = get_run_logger()
    overrides = list(overrides or [])
    cfg = load_config(config, overrides)
    prepare_corpus(cfg)
    run = TrainingRun(cfg, config, overrides)
    sink = MlflowSink(cfg.tracking)
    sink.start(f"{cfg.run.name}-{run.run_id}", flatten_params(cfg.public_dict()),
               {"diloco.run_id": run.run_id, "diloco.config_hash": config_hash(cfg),
                "diloco.store": run.store.url})
    status = "FAILED"
    try:
        params, _ = initial_parameters(cfg)
        model0 = ByteGPT(cfg.model)
        model0.load_state_dict(params, strict=False)
        eval_initial = evaluate(cfg, model0)
        sink.log_metric("eval/loss", eval_initial, 0)
        logger.info("run %s: initial held-out loss %.4f nats/byte", run.run_id, eval_initial)
        sink.log_dict(cfg.public_dict(), "config.json")
        summary = _execute(run, sink, eval_initial, {})
        sink.log_dict(run.store.get_json(keys.plan_key(run.run_id)), "plan.json")
        status = "FINISHED"
    except BaseException as err:
        if not isinstance(err, Exception):  # cancelled (TerminationSignal), Ctrl-C, SystemExit
            status = "KILLED"
        raise
    finally:
        run.stop_all()
        sink.end(status)
    return _with_flow_runs(run, summary)


@flow(name="resume", log_prints=True)
def resume(checkpoint_url: str, config: Optional[str] = None, overrides: Optional[list[str]] = None) -> dict:
    """Continue a run from a checkpoint in any store (file://, s3://, gs://) and return its summary.

    Args:
        checkpoint_url: ``{store}/{run_id}/checkpoints/{seq}``, or ``{store}/{run_id}`` for the
            newest checkpoint that verifies.
        config: a recipe; by default the run's own config from the store. Training fields must
            match the checkpoint's (a budget may be extended with overrides).
        overrides: ``section.field=value`` strings.
    """
    logger = get_run_logger()
    overrides = list(overrides or [])
    cfg, store, run_id, ckpt = open_checkpoint(checkpoint_url, config, overrides, {})
    prepare_corpus(cfg)
    run = TrainingRun(cfg, config, overrides, run_id=run_id,
                      resume_url=f"{store.url}/{run_id}/checkpoints/{ckpt.seq:08d}")
    sink = MlflowSink(cfg.tracking)
    if not sink.resume(run_id):
        sink.start(f"{cfg.run.name}-{run_id}", flatten_params(cfg.public_dict()),
                   {"diloco.run_id": run_id, "diloco.config_hash": config_hash(cfg), "diloco.store": store.url})
    status = "FAILED"
    try:
        eval_start = evaluate(cfg, model_from_checkpoint(cfg, ckpt))
        logger.info("run %s: resuming from checkpoint %d, held-out loss %.4f nats/byte", run_id, ckpt.seq, eval_start)
        incarnations = {int(lid.rsplit("-", 1)[1]) : int(d["incarnation"]) + 1
                        for lid, d in ckpt.manifest["learners"].items() if lid.rsplit("-", 1)[-1].isdigit()}
        summary = _execute(run, sink, eval_start, incarnations)
        status = "FINISHED"
    except BaseException as err:
        if not isinstance(err, Exception):
            status = "KILLED"
        raise
    finally:
        run.stop_all()
        sink.end(status)
    return _with_flow_runs(run, summary)


def _report(summary: dict) -> None:
    print(json.dumps({k: summary[k] for k in ("run_id", "eval_loss_initial", "eval_loss_final", "wall_s",
                                              "merges", "compute_goodput", "token_goodput", "mlflow_run_id")}))


def run_resume_cli(checkpoint_url: str, config: Optional[str], overrides: list[str]) -> int:
    """Entry of ``diloco-async resume``."""
    try:
        summary = resume(checkpoint_url=checkpoint_url, config=config, overrides=overrides)
    except Exception as err:
        print(f"resume failed: {err}", file=sys.stderr)
        return 1
    _report(summary)
    return 0


def run_train_cli(config: Optional[str], overrides: list[str]) -> int:
    """Entry of ``diloco-async train``: run the flow, print where to look, exit code 0 on success."""
    try:
        summary = train(config=config, overrides=overrides)
    except KeyboardInterrupt:
        raise
    except Exception as err:
        print(f"training failed: {err}", file=sys.stderr)
        return 1
    _report(summary)
    return 0
