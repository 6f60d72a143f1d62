"""MLflow sink: one writer per run, buffered, errors counted and never raised into training.

Metric points come from the synchronizer's metric stream (``GET /metrics``); learners never
talk to MLflow themselves, so there is no concurrent-writer problem on the tracking store.
"""

from __future__ import annotations

import logging
import math
import os
import time
import urllib.parse
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from mlflow.entities import Metric, Param
from mlflow.tracking import MlflowClient

from diloco_async.config.schema import TrackingConfig
from diloco_async.flows.mlflow_views import ensure_runs_view, runs_table_path
from diloco_async.storage.retry import Backoff

__all__ = ["MlflowSink", "flatten_params", "resolve_uri", "artifact_root", "learners_chart_path", "EXPERIMENT_KIND_TAG",
           "MODEL_TRAINING_KIND", "LEARNERS_CHART_TAG"]

log = logging.getLogger("diloco.tracking")


def flatten_params(d: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """``{"a": {"b": 1}} -> {"a.b": "1"}``; values cut to MLflow's 6000-character limit."""
    out: dict[str, str] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flatten_params(v, key + "."))
        else:
            out[key] = str(v)[:6000]
    return out


def resolve_uri(uri: str) -> str:
    """Make a relative ``sqlite:///path`` absolute and create its folder."""
    prefix = "sqlite:///"
    if uri.startswith(prefix) and not uri.startswith(prefix + "/"):
        path = Path(uri[len(prefix):]).resolve()
        path.parent.mkdir(parents=True, exist_ok=True)
        return prefix + str(path)
    return uri


#: store schemes MLflow can keep artifacts in (its S3 and GCS artifact repositories, local files)
ARTIFACT_SCHEMES = ("file", "s3", "gs")
#: where artifacts go when neither the config nor a store says (the default store's folder)
FALLBACK_ARTIFACTS = ".local/store/mlartifacts"


def _file_uri(path: str) -> str:
    return Path(path.removeprefix("file://")).expanduser().resolve().as_uri()


def artifact_root(cfg: TrackingConfig, store: str | None = None) -> str | None:
    """The artifact location of a new experiment, as a URI another host can use (issue 46 item 5):

    * ``tracking.artifact_location`` when set (a plain path becomes a ``file://`` URI);
    * None with a tracking server (``http(s)://`` ``mlflow_uri``): the server chooses, and an
      ``mlflow server`` (artifact serving is on by default) answers ``mlflow-artifacts:/...``, its
      proxy, which every client of the server can read and write;
    * else ``<store>/mlartifacts`` for a store MLflow can write (``s3://``, ``gs://``, ``file://``):
      the artifacts sit beside the runs, at the store's URL;
    * else (``memory://``) :data:`FALLBACK_ARTIFACTS` on this machine.
    """
    if cfg.artifact_location:
        return cfg.artifact_location if "://" in cfg.artifact_location else _file_uri(cfg.artifact_location)
    if cfg.mlflow_uri.startswith(("http://", "https://")):
        return None
    scheme = store.split("://", 1)[0].lower() if store and "://" in store else "file"
    if store and scheme in ARTIFACT_SCHEMES:
        root = _file_uri(store) if scheme == "file" else store.rstrip("/")
        return root.rstrip("/") + "/mlartifacts"
    return _file_uri(FALLBACK_ARTIFACTS)


def _s3_endpoint(storage_options: Mapping[str, Any]) -> str | None:
    """The S3 endpoint fsspec's storage options name (``endpoint_url``, top level or in ``client_kwargs``)."""
    client = storage_options.get("client_kwargs") or {}
    return storage_options.get("endpoint_url") or (client.get("endpoint_url") if isinstance(client, Mapping) else None)


#: the experiment tag MLflow 3's UI reads to choose its layout, and the value for model training
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
MODEL_TRAINING_KIND = "custom_model_development"
#: the parent run's tag holding the UI path of its learners' chart view (:func:`learners_chart_path`)
LEARNERS_CHART_TAG = "diloco.learners_chart"


def learners_chart_path(experiment_id: str, run_id: str) -> str:
    """The MLflow UI path (after the server's address) of the experiment's chart view listing only
    the nested learner runs of ``run_id``: one chart per metric key with a line per learner, so
    ``train_loss`` of every learner is on one chart. Ordering by run name keeps the learners flat
    (the UI nests children under their parent only in its default order)."""
    query = urllib.parse.urlencode({"compareRunsMode": "CHART",
                                    "searchFilter": f"tags.`mlflow.parentRunId` = '{run_id}'",
                                    "orderByKey": "tags.`mlflow.runName`", "orderByAsc": "true"})
    return f"/#/experiments/{experiment_id}/runs?{query}"


