"""Read a training run back from MLflow and print what its dashboard holds (``make mlflow-check``).

With ``MlflowClient`` only (no server): the newest top-level training run (tag ``diloco.run_id``)
of the experiment, or ``--run-id``. Prints, one line each: the points of ``eval/loss`` (distinct
steps, first and last value), of ``goodput/compute`` and ``goodput/token``, every ``system/*``
series and its sample count, the experiment's ``mlflow.experimentKind`` tag, each learner run's
``train_loss`` points and the learners' chart path. Exit 0 when the run meets the dashboard checks
(``eval/loss`` and ``goodput/compute`` with at least ``--min-points`` steps each, ``eval/loss`` not
constant, CPU, memory and network system metrics present, the model-training marker), 1 when one
fails (each failure printed as ``FAIL ...``), 2 when there is no run to read.

    .venv/bin/python scripts/mlflow_readback.py                      # .local/mlflow.db
    .venv/bin/python scripts/mlflow_readback.py --db sqlite:///x.db --run-id <id> --json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mlflow.tracking import MlflowClient

from diloco_async.flows.tracking import EXPERIMENT_KIND_TAG, LEARNERS_CHART_TAG, MODEL_TRAINING_KIND

SYSTEM_REQUIRED = ("system/cpu_utilization_percentage", "system/system_memory_usage_megabytes",
                   "system/network_receive_megabytes", "system/network_transmit_megabytes")


def _series(client: MlflowClient, run_id: str, key: str) -> dict:
    hist = sorted(client.get_metric_history(run_id, key), key=lambda m: (m.step, m.timestamp))
    return {"points": len(hist), "steps": len({m.step for m in hist}), "distinct_values": len({m.value for m in hist}),
            "first": hist[0].value if hist else None, "last": hist[-1].value if hist else None,
            "last_step": hist[-1].step if hist else None}


def _find_run(client: MlflowClient, experiment: str, run_id: str | None):
    if run_id:
        return client.get_run(run_id)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return None
    runs = client.search_runs([exp.experiment_id], "tags.`diloco.run_id` != ''",
                              order_by=["attributes.start_time DESC"], max_results=50)
    top = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    return top[0] if top else None


def read_back(client: MlflowClient, run) -> dict:
    """What the dashboard of ``run`` (an MLflow ``Run``) holds, as plain data."""
    rid, exp_id = run.info.run_id, run.info.experiment_id
    keys = sorted(run.data.metrics)
    children = client.search_runs([exp_id], f"tags.`mlflow.parentRunId` = '{rid}'")
    return {
        "run_id": rid, "run_name": run.info.run_name, "status": run.info.status,
        "diloco_run_id": run.data.tags.get("diloco.run_id"),
        "experiment_kind": client.get_experiment(exp_id).tags.get(EXPERIMENT_KIND_TAG),
        "series": {k: _series(client, rid, k) for k in ("eval/loss", "eval/bits_per_byte", "goodput/compute",
                                                        "goodput/token")},
        "system": {k: len(client.get_metric_history(rid, k)) for k in keys if k.startswith("system/")},
        "learners": {c.data.tags.get("diloco.learner_id", c.info.run_name):
                     len(client.get_metric_history(c.info.run_id, "train_loss")) for c in children},
        "learners_chart": run.data.tags.get(LEARNERS_CHART_TAG),
    }


def failures(found: dict, min_points: int) -> list[str]:
    """The dashboard checks ``found`` (:func:`read_back`) does not pass, as sentences."""
    out = []
    for key in ("eval/loss", "goodput/compute"):
        if found["series"][key]["steps"] < min_points:
            out.append(f"{key} has {found['series'][key]['steps']} steps, fewer than {min_points}")
    if found["series"]["eval/loss"]["distinct_values"] < 2:
        out.append("eval/loss is constant")
    out += [f"no system metric {k}" for k in SYSTEM_REQUIRED if not found["system"].get(k)]
    if found["experiment_kind"] != MODEL_TRAINING_KIND:
        out.append(f"experiment tag {EXPERIMENT_KIND_TAG} is {found['experiment_kind']!r}, not {MODEL_TRAINING_KIND!r}")
    return out


def _print(found: dict) -> None:
    print(f"run {found['run_name']} ({found['run_id']}, diloco run {found['diloco_run_id']}), {found['status']}")
    print(f"experiment {EXPERIMENT_KIND_TAG} = {found['experiment_kind']}")
    for key, s in found["series"].items():
        print(f"{key:22s} {s['points']:4d} points, {s['steps']:4d} steps, first {s['first']}, last {s['last']} "
              f"(step {s['last_step']})")
    for key, n in found["system"].items():
        print(f"{key:40s} {n:4d} samples")
    for lid, n in sorted(found["learners"].items()):
        print(f"{lid:22s} train_loss {n} points (nested run)")
    print(f"learners' chart: {found['learners_chart']}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--db", default=".local/mlflow.db", help="sqlite file or tracking URI (default %(default)s)")
    ap.add_argument("--experiment", default="diloco-async")
    ap.add_argument("--run-id", help="an MLflow run id (default: the newest top-level training run)")
    ap.add_argument("--min-points", type=int, default=10, help="steps eval/loss and goodput/compute need")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    uri = args.db if "://" in args.db else "sqlite:///" + str(Path(args.db).resolve())
    if "://" not in args.db and not Path(args.db).exists():
        print(f"mlflow_readback: no MLflow database at {args.db} (run `make run` first)", file=sys.stderr)
        return 2
    client = MlflowClient(tracking_uri=uri)
    run = _find_run(client, args.experiment, args.run_id)
    if run is None:
        print(f"mlflow_readback: no training run in experiment {args.experiment!r}", file=sys.stderr)
        return 2
    found = read_back(client, run)
    failed = failures(found, args.min_points)
    if args.json:
        print(json.dumps({**found, "failures": failed}, indent=2))
    else:
        _print(found)
    for line in failed:
        print(f"FAIL {line}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
