"""The ``diloco-async simulate`` command as a process: it imports MLflow and matplotlib only when
asked, and logs to MLflow (the simulator's math is tests/unit/test_simulator.py's)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from test_simulator import CALIBRATION, REPO  # noqa: F401, F811 (shared with unit/test_simulator.py; fixtures among them)

from diloco_async.flows.simulate_cli import main as simulate_main


def test_simulate_command_imports_mlflow_and_matplotlib_only_when_asked() -> None:
    code = (
        "import sys, diloco_async.sim, diloco_async.flows.simulate_cli; "
        "bad = [m for m in ('mlflow', 'matplotlib', 'prefect') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_cli_logs_to_mlflow(tmp_path: Path, monkeypatch, capsys) -> None:
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.chdir(tmp_path)  # artifacts go to ./.local/store/mlartifacts
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    argv = ["--chips", "150000", "300000", "--learners", "8", "--calibration", str(CALIBRATION),
            "--mlflow", "--mlflow-uri", uri, "--experiment", "sim-test"]
    assert simulate_main(argv) == 0
    run_id = capsys.readouterr().err.strip().split()[-1]
    client = mlflow.MlflowClient(tracking_uri=uri)
    run = client.get_run(run_id)
    assert run.data.metrics["goodput/diloco_M8_K1/150000"] > 0.9
    assert run.data.params["elastic.reshard_pause_s"] == "20.0"
    names = {a.path for a in client.list_artifacts(run_id)}
    assert {"goodput_vs_chips.png", "results.json", "calibration.toml"} <= names
    assert list((tmp_path / ".local" / "store" / "mlartifacts").rglob("goodput_vs_chips.png"))
