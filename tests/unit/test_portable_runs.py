"""Runs that work from another host (issue 46 item 5): MLflow artifact roots are the store's URL or
the tracking server's proxy, the Prefect deployments' pull step records no path of the checkout
`prefect deploy` ran in, and a LoRA adapter names its base by a reference other hosts resolve."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from prefect.utilities.importtools import import_object
from test_models import batch, tiny_hf

from diloco_async.config.model import ModelConfig
from diloco_async.config.tracking import TrackingConfig
from diloco_async.flows.pull import CHECKOUT_ENV, checkout_directory
from diloco_async.flows.tracking import FALLBACK_ARTIFACTS, artifact_root
from diloco_async.models import CausalLM, build_model, load_saved_model, save_final_model, trainable_parameters
from diloco_async.models.export import upload_folder
from diloco_async.storage.store import ObjectStore

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("cfg, store, expected", [
    (TrackingConfig(), "s3://bucket/runs", "s3://bucket/runs/mlartifacts"),
    (TrackingConfig(), "gs://bucket/runs/", "gs://bucket/runs/mlartifacts"),
    (TrackingConfig(mlflow_uri="https://mlflow.example.org"), "s3://bucket/runs", None),  # the server's proxy
    (TrackingConfig(artifact_location="s3://other/art"), "gs://bucket/runs", "s3://other/art"),
])
def test_a_new_experiment_keeps_its_artifacts_at_a_uri_other_hosts_use(cfg, store, expected):
    assert artifact_root(cfg, store) == expected


def test_a_local_store_or_path_becomes_an_absolute_file_uri(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    local = (tmp_path / ".local" / "store").as_uri()
    assert artifact_root(TrackingConfig(), "file://.local/store") == f"{local}/mlartifacts"
    assert artifact_root(TrackingConfig(artifact_location="art"), None) == (tmp_path / "art").as_uri()
    # MLflow cannot write to memory://: this machine's folder, as before
    assert artifact_root(TrackingConfig(), "memory://runs") == (tmp_path / FALLBACK_ARTIFACTS).as_uri()


def test_the_deployments_record_no_path_of_this_checkout():
    text = (ROOT / "prefect.yaml").read_text()
    spec = yaml.safe_load(text)
    assert str(ROOT) not in text and "$PWD" not in text
    assert spec["pull"] == [{"diloco_async.flows.pull.set_checkout_directory": {}}]
    for deployment in spec["deployments"]:
        assert "pull" not in deployment, deployment["name"]  # every one uses the top-level step
        assert not Path(deployment["entrypoint"].split(":")[0]).is_absolute()


def test_the_pull_step_runs_each_flow_in_its_hosts_checkout(tmp_path, monkeypatch):
    """The deployments' pull step, imported as Prefect imports it: the working directory becomes
    the checkout DILOCO_CHECKOUT names (another host's, at another path), else this installed one."""
    (step,) = yaml.safe_load((ROOT / "prefect.yaml").read_text())["pull"]
    ((fqn, inputs),) = step.items()
    pull = import_object(fqn)
    elsewhere = tmp_path / "host-b" / "diloco-async"
    elsewhere.mkdir(parents=True)
    shutil.copy(ROOT / "prefect.yaml", elsewhere / "prefect.yaml")
    monkeypatch.chdir(tmp_path)  # restored afterwards
    monkeypatch.setenv(CHECKOUT_ENV, str(elsewhere))
    assert pull(**inputs) == {"directory": str(elsewhere.resolve())} and Path.cwd() == elsewhere.resolve()
    monkeypatch.delenv(CHECKOUT_ENV)
    assert pull(**inputs) == {"directory": str(ROOT.resolve())} and Path.cwd() == ROOT.resolve()
    monkeypatch.setenv(CHECKOUT_ENV, str(tmp_path))  # not a checkout: refused, naming the variable
    with pytest.raises(ValueError, match=f"{CHECKOUT_ENV}=.*not a checkout"):
        checkout_directory(os.environ)


def _tuned_adapter(tmp_path: Path, pretrained: str | None) -> tuple[CausalLM, ModelConfig]:
    hf = {"pretrained": pretrained} if pretrained else tiny_hf().hf.model_dump()
    cfg = ModelConfig.model_validate({"kind": "hf", "context": 16, "hf": hf,
                                      "lora": {"r": 4, "target_modules": ["q_proj", "v_proj"]}})
    tuned = build_model(cfg, 256, seed=0)
    with torch.no_grad():
        for p in trainable_parameters(tuned).values():
            p.add_(0.05 * torch.randn_like(p))
    return tuned, cfg


def test_a_lora_adapter_names_its_base_in_the_store_and_loads_from_there(tmp_path):
    base = build_model(tiny_hf(), 256, seed=5)
    base.net.save_pretrained(str(tmp_path / "pretrained"))
    tuned, cfg = _tuned_adapter(tmp_path, str(tmp_path / "pretrained"))
    store = ObjectStore(f"file://{tmp_path}/store")
    prefix = "run-1/epochs/0/model/"
    out = save_final_model(tuned, cfg, tmp_path / "artifact", base_url=f"{store.url}/{prefix}")
    ref = json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert ref == f"{store.url}/{prefix}base" and str(tmp_path / "pretrained") not in (out / "LOADING.md").read_text()
    assert (out / "base" / "model.safetensors").read_bytes() == (tmp_path / "pretrained" / "model.safetensors") \
        .read_bytes()  # the base it trained on, file for file
    upload_folder(store, prefix, out)
    # another host: the adapter alone (no base/ beside it, no pretrained folder), the base from the store
    adapter_only = tmp_path / "host-b"
    adapter_only.mkdir()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        shutil.copy(out / name, adapter_only / name)
    shutil.rmtree(tmp_path / "pretrained")
    back = CausalLM(load_saved_model(adapter_only, cache_dir=str(tmp_path / "cache")), 16, hf=True)
    x, y = batch()
    assert back.loss(x, y).item() == pytest.approx(tuned.loss(x, y).item(), abs=1e-5)


def test_a_lora_adapter_on_a_remote_or_hub_base_names_it_as_given(tmp_path, monkeypatch):
    from diloco_async.models import export

    tuned, _ = _tuned_adapter(tmp_path, None)
    monkeypatch.setattr(export, "fetch_pretrained", None)  # a remote base is never fetched to be saved
    for pretrained, revision in (("s3://models/llama-tiny", None), ("org/llama-tiny", "v1")):
        hf = {"pretrained": pretrained, "revision": revision} if revision else {"pretrained": pretrained}
        cfg = ModelConfig.model_validate({"kind": "hf", "context": 16, "hf": hf,
                                          "lora": {"r": 4, "target_modules": ["q_proj", "v_proj"]}})
        out = save_final_model(tuned, cfg, tmp_path / pretrained.replace("/", "_").replace(":", ""))
        doc = json.loads((out / "adapter_config.json").read_text())
        assert doc["base_model_name_or_path"] == pretrained and doc.get("revision") == revision
        assert not (out / "base").exists()  # nothing copied: every host reads the same base
