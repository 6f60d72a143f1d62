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

import logging
import signal
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from prefect import flow, get_run_logger, task
from prefect.exceptions import TerminationSignal
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from diloco_async.config.resolved import with_fields
from diloco_async.config.schema import Config, config_hash, load_config
from diloco_async.data.sources import corpus_urls
from diloco_async.data.tokens import open_corpus
from diloco_async.flows.artifacts import log_rounds, log_run_artifacts, register_final_model
from diloco_async.flows.deployments import DeploymentLauncher
from diloco_async.flows.heldout import final_samples, heldout_curve, hf_tokenizer
from diloco_async.flows.links import link_mlflow_run
from diloco_async.flows.provenance import SLICE_FIGURES, log_corpus
from diloco_async.flows.resolve import resume_config
from diloco_async.flows.run_end import STOPPED_TAG, finish, interrupted, run_logs
from diloco_async.flows.summary import exit_status, report, stopped_by_signal, summary_table, worker_intent
from diloco_async.flows.timeline_report import write_run_timeline
from diloco_async.flows.tracking import MlflowSink, flatten_params
from diloco_async.learner import TIMELINE_DIR_ENV
from diloco_async.metrics.evaluation import heldout_loss, heldout_split, model_from_checkpoint
from diloco_async.models import build_run_model
from diloco_async.policy.slices import check_corpus_slices
from diloco_async.prerequisites import prepare
from diloco_async.run import RunProcesses, next_incarnations
from diloco_async.runtime.supervisor import Restart
from diloco_async.storage import keys
from diloco_async.storage.options import storage_options_from_env
from diloco_async.sync import open_run

__all__ = ["train", "resume", "run_train_cli", "run_resume_cli", "TrainingRun"]

log = logging.getLogger("diloco.flows.train")


@task(name="prepare-corpus", retries=2, retry_delay_seconds=5)
def prepare_corpus(cfg: Config) -> list[str]:
    """Make sure the corpus is on disk (downloads Shakespeare once) before learners start."""
    return corpus_urls(cfg.data)


@task(name="prepare-prerequisites")
def prepare_prerequisites(cfg: Config) -> list[str]:
    """Download the recipe's Hub model and data once (learners only read the copies) and build a
    missing base model, before anything else (:func:`diloco_async.prerequisites.prepare`); a Hub
    id that does not exist fails here, naming it (no retries)."""
    return prepare(cfg, say=get_run_logger().info)


@task(name="prepare-tokens")
def prepare_tokens(cfg: Config) -> dict:
    """Tokenize the corpus once into the token cache (training a BPE first if needed) and check the
    tokenizer against the model, before any process starts; bad data input fails here (no retries)."""
    corpus = open_corpus(cfg.data, cfg.model.context, model_vocab=cfg.model.vocab_size)
    if cfg.data.slices:  # too few slices for the learners is refused here, naming data.slice_tokens
        check_corpus_slices(cfg, len(corpus.train))
    return {"tokenizer": cfg.data.tokenizer, "vocab_size": corpus.vocab_size, "train_tokens": len(corpus.train),
            "heldout_tokens": len(corpus.heldout), "heldout_bytes": corpus.heldout_bytes,
            "corpus_manifest": corpus.manifest_url}


@task(name="evaluate")
def evaluate(cfg: Config, model: torch.nn.Module) -> tuple[float, float]:
    """Held-out loss of ``model``: (nats per token, bits per byte)."""
    split = heldout_split(cfg)
    nats = heldout_loss(model, split.batches)
    return nats, split.bits_per_byte(nats)


