"""Record goodput-simulator results in MLflow, with a plot of goodput against chips.

Thin: the numbers come from :mod:`diloco_async.sim`; this module only draws and logs them. It is
imported by ``diloco-async simulate --mlflow`` and nowhere in the library, so the library never
imports MLflow or matplotlib.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

from diloco_async.flows.tracking import resolve_uri
from diloco_async.sim import CellResult
from diloco_async.sim.calibration import Calibration

__all__ = ["plot_goodput", "log_results", "cell_key", "DEFAULT_TRACKING_URI", "DEFAULT_ARTIFACTS"]

DEFAULT_TRACKING_URI = "sqlite:///.local/mlflow.db"
"""Used when neither ``tracking_uri`` nor ``MLFLOW_TRACKING_URI`` is given (as ``make ui``)."""
DEFAULT_ARTIFACTS = ".local/store/mlartifacts"
"""Artifact root of an experiment this module creates (relative to the working directory)."""


def cell_key(r: CellResult) -> str:
    """A metric-safe name for a cell's method: ``dp_M1_K1``, ``diloco_M8_K1``."""
    s = r.scenario
    return f"{s.method}_M{s.learners}_K{s.quorum}"


def plot_goodput(results: Sequence[CellResult], path: Path, title: str = "") -> Path:
    """Goodput (%) against chips (log axis), one line per method; the paper's values dashed.

    Writes a PNG at ``path`` and returns it. Uses matplotlib's object API (no pyplot state).
    """
    from matplotlib.figure import Figure

    lines: dict[str, list[CellResult]] = {}
    for r in results:
        lines.setdefault(r.scenario.label, []).append(r)
    fig = Figure(figsize=(8.5, 5.2), layout="constrained")
    ax = fig.add_subplot()
    for i, (label, cells) in enumerate(lines.items()):
        cells = sorted(cells, key=lambda r: r.scenario.chips)
        chips = [r.scenario.chips for r in cells]
        color = f"C{i % 10}"
        ax.plot(chips, [100 * r.goodput for r in cells], "o-", color=color, label=label)
        paper = [(r.scenario.chips, 100 * r.scenario.paper) for r in cells if r.scenario.paper is not None]
        if paper:
            ax.plot(*zip(*paper, strict=True), "x--", color=color, alpha=0.6)
    if any(r.scenario.paper is not None for r in results):
        ax.plot([], [], "kx--", alpha=0.6, label="paper (dashed)")
    all_chips = sorted({r.scenario.chips for r in results})
    if len(all_chips) > 1:
        ax.set_xscale("log")
    ax.set_xticks(all_chips, [f"{c / 1e3:g}k" if c < 1e6 else f"{c / 1e6:g}M" for c in all_chips])
    ax.minorticks_off()
    ax.set_xlabel("chips")
    ax.set_ylabel("goodput (%)")
    ax.set_ylim(0, 102)
    ax.grid(alpha=0.3)
    ax.set_title(title or "Goodput under chip failures (simulated)")
    ax.legend(fontsize="small", loc="lower left")
    fig.savefig(path, dpi=120)
    return path


def _flat_params(cal: Calibration) -> dict[str, str]:
    out = {}
    for section, model in cal:
        for name, value in model:
            out[f"{section}.{name}"] = json.dumps(value) if isinstance(value, (dict, list)) else str(value)
    return out


def log_results(
    results: Sequence[CellResult], *, grid: str, calibration_path: Path, calibration: Calibration,
    seed: int, elapsed_s: float, tracking_uri: str | None = None, experiment: str = "simulate",
) -> str:
    """Log one MLflow run: calibration as params, goodput/uptime per cell as metrics, artifacts.

    Metrics are ``goodput/<method>_M<m>_K<k>/<chips>`` (0-1), the same for ``uptime`` and, for
    paper cells, ``diff_pts`` (points); ``max_abs_diff_pts`` and ``sim/elapsed_s`` summarise.
    Artifacts: ``results.json``, ``goodput_vs_chips.png`` and the calibration file.

    Args:
        tracking_uri: MLflow tracking URI; default ``MLFLOW_TRACKING_URI``, else
            :data:`DEFAULT_TRACKING_URI`.
        experiment: experiment name; created with artifacts under :data:`DEFAULT_ARTIFACTS` when new.

    Returns:
        The MLflow run id.
    """
    import mlflow

    uri = resolve_uri(tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_TRACKING_URI)
    mlflow.set_tracking_uri(uri)
    client = mlflow.MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(experiment)
    exp_id = exp.experiment_id if exp is not None else client.create_experiment(
        experiment, artifact_location=Path(DEFAULT_ARTIFACTS).resolve().as_uri()
    )
    with mlflow.start_run(experiment_id=exp_id, run_name=f"simulate-{grid}") as run:
        mlflow.log_params({"grid": grid, "seed": seed, "cells": len(results), **_flat_params(calibration)})
        metrics = {"sim/elapsed_s": elapsed_s}
        diffs = []
        for r in results:
            key = f"{cell_key(r)}/{r.scenario.chips}"
            metrics[f"goodput/{key}"] = r.goodput
            metrics[f"uptime/{key}"] = r.uptime
            if r.scenario.paper is not None:
                diffs.append(100 * (r.goodput - r.scenario.paper))
                metrics[f"diff_pts/{key}"] = diffs[-1]
        if diffs:
            metrics["max_abs_diff_pts"] = max(abs(d) for d in diffs)
        mlflow.log_metrics({k: v for k, v in metrics.items() if math.isfinite(v)})
        with tempfile.TemporaryDirectory() as tmp:
            d = Path(tmp)
            (d / "results.json").write_text(json.dumps([r.to_json() for r in results], indent=2))
            plot_goodput(results, d / "goodput_vs_chips.png", title=f"Goodput vs chips ({grid})")
            mlflow.log_artifacts(str(d))
        mlflow.log_artifact(str(calibration_path))
        return run.info.run_id
