"""The end of a training run as an operator reads it: the summary table, the one-line report,
and the exit status after a stop by a signal (``diloco_async.flows.train`` prints them)."""

from __future__ import annotations

import json
import signal

from rich.table import Table

__all__ = ["summary_rows", "summary_table", "report", "stopped_by_signal", "exit_status"]


def _loss(value: float | None) -> str:
    return "not evaluated (stopped by a signal)" if value is None else f"{value:.4f}"


def summary_rows(summary: dict) -> list[tuple[str, str]]:
    """The run's figures as (figure, value) rows: the terminal's table and the Prefect artifact's."""
    resumed = summary.get("eval_loss_run_initial") not in (None, summary["eval_loss_initial"])
    return [
        *([("eval loss, at the run's start (nats/token)", _loss(summary["eval_loss_run_initial"]))] if resumed else []),
        ("eval loss, initial" + (" of this resume" if resumed else "") + " (nats/token)",
         _loss(summary["eval_loss_initial"])),
        ("eval loss, final (nats/token)", _loss(summary["eval_loss_final"])),
        ("eval loss, initial (bits/byte)", _loss(summary["eval_bits_per_byte_initial"])),
        ("eval loss, final (bits/byte)", _loss(summary["eval_bits_per_byte_final"])),
        ("tokenizer", str(summary.get("tokenizer", "bytes"))),
        ("wall time of this synchronizer (s)", f"{summary['wall_s']:.1f}"),
        ("merges", str(summary["merges"])),
        ("contributions merged / late / rejected",
         f"{summary['contributions_merged']} / {summary['contributions_late']} / {summary['contributions_rejected']}"),
        ("late contributions that joined a later round", str(summary.get("contributions_folded") or 0)),
        ("compute goodput", f"{summary['compute_goodput']:.3f}"),
        ("token goodput", f"{summary['token_goodput']:.3f}"),
        ("uptime", f"{summary['uptime']:.3f}"),
        ("tokens processed", str(summary["tokens_processed"])),
        *([("tokens trained / thrown away / re-queued (leased slices)",
            f"{summary['tokens_trained']} / {summary['tokens_thrown_away']} / {summary['tokens_requeued']}"),
           ("slices never reached / epoch", f"{summary['slices_never_reached']} / {summary['slices_epoch']}")]
          if "tokens_trained" in summary else []),
        ("bytes in / out", f"{summary['bytes_in']} / {summary['bytes_out']}"),
        ("peak bytes/s in / out (1 s windows)",
         f"{summary.get('peak_bytes_in_per_s', 0.0):.0f} / {summary.get('peak_bytes_out_per_s', 0.0):.0f}"),
        ("bytes per token up / down", " / ".join("-" if summary.get(k) is None else f"{summary[k]:.2f}"
                                                 for k in ("bytes_up_per_token", "bytes_down_per_token"))),
        ("stop reason", str(summary["stop_reason"])),
        ("MLflow run", summary["mlflow_run_id"]),
    ]


def summary_table(summary: dict) -> Table:
    """The run's figures as a two-column table (a loss not evaluated says so)."""
    table = Table(title=f"diloco-async run {summary['run_id']}")
    table.add_column("figure")
    table.add_column("value", justify="right")
    for k, v in summary_rows(summary):
        table.add_row(k, v)
    return table


def stopped_by_signal(summary: dict) -> bool:
    """The synchronizer stopped because it got SIGINT or SIGTERM (Ctrl-C on the command, a
    cancellation), not because the budget was spent."""
    return str(summary.get("stop_reason") or "").startswith("signal")


def report(summary: dict) -> None:
    """The summary's main figures as one JSON line; after a stop by a signal, one more line: where
    the final checkpoint is and how to continue from it."""
    print(json.dumps({k: summary[k] for k in ("run_id", "eval_loss_initial", "eval_loss_final",
                                              "eval_bits_per_byte_final", "wall_s",
                                              "merges", "compute_goodput", "token_goodput", "mlflow_run_id")}))
    if stopped_by_signal(summary):
        print(f"stopped ({summary['stop_reason']}) at checkpoint {summary['checkpoint_seq']}; continue with: "
              f"diloco-async resume {summary['store_url']}/{summary['run_id']}", flush=True)


def exit_status(summary: dict) -> int:
    """0, or 128 + the signal that stopped the run (130 SIGINT, 143 SIGTERM)."""
    if not stopped_by_signal(summary):
        return 0
    name = str(summary["stop_reason"]).split()[-1]
    return 128 + int(signal.Signals[name]) if name in signal.Signals.__members__ else 130


def worker_intent() -> str | None:
    """What a Prefect worker meant by the SIGTERM it sent (``"cancel"``, ...); None for a SIGTERM
    from anyone else. The worker's control channel says so when it is connected; otherwise the flow
    run's own state does (a cancellation sets it to Cancelling before the worker signals)."""
    try:
        from prefect._internal.control_listener import get_intent
        intent = get_intent()
    except ImportError:
        intent = None
    if intent is not None:
        return str(intent)
    from prefect.client.orchestration import get_client
    from prefect.runtime import flow_run

    try:
        with get_client(sync_client=True) as client:
            state = client.read_flow_run(flow_run.id).state
    except Exception:  # no API to ask (the run is not being cancelled through one)
        return None
    return "cancel" if state is not None and state.type.value in ("CANCELLING", "CANCELLED") else None
