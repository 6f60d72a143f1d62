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

import contextlib
import json
import math
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from prefect import flow, get_run_logger
from prefect.exceptions import CancelledRun
from prefect.states import Cancelled
from rich.console import Console
from rich.table import Table

from diloco_async.chaos.measure import Measurement, learner_shares, measure, speed_weighted_goodput, step_stats
from diloco_async.chaos.scenario import (
    FaultEvent,
    Scenario,
    Schedule,
    load_scenario,
    make_schedule,
    method_config,
    with_user_overrides,
)
from diloco_async.chaos.targets import DdpTarget, DilocoTarget
from diloco_async.config.schema import Config, load_config
from diloco_async.flows.timeline_report import plot_timeline
from diloco_async.flows.tracking import MlflowSink, flatten_params
from diloco_async.flows.train import prepare_corpus
from diloco_async.metrics.evaluation import heldout_batches
from diloco_async.metrics.timeline import Timeline

__all__ = ["chaos", "run_chaos_cli", "MethodResult", "scenario_recipe", "link_skip", "learners_table"]

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
    #: DiLoCo methods: each slot's merged share against its compute share
    #: (:func:`~diloco_async.chaos.measure.learner_shares`); [] for DDP
    learners: list[dict] = field(default_factory=list, repr=False)
    #: compute goodput in compute actually available (:func:`~diloco_async.chaos.measure.speed_weighted_goodput`)
    speed_weighted_compute_goodput: float = 0.0

    def row(self) -> dict:
        return {"method": self.method, **{k: getattr(self, k) for k in TABLE_FIELDS},
                "availability": self.availability, "tokens_merged": self.tokens_merged,
                "failures": self.failures, "restarts": self.restarts, "mlflow_run_id": self.mlflow_run_id,
                "eval_curve": [list(c) for c in self.curve], "learners": self.learners,
                "speed_weighted_compute_goodput": self.speed_weighted_compute_goodput}


def _up_s(tl: Timeline, slots: int) -> list[float]:
    """Seconds each slot was not down over the whole timeline (a slot not in it: 0)."""
    span = tl.end_s - tl.start_s
    out = []
    for i in range(slots):
        lid = f"slot-{i}"
        down = sum(max(0.0, min(iv.t1, tl.end_s) - max(iv.t0, tl.start_s))
                   for iv in tl.intervals if iv.learner == lid and iv.state == "down")
        out.append(max(0.0, span - down) if lid in tl.learners else 0.0)
    return out


@dataclass(frozen=True)
class _Where:
    """Where a method's processes run: ``place``, the placement of a scenario with a ``[link]``
    (:class:`~diloco_async.wan.slot_link.SlotLinkPlacement`; None: every process here), and
    ``skip``, the slots whose learner does not run, with the reason."""

    place: object | None = None
    skip: dict[int, str] = field(default_factory=dict)


def _target(sc: Scenario, method: str, base: Config, cfg0: Config, sink: MlflowSink, where: _Where):
    """The method's target: DDP's, a DiLoCo target in the link's placement, or a DiLoCo target
    here with the skipped slots left out."""
    if method == "ddp":
        return DdpTarget(sc, cfg0)
    if where.place is not None:
        from diloco_async.wan.methods import WanDilocoTarget

        return WanDilocoTarget(sc, method, base, where.place, None,  # type: ignore[arg-type]
                               on_metrics=sink.log_points)
    return DilocoTarget(sc, cfg0, on_metrics=sink.log_points, skip=dict(where.skip))


