"""Prefect flow ``ablate`` and ``diloco-async ablate --suite FILE``: the paper's ablations, run by
the product itself, with intervals and a verdict per claim.

For a suite file (:mod:`diloco_async.ablation.suite`) every (arm, seed) is one real run: the
synchronizer and ``learners.count`` learner processes through
:class:`~diloco_async.run.RunProcesses` (what ``train`` uses), a store, the same token budget
for every arm; then the held-out loss of the final global model. Each run is one MLflow run
nested under the suite's parent run; its record (figures, overrides, wall time) is saved as
``{out}/runs/{arm}-s{seed}.json`` the moment it finishes, so an interrupted suite restarted with
the same out folder skips every finished (arm, seed) whose overrides are unchanged.

Scheduling: one run at a time. A run already keeps both cores busy (M >= 2 learner processes at
one torch thread each, plus the synchronizer); two at once would only share the same two cores
and make their step times, hence goodput and the heterogeneity arms, noisier. Seeds are the outer
loop (every arm of seed 0, then seed 1, ...) so an interrupted suite already has complete pairs.

The report (:mod:`diloco_async.flows.ablate_report`): a markdown table, bar charts with 95% intervals (PNG),
both logged to the parent MLflow run, and the table in the terminal.
"""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
import time
from pathlib import Path

from prefect import flow, get_run_logger

from diloco_async.ablation.analysis import analyse
from diloco_async.ablation.suite import Arm, Suite, arm_overrides, figures_of, load_suite, run_config, run_fields
from diloco_async.config.schema import load_config
from diloco_async.flows.ablate_report import write_report
from diloco_async.flows.resolve import check_arms
from diloco_async.flows.tracking import MlflowSink, flatten_params
from diloco_async.flows.train import prepare_corpus
from diloco_async.metrics.evaluation import heldout_loss, heldout_split, model_from_checkpoint
from diloco_async.run import RunProcesses
from diloco_async.storage import keys
from diloco_async.storage.checkpoint import latest_checkpoint

__all__ = ["ablate", "run_ablate_cli", "record_path", "load_records"]

log = logging.getLogger("diloco.flows.ablate")

#: the summary fields every run record keeps besides its figures
_KEPT = ("stop_reason", "tokens_processed", "wall_s", "merges", "compute_goodput", "token_goodput", "uptime",
         "bytes_in", "bytes_out", "contributions_merged", "contributions_late", "rounds_abandoned")


def record_path(out: Path, arm: str, seed: int) -> Path:
    """Where the record of (arm, seed) is saved."""
    return out / "runs" / f"{arm}-s{seed}.json"


def load_records(out: Path, suite: Suite, extra: list[str]) -> dict[tuple[str, int], dict]:
    """The saved records of ``suite`` under ``out`` whose overrides are those this suite would
    use now and that hold every figure it asks for (a record from an edited suite, another budget,
    other ``extra`` overrides or a shorter ``figures`` list is stale and not returned); (arm,
    seed) -> record."""
    out_ = {}
    for arm in suite.arms:
        for seed in suite.suite.seeds:
            p = record_path(out, arm.name, seed)
            try:
                rec = json.loads(p.read_text())
            except (OSError, ValueError):
                continue
            figures = rec.get("figures") or {}
            if rec.get("overrides") == arm_overrides(suite, arm, extra) \
                    and rec.get("fields") == run_fields(suite, arm, seed) \
                    and rec.get("synchronous", False) == arm.synchronous and figures \
                    and set(suite.suite.figures) <= set(figures):
                out_[(arm.name, seed)] = rec
    return out_


