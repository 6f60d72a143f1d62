"""Prefect flow ``chaos`` and ``diloco-async chaos``: one fault schedule, three methods.

For a scenario file (:mod:`diloco_async.chaos.scenario`) this runs, one after the other and on
the same processes, data, token budget and seeded fault schedule:

* ``ddp``: data-parallel with ``torch.distributed`` (gloo), gradients all-reduced every step;
  any failure tears the whole group down and, once every slot is back, the group restarts from
  its last checkpoint (``torchrun`` semantics, DESIGN §8);
* ``sync-diloco``: K = M, no grace window, learners wait at every round;
* ``decoupled``: K = 1 with the adaptive grace window.

The library does the work: :mod:`diloco_async.chaos.targets` applies the schedule to the real
processes of each method (SIGKILL of a slot's process group at a failure and a restart after
the drawn recovery delay, SIGSTOP/SIGCONT for stalls) and reads back every slot's timeline;
:mod:`diloco_async.chaos.measure` turns it into compute goodput, token goodput and uptime
(DESIGN §7) and reads the held-out loss at the end of the common wall time and at the
scenario's token count. This module is the flow: each method is one MLflow run (nested under one
parent run) with its timeline PNG, and the table.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from prefect import flow, get_run_logger
from prefect.exceptions import CancelledRun
from prefect.states import Cancelled
from rich.console import Console
from rich.table import Table

from diloco_async.chaos.measure import Measurement, measure
from diloco_async.chaos.scenario import (
    FaultEvent,
    Scenario,
    load_scenario,
    make_schedule,
    method_config,
    with_user_overrides,
)
from diloco_async.chaos.targets import DdpTarget, DilocoTarget
from diloco_async.config.schema import Config, load_config
from diloco_async.metrics.evaluation import heldout_batches
from diloco_async.metrics.timeline import Timeline
from flows.timeline_report import plot_timeline
from flows.tracking import MlflowSink, flatten_params
from flows.train import prepare_corpus

__all__ = ["chaos", "run_chaos_cli", "MethodResult", "scenario_recipe"]

TABLE_FIELDS = ("compute_goodput", "token_goodput", "uptime", "eval_loss_equal_time", "eval_loss_equal_tokens",
                "wall_s")


@dataclass
class MethodResult:
    """What one method achieved under the scenario (one row of the table)."""

    method: str
    compute_goodput: float
    token_goodput: float
    uptime: float
    eval_loss_equal_time: float
    eval_loss_equal_tokens: float | None
    wall_s: float
    availability: float
    tokens_merged: float
    failures: int
    restarts: int
    accounting: dict = field(repr=False)
    timeline_png: str = ""
    mlflow_run_id: str = ""
    #: held-out loss of each snapshot of the global model: (seconds, tokens, loss)
    curve: list[tuple[float, float, float]] = field(default_factory=list, repr=False)

    def row(self) -> dict:
        return {"method": self.method, **{k: getattr(self, k) for k in TABLE_FIELDS},
                "availability": self.availability, "tokens_merged": self.tokens_merged,
                "failures": self.failures, "restarts": self.restarts, "mlflow_run_id": self.mlflow_run_id,
                "eval_curve": [list(c) for c in self.curve]}


def _run_method(sc: Scenario, method: str, base: Config, events: list[FaultEvent], parent: MlflowSink,
                outdir: Path, batches) -> MethodResult:
    """Run one method under the schedule as its own MLflow run (a child of ``parent``); ``base``: the
    scenario's recipe with every override, resolved once (:func:`scenario_recipe`)."""
    s = sc.scenario
    cfg0 = method_config(sc, method, base)
    sink = MlflowSink(cfg0.tracking)
    sink.start(f"chaos-{s.name}-{method}", flatten_params({"scenario": sc.model_dump(), "method": method}),
               {"mlflow.parentRunId": parent.run_id or "", "diloco.chaos.scenario": s.name,
                "diloco.chaos.method": method})
    status = "FAILED"
    try:
        target = DdpTarget(sc, cfg0) if method == "ddp" else DilocoTarget(sc, cfg0, on_metrics=sink.log_points)
        run = target.run(events)
        m = measure(run.timeline, run.snapshots, run.cfg, batches, s.eval_tokens)
        acc = m.accounting
        png = outdir / f"timeline-{method}.png"
        plot_timeline(run.timeline, png, mark_s=m.window_start_s,
                      title=f"{s.name}: {method} (compute goodput {acc.compute_goodput:.3f} from the dashed line)")
        res = MethodResult(method=method, compute_goodput=acc.compute_goodput, token_goodput=acc.token_goodput,
                           uptime=acc.uptime, eval_loss_equal_time=m.eval_loss_equal_time,
                           eval_loss_equal_tokens=m.eval_loss_equal_tokens, wall_s=acc.wall_s,
                           availability=acc.availability, tokens_merged=acc.to_json()["tokens_merged"],
                           failures=run.slots.failures, restarts=run.slots.restarts, accounting=acc.to_json(),
                           timeline_png=str(png), mlflow_run_id=sink.run_id or "", curve=m.curve)
        _log_method(sink, res, m, run.timeline)
        status = "FINISHED"
        return res
    except KeyboardInterrupt:
        status = "KILLED"
        raise
    finally:
        sink.end(status)


