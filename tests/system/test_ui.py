"""The MLflow UI shows a run with its loss and goodput charts: a real run logged through the
project's MLflow sink into sqlite, a real `mlflow server`, headless Chromium loading the run page
and its metric charts (scripts/mlflow_screenshot.py)."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import struct
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import numpy as np
import pytest

from diloco_async.config.schema import TrackingConfig
from diloco_async.flows.mlflow_views import runs_table_path
from diloco_async.flows.tracking import LEARNERS_CHART_TAG, MlflowSink
from tests.polling import wait_until

pytestmark = [pytest.mark.timeout(240)]

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "mlflow_screenshot.py"
WINDOW = (1600, 1200)
ARTIFACTS = ROOT / ".local" / "screenshots" / "test_ui"  # kept after the test: CI's artifacts


def _load_script():
    spec = importlib.util.spec_from_file_location("mlflow_screenshot", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _log_run(tmp_path: Path) -> tuple[str, str, str, Path]:
    """A parent run with eval loss, goodput and synchronizer series, two nested learner runs, the
    flow machine's system metrics (MLflow's own monitor, sampling for real) and a loss-curve PNG
    artifact, all through MlflowSink. Returns (tracking URI, run id, run name, png)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    sink = MlflowSink(TrackingConfig(mlflow_uri=uri, experiment="diloco-async",
                                     artifact_location=str(tmp_path / "store" / "mlartifacts")))
    name = f"ui-check-{uuid.uuid4().hex[:8]}"
    sink.start(name, {"learners.count": "2", "synchronizer.min_quorum": "1"}, {"diloco.run_id": name})
    sink.start_children(["learner-0", "learner-1"])
    sink.start_system_metrics(0.5)
    now = int(time.time() * 1000)
    points = []
    for step in range(0, 41, 4):  # a falling held-out loss and rising goodput over 40 merges
        points += [
            {"key": "eval/loss", "value": 5.5 - 3.4 * (1 - np.exp(-step / 12)), "step": step,
             "timestamp_ms": now + step},
            {"key": "goodput/compute", "value": 0.5 + 0.4 * step / 40, "step": step, "timestamp_ms": now + step},
            {"key": "goodput/token", "value": 0.7 + 0.25 * step / 40, "step": step, "timestamp_ms": now + step},
            {"key": "sync/merges", "value": step, "step": step, "timestamp_ms": now + step},
            {"key": "sync/tokens_processed", "value": 1536 * step, "step": step, "timestamp_ms": now + step},
            {"key": "sync/quorum_size", "value": 1 + step % 2, "step": step, "timestamp_ms": now + step},
            {"key": "learner/learner-0/train_loss", "value": 2.0 + 3.0 * np.exp(-step / 15), "step": step,
             "timestamp_ms": now + step},
            {"key": "learner/learner-1/train_loss", "value": 2.2 + 3.0 * np.exp(-step / 10), "step": step,
             "timestamp_ms": now + step},
        ]
    assert sink.log_points(points) == len(points)
    hist = sink.client.get_metric_history(sink.run_id, "eval/loss")
    fig, ax = plt.subplots(figsize=(4, 3))
    ax.plot([m.step for m in hist], [m.value for m in hist], "o-")
    png = tmp_path / "loss_curve.png"
    fig.savefig(png, dpi=80)
    plt.close(fig)
    sink.log_artifact(png)
    wait_until(lambda: len(sink.client.get_metric_history(sink.run_id, "system/cpu_utilization_percentage")) >= 3,
               120, "three samples of the system metrics")
    sink.end()
    assert sink.errors == 0
    return uri, sink.run_id, name, png


def _tag(run: dict, key: str) -> str:
    """Tag ``key`` of a run as the REST API returns it."""
    return next(t["value"] for t in run["data"]["tags"] if t["key"] == key)


def _png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR", f"{path} is not a PNG"
    return struct.unpack(">II", head[16:24])


def _distinct_colours(path: Path) -> tuple[int, float]:
    """Number of distinct RGB colours and the share of pixels that are not near-white."""
    import matplotlib.image

    img = matplotlib.image.imread(str(path))[..., :3]
    rgb = (img * 255).round().astype(np.uint8).reshape(-1, 3)
    packed = (rgb[:, 0].astype(np.uint32) << 16) | (rgb[:, 1].astype(np.uint32) << 8) | rgb[:, 2]
    return len(np.unique(packed)), float((rgb.min(axis=1) < 235).mean())


def _chart(html: str, title: str) -> str:
    """The rendered DOM of the chart titled ``title``: from its title to the end of its plot."""
    start = html.find(f'title="{title}"')
    assert start >= 0, f"no chart of {title}"
    plot = html.find("js-plotly-plot", start)
    end = html.find("js-plotly-plot", plot + 1)
    return html[start:end if end > 0 else len(html)]


def _lines(chart: str) -> set[str]:
    """The distinct line paths (``d`` of plotly's ``js-line``) of one chart: one per run drawn."""
    return set(re.findall(r'class="js-line"[^>]*\bd="([^"]+)"', chart))


def _vertices(path: str) -> list[tuple[float, float]]:
    return [(float(x), float(y)) for x, y in re.findall(r"[ML]([-\d.]+),([-\d.]+)", path)]


def _column_cells(html: str, col_id: str) -> tuple[list[str], list[str]]:
    """The texts of the header cells and of the body cells of the runs table's column ``col_id``
    (ag-grid's ``col-id`` attribute), from the rendered DOM."""
    headers, cells = [], []
    for m in re.finditer(r'<div\b[^>]*\bcol-id="' + re.escape(col_id) + r'"[^>]*>', html):
        end = html.find("col-id=", m.end())
        text = re.sub(r"<[^>]+>", " ", html[m.end():end if end > 0 else len(html)])
        text = " ".join(text.split())
        (headers if 'role="columnheader"' in m.group(0) else cells).append(text)
    return headers, cells