def _run_method(sc: Scenario, method: str, base: Config, events: list[FaultEvent], parent: MlflowSink,
                outdir: Path, batches, where: _Where = _Where()) -> MethodResult:
    """Run one method under the schedule as its own MLflow run (a child of ``parent``); ``base``: the
    scenario's recipe with every override, resolved once (:func:`scenario_recipe`); ``where``: the
    link's placement and the skipped slots."""
    s = sc.scenario
    cfg0 = method_config(sc, method, base)
    sink = MlflowSink(cfg0.tracking, cfg0.run.store, cfg0.run.storage_options)
    sink.start(f"chaos-{s.name}-{method}", flatten_params({"scenario": sc.model_dump(), "method": method}),
               {"mlflow.parentRunId": parent.run_id or "", "diloco.chaos.scenario": s.name,
                "diloco.chaos.method": method})
    status = "FAILED"
    try:
        target = _target(sc, method, base, cfg0, sink, where)
        run = target.run(events)
        m = measure(run.timeline, run.snapshots, run.cfg, batches, s.eval_tokens)
        acc = m.accounting
        speeds = sc.speed_factors()
        tl = run.timeline
        shares = [] if method == "ddp" else learner_shares(speeds, _up_s(tl, s.slots), run.ledgers, run.skipped,
                                                           step_stats(tl, s.slots))
        weighted = speed_weighted_goodput(acc, {f"slot-{i}": v for i, v in enumerate(speeds)})
        png = outdir / f"timeline-{method}.png"
        plot_timeline(run.timeline, png, mark_s=m.window_start_s,
                      title=f"{s.name}: {method} (compute goodput {acc.compute_goodput:.3f} from the dashed line)")
        res = MethodResult(method=method, compute_goodput=acc.compute_goodput, token_goodput=acc.token_goodput,
                           uptime=acc.uptime, eval_loss_equal_time=m.eval_loss_equal_time,
                           eval_loss_equal_tokens=m.eval_loss_equal_tokens, wall_s=acc.wall_s,
                           availability=acc.availability, tokens_merged=acc.to_json()["tokens_merged"],
                           failures=run.slots.failures, restarts=run.slots.restarts, accounting=acc.to_json(),
                           timeline_png=str(png), mlflow_run_id=sink.run_id or "", curve=m.curve,
                           learners=shares, speed_weighted_compute_goodput=weighted)
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
    for ln in res.learners:
        for key in ("compute_share", "processed_share", "merged_share", "tokens_merged"):
            if ln[key] is not None:
                sink.log_metric(f"chaos/slot-{ln['slot']}/{key}", float(ln[key]))
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


def link_skip(sc: Scenario) -> dict[int, str]:
    """Slot -> why it is skipped: the slot of a shaped ``[link]`` that cannot be built on this
    machine (not root, no ``tc``; :func:`~diloco_async.wan.slot_link.link_skip_reason`); {} otherwise.
    Decided on the scenario as written, so its full-speed baseline skips the same slot."""
    from diloco_async.wan.slot_link import link_skip_reason

    why = link_skip_reason(sc.link)
    return {} if why is None or sc.link is None else {sc.link.slot: why}


@contextlib.contextmanager
def _placement(sc: Scenario, skip: dict[int, str], workdir: Path) -> Iterator[object | None]:
    """The link's placement of a scenario with a ``[link]`` whose slot is not skipped
    (:func:`~diloco_async.wan.slot_link.slot_link_placement`), else None (every process here)."""
    if sc.link is None or sc.link.slot in skip:
        yield None
        return
    from diloco_async.wan.slot_link import slot_link_placement

    with slot_link_placement(sc, workdir) as place:
        yield place


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
          overrides: list[str] | None = None, log_table: bool = True, full_speed: bool = False) -> list[dict]:
    """Run every method of a chaos scenario under its fault schedule; return the table rows.

    Args:
        scenario: path of a scenario TOML (``configs/chaos/``).
        methods: a subset of ``ddp``, ``sync-diloco``, ``decoupled`` (default: the scenario's).
        overrides: ``section.field=value`` applied to every method's recipe after the scenario's
            own (e.g. where the store, process logs and MLflow runs go).
        log_table: also write the table to the flow run's log (the CLI prints it itself).
        full_speed: run the scenario with every learner at full speed instead
            (:meth:`~diloco_async.chaos.scenario.Scenario.at_full_speed`: the heterogeneity bars' baseline).

    A scenario with a ``[link]`` runs in that link's placement (:mod:`diloco_async.wan.slot_link`:
    network namespaces, needs root); where it cannot be built, the link's slot is skipped (its
    learner never runs) in the scenario and in its full-speed baseline alike, and every row's
    ``learners`` says so.

    Returns:
        One dict per method: ``method``, ``compute_goodput``, ``token_goodput``, ``uptime``,
        ``eval_loss_equal_time``, ``eval_loss_equal_tokens`` (None when the method never had
        that many tokens in its model), ``wall_s``, plus ``availability``, ``tokens_merged``,
        ``failures``, ``restarts``, ``mlflow_run_id``, ``learners`` (each slot's merged share
        against its compute share, DiLoCo methods) and ``speed_weighted_compute_goodput``.

    Raises:
        ValueError: a bad scenario file or an unknown method.
        CancelledRun: Ctrl-C stopped it (flow run Cancelled, processes stopped, MLflow runs KILLED).
    """
    logger = get_run_logger()
    sc, chosen = _scenario_and_methods(scenario, methods, overrides)
    skip = link_skip(sc)
    if full_speed:
        sc = sc.at_full_speed()
    schedule = make_schedule(sc)
    cfg = method_config(sc, "decoupled", base := scenario_recipe(sc))  # the recipe parsed once, for every method
    batches = _prepare(cfg)
    parent, outdir = _parent_run(sc, cfg)
    logger.info("scenario %s: %d slots, %.0f s per method, %d fault events, planned availability %.3f",
                sc.scenario.name, sc.scenario.slots, sc.scenario.wall_s, len(schedule.events), schedule.availability())
    status, m = "FAILED", chosen[0]
    rows: list[dict] = []
    if skip:
        logger.warning("skipped: %s", "; ".join(f"slot {slot}: {why}" for slot, why in skip.items()))
    try:
        with _placement(sc, skip, Path(cfg.run.workdir)) as place:
            for m in chosen:
                rows.append(_one_method(sc, m, base, schedule, parent, outdir, batches, _Where(place, skip)))
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
        _log_table(sc, rows, schedule.availability())
    return rows