def _host_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` without what names a folder of this host: a learner flow run may run on another host
    (its worker's), where this run's timeline folder is not (docs/multi-host.md); its learner then
    keeps no timeline records."""
    return {k: v for k, v in env.items() if k != TIMELINE_DIR_ENV}


class TrainingRun(RunProcesses):
    """The processes of one training run (:class:`~diloco_async.run.RunProcesses`), with learners
    started as flow runs of the ``learner/{region}`` deployments when ``run.launcher =
    "deployments"``, and supervision decisions in the flow run's log."""

    def __init__(self, cfg: Config, run_id: str | None = None, resume_url: str | None = None) -> None:
        super().__init__(cfg, run_id=run_id, resume_url=resume_url)
        self.deployer: DeploymentLauncher | None = None
        self.stopped = False  # stopped by a signal (diloco_async.flows.run_end.interrupted)
        self.run_initial_loss: float | None = None  # the run's first held-out loss (a resume's is its start)
        if cfg.run.launcher == "deployments":
            from prefect.runtime import flow_run

            tags = ["diloco", f"diloco-run:{self.run_id}"]
            if flow_run.id:
                tags.append(f"train-flow-run:{flow_run.id}")
            self.deployer = DeploymentLauncher(cfg.run.learner_deployment, cfg.run.regions, _host_env(self.env), tags)

    def _log(self, line: str) -> None:
        try:
            get_run_logger().warning("%s", line)
        except Exception:  # noqa: BLE001 - outside a flow run
            log.warning("%s", line)

    def learner_handle(self, index: int, incarnation: int) -> Any:
        """A subprocess, or a flow run with ``run.launcher = "deployments"``.

        Raises:
            RuntimeError: with the deployments launcher, the learner deployment does not exist.
        """
        if self.deployer is None:
            return super().learner_handle(index, incarnation)
        return self.deployer.start_learner(index, incarnation, {
            "sync_url": self.learner_sync_url, "store_url": self.store.url, "run_id": self.run_id,
            **self.group_parameters()}, env=_host_env(self.learner_env(f"learner-{index}")))

    def group_parameters(self) -> dict[str, Any]:
        """The learner deployment's torchrun-group parameters (``learners.*``), when a learner spans
        several processes; none otherwise (the deployment's defaults: one process)."""
        lc = self.cfg.learners
        if lc.ranks_per_learner == 1:
            return {}
        return {"launch": {"nproc_per_learner": lc.nproc_per_learner, "nnodes": lc.nnodes,
                           "rdzv_endpoint": lc.rdzv_endpoint, "group_timeout_s": lc.group_timeout_s}}

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


def _watch(run: TrainingRun, sink: MlflowSink, console: Console,
           pending: Callable[[], list[dict]] = list) -> None:
    """Pull metrics (and the points ``pending`` hands over) into MLflow until the synchronizer
    exits; restart learners that die; show progress. A SIGTERM to this process meanwhile (Prefect
    raises ``TerminationSignal``) stops the run cleanly, as Ctrl-C does: the synchronizer gets it,
    writes its final checkpoint and tells the learners to stop. A cancellation sent by a Prefect
    worker is left to Prefect."""
    cfg = run.cfg
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("{task.fields[info]}"), TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
                  console=console, transient=False, disable=not console.is_terminal) as progress:
        bars = (progress.add_task("tokens", total=cfg.budget.tokens, info=""),
                progress.add_task("merges", total=None, info=""))
        last_print = [0.0]
        while run.sync is not None and run.synchronizer_running():
            try:
                _watch_once(run, sink, console, progress, bars, last_print, pending)
            except TerminationSignal as sig:
                if worker_intent() is not None:
                    raise
                get_run_logger().warning("%s: stopping the run cleanly (final checkpoint)",
                                         signal.Signals(sig.signal).name)
                run.signal_synchronizers(sig.signal)  # the synchronizer's clean stop; its stop reason names it
    sink.log_points(run.pull_metrics())


def _watch_once(run: TrainingRun, sink: MlflowSink, console: Console, progress: Progress, bars: tuple,
                last_print: list[float], pending: Callable[[], list[dict]]) -> None:
    """One pass of :func:`_watch`: metrics, status, supervision, then a pause that ends early when
    the synchronizer exits."""
    cfg = run.cfg
    sink.log_points(run.pull_metrics() + pending())
    st = run.status()
    if st is not None:
        rate = st["tokens_processed"] / st["wall_s"] if st.get("wall_s") else 0.0
        progress.update(bars[0], completed=st["tokens_processed"],
                        info=f"{rate:,.0f} tokens/s, goodput {st['compute_goodput']:.2f}")
        live = sum(1 for v in st["learners"].values() if v["live"])
        progress.update(bars[1], completed=st["merges"],
                        info=f"{live} live learners, versions {min(st['versions'].values())}+")
        if not console.is_terminal and time.monotonic() - last_print[0] > 15:
            last_print[0] = time.monotonic()
            print(f"[{st['wall_s']:.0f}s] tokens {st['tokens_processed']}, merges {st['merges']}, "
                  f"live learners {live}, compute goodput {st['compute_goodput']:.3f}", flush=True)
    if run.synchronizer_running():  # supervise only while the synchronizer is still running
        _log_restarts(run, sink, run.supervise())
    pause = cfg.tracking.poll_s
    due = run.supervisor.next_due()
    if due is not None:
        pause = min(pause, max(0.05, due - time.monotonic()))
    run.pause_while_running(pause)


def _log_goodput_timeline(run: TrainingRun, sink: MlflowSink, summary: dict) -> None:
    """The per-learner goodput timeline of this epoch as a PNG and its accounting as JSON, when
    the learners' records are on this machine (local launcher; a learner flow run of the deployments
    launcher may run on another host and keeps none)."""
    png = run.workdir / f"goodput_timeline-{run.epoch}.png"
    try:
        acc = write_run_timeline(run.cfg, run.store, run.run_id, str(run.epoch), run.workdir / "timeline", png,
                                 float(summary.get("uptime_max_gap_s", 30.0)), ledger=summary)
    except (OSError, ValueError) as err:
        log.warning("no goodput timeline: %s", err)
        return
    if acc is None:
        return
    sink.log_artifact(png)
    sink.log_dict(acc, f"goodput_timeline-{run.epoch}.json")
    summary["timeline_compute_goodput"] = acc["compute_goodput"]


def _execute(run: TrainingRun, sink: MlflowSink, eval_start: tuple[float, float],
             incarnations: dict[int, int]) -> dict:
    """Start the synchronizer and the learners, watch them, evaluate the final model."""
    logger = get_run_logger()
    cfg = run.cfg
    console = Console(stderr=False, width=None if sys.stdout.isatty() else 110)
    t0 = time.monotonic()
    sink.start_children(f"learner-{i}" for i in range(cfg.learners.count))
    run.start_synchronizer()
    logger.info("starting %d learners, synchronizer at %s", cfg.learners.count, " ".join(run.shard_urls))
    for i in range(cfg.learners.count):
        run.start_learner(i, incarnations.get(i, 0))
    with heldout_curve(cfg, run.store, run.run_id, sink) as pending:
        _watch(run, sink, console, pending)
    code = run.wait_synchronizers()
    run.finished_cleanly = code == 0
    if code != 0:
        raise RuntimeError(f"synchronizer exited with code {code}; logs: {run.workdir / 'logs'}")
    sink.log_points(run.remaining_metrics_from_store())
    summary = run.final_summary()
    log_rounds(sink, run.store, run.run_id, str(run.epoch), f"rounds-{run.epoch}.jsonl" if run.resume_url else
               "rounds.jsonl")
    if stopped_by_signal(summary):
        return interrupted(run, sink, summary, eval_start, t0)
    ckpt = run.final_checkpoint()
    if ckpt is None:
        raise RuntimeError("no verified checkpoint at the end of the run")
    final_model = model_from_checkpoint(cfg, ckpt)
    eval_final, bpb_final = evaluate(cfg, final_model)
    summary.update(eval_loss_initial=eval_start[0], eval_loss_final=eval_final,
                   eval_bits_per_byte_initial=eval_start[1], eval_bits_per_byte_final=bpb_final,
                   tokenizer=cfg.data.tokenizer, eval_loss_run_initial=run.run_initial_loss,
                   flow_wall_s=time.monotonic() - t0, mlflow_run_id=sink.run_id,
                   checkpoint_seq=ckpt.seq, store_url=run.store.url, logs=run_logs(run, sink),
                   launcher=cfg.run.launcher,
                   learner_restarts=len(run.supervisor.restarts),
                   restarts=[{"learner": f"learner-{r.index}", "incarnation": r.incarnation, "reason": r.reason}
                             for r in run.supervisor.restarts])
    step = int(summary["merges"])
    sink.log_metric("eval/loss", eval_final, step)
    sink.log_metric("eval/final_loss", eval_final, step)
    sink.log_metric("eval/bits_per_byte", bpb_final, step)
    sink.log_metric("goodput/uptime", summary["uptime"], step)
    for d in ("up", "down"):  # the final figures (the stream carried them through the run)
        if summary.get(f"bytes_{d}_per_token") is not None:
            sink.log_metric(f"net/bytes_{d}_per_token", summary[f"bytes_{d}_per_token"], step)
    for key in SLICE_FIGURES if cfg.data.slices else ():  # the slice ledger's accounting (DESIGN §5.2)
        sink.log_metric(f"data/{key}", summary.get(key, 0), step)
    summary["model_uri"] = log_run_artifacts(sink, final_model, cfg.model,
                                             (run.store, keys.final_model_prefix(run.run_id, str(run.epoch))),
                                             samples=cfg.data.tokenizer == "bytes", tokenizer=hf_tokenizer(cfg),
                                             sample_text=final_samples(cfg, final_model, step, sink))
    summary["registered_model"] = register_final_model(sink, summary["model_uri"], cfg.tracking.register_model)
    _log_goodput_timeline(run, sink, summary)
    sink.log_dict(summary, f"summary-{run.epoch}.json" if run.resume_url else "summary.json")
    console.print(summary_table(summary))
    logger.info("run %s finished: eval loss %.4f -> %.4f nats/token, %.4f -> %.4f bits/byte, compute goodput %.3f",
                run.run_id, eval_start[0], eval_final, eval_start[1], bpb_final, summary["compute_goodput"])
    return summary


@contextmanager
def _stopping(run: TrainingRun, sink: MlflowSink) -> Iterator[None]:
    """Whatever happens inside, stop every process of the run and end the MLflow run: FINISHED,
    FAILED (an error) or KILLED (cancelled: TerminationSignal, Ctrl-C, SystemExit; or stopped
    cleanly by a signal, :func:`diloco_async.flows.run_end.interrupted`)."""
    status = "FAILED"
    sink.start_system_metrics(run.cfg.tracking.system_metrics_s)
    try:
        yield
        status = "KILLED" if run.stopped else "FINISHED"
        if status == "FINISHED" and run.resume_url:  # no longer stopped: the resume finished it
            sink.clear_tag(STOPPED_TAG)
    except BaseException as err:
        if not isinstance(err, Exception):
            status = "KILLED"
        raise
    finally:
        run.stop_all()
        sink.end(status)


@flow(name="train", log_prints=True)
def train(config: str | None = "configs/default.toml", overrides: list[str] | None = None) -> dict:
    """Run one training job end to end and return its summary (also logged to MLflow).

    Args:
        config: path of a TOML recipe (None: built-in defaults).
        overrides: ``section.field=value`` strings applied on top of the recipe.
    """
    logger = get_run_logger()
    overrides = list(overrides or [])
    cfg = load_config(config, overrides)  # the one parse of the run's recipe: processes get the value
    prepare_prerequisites(cfg)  # the Hub is asked here, once per run; no learner ever asks it
    model0 = build_run_model(cfg)  # Θ^0, as the synchronizer builds it; a model that cannot be built stops here
    prepare_corpus(cfg)
    tokens = prepare_tokens(cfg)
    run = TrainingRun(cfg)
    sink = MlflowSink(cfg.tracking, cfg.run.store, cfg.run.storage_options)
    sink.start(f"{cfg.run.name}-{run.run_id}", flatten_params(cfg.public_dict()),
               {"diloco.run_id": run.run_id, "diloco.config_hash": config_hash(cfg),
                "diloco.store": run.store.url})
    log_corpus(sink, tokens["corpus_manifest"])  # provenance: every source shard and its digest (mlflow.log_input)
    links = link_mlflow_run(sink, cfg.tracking)
    with _stopping(run, sink):
        eval_initial = evaluate(cfg, model0)
        run.run_initial_loss = eval_initial[0]
        sink.log_metric("eval/loss", eval_initial[0], 0)
        sink.log_metric("eval/bits_per_byte", eval_initial[1], 0)
        logger.info("run %s: initial held-out loss %.4f nats/token, %.4f bits/byte", run.run_id, *eval_initial)
        sink.log_dict(cfg.public_dict(), "config.json")
        summary = _execute(run, sink, eval_initial, {})
        sink.log_dict(run.store.get_json(keys.plan_key(run.run_id)), "plan.json")
    return finish(run, summary, links)


@flow(name="resume", log_prints=True)
def resume(checkpoint_url: str, config: str | None = None, overrides: list[str] | None = None) -> dict:
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
    # the store's options (an S3 endpoint) as every other entry point takes them: DILOCO_STORAGE_OPTIONS;
    # the stored config has none (secrets), so they are also the resumed run's when its config names none
    options = storage_options_from_env()
    given = resume_config(checkpoint_url, config, overrides, options)  # the one parse of the resume's config
    cfg, store, run_id, ckpt = open_run(checkpoint_url, given, options)
    if options and not cfg.run.storage_options:
        cfg = with_fields(cfg, {"run.storage_options": options})
    prepare_prerequisites(cfg)
    prepare_corpus(cfg)
    prepare_tokens(cfg)
    run = TrainingRun(cfg, run_id=run_id, resume_url=keys.checkpoint_url(store.url, run_id, ckpt.seq))
    sink = MlflowSink(cfg.tracking, cfg.run.store, cfg.run.storage_options)
    if not sink.resume(run_id):
        sink.start(f"{cfg.run.name}-{run_id}", flatten_params(cfg.public_dict()),
                   {"diloco.run_id": run_id, "diloco.config_hash": config_hash(cfg), "diloco.store": store.url})
    links = link_mlflow_run(sink, cfg.tracking)
    with _stopping(run, sink):
        eval_start = evaluate(cfg, model_from_checkpoint(cfg, ckpt))
        run.run_initial_loss = sink.first_value("eval/loss")
        logger.info("run %s: resuming from checkpoint %d, held-out loss %.4f nats/token, %.4f bits/byte", run_id,
                    ckpt.seq, *eval_start)
        incarnations = next_incarnations(ckpt.manifest)
        summary = _execute(run, sink, eval_start, incarnations)
    return finish(run, summary, links)


def run_resume_cli(checkpoint_url: str, config: str | None, overrides: list[str]) -> int:
    """Entry of ``diloco-async resume``: exit code 0 on success, 128 + N after a stop by signal N."""
    try:
        summary = resume(checkpoint_url=checkpoint_url, config=config, overrides=overrides)
    except Exception as err:
        print(f"resume failed: {err}", file=sys.stderr)
        return 1
    report(summary)
    return exit_status(summary)


def run_train_cli(config: str | None, overrides: list[str]) -> int:
    """Entry of ``diloco-async train``: run the flow, print where to look; exit code 0 on success,
    128 + N after a stop by signal N."""
    try:
        summary = train(config=config, overrides=overrides)
    except KeyboardInterrupt:
        raise
    except Exception as err:
        print(f"training failed: {err}", file=sys.stderr)
        return 1
    report(summary)
    return exit_status(summary)
