"""Prefect flow ``wan`` and ``diloco-async wan``: the methods of a WAN scenario over the same
shaped links (issue 13).

For a WAN scenario file (:mod:`diloco_async.wan.scenario`: a chaos scenario with ``[links]``,
``[target]`` and ``[budget]``) this builds the regions and their shaped links once
(:func:`diloco_async.wan.place.placement`: each link's rate verified, or the run refuses to
start), runs DDP, synchronous DiLoCo and Decoupled DiLoCo one after the other over them, each to
the same token budget (:mod:`diloco_async.wan.methods`), and reports per method
(:mod:`diloco_async.wan.report`): time to the target held-out loss (DDP's final one), bytes on
the wire per token from the veth counters, mean link utilisation and the link rate the method
needs to keep its learners busy. Each method is one MLflow run nested under the scenario's run.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

import torch
from prefect import flow, get_run_logger
from rich.console import Console
from rich.table import Table

from diloco_async.chaos.scenario import METHODS, with_user_overrides
from diloco_async.config.schema import Config
from diloco_async.flows.chaos import scenario_recipe
from diloco_async.flows.tracking import MlflowSink, flatten_params
from diloco_async.flows.train import prepare_corpus
from diloco_async.metrics.evaluation import heldout_batches
from diloco_async.models.transformer import ByteGPT
from diloco_async.wan.report import WireRun, json_row, ring_allreduce_bytes, target_loss
from diloco_async.wan.scenario import WanScenario, load_wan_scenario, wan_config

__all__ = ["wan", "run_wan_cli", "wan_table", "JSON_KEYS"]

#: the keys of each object ``diloco-async wan --json`` prints
JSON_KEYS = ("method", "time_to_target_s", "bytes_per_token", "eval_loss_equal_tokens", "link_rates")


def _scenario(path: str, methods: list[str] | None, overrides: list[str] | None) -> tuple[WanScenario, list[str]]:
    """The scenario with the user's overrides after its own, and the methods to run.

    Raises:
        ValueError: a bad scenario file, an override of a field the harness sets, an unknown method.
    """
    sc, chosen = with_user_overrides(load_wan_scenario(path), overrides, methods)
    return sc, sorted(chosen, key=METHODS.index)  # DDP first: its final loss is the target


def _log_method(sink: MlflowSink, row: dict, wire: WireRun) -> None:
    """Loss curve by tokens, every numeric figure, bytes per region and direction, the row as JSON."""
    now_ms = int(time.time() * 1000)
    sink.log_points([{"key": "wan/eval_loss_by_tokens", "value": loss, "step": int(tokens), "timestamp_ms": now_ms}
                     for _, tokens, loss in wire.curve])
    for key, value in row.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            sink.log_metric(f"wan/{key}", float(value))
    for region, c in wire.counters.items():
        for d in ("up_bytes", "down_bytes"):
            sink.log_metric(f"wan/{region}/{d}", float(c[d]))
    sink.log_dict(row, "wan_row.json")


def _model_bytes(cfg: Config) -> int:
    return 4 * sum(p.numel() for p in ByteGPT(cfg.model).parameters())


def _run_all(sc: WanScenario, base: Config, chosen: list[str], seed: int | None, shaped: bool, parent: MlflowSink,
             batches) -> tuple[list[dict], dict]:
    """Run every chosen method in one placement; returns the rows and the links' verification. ``base``:
    the scenario's recipe with every override, resolved once (:func:`diloco_async.flows.chaos.scenario_recipe`)."""
    from diloco_async.wan.methods import run_method
    from diloco_async.wan.place import placement

    logger = get_run_logger()
    wires: dict[str, WireRun] = {}
    rows: list[dict] = []
    with placement(sc, shaped=shaped) as place:
        verified = dict(getattr(place.net, "verified", {}) or {})
        logger.info("links: %s", json.dumps(verified))
        for m in chosen:
            wcfg = wan_config(sc, m, base)
            sink = MlflowSink(wcfg.tracking, wcfg.run.store, wcfg.run.storage_options)
            sink.start(f"wan-{sc.scenario.name}-{m}", flatten_params({"method": m, "seed": seed, "shaped": shaped}),
                       {"mlflow.parentRunId": parent.run_id or "", "diloco.wan.scenario": sc.scenario.name,
                        "diloco.wan.method": m})
            status = "FAILED"
            try:
                logger.info("method %s: starting", m)
                wires[m], _ = run_method(sc, m, base, place, batches, seed, on_metrics=sink.log_points)
                target = target_loss(sc.target.rule, wires, sc.target.loss)
                rows.append(json_row(wires[m], target))
                _log_method(sink, rows[-1], wires[m])
                logger.info("method %s: %s", m, json.dumps({k: rows[-1][k] for k in JSON_KEYS[:4]}))
                status = "FINISHED"
            finally:
                sink.end(status)
    target = target_loss(sc.target.rule, wires, sc.target.loss)
    return [json_row(wires[r["method"]], target) for r in rows], verified  # DDP's target known to all