def _one_method(sc: Scenario, m: str, base: Config, schedule: Schedule, parent: MlflowSink, outdir: Path,
                batches: list, where: _Where) -> dict:
    """Run method ``m`` of the scenario under its fault ``schedule``; its table row."""
    logger = get_run_logger()
    logger.info("method %s: starting", m)
    res = _run_method(sc, m, base, list(schedule.events), parent, outdir, batches, where)
    parent.log_artifact(res.timeline_png)
    logger.info("method %s: compute goodput %.3f, token goodput %.3f, eval loss %.4f", m,
                res.compute_goodput, res.token_goodput, res.eval_loss_equal_time)
    return res.row()


def _log_table(sc: Scenario, rows: list[dict], availability: float) -> None:
    """The scenario's table in the flow run's log."""
    console = Console(width=140, record=True, file=open(os.devnull, "w"))
    console.print(_table(sc.scenario.name, rows, availability))
    get_run_logger().info("\n%s", console.export_text())


def _prepare(cfg: Config) -> list:
    """The corpus made ready and the held-out batches; one thread per process from here on."""
    prepare_corpus(cfg)
    batches = heldout_batches(cfg)
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the fork server and every process forked from it
    return batches


def _parent_run(sc: Scenario, cfg: Config) -> tuple[MlflowSink, Path]:
    """The scenario's parent MLflow run, started, and its output folder (made) under the run's workdir."""
    parent = MlflowSink(cfg.tracking, cfg.run.store, cfg.run.storage_options)
    parent.start(f"chaos-{sc.scenario.name}", flatten_params({"scenario": sc.model_dump()}),
                 {"diloco.chaos.scenario": sc.scenario.name})
    outdir = Path(cfg.run.workdir).resolve() / f"chaos-{sc.scenario.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    outdir.mkdir(parents=True, exist_ok=True)
    return parent, outdir


def _fmt_share(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.3f}"