def _shows(cells: list[str], value: float) -> bool:
    """Whether one cell shows ``value`` (as the UI rounds it: within 1%)."""
    for text in cells:
        found = re.match(r"^-?[\d,]*\.?\d+", text)
        if found and abs(float(found.group(0).replace(",", "")) - value) <= 0.01 * abs(value):
            return True
    return False


def test_mlflow_ui_shows_the_run_with_loss_and_goodput_charts(tmp_path):
    if shutil.which("chromium") is None:
        pytest.skip("chromium is not installed (Debian: apt-get install chromium; .ci/run installs it)")
    shot = _load_script()
    uri, run_id, name, png = _log_run(tmp_path)
    with shot.mlflow_server(uri, str(tmp_path / "store" / "mlartifacts"), log_path=tmp_path / "server.log") as base:
        # the run's artifacts live in the store and the server hands them to the UI
        run = json.loads(urllib.request.urlopen(f"{base}/api/2.0/mlflow/runs/get?run_id={run_id}").read())["run"]
        assert run["info"]["artifact_uri"].startswith((tmp_path / "store" / "mlartifacts").as_uri())
        served = urllib.request.urlopen(f"{base}/get-artifact?path=loss_curve.png&run_uuid={run_id}").read()
        assert served == png.read_bytes()

        out = tmp_path / "shots"
        proc = subprocess.run(
            [sys.executable, str(SCRIPT), "--url", base, "--out", str(out), "--dump-dom", "--json",
             "--pages", "overview,model-metrics,system-metrics,learners,runs",
             "--window-size", f"{WINDOW[0]},{WINDOW[1]}", "--expect", "eval/loss", "--expect", "goodput/compute"],
            capture_output=True, text=True, timeout=200, cwd=ROOT)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    for path in out.iterdir():
        shutil.copy2(path, ARTIFACTS / path.name.replace(run_id, "run"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(proc.stdout)
    assert result["run_id"] == run_id, "the newest top-level run, not the nested learner run"
    assert result["run_name"] == name and result["missing"] == []

    for page in ("overview", "model-metrics", "system-metrics", "learners", "runs"):
        path = Path(result["screenshots"][page])
        assert _png_size(path) == WINDOW
        colours, ink = _distinct_colours(path)
        assert colours > 150 and ink > 0.02, f"{page} screenshot looks blank: {colours} colours, {ink:.1%} ink"

    overview = Path(result["dom"]["overview"]).read_text()
    for text in (name, "eval/loss", "goodput/compute", "goodput/token", "sync/merges"):
        assert text in overview, f"{text!r} not on the run page"
    charts = Path(result["dom"]["model-metrics"]).read_text()
    for metric in ("eval/loss", "goodput/compute", "goodput/token"):
        assert f'title="{metric}"' in charts, f"no chart of {metric}"
    assert charts.count("scatterlayer") >= 3, "the metric charts did not draw"
    # the held-out loss is drawn as a curve: every logged point, falling, not a two-point segment
    eval_chart = _chart(charts, "eval/loss")
    assert eval_chart.count('class="point"') == 11, "the eval/loss chart does not show its 11 points"
    (line,) = _lines(eval_chart)
    ys = [y for _x, y in _vertices(line)]
    assert len(ys) > 2 and len(set(ys)) == len(ys), f"eval/loss is not drawn as a curve: {line}"

    system = Path(result["dom"]["system-metrics"]).read_text()
    for metric in ("system/cpu_utilization_percentage", "system/system_memory_usage_megabytes",
                   "system/network_receive_megabytes"):
        assert _lines(_chart(system, metric)), f"the System metrics tab has no line for {metric}"

    # every learner's train_loss on one chart: the view the run's description links to
    assert result["urls"]["learners"].endswith(_tag(run, LEARNERS_CHART_TAG))
    assert _tag(run, "mlflow.note.content").count(_tag(run, LEARNERS_CHART_TAG)) == 1
    assert "the learners' runs, chart view" in overview, "the run's description (with the link) is not shown"
    learners = Path(result["dom"]["learners"]).read_text()
    assert "learner-0 (train_loss)" in learners and "learner-1 (train_loss)" in learners
    assert name not in learners, "the parent run is listed among its learners"
    assert len(_lines(_chart(learners, "train_loss"))) == 2, "not one train_loss line per learner"

    # the runs table the run's description and the printed link open: eval loss, goodput and tokens
    # as columns, with the run's last values (MLflow's default columns are Source, Models, Dataset)
    assert result["urls"]["runs"].endswith(runs_table_path(run["info"]["experiment_id"]))
    assert runs_table_path(run["info"]["experiment_id"]) in _tag(run, "mlflow.note.content")
    table = Path(result["dom"]["runs"]).read_text()
    assert name in table, "the run is not in the runs table"
    last = {"eval/loss": 5.5 - 3.4 * (1 - np.exp(-40 / 12)), "goodput/compute": 0.9,
            "sync/tokens_processed": 1536 * 40}
    for metric, value in last.items():
        headers, cells = _column_cells(table, f"metrics.`{metric}`")
        assert any(metric in h for h in headers), f"no {metric} column header in the runs table: {headers}"
        assert _shows(cells, value), f"the {metric} column does not show {value:.4g}: {cells}"
