"""diloco_async.flows.links: the MLflow run's address and the summary's markdown (issue 46 item 4)."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from diloco_async.config.tracking import TrackingConfig
from diloco_async.flows.links import MAKE_UI_URL, mlflow_run_url, publish_summary, summary_markdown
from diloco_async.flows.summary import summary_rows

SUMMARY = {"run_id": "20261206-191500-ab12cd", "eval_loss_initial": 5.5, "eval_loss_final": None,
           "eval_bits_per_byte_initial": 8.0, "eval_bits_per_byte_final": None, "wall_s": 12.5, "merges": 7,
           "contributions_merged": 9, "contributions_late": 1, "contributions_rejected": 0,
           "compute_goodput": 0.5, "token_goodput": 0.75, "uptime": 1.0, "tokens_processed": 1000,
           "bytes_in": 10, "bytes_out": 20, "stop_reason": "signal SIGINT", "mlflow_run_id": "abc"}


@pytest.mark.parametrize("cfg, base", [
    (TrackingConfig(), MAKE_UI_URL),
    (TrackingConfig(mlflow_uri="https://mlflow.example.org/"), "https://mlflow.example.org"),
    (TrackingConfig(mlflow_uri="https://mlflow.example.org", ui_url="http://ui.example.org:8080"),
     "http://ui.example.org:8080"),
])
def test_the_mlflow_run_address_goes_by_ui_url_then_the_server_then_make_ui(cfg, base):
    assert mlflow_run_url(cfg, "3", "abc") == f"{base}/#/experiments/3/runs/abc"


@pytest.mark.parametrize("bad", ["http://127.0.0.1:5000;", "http://x.org.", "ftp://x.org", "http://a b"])
def test_a_ui_url_with_trailing_punctuation_or_another_scheme_is_refused(bad):
    with pytest.raises(ValidationError, match="ui_url"):
        TrackingConfig(ui_url=bad)


def test_the_markdown_links_the_mlflow_run_and_holds_every_row():
    text = summary_markdown(SUMMARY, "http://127.0.0.1:5000/#/experiments/3/runs/abc")
    assert text.startswith("# diloco-async run 20261206-191500-ab12cd\n")
    assert "MLflow run `abc`: http://127.0.0.1:5000/#/experiments/3/runs/abc\n" in text
    assert "| eval loss, final (nats/token) | not evaluated (stopped by a signal) |" in text
    assert "| contributions merged / late / rejected | 9 / 1 / 0 |" in text
    assert "| stop reason | signal SIGINT |" in text


def test_outside_a_flow_run_nothing_is_published():
    assert publish_summary(SUMMARY, "http://x") is None


def test_a_resumed_run_shows_the_runs_initial_loss_beside_the_resumes():
    rows = dict(summary_rows({**SUMMARY, "eval_loss_run_initial": 5.5, "eval_loss_initial": 2.25}))
    assert rows["eval loss, at the run's start (nats/token)"] == "5.5000"
    assert rows["eval loss, initial of this resume (nats/token)"] == "2.2500"
    rows = dict(summary_rows({**SUMMARY, "eval_loss_run_initial": 5.5}))  # not a resume: one row
    assert rows["eval loss, initial (nats/token)"] == "5.5000" and len([k for k in rows if "initial" in k
                                                                        or "start" in k]) == 2  # nats, bits


def test_the_runs_table_link_opens_the_saved_view_the_ui_reads():
    from diloco_async.flows.links import mlflow_runs_table_url
    from diloco_async.flows.mlflow_views import RUNS_VIEW_ID, runs_view_tag

    url = mlflow_runs_table_url(TrackingConfig(ui_url="http://ui.example.org:8080"), "3")
    assert url == f"http://ui.example.org:8080/#/experiments/3/runs?viewStateShareKey={RUNS_VIEW_ID}"
    key, value = runs_view_tag(1_700_000_000_000)
    assert key == f"mlflow.sharedViewState.{RUNS_VIEW_ID}"
    # the envelope MLflow 3's UI parses: string name, number createdAt, string state (UI state as JSON)
    envelope = json.loads(value)
    assert isinstance(envelope["name"], str) and envelope["createdAt"] == 1_700_000_000_000
    state = json.loads(envelope["state"])
    assert {"metrics.`eval/loss`", "metrics.`goodput/compute`", "metrics.`sync/tokens_processed`"} <= set(
        state["selectedColumns"])
    text = summary_markdown(SUMMARY, "http://x/#/experiments/3/runs/abc", url)
    assert f"Every run's eval loss, goodput and tokens: {url}\n" in text


class _Sink:
    experiment_id, run_id = "3", "abc"

    def __init__(self) -> None:
        self.tags: dict[str, str] = {}

    def set_tags(self, tags: dict[str, str]) -> None:
        self.tags.update(tags)


def test_the_flow_run_address_is_tagged_only_where_a_configured_server_serves_it(monkeypatch):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    import diloco_async.flows.links as links

    monkeypatch.setattr(links, "prefect_flow_run", lambda: ("f-1", "http://127.0.0.1:4200/runs/flow-run/f-1"))
    with temporary_settings(updates={PREFECT_API_URL: "http://127.0.0.1:4200/api"}):
        sink = _Sink()
        links.link_mlflow_run(sink, TrackingConfig())
    assert sink.tags == {"prefect.flow_run_id": "f-1", "prefect.flow_run_url": "http://127.0.0.1:4200/runs/flow-run/f-1"}
    with temporary_settings(restore_defaults={PREFECT_API_URL}):  # the command's temporary server: no UI
        sink = _Sink()
        out = links.link_mlflow_run(sink, TrackingConfig())
    assert sink.tags == {"prefect.flow_run_id": "f-1", "prefect.server": links.TEMPORARY_SERVER_TAG}
    assert out.run_url == f"{MAKE_UI_URL}/#/experiments/3/runs/abc"
    monkeypatch.setattr(links, "prefect_flow_run", lambda: None)  # outside a flow run: no tag at all
    sink = _Sink()
    links.link_mlflow_run(sink, TrackingConfig())
    assert sink.tags == {}
