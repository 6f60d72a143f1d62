"""Where a run's summary says its logs are (diloco_async/flows/run_end.py ``run_logs``), and what the ``train``
flow hands a learner flow run that may run on another host (diloco_async/flows/train.py ``_host_env``): the
multi-host rehearsal's findings (docs/multi-host.md), on a recording sink."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from diloco_async.flows.run_end import run_logs
from diloco_async.flows.train import _host_env
from diloco_async.learner import TIMELINE_DIR_ENV

ARTIFACT_URI = "s3://bucket/runs/mlartifacts/1/abc/artifacts"


class RecordingSink:
    """The parts of diloco_async.flows.tracking.MlflowSink that run_logs uses; ``fail`` makes uploads count an error."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.errors = 0
        self.uploads: list[tuple[str, str]] = []
        self.run_id = "abc"
        self.client = SimpleNamespace(get_run=lambda run_id: SimpleNamespace(info=SimpleNamespace(
            artifact_uri=ARTIFACT_URI + "/")))

    def log_artifacts(self, folder, artifact_path=None) -> None:
        if self.fail:
            self.errors += 1
            return
        self.uploads.append((str(folder), artifact_path))


def a_run(tmp_path: Path, with_log: bool = True) -> SimpleNamespace:
    (tmp_path / "logs").mkdir(parents=True)
    if with_log:
        (tmp_path / "logs" / "synchronizer.log").write_text("listening\n")
    return SimpleNamespace(workdir=tmp_path, epoch="e1")


def test_the_logs_are_uploaded_and_the_summary_names_their_uri(tmp_path):
    sink = RecordingSink()
    assert run_logs(a_run(tmp_path), sink) == f"{ARTIFACT_URI}/logs/e1"
    assert sink.uploads == [(str(tmp_path / "logs"), "logs/e1")]


def test_a_failed_upload_or_no_log_leaves_the_local_folder(tmp_path):
    sink = RecordingSink(fail=True)
    assert run_logs(a_run(tmp_path / "a"), sink) == str(tmp_path / "a" / "logs") and sink.errors == 1
    sink = RecordingSink()
    assert run_logs(a_run(tmp_path / "b", with_log=False), sink) == str(tmp_path / "b" / "logs")
    assert sink.uploads == []


def test_a_learner_flow_run_gets_no_folder_of_the_flows_host():
    env = {TIMELINE_DIR_ENV: "/srv/flow-host/runs/r1/timeline", "DILOCO_STORAGE_OPTIONS": "{}", "HF_HUB_OFFLINE": "1"}
    assert _host_env(env) == {"DILOCO_STORAGE_OPTIONS": "{}", "HF_HUB_OFFLINE": "1"}
    assert TIMELINE_DIR_ENV in env  # the caller's environment (the local launcher's) is left as it was
