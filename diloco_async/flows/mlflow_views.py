"""The experiment's runs table with the training figures as columns (issue 46 item 3).

MLflow 3's runs table opens with the columns Source, Models and Dataset: its default UI state is
built in the browser (``selectedColumns`` of the experiment page's UI state), then kept in the
browser's local storage; no experiment tag, server setting or logged metric changes that default.
What the server can hold is a *saved view*: an experiment tag ``mlflow.sharedViewState.<id>``
whose value is ``{"name", "createdAt", "updatedAt", "state"}``, ``state`` being the page's UI state
and search facets as JSON. The page opens it from ``#/experiments/<id>/runs?viewStateShareKey=<id>``
and lists it under "Saved views". :class:`~diloco_async.flows.tracking.MlflowSink` writes the view
:data:`RUNS_VIEW_ID` (columns :data:`RUNS_TABLE_COLUMNS`) on the experiment; the links a run prints
and its MLflow description open the table through it (:func:`runs_table_path`).
"""

from __future__ import annotations

import json
import logging
import time
import urllib.parse
from typing import Any

__all__ = ["RUNS_VIEW_ID", "RUNS_VIEW_NAME", "RUNS_TABLE_METRICS", "RUNS_TABLE_COLUMNS", "SHARED_VIEW_TAG_PREFIX",
           "runs_view_state", "runs_view_tag", "runs_table_path", "ensure_runs_view"]

log = logging.getLogger("diloco.flows.mlflow_views")

#: the prefix of the experiment tags MLflow 3's UI keeps its saved (shared) views in
SHARED_VIEW_TAG_PREFIX = "mlflow.sharedViewState."
RUNS_VIEW_ID = "diloco-training"
RUNS_VIEW_NAME = "Training: eval loss, goodput, tokens"
#: the run-level metrics shown as columns: held-out loss (nats/token), compute goodput (0-1) and
#: tokens processed by all learners (the synchronizer's goodput series logs the last two)
RUNS_TABLE_METRICS = ("eval/loss", "goodput/compute", "sync/tokens_processed")
#: the table's columns in the UI's own keys (``<type>.`<name>```): duration, then the metrics
RUNS_TABLE_COLUMNS = ("attributes.`Duration`", *(f"metrics.`{m}`" for m in RUNS_TABLE_METRICS),
                      "attributes.`Models`")


def runs_view_state() -> dict[str, Any]:
    """The UI state of the view: the columns, newest run first, the table (not the charts)."""
    return {"selectedColumns": list(RUNS_TABLE_COLUMNS), "orderByKey": "attributes.start_time",
            "orderByAsc": False}


def runs_view_tag(now_ms: int) -> tuple[str, str]:
    """(tag key, tag value) of the saved view, created at ``now_ms`` (ms since the epoch)."""
    value = {"name": RUNS_VIEW_NAME, "createdAt": now_ms, "updatedAt": now_ms,
             "state": json.dumps(runs_view_state(), sort_keys=True)}
    return SHARED_VIEW_TAG_PREFIX + RUNS_VIEW_ID, json.dumps(value)


def runs_table_path(experiment_id: str) -> str:
    """The UI path (after the server's address) of the experiment's runs table in the view."""
    return f"/#/experiments/{experiment_id}/runs?" + urllib.parse.urlencode({"viewStateShareKey": RUNS_VIEW_ID})


def _same_view(value: str | None) -> bool:
    try:
        return json.loads(json.loads(value or "")["state"]) == runs_view_state()
    except (ValueError, KeyError, TypeError):
        return False


def ensure_runs_view(client: Any, experiment_id: str, tags: dict[str, str]) -> bool:
    """Write the view on the experiment unless its tags (``tags``) already hold it, as it is now.

    Args:
        client: an ``MlflowClient``.
        experiment_id: the experiment.
        tags: the experiment's tags as read.

    Returns:
        True when the tag was written.
    """
    key, value = runs_view_tag(int(time.time() * 1000))
    if _same_view(tags.get(key)):
        return False
    client.set_experiment_tag(experiment_id, key, value)
    log.info("experiment %s: saved view %r written (the runs table with %s)", experiment_id, RUNS_VIEW_ID,
             ", ".join(RUNS_TABLE_METRICS))
    return True