@flow(name="wan", log_prints=True)
def wan(scenario: str = "configs/wan/wan-ci.toml", methods: list[str] | None = None,
        overrides: list[str] | None = None, seed: int | None = None, shaped: bool = True) -> dict:
    """Run the methods of a WAN scenario over its shaped links; return the report.

    Args:
        scenario: path of a WAN scenario TOML (``configs/wan/``).
        methods: a subset of ``ddp``, ``sync-diloco``, ``decoupled`` (default: the scenario's).
        overrides: ``section.field=value`` for every method's recipe after the scenario's own.
        seed: ``run.seed`` of every method (model init, data order); None: the recipe's.
        shaped: False runs the same processes unshaped on loopback (the tokens/s reference).

    Returns:
        ``{"scenario", "seed", "shaped", "links", "verified", "model_bytes", "ddp_ring_bytes_per_token",
        "rows"}``; ``rows``: one :func:`~diloco_async.wan.report.json_row` per method.

    Raises:
        ValueError: a bad scenario or method. LinkRateError: a link failed its verification.
        RuntimeError: not root / no ``tc`` (the reason), or a method's processes failed.
    """
    sc, chosen = _scenario(scenario, methods, overrides)
    base = scenario_recipe(sc)
    cfg = wan_config(sc, "decoupled", base)
    prepare_corpus(cfg)
    batches = heldout_batches(cfg)
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"
    parent = MlflowSink(cfg.tracking, cfg.run.store, cfg.run.storage_options)
    params = flatten_params({"scenario": sc.model_dump(), "seed": seed, "shaped": shaped})
    parent.start(f"wan-{sc.scenario.name}", params, {"diloco.wan.scenario": sc.scenario.name})
    status = "FAILED"
    try:
        rows, verified = _run_all(sc, base, chosen, seed, shaped, parent, batches)
        model_bytes = _model_bytes(cfg)
        per_token = 2 * ring_allreduce_bytes(model_bytes, sc.scenario.slots) / (cfg.learners.batch_size
                                                                               * cfg.model.context)
        report = {"scenario": sc.scenario.name, "seed": seed, "shaped": shaped,
                  "links": [dict(zip(("region", "up_mbit", "down_mbit", "delay_ms"), x, strict=True))
                            for x in sc.link_settings()],
                  "verified": verified, "model_bytes": model_bytes, "ddp_ring_bytes_per_token": per_token,
                  "eval_tokens": sc.scenario.eval_tokens, "rows": rows}
        parent.log_dict(report, "wan_report.json")
        status = "FINISHED"
    finally:
        parent.end(status)
    return report


def _fmt(v, spec: str) -> str:
    return "n/a" if v is None else format(v, spec)


def wan_table(report: dict) -> Table:
    """The report as a rich table, one row per method, the shaped and verified rates in the title."""
    links = ", ".join(f"{x['region']} {x['up_mbit']:g}/{x['down_mbit']:g}" for x in report["links"])
    meas = ", ".join(f"{r} {_fmt(v.get('up_mbit_measured'), '.1f')}/{_fmt(v.get('down_mbit_measured'), '.1f')}"
                     for r, v in report["verified"].items()) or "not shaped"
    t = Table(title=f"WAN scenario {report['scenario']}: links up/down Mbit/s set {links}; measured {meas}; "
                    f"DDP fp32 ring all-reduce {report['ddp_ring_bytes_per_token']:.0f} bytes/token (up+down)")
    for col in ("method", "time to target s", "target loss", "eval loss @ equal tokens", "bytes/token up+down",
                "up", "down", "link utilisation", "needed Mbit/s", "tokens/s per learner"):
        t.add_column(col, justify="left" if col == "method" else "right")
    for r in report["rows"]:
        t.add_row(r["method"], _fmt(r["time_to_target_s"], ".1f"), _fmt(r["target_loss"], ".4f"),
                  _fmt(r["eval_loss_equal_tokens"], ".4f"), _fmt(r["bytes_per_token"], ".1f"),
                  _fmt(r["up_bytes_per_token"], ".1f"), _fmt(r["down_bytes_per_token"], ".1f"),
                  _fmt(r["link_utilisation"], ".3f"), _fmt(r["needed_mbit"], ".2f"),
                  _fmt(r["tokens_per_s_per_learner"], ".0f"))
    return t


def run_wan_cli(scenario: str, methods: list[str] | None, as_json: bool, overrides: list[str] | None = None,
                out: str | None = None, seed: int | None = None, shaped: bool = True) -> int:
    """Entry of ``diloco-async wan``: the table (stderr with ``--json``), then with ``as_json`` one
    JSON object per method (a list) with :data:`JSON_KEYS`; ``out``: the whole report as JSON."""
    try:
        report = wan(scenario=scenario, methods=methods, overrides=list(overrides or []), seed=seed, shaped=shaped)
    except Exception as err:
        print(f"wan run failed: {type(err).__name__}: {err}", file=sys.stderr)
        return 1
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(report, indent=1))
    Console(file=sys.stderr if as_json else sys.stdout, width=None if sys.stdout.isatty() else 160).print(
        wan_table(report))
    if as_json:
        print(json.dumps([{k: r[k] for k in JSON_KEYS} for r in report["rows"]]))
    return 0