def _log_method(sink: MlflowSink, res: MethodResult, m: Measurement, tl: Timeline) -> None:
    """The loss curve in tokens (one point per snapshot), the row's figures, each slot's compute
    goodput, the timeline PNG, the accounting and the timeline (goodput window) as JSON."""
    now_ms = int(time.time() * 1000)
    sink.log_points([{"key": "chaos/eval_loss_by_tokens", "value": loss, "step": int(tokens),
                      "timestamp_ms": now_ms} for _, tokens, loss in m.curve])
    for key, value in res.row().items():
        if isinstance(value, (int, float)) and value is not None and math.isfinite(value):
            sink.log_metric(f"chaos/{key}", float(value))
    for lid, a in m.accounting.learners.items():
        sink.log_metric(f"chaos/{lid}/compute_goodput", a.compute_goodput)
    sink.log_artifact(Path(res.timeline_png))
    sink.log_dict(m.accounting.to_json(), "goodput_accounting.json")
    sink.log_dict({"timeline": {"start_s": m.window_start_s, "end_s": tl.end_s, "merges_s": tl.merges_s,
                                "intervals": [iv.__dict__ for iv in tl.intervals]}}, "timeline.json")




def _table(name: str, rows: list[dict], availability: float) -> Table:
    t = Table(title=f"chaos scenario {name}: mean slot availability {availability:.3f}")
    for col in ("method", "compute goodput", "token goodput", "uptime", "eval loss @ equal time",
                "eval loss @ equal tokens", "wall s", "failures"):
        t.add_column(col, justify="left" if col == "method" else "right")
    for r in rows:
        eqt = "not reached" if r["eval_loss_equal_tokens"] is None else f"{r['eval_loss_equal_tokens']:.4f}"
        t.add_row(r["method"], f"{r['compute_goodput']:.3f}", f"{r['token_goodput']:.3f}", f"{r['uptime']:.3f}",
                  f"{r['eval_loss_equal_time']:.4f}", eqt, f"{r['wall_s']:.1f}", str(r["failures"]))
    return t


def scenario_recipe(sc: Scenario) -> Config:
    """The recipe of a chaos or WAN scenario with its overrides (the scenario file's, then the
    user's), parsed once: the base every method's config is built from (typed fields, no strings).

    Raises:
        FileNotFoundError: no such recipe. ValueError: an override or the recipe does not validate.
    """
    return load_config(sc.scenario.config, list(sc.scenario.overrides))


def _scenario_and_methods(scenario: str, methods: list[str] | None,
                          overrides: list[str] | None) -> tuple[Scenario, list[str]]:
    """The scenario file with the user's ``overrides`` after its own, and the methods to run.

    Raises:
        ValueError: a bad scenario file, an override of a field the harness sets, an unknown method.
    """
    return with_user_overrides(load_scenario(scenario), overrides, methods)


