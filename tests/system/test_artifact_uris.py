"""MLflow artifacts a run logs land at URIs another host uses (issue 46 item 5): with a store on S3
(moto's server) they go to ``s3://<bucket>/.../mlartifacts`` and read back through the store; with a
tracking server they go through its artifact proxy (``mlflow-artifacts:``), and a client that only
knows the server's address downloads them. Nothing lands under the flow's working directory."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import fsspec
import pytest
from mlflow.tracking import MlflowClient

from diloco_async.config.tracking import TrackingConfig
from diloco_async.flows.mlflow_views import RUNS_VIEW_ID, SHARED_VIEW_TAG_PREFIX
from diloco_async.flows.tracking import MlflowSink

from storage_servers import make_bucket

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.timeout(300)]


def _shot():
    spec = importlib.util.spec_from_file_location("mlflow_screenshot", ROOT / "scripts" / "mlflow_screenshot.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _log(sink: MlflowSink, tmp_path: Path) -> bytes:
    sink.start("portable", {}, {})
    payload = json.dumps({"loss": 2.5}).encode()
    (tmp_path / "figures.json").write_bytes(payload)
    sink.log_artifact(tmp_path / "figures.json")
    sink.log_text("generated text\n", "eval_samples/step-00000003.txt")
    sink.end()
    assert sink.errors == 0
    return payload


def test_a_store_on_s3_keeps_the_runs_artifacts(s3_endpoint, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # absent now, and absent again afterwards (the sink sets it in this process from the store's options)
    monkeypatch.setenv("MLFLOW_S3_ENDPOINT_URL", "")
    monkeypatch.delenv("MLFLOW_S3_ENDPOINT_URL")
    bucket = make_bucket("s3", s3_endpoint.storage_options)
    store = f"s3://{bucket}/runs"
    sink = MlflowSink(TrackingConfig(mlflow_uri=f"sqlite:///{tmp_path}/mlflow.db", experiment="s3-art"),
                      store, s3_endpoint.storage_options)
    payload = _log(sink, tmp_path)
    run = sink.client.get_run(sink.run_id)
    assert run.info.artifact_uri == f"{store}/mlartifacts/{sink.run_id}/artifacts"
    fs = fsspec.filesystem("s3", **s3_endpoint.storage_options)  # the store, as every host reads it
    base = run.info.artifact_uri.removeprefix("s3://")
    assert fs.cat(f"{base}/figures.json") == payload
    assert fs.cat(f"{base}/eval_samples/step-00000003.txt") == b"generated text\n"
    assert not (tmp_path / ".local").exists() and not (tmp_path / "mlartifacts").exists()
    # the experiment carries the runs table's view (diloco_async/flows/mlflow_views.py)
    tags = sink.client.get_experiment(sink.experiment_id).tags
    assert json.loads(json.loads(tags[SHARED_VIEW_TAG_PREFIX + RUNS_VIEW_ID])["state"])["selectedColumns"]


def test_a_tracking_server_proxies_the_artifacts(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    served = tmp_path / "server-artifacts"
    with _shot().mlflow_server(str(tmp_path / "mlflow.db"), str(served), proxy_artifacts=True,
                               log_path=tmp_path / "server.log") as base:
        sink = MlflowSink(TrackingConfig(mlflow_uri=base, experiment="proxied"), f"file://{tmp_path}/store")
        payload = _log(sink, tmp_path)
        run = MlflowClient(base).get_run(sink.run_id)
        assert run.info.artifact_uri.startswith("mlflow-artifacts:/"), run.info.artifact_uri
        # another host knows the server's address only
        got = MlflowClient(base).download_artifacts(sink.run_id, "figures.json", str(tmp_path / "host-b"))
        assert Path(got).read_bytes() == payload
    assert not (tmp_path / "store").exists(), "a tracking server's run wrote its artifacts to the flow's disk"
    assert list(served.rglob("figures.json")), "the server did not keep the artifact"


def test_a_finished_resume_clears_the_stop_mark_and_clearing_a_missing_tag_is_quiet(tmp_path):
    """A run stopped by a signal is tagged STOPPED_TAG; a resume of it that finishes clears it
    (diloco_async.flows.train._stopping), so a FINISHED run never reads as stopped."""
    from diloco_async.flows.run_end import STOPPED_TAG

    sink = MlflowSink(TrackingConfig(mlflow_uri=f"sqlite:///{tmp_path}/mlflow.db", experiment="stops"),
                      f"file://{tmp_path}/store")
    sink.start("stopped-then-resumed", {}, {STOPPED_TAG: "signal SIGINT", "keep": "me"})
    sink.clear_tag(STOPPED_TAG)
    sink.clear_tag(STOPPED_TAG)  # a run that was never stopped: nothing to clear, no error
    tags = sink.client.get_run(sink.run_id).data.tags
    assert STOPPED_TAG not in tags and tags["keep"] == "me" and sink.errors == 0
