"""The Python API (issue 46 item 1): ``diloco_async.train(...)`` and ``resume(...)`` run a real
synchronizer and real learners from a script with no Prefect and no MLflow imported, return the
summary with the held-out losses, and refuse a bad config with the CLI's one-line error."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_SCRIPT = """
import json, sys
import diloco_async

tmp = sys.argv[1]
tiny = [f"run.store=file://{tmp}/store", f"run.workdir={tmp}/runs", "model.n_layer=1", "model.d_model=32",
        "model.n_head=2", "model.context=32", "learners.count=2", "learners.batch_size=8",
        "synchronizer.num_fragments=3", "synchronizer.sync_every=12", "synchronizer.checkpoint_every_s=5",
        "budget.tokens=20000", "budget.wall_s=120", "data.eval_batches=4"]
seen = []
first = diloco_async.train("default", tiny, on_status=lambda st: seen.append(st["merges"]), poll_s=0.5)
again = diloco_async.resume(f"file://{tmp}/store/{first['run_id']}",
                            overrides=[f"budget.tokens={first['tokens_processed'] + 20000}"], poll_s=0.5)
print("RESULT " + json.dumps({"first": first, "again": again, "polled": len(seen),
                              "modules": sorted(m for m in sys.modules if m.split(".")[0] in ("prefect", "mlflow"))}))
"""


def test_train_and_resume_from_python_without_prefect_or_mlflow(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run([sys.executable, "-c", _SCRIPT, str(tmp_path)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    out = json.loads(next(ln for ln in done.stdout.splitlines() if ln.startswith("RESULT "))[7:])
    first, again = out["first"], out["again"]
    assert out["modules"] == []  # neither Prefect nor MLflow was imported
    assert out["polled"] >= 1  # on_status saw the synchronizer's /status
    assert first["stop_reason"].startswith("token budget") and first["merges"] > 0
    assert first["eval_loss_final"] < first["eval_loss_initial"] - 0.5
    assert again["run_id"] == first["run_id"] and again["resumed_from"] == first["checkpoint_seq"]
    assert again["merges"] > first["merges"] and again["eval_loss_final"] is not None
    assert not (tmp_path / ".local").exists() or not any((tmp_path / ".local").glob("prefect*"))


def test_a_bad_config_raises_the_clis_one_line_error_naming_the_field(tmp_path):
    script = ("import diloco_async\n"
              "try:\n    diloco_async.train('default', ['learners.count=0'])\n"
              "except ValueError as err:\n    print(err)\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    api = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    cli = subprocess.run([sys.executable, "-m", "diloco_async.flows.cli", "train", "--set", "learners.count=0"],
                         cwd=ROOT,
                         env={**env, "PREFECT_HOME": str(tmp_path / "prefect")}, capture_output=True, text=True,
                         timeout=120)
    assert cli.returncode == 2 and cli.stderr.startswith("error: invalid config")
    assert "learners.count" in api.stdout and cli.stderr == "error: " + api.stdout