@flow(name="chaos", log_prints=True)
def chaos(scenario: str = "configs/chaos/storm-ci.toml", methods: list[str] | None = None,
          overrides: list[str] | None = None, log_table: bool = True) -> list[dict]:
    """Run every method of a chaos scenario under its fault schedule; return the table rows.

    Args:
        scenario: path of a scenario TOML (``configs/chaos/``).
        methods: a subset of ``ddp``, ``sync-diloco``, ``decoupled`` (default: the scenario's).
        overrides: ``section.field=value`` applied to every method's recipe after the scenario's
            own (e.g. where the store, process logs and MLflow runs go).
        log_table: also write the table to the flow run's log (the CLI prints it itself).

    Returns:
        One dict per method: ``method``, ``compute_goodput``, ``token_goodput``, ``uptime``,
        ``eval_loss_equal_time``, ``eval_loss_equal_tokens`` (None when the method never had
        that many tokens in its model), ``wall_s``, plus ``availability``, ``tokens_merged``,
        ``failures``, ``restarts`` and ``mlflow_run_id``.

    Raises:
        ValueError: a bad scenario file or an unknown method.
        CancelledRun: Ctrl-C stopped it (flow run Cancelled, processes stopped, MLflow runs KILLED).
    """
    logger = get_run_logger()
    sc, chosen = _scenario_and_methods(scenario, methods, overrides)
    schedule = make_schedule(sc)
    cfg = method_config(sc, "decoupled", base := scenario_recipe(sc))  # the recipe parsed once, for every method
    prepare_corpus(cfg)
    batches = heldout_batches(cfg)
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the fork server and every process forked from it
    parent = MlflowSink(cfg.tracking)
    parent.start(f"chaos-{sc.scenario.name}", flatten_params({"scenario": sc.model_dump()}),
                 {"diloco.chaos.scenario": sc.scenario.name})
    outdir = Path(cfg.run.workdir).resolve() / f"chaos-{sc.scenario.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    outdir.mkdir(parents=True, exist_ok=True)
    logger.info("scenario %s: %d slots, %.0f s per method, %d fault events, planned availability %.3f",
                sc.scenario.name, sc.scenario.slots, sc.scenario.wall_s, len(schedule.events), schedule.availability())
    status, m = "FAILED", chosen[0]
    rows: list[dict] = []
    try:
        for m in chosen:
            logger.info("method %s: starting", m)
            res = _run_method(sc, m, base, list(schedule.events), parent, outdir, batches)
            rows.append(res.row())
            parent.log_artifact(res.timeline_png)
            logger.info("method %s: compute goodput %.3f, token goodput %.3f, eval loss %.4f", m,
                        res.compute_goodput, res.token_goodput, res.eval_loss_equal_time)
        parent.log_dict(rows, "chaos_table.json")
        (outdir / "chaos_table.json").write_text(json.dumps(rows, indent=1))
        status = "FINISHED"
    except KeyboardInterrupt:  # Ctrl-C: the method's processes are stopped by now; the flow run ends Cancelled
        status = "KILLED"
        done = ", ".join(r["method"] for r in rows) or "none"
        return Cancelled(message=f"stopped by the operator during method {m}; methods finished: {done}")
    finally:
        parent.end(status)
    if log_table:
        console = Console(width=140, record=True, file=open(os.devnull, "w"))
        console.print(_table(sc.scenario.name, rows, schedule.availability()))
        logger.info("\n%s", console.export_text())
    return rows


def run_chaos_cli(scenario: str, methods: list[str] | None, as_json: bool,
                  overrides: list[str] | None = None, out: str | None = None) -> int:
    """Entry of ``diloco-async chaos``; ``out``: also write the full rows (with ``availability``,
    ``tokens_merged``, ``failures`` and ``eval_curve``) there as JSON."""
    try:
        rows = chaos(scenario=scenario, methods=methods, overrides=list(overrides or []), log_table=False)
    except CancelledRun as err:
        print(f"chaos run stopped: {err}", file=sys.stderr)
        return 130
    except Exception as err:
        print(f"chaos run failed: {err}", file=sys.stderr)
        return 1
    sc = load_scenario(scenario)
    availability = make_schedule(sc).availability()
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps({"scenario": sc.scenario.name, "availability": availability,
                                         "eval_tokens": sc.scenario.eval_tokens, "rows": rows}, indent=1))
    Console(file=sys.stderr if as_json else sys.stdout, width=None if sys.stdout.isatty() else 140).print(
        _table(sc.scenario.name, rows, availability))
    if as_json:
        keys_ = ("method",) + TABLE_FIELDS
        print(json.dumps([{k: r[k] for k in keys_} for r in rows]))
    return 0