class MlflowSink:
    """Logs params, metric points and artifacts of one training run to MLflow.

    Args:
        cfg: tracking section of the config.
        store: the run's store URL (``run.store``): a new experiment keeps its artifacts there
            (:func:`artifact_root`); an existing experiment keeps the location it was created with.
        storage_options: the store's fsspec options; an S3 endpoint among them becomes MLflow's
            (``MLFLOW_S3_ENDPOINT_URL`` in this process, unless set), so its artifacts reach the
            same S3 service. MLflow authenticates with boto3's own credentials (environment, profile).
    """

    def __init__(self, cfg: TrackingConfig, store: str | None = None,
                 storage_options: Mapping[str, Any] | None = None) -> None:
        self.uri = resolve_uri(cfg.mlflow_uri)
        self.client = MlflowClient(tracking_uri=self.uri)
        endpoint = _s3_endpoint(storage_options or {})
        if endpoint and store and store.lower().startswith("s3://"):
            os.environ.setdefault("MLFLOW_S3_ENDPOINT_URL", str(endpoint))
        exp = self.client.get_experiment_by_name(cfg.experiment)
        if exp is None:
            location = artifact_root(cfg, store)
            if location is not None and location.startswith("file://"):
                Path(urllib.parse.unquote(urllib.parse.urlparse(location).path)).mkdir(parents=True, exist_ok=True)
            self.experiment_id = self.client.create_experiment(cfg.experiment, artifact_location=location)
        else:
            self.experiment_id = exp.experiment_id
        if exp is None or exp.tags.get(EXPERIMENT_KIND_TAG) != MODEL_TRAINING_KIND:
            # MLflow 3's UI then opens the experiment on its training runs, not on the GenAI overview
            self.client.set_experiment_tag(self.experiment_id, EXPERIMENT_KIND_TAG, MODEL_TRAINING_KIND)
        self.run_id: str | None = None
        self.errors = 0
        # the runs table with eval loss, goodput and tokens as columns (diloco_async/flows/mlflow_views.py)
        self._call(ensure_runs_view, self.client, self.experiment_id, dict(exp.tags) if exp is not None else {})
        self._last_step: dict[str, int] = {}
        self.children: dict[str, str] = {}  # learner id -> nested MLflow run id
        self._system: Any = None  # the SystemMetricsMonitor while one runs

    def start(self, run_name: str, params: Mapping[str, str], tags: Mapping[str, str]) -> str:
        run = self.client.create_run(self.experiment_id, run_name=run_name, tags=dict(tags))
        self.run_id = run.info.run_id
        items = [Param(k, v) for k, v in params.items()]
        for i in range(0, len(items), 100):
            self._call(self.client.log_batch, self.run_id, params=items[i:i + 100])
        return self.run_id

    def start_children(self, learner_ids: Iterable[str]) -> None:
        """One nested run per learner (``mlflow.parentRunId``); learner metrics go there too, without
        the ``learner/<id>/`` prefix, so the same key (``train_loss``) of every learner is one chart
        in the experiment's chart view of those runs, which the parent's description links to
        (:func:`learners_chart_path`). Existing children (after a resume) are reused."""
        assert self.run_id is not None, "start() or resume() first"
        existing = {r.data.tags.get("diloco.learner_id"): r.info.run_id for r in self.client.search_runs(
            [self.experiment_id], f"tags.`mlflow.parentRunId` = '{self.run_id}'")}
        for lid in learner_ids:
            if lid in existing:
                self.children[lid] = existing[lid]
                self._call(self.client.update_run, existing[lid], status="RUNNING")
                continue
            run = self.client.create_run(self.experiment_id, run_name=lid, tags={
                "mlflow.parentRunId": self.run_id, "diloco.learner_id": lid})
            self.children[lid] = run.info.run_id
        path = learners_chart_path(self.experiment_id, self.run_id)
        self._call(self.client.set_tag, self.run_id, LEARNERS_CHART_TAG, path)
        self._call(self.client.set_tag, self.run_id, "mlflow.note.content",
                   f"Every learner's `train_loss` on one chart: [the learners' runs, chart view]({path}).\n\n"
                   f"Every run's eval loss, goodput and tokens side by side: "
                   f"[the runs table]({runs_table_path(self.experiment_id)}).")

    def resume(self, diloco_run_id: str) -> bool:
        """Log into the existing MLflow run of a resumed training run (found by its
        ``diloco.run_id`` tag); set it RUNNING again. Points at or below the last logged step of a
        metric are skipped afterwards, so a replayed step never appears twice. Returns False
        when there is no such run."""
        found = self.client.search_runs([self.experiment_id], f"tags.`diloco.run_id` = '{diloco_run_id}'",
                                        max_results=1)
        if not found:
            return False
        self.run_id = found[0].info.run_id
        self._call(self.client.update_run, self.run_id, status="RUNNING")
        for key in found[0].data.metrics:
            history = self.client.get_metric_history(self.run_id, key)
            if history:
                self._last_step[key] = max(m.step for m in history)
        log.info("resuming MLflow run %s (%d metric series)", self.run_id, len(self._last_step))
        return True

    def first_value(self, key: str) -> float | None:
        """The value of metric ``key`` at its lowest step in this run (a resumed run's first held-out
        loss is the run's initial one); None when it has no point."""
        history = self.client.get_metric_history(self.run_id, key) if self.run_id else []
        return min(history, key=lambda m: (m.step, m.timestamp)).value if history else None

    def set_tags(self, tags: Mapping[str, str]) -> None:
        """Set tags on the run (after :meth:`start` or :meth:`resume`)."""
        for k, v in tags.items():
            self._call(self.client.set_tag, self.run_id, k, v)

    def clear_tag(self, key: str) -> None:
        """Delete tag ``key`` of the run if it has it (a resume that finished clears the mark of
        the stop it resumed from); like every call here, never raises."""
        try:
            present = bool(self.run_id) and key in self.client.get_run(self.run_id).data.tags
        except Exception as err:  # the tracking store must never stop training
            self.errors += 1
            log.warning("MLflow call get_run failed: %s", err)
            return
        if present:
            self._call(self.client.delete_tag, self.run_id, key)

    def _call(self, fn, *args, **kwargs) -> None:
        """``fn(*args, **kwargs)``, tried 3 times with the project's one backoff between (from
        0.2 s, jittered); every failure is counted in ``errors`` and logged, never raised."""
        backoff = Backoff(0.2, 1.0)
        for attempt in range(3):
            try:
                fn(*args, **kwargs)
                return
            except Exception as err:  # the tracking store must never stop training
                self.errors += 1
                log.warning("MLflow call %s failed (attempt %d): %s", fn.__name__, attempt + 1, err)
                if attempt < 2:
                    time.sleep(backoff.next_pause_s())

    def log_points(self, points: Iterable[Mapping[str, Any]]) -> int:
        """Log metric points ``{key, value, step, timestamp_ms}``; null and non-finite values are
        skipped. Returns how many were logged."""
        metrics = []
        per_child: dict[str, list[Metric]] = {}
        for pt in points:
            value = float("nan") if pt["value"] is None else float(pt["value"])
            if not math.isfinite(value):
                continue
            last = self._last_step.get(pt["key"])
            if last is not None and int(pt["step"]) <= last:
                continue  # already logged by the run before the resume
            metric = Metric(pt["key"], value, int(pt["timestamp_ms"]), int(pt["step"]))
            metrics.append(metric)
            parts = pt["key"].split("/", 2)
            if len(parts) == 3 and parts[0] == "learner" and parts[1] in self.children:
                per_child.setdefault(parts[1], []).append(Metric(parts[2], value, metric.timestamp, metric.step))
        for i in range(0, len(metrics), 1000):
            self._call(self.client.log_batch, self.run_id, metrics=metrics[i:i + 1000])
        for lid, items in per_child.items():
            for i in range(0, len(items), 1000):
                self._call(self.client.log_batch, self.children[lid], metrics=items[i:i + 1000])
        return len(metrics)

    def log_metric(self, key: str, value: float, step: int = 0) -> None:
        self.log_points([{"key": key, "value": value, "step": step, "timestamp_ms": int(time.time() * 1000)}])

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        self._call(self.client.log_artifact, self.run_id, str(path), artifact_path)

    def log_artifacts(self, folder: str | Path, artifact_path: str | None = None) -> None:
        """Log every file under ``folder`` (as ``artifact_path/...``)."""
        self._call(self.client.log_artifacts, self.run_id, str(folder), artifact_path)

    def log_inputs(self, datasets: list) -> None:
        """Record ``datasets`` (``mlflow.entities.DatasetInput``) as the run's inputs (``mlflow.log_input``)."""
        self._call(self.client.log_inputs, self.run_id, datasets=datasets)

    def log_dict(self, obj: Any, name: str) -> None:
        self._call(self.client.log_dict, self.run_id, obj, name)

    def log_text(self, text: str, name: str) -> None:
        """Log ``text`` as the artifact ``name`` (a path in the run's artifacts, e.g. ``a/b.txt``)."""
        self._call(self.client.log_text, self.run_id, text, name)

    def start_system_metrics(self, interval_s: float) -> None:
        """Sample this machine's CPU, memory, disk and network (and GPUs through NVML, when there
        are any) every ``interval_s`` seconds into the run's System metrics (``system/*``), until
        :meth:`end`; 0 turns it off. A monitor that cannot start is counted, never fatal."""
        if interval_s <= 0 or self.run_id is None:
            return
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        try:
            self._system = SystemMetricsMonitor(self.run_id, sampling_interval=interval_s, tracking_uri=self.uri,
                                                resume_logging=True)
            self._system.start()
        except Exception as err:  # noqa: BLE001 - system metrics are a view, never the run's fate
            self.errors += 1
            log.warning("MLflow system metrics could not start (%s: %s)", type(err).__name__, err)
            self._system = None

    def end(self, status: str = "FINISHED") -> None:
        if self._system is not None:
            self._call(self._system.finish)
            self._system = None
        for child in self.children.values():
            self._call(self.client.set_terminated, child, status)
        if self.run_id is not None:
            self._call(self.client.set_terminated, self.run_id, status)
