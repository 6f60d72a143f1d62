"""How a ``train`` or ``resume`` flow run ends (issue 46 items 3-4).

* A run stopped by a signal (Ctrl-C, SIGTERM) ends without the final evaluation
  (:func:`interrupted`), and is visibly stopped: the flow run ends in a Completed state named
  ``Stopped`` (the run did what it was asked: it stopped cleanly at a checkpoint a resume continues
  from; ``Cancelled`` would say the work was thrown away), the MLflow run ends ``KILLED`` with the
  tag ``diloco.stopped`` holding the reason.
* Every end (:func:`finish`) adds the learner flow runs, publishes the summary as the flow run's
  markdown artifact linked to the MLflow run (:mod:`diloco_async.flows.links`) and logs the MLflow run's address.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from prefect import get_run_logger
from prefect.states import Completed
from rich.console import Console

from diloco_async.flows.links import MAKE_UI_URL, MlflowLinks, publish_summary
from diloco_async.flows.summary import stopped_by_signal, summary_table

__all__ = ["INTERRUPTED_LEARNER_WAIT_S", "STOPPED_STATE_NAME", "STOPPED_TAG", "interrupted", "finish", "run_logs"]

#: after a stop by a signal, how long (s) learners may take to exit on their own (those that heard
#: "stop" take well under a second) before they get SIGTERM
INTERRUPTED_LEARNER_WAIT_S = 2.0
#: the name of the Completed state a flow run stopped by a signal ends in
STOPPED_STATE_NAME = "Stopped"
#: the MLflow tag of a run stopped by a signal (its value: the stop reason); cleared when a resume of
#: it finishes
STOPPED_TAG = "diloco.stopped"


def run_logs(run: Any, sink: Any) -> str:
    """Where anyone can read the run's process logs (the summary's ``logs``): the run's ``logs/``
    folder on this host (the synchronizer's log; with the local launcher the learners' too)
    uploaded as the MLflow run's artifacts ``logs/{epoch}/``, whose URI this returns, so another
    host opens it (docs/multi-host.md). The local folder's path when there is nothing to upload or
    the upload failed (counted in ``sink.errors`` and logged by the sink)."""
    folder = run.workdir / "logs"
    errors = sink.errors
    if not folder.is_dir() or not any(folder.iterdir()):
        return str(folder)
    sink.log_artifacts(folder, f"logs/{run.epoch}")
    if sink.errors > errors:
        return str(folder)
    return f"{sink.client.get_run(sink.run_id).info.artifact_uri.rstrip('/')}/logs/{run.epoch}"


def interrupted(run: Any, sink: Any, summary: dict, eval_start: tuple[float, float], t0: float) -> dict:
    """The end of a run stopped by a signal: the synchronizer's figures and its final checkpoint,
    without the final evaluation and the model artifacts (a stop should take seconds; a resume
    continues from that checkpoint and evaluates at its end). Marks ``run.stopped``."""
    summary.update(eval_loss_initial=eval_start[0], eval_loss_final=None, eval_bits_per_byte_initial=eval_start[1],
                   eval_bits_per_byte_final=None, tokenizer=run.cfg.data.tokenizer, flow_wall_s=time.monotonic() - t0,
                   mlflow_run_id=sink.run_id, checkpoint_seq=summary.get("last_checkpoint_seq"),
                   store_url=run.store.url, logs=run_logs(run, sink), launcher=run.cfg.run.launcher,
                   learner_restarts=len(run.supervisor.restarts), eval_loss_run_initial=run.run_initial_loss)
    run.learner_exit_wait_s = INTERRUPTED_LEARNER_WAIT_S
    run.stopped = True
    sink.set_tags({STOPPED_TAG: str(summary["stop_reason"])})
    sink.log_dict(summary, f"summary-{run.epoch}.json" if run.resume_url else "summary.json")
    Console(stderr=False, width=None if sys.stdout.isatty() else 110).print(summary_table(summary))
    get_run_logger().info("run %s stopped (%s) at checkpoint %s after %d merges", run.run_id, summary["stop_reason"],
                          summary["checkpoint_seq"], summary["merges"])
    return summary


def finish(run: Any, summary: dict, links: MlflowLinks) -> Any:
    """Add the learner flow runs (deployments launcher) and their final states and the MLflow run's
    address to a summary, publish it (:func:`diloco_async.flows.links.publish_summary`) and log the addresses of
    the run and of the experiment's runs table.

    Returns:
        the summary, or after a stop by a signal a Completed state named :data:`STOPPED_STATE_NAME`
        holding it (calling the flow still returns the summary).
    """
    if run.deployer is not None:
        summary["learner_flow_runs"] = run.learner_flow_runs()
    summary["mlflow_run_url"] = links.run_url
    publish_summary(summary, links.run_url, links.runs_table_url)
    get_run_logger().info("MLflow run %s: %s", summary["mlflow_run_id"], links.run_url)
    get_run_logger().info("MLflow runs table (eval loss, goodput, tokens): %s", links.runs_table_url)
    if links.run_url.startswith(MAKE_UI_URL):  # no tracking server of the run's own: nothing serves them yet
        get_run_logger().info("these open while `make ui` serves the run's database (outside a checkout: "
                              "`mlflow server`, docs/install.md)")
    if not stopped_by_signal(summary):
        return summary
    # no address in the message: Prefect prints it quoted, and a terminal would link the quote too
    return Completed(name=STOPPED_STATE_NAME, data=summary,
                     message=f"stopped ({summary['stop_reason']}) at checkpoint {summary['checkpoint_seq']} of run "
                             f"{summary['run_id']}: resumable (diloco-async resume)")
