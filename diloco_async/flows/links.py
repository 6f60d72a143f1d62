"""Prefect and MLflow, linked (issue 46 item 4).

* The MLflow run of a ``train``/``resume`` flow run carries the flow run's id and UI address as
  tags (``prefect.flow_run_id``, ``prefect.flow_run_url``): :func:`link_mlflow_run`. On the
  temporary server a command starts for itself (no ``PREFECT_API_URL``; no UI, gone when the
  command exits) the address would be dead: the id is tagged, and ``prefect.server`` says why no
  address is.
* The flow run publishes a Prefect markdown artifact (key ``diloco-run-<run id>``) with the
  summary table and a link to the MLflow run: :func:`publish_summary`.
* The experiment's runs table, with eval loss, goodput and tokens as columns (the saved view of
  :mod:`diloco_async.flows.mlflow_views`): :func:`mlflow_runs_table_url`, in the artifact and the flow's log.
* Addresses are printed alone, never followed by punctuation, so a terminal or a UI that makes
  links of them links the address and nothing else.

The MLflow UI's address is ``tracking.ui_url``, else the tracking server's (an ``http(s)``
``tracking.mlflow_uri``), else :data:`MAKE_UI_URL` (what ``make ui`` serves over the default
database).
"""

from __future__ import annotations

import logging
from typing import NamedTuple

from diloco_async.config.tracking import TrackingConfig
from diloco_async.flows.mlflow_views import runs_table_path
from diloco_async.flows.summary import summary_rows

__all__ = ["MAKE_UI_URL", "TEMPORARY_SERVER_TAG", "mlflow_run_url", "mlflow_runs_table_url", "MlflowLinks",
           "prefect_flow_run", "link_mlflow_run", "summary_markdown", "publish_summary"]

log = logging.getLogger("diloco.flows.links")

#: the MLflow UI that ``make ui`` serves (MLFLOW_PORT in the Makefile)
MAKE_UI_URL = "http://127.0.0.1:5000"


def _ui_base(cfg: TrackingConfig) -> str:
    base = cfg.ui_url or (cfg.mlflow_uri if cfg.mlflow_uri.startswith(("http://", "https://")) else MAKE_UI_URL)
    return base.rstrip("/")


def mlflow_run_url(cfg: TrackingConfig, experiment_id: str, run_id: str) -> str:
    """The UI page of MLflow run ``run_id`` of ``experiment_id`` (see the module docstring for the base)."""
    return f"{_ui_base(cfg)}/#/experiments/{experiment_id}/runs/{run_id}"


def mlflow_runs_table_url(cfg: TrackingConfig, experiment_id: str) -> str:
    """The runs table of ``experiment_id`` with eval loss, goodput and tokens as columns
    (:func:`diloco_async.flows.mlflow_views.runs_table_path`)."""
    return _ui_base(cfg) + runs_table_path(experiment_id)


def prefect_flow_run() -> tuple[str, str] | None:
    """(id, UI address) of the Prefect flow run this code runs in; None outside one."""
    from prefect.runtime import flow_run

    run_id = flow_run.id
    if not run_id:
        return None
    return str(run_id), str(flow_run.ui_url or "")


class MlflowLinks(NamedTuple):
    """The UI addresses of a training run's MLflow run and of its experiment's runs table."""

    run_url: str
    runs_table_url: str


#: the ``prefect.server`` tag of a run whose flow ran on the command's own temporary server
TEMPORARY_SERVER_TAG = ("the command's temporary Prefect server (no UI, stopped when the command exited): "
                        "set PREFECT_API_URL, e.g. to make ui's server, for a flow-run page")


def link_mlflow_run(sink, cfg: TrackingConfig) -> MlflowLinks:
    """Tag ``sink``'s MLflow run with the Prefect flow run it belongs to (a resume's flow run
    replaces the train's; its UI address only where a configured server serves it, see the module
    docstring) and return the UI addresses of the run and of the runs table."""
    from prefect.settings import PREFECT_API_URL

    here = prefect_flow_run()
    if here is not None and PREFECT_API_URL.value():
        sink.set_tags({"prefect.flow_run_id": here[0], "prefect.flow_run_url": here[1]})
    elif here is not None:
        sink.set_tags({"prefect.flow_run_id": here[0], "prefect.server": TEMPORARY_SERVER_TAG})
    return MlflowLinks(mlflow_run_url(cfg, sink.experiment_id, sink.run_id),
                       mlflow_runs_table_url(cfg, sink.experiment_id))


def summary_markdown(summary: dict, mlflow_url: str, runs_table_url: str | None = None) -> str:
    """The summary table as markdown, headed by the run id, the MLflow run's address and the runs
    table's (each alone at the end of its line: the UI links it, and nothing after it)."""
    lines = [f"# diloco-async run {summary['run_id']}", "", f"MLflow run `{summary['mlflow_run_id']}`: {mlflow_url}"]
    if runs_table_url:
        lines += ["", f"Every run's eval loss, goodput and tokens: {runs_table_url}"]
    lines += ["", "| figure | value |", "|---|---|"]
    lines += [f"| {k} | {str(v).replace('|', '/')} |" for k, v in summary_rows(summary)]
    return "\n".join(lines) + "\n"


def publish_summary(summary: dict, mlflow_url: str, runs_table_url: str | None = None) -> str | None:
    """Publish :func:`summary_markdown` as the flow run's markdown artifact ``diloco-run-<run id>``;
    returns the artifact's id, or None outside a flow run or when the Prefect API refuses (logged:
    the run's result never depends on it)."""
    if prefect_flow_run() is None:
        return None
    from prefect.artifacts import create_markdown_artifact

    key = "diloco-run-" + "".join(c if c.isalnum() else "-" for c in str(summary["run_id"]).lower())
    try:
        return str(create_markdown_artifact(markdown=summary_markdown(summary, mlflow_url, runs_table_url), key=key,
                                            description=f"diloco-async run {summary['run_id']}: summary"))
    except Exception as err:  # noqa: BLE001 - the API's errors vary by transport; the run is done either way
        log.warning("no Prefect artifact for run %s: %s", summary["run_id"], err)
        return None
