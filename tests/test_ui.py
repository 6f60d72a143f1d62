"""The MLflow UI shows a run with its loss and goodput charts: a real run logged through the
project's MLflow sink into sqlite, a real `mlflow server`, headless Chromium loading the run page
and its metric charts (scripts/mlflow_screenshot.py)."""

from __future__ import annotations

import importlib.util
import json
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

from diloco_async.config import TrackingConfig
from flows.tracking import MlflowSink

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "mlflow_screenshot.py"
WINDOW = (1600, 1200)


def _load_script():
    spec = importlib.util.spec_from_file_location("mlflow_screenshot", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _log_run(tmp_path: Path) -> tuple[str, str, str, Path]:
    """A parent run with eval loss, goodput and synchronizer series, a nested learner run and a
    loss-curve PNG artifact, all through MlflowSink. Returns (tracking URI, run id, run name, png)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    sink = MlflowSink(TrackingConfig(mlflow_uri=uri, experiment="diloco-async",
                                     artifact_location=str(tmp_path / "store" / "mlartifacts")))
    name = f"ui-check-{uuid.uuid4().hex[:8]}"
    sink.start(name, {"learners.count": "2", "synchronizer.min_quorum": "1"}, {"diloco.run_id": name})
    sink.start_children(["learner-0"])
    now = int(time.time() * 1000)
    points = []
    for step in range(0, 41, 4):  # a falling held-out loss and rising goodput over 40 merges
        points += [
            {"key": "eval/loss", "value": 5.5 - 3.4 * (1 - np.exp(-step / 12)), "step": step,
             "timestamp_ms": now + step},
            {"key": "goodput/compute", "value": 0.5 + 0.4 * step / 40, "step": step, "timestamp_ms": now + step},
            {"key": "goodput/token", "value": 0.7 + 0.25 * step / 40, "step": step, "timestamp_ms": now + step},
            {"key": "sync/merges", "value": step, "step": step, "timestamp_ms": now + step},
            {"key": "sync/quorum_size", "value": 1 + step % 2, "step": step, "timestamp_ms": now + step},
            {"key": "learner/learner-0/train_loss", "value": 5.0 - step / 10, "step": step, "timestamp_ms": now + step},
        ]
    assert sink.log_points(points) == len(points)
    hist = sink.client.get_metric_history(sink.run_id, "eval/loss")
    fig, ax = plt.subplots(figsize=(4, 3))
    ax.plot([m.step for m in hist], [m.value for m in hist], "o-")
    png = tmp_path / "loss_curve.png"
    fig.savefig(png, dpi=80)
    plt.close(fig)
    sink.log_artifact(png)
    sink.end()
    assert sink.errors == 0
    return uri, sink.run_id, name, png


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
             "--window-size", f"{WINDOW[0]},{WINDOW[1]}", "--expect", "eval/loss", "--expect", "goodput/compute"],
            capture_output=True, text=True, timeout=200, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(proc.stdout)
    assert result["run_id"] == run_id, "the newest top-level run, not the nested learner run"
    assert result["run_name"] == name and result["missing"] == []

    for page in ("overview", "model-metrics"):
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