def _save(path: Path, record: dict) -> None:
    """Write atomically: a suite killed mid-write leaves no half record behind."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1))
    os.replace(tmp, path)


def _drive(run: RunProcesses, sink: MlflowSink) -> dict:
    """Start the synchronizer and the learners, relay metrics and supervise until the
    synchronizer exits; return its summary.

    Raises:
        RuntimeError: the synchronizer exited with a non-zero code.
    """
    cfg = run.cfg
    run.start_synchronizer()
    for i in range(cfg.learners.count):
        run.start_learner(i, 0)
    while run.sync.poll() is None:
        sink.log_points(run.pull_metrics())
        if run.sync.poll() is None:
            run.supervise()
        try:
            run.sync.wait(timeout=cfg.tracking.poll_s)
        except subprocess.TimeoutExpired:
            pass
    code = run.sync.wait()
    run.finished_cleanly = code == 0
    if code != 0:
        raise RuntimeError(f"synchronizer exited with code {code}; log: {run.sync.log_path}")
    sink.log_points(run.remaining_metrics_from_store())
    return run.store.get_json(keys.summary_key(run.run_id, str(run.epoch)))


def run_one(suite: Suite, arm: Arm, seed: int, extra: list[str], parent_id: str) -> dict:
    """One real run of ``arm`` at ``seed`` as a nested MLflow run; returns its record.

    Raises:
        RuntimeError: the run failed (synchronizer exit code, no checkpoint); its processes are
            stopped and its MLflow run ends FAILED. KeyboardInterrupt: stopped, MLflow run KILLED.
    """
    s = suite.suite
    overrides = arm_overrides(suite, arm, extra)
    cfg = run_config(suite, arm, seed, load_config(s.config, overrides))  # the one parse of this run's recipe
    run = RunProcesses(cfg)
    sink = MlflowSink(cfg.tracking, cfg.run.store, cfg.run.storage_options)
    sink.start(f"ablate-{s.name}-{arm.name}-s{seed}", flatten_params(cfg.public_dict()),
               {"mlflow.parentRunId": parent_id, "diloco.run_id": run.run_id, "diloco.ablate.suite": s.name,
                "diloco.ablate.arm": arm.name, "diloco.ablate.seed": str(seed)})
    status, t0 = "FAILED", time.monotonic()
    try:
        summary = _drive(run, sink)
        ckpt = latest_checkpoint(run.store, run.run_id)
        if ckpt is None:
            raise RuntimeError("no verified checkpoint at the end of the run")
        loss = heldout_loss(model_from_checkpoint(cfg, ckpt), heldout_split(cfg).batches)
        figures = figures_of(summary, loss, s.figures)
        if not str(summary.get("stop_reason", "")).startswith("token budget reached"):
            log.warning("%s seed %d stopped before its token budget (%s): not at equal tokens",
                        arm.name, seed, summary.get("stop_reason"))
        record = {"suite": s.name, "arm": arm.name, "seed": seed, "overrides": overrides,
                  "fields": run_fields(suite, arm, seed), "synchronous": arm.synchronous, "run_id": run.run_id,
                  "mlflow_run_id": sink.run_id, "figures": figures, "run_wall_s": time.monotonic() - t0,
                  "summary": {k: summary.get(k) for k in _KEPT}}
        for name, value in figures.items():
            if value is not None:
                sink.log_metric(f"ablate/{name}", value)
        sink.log_dict(record, "ablate_record.json")
        status = "FINISHED"
        return record
    except KeyboardInterrupt:
        status = "KILLED"
        raise
    finally:
        run.stop_all()
        sink.end(status)


def _plan(suite: Suite, done: dict, arms: list[str] | None, seeds: list[int] | None) -> list[tuple[Arm, int]]:
    """The (arm, seed) runs still to do, seed-major."""
    chosen = [a for a in suite.arms if arms is None or a.name in arms]
    return [(a, seed) for seed in suite.suite.seeds if seeds is None or seed in seeds
            for a in chosen if (a.name, seed) not in done]


def _out_folder(suite: Suite, out: str | None) -> Path:
    return Path(out or f".local/ablate/{suite.suite.name}").resolve()


@flow(name="ablate", log_prints=True)
def ablate(suite: str, overrides: list[str] | None = None, out: str | None = None,
           arms: list[str] | None = None, seeds: list[int] | None = None) -> dict:
    """Run every (arm, seed) of a suite not already finished under ``out``, then write the report.

    Args:
        suite: path of a suite file (``configs/ablations/*.toml``).
        overrides: ``section.field=value`` applied to every run after the suite's own (where the
            store, the process logs and MLflow go; part of each record's identity).
        out: the suite's folder (records, report); default ``.local/ablate/{suite name}``.
        arms, seeds: run only these (default: all); the report covers every saved record.

    Returns:
        ``{"suite", "out", "report_md", "charts", "rows", "missing", "runs_done", "runs_skipped", "failed"}``;
        ``rows``: one dict per comparison (figure, both arms' means and intervals, the difference
        and its interval, the verdict).

    Raises:
        ValueError: a bad suite file, or an arm whose recipe does not validate.
    """
    logger = get_run_logger()
    sp = load_suite(suite)
    extra = list(overrides or [])
    cfgs = check_arms(sp, extra)
    cfg0 = cfgs[sp.arms[0].name]
    prepare_corpus(cfg0)
    outdir = _out_folder(sp, out)
    done = load_records(outdir, sp, extra)
    todo = _plan(sp, done, arms, seeds)
    logger.info("suite %s: %d arms x %d seeds, %d tokens per run; %d runs saved in %s, %d to run",
                sp.suite.name, len(sp.arms), len(sp.suite.seeds), sp.suite.tokens, len(done), outdir, len(todo))
    parent = MlflowSink(cfg0.tracking, cfg0.run.store, cfg0.run.storage_options)
    parent.start(f"ablate-{sp.suite.name}", flatten_params({"suite": sp.model_dump()}),
                 {"diloco.ablate.suite": sp.suite.name, "diloco.ablate.out": str(outdir)})
    status, failed, ran = "FAILED", [], 0
    try:
        for arm, seed in todo:
            logger.info("run %d/%d: arm %s, seed %d", ran + len(failed) + 1, len(todo), arm.name, seed)
            try:
                rec = run_one(sp, arm, seed, extra, parent.run_id or "")
            except (RuntimeError, OSError, TimeoutError) as err:
                failed.append(f"{arm.name}-s{seed}: {err}")
                logger.error("arm %s seed %d failed: %s", arm.name, seed, err)
                continue
            _save(record_path(outdir, arm.name, seed), rec)
            done[(arm.name, seed)] = rec
            ran += 1
            logger.info("arm %s seed %d: %s in %.0f s", arm.name, seed, _brief(rec["figures"]), rec["run_wall_s"])
        result = _report(sp, list(done.values()), outdir, parent)
        status = "FINISHED"
    except KeyboardInterrupt:
        status = "KILLED"
        raise
    finally:
        parent.end(status)
    return {**result, "suite": sp.suite.name, "out": str(outdir), "runs_done": ran,
            "runs_skipped": len(done) - ran, "failed": failed}


def _brief(figures: dict) -> str:
    return ", ".join(f"{k} {v:.4g}" for k, v in figures.items() if isinstance(v, float) and math.isfinite(v))


def _report(sp: Suite, records: list[dict], outdir: Path, parent: MlflowSink) -> dict:
    """Analyse the records, write the markdown and the charts, log them to the parent run."""
    analysis = analyse(sp, records)
    md, charts, rows = write_report(sp, analysis, outdir)
    parent.log_artifact(md)
    for png in charts:
        parent.log_artifact(png, "charts")
    parent.log_dict(rows, "ablate_rows.json")
    for i, r in enumerate(rows):
        if r["diff_mean"] is not None:
            parent.log_metric(f"ablate/row{i}/diff_mean", r["diff_mean"])
    return {"report_md": str(md), "charts": [str(c) for c in charts], "rows": rows,
            "missing": [f"{a}-s{s}" for a, s in analysis.missing]}


def run_ablate_cli(suite: str, overrides: list[str], out: str | None, as_json: bool = False) -> int:
    """Entry of ``diloco-async ablate``: run the suite, print the table; exit 0 when every run of
    the suite has a record, 1 when a run failed or the flow failed."""
    from diloco_async.flows.ablate_report import print_table

    try:
        result = ablate(suite=suite, overrides=overrides, out=out)
    except Exception as err:
        print(f"ablate failed: {err}", file=sys.stderr)
        return 1
    print_table(result["suite"], result["rows"])
    print(f"report: {result['report_md']}; charts: {', '.join(result['charts']) or 'none'}; "
          f"{result['runs_done']} runs done, {result['runs_skipped']} reused from {result['out']}/runs")
    for line in result["failed"]:
        print(f"failed: {line}", file=sys.stderr)
    if as_json:
        print(json.dumps(result["rows"]))
    return 1 if result["failed"] or result["missing"] else 0