def learners_table(name: str, row: dict) -> Table:
    """One method's ``learners`` (:func:`~diloco_async.chaos.measure.learner_shares`) as a table:
    per slot its speed, what makes it different, its nominal compute share (speed x time up), its
    measured one (time up x its tokens per second inside steps), its share of the tokens processed,
    its merged share of the tokens, that over its measured compute share and over its processed
    share, the tokens it had merged and its contributions by outcome."""
    t = Table(title=f"{name}, {row['method']}: each learner's merged share of the tokens against its share of "
                    f"the compute (nominal: speed x time up; measured: time up x step rate; done: tokens processed)")
    for col in ("slot", "speed", "note", "nominal share", "measured share", "processed share", "merged share",
                "merged / measured", "merged / processed", "tokens merged", "contributions"):
        t.add_column(col, justify="left" if col in ("slot", "note", "contributions") else "right")
    for ln in row["learners"]:
        contrib = ", ".join(f"{k} {v}" for k, v in sorted(ln["contributions"].items())) or "none"
        t.add_row(f"slot-{ln['slot']}", f"{ln['speed']:g}", ln.get("note") or ("skipped: " + ln["skipped"]
                                                                             if ln["skipped"] else ""),
                  _fmt_share(ln["compute_share"]), _fmt_share(ln.get("capacity_share")),
                  _fmt_share(ln.get("processed_share")), _fmt_share(ln["merged_share"]),
                  _fmt_share(ln.get("merged_over_capacity")), _fmt_share(ln.get("merged_over_processed")),
                  f"{ln['tokens_merged']:.0f}", contrib)
    return t


def _notes(sc: Scenario, skip: dict[int, str], full_speed: bool) -> dict[int, str]:
    """Slot -> what sets it apart in the run (slow storage, the shaped link, skipped)."""
    notes: dict[int, str] = {}
    st = sc.storage
    if st.slots and not full_speed and (st.p_slow or st.p_transient):
        for i in st.slots:
            notes[i] = f"storage: p_slow {st.p_slow:g} x {st.slow_s:g} s on {','.join(st.ops or ['every op'])}"
    if sc.link is not None:
        i = sc.link.slot
        notes[i] = (f"skipped: {skip[i]}" if i in skip else
                    "link unshaped (full-speed baseline)" if full_speed else
                    f"link {sc.link.up_mbit:g}/{sc.link.down_mbit:g} Mbit/s, {sc.link.delay_ms:g} ms")
    return notes


def run_chaos_cli(scenario: str, methods: list[str] | None, as_json: bool,
                  overrides: list[str] | None = None, out: str | None = None, full_speed: bool = False) -> int:
    """Entry of ``diloco-async chaos``; ``out``: also write the full rows (with ``availability``,
    ``tokens_merged``, ``failures``, ``eval_curve`` and ``learners``) there as JSON, with the
    scenario's name, ``wall_s``, ``seed`` (``run.seed``), ``full_speed``, ``speeds`` and ``skipped``;
    ``full_speed``: the scenario's full-speed baseline (:func:`chaos`)."""
    try:
        rows = chaos(scenario=scenario, methods=methods, overrides=list(overrides or []), log_table=False,
                     full_speed=full_speed)
    except CancelledRun as err:
        print(f"chaos run stopped: {err}", file=sys.stderr)
        return 130
    except Exception as err:
        print(f"chaos run failed: {err}", file=sys.stderr)
        return 1
    sc, _ = with_user_overrides(load_scenario(scenario), overrides, methods)
    skip = link_skip(sc)
    run_sc = sc.at_full_speed() if full_speed else sc
    availability = make_schedule(sc).availability()
    notes = _notes(sc, skip, full_speed)
    for r in rows:
        for ln in r["learners"]:
            ln["note"] = notes.get(ln["slot"], "")
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps({
            "scenario": sc.scenario.name, "availability": availability, "eval_tokens": sc.scenario.eval_tokens,
            "wall_s": sc.scenario.wall_s, "seed": scenario_recipe(sc).run.seed, "full_speed": full_speed,
            "speeds": run_sc.speed_factors(), "skipped": {str(k): v for k, v in skip.items()},
            "link": None if run_sc.link is None else run_sc.link.model_dump(), "rows": rows}, indent=1))
    console = Console(file=sys.stderr if as_json else sys.stdout, width=None if sys.stdout.isatty() else 140)
    console.print(_table(sc.scenario.name + (" at full speed" if full_speed else ""), rows, availability))
    if notes or any(v < 1.0 for v in run_sc.speed_factors()):
        for r in rows:
            if r["learners"]:
                console.print(learners_table(sc.scenario.name + (" at full speed" if full_speed else ""), r))
    if as_json:
        keys_ = ("method",) + TABLE_FIELDS
        print(json.dumps([{k: r[k] for k in keys_} for r in rows]))
    return 0
