"""model.kind = byte-gpt | hf | factory, LoRA, the model identity in the plan, bad model input, recipes.

Small models only: each test builds its models in about a second.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from diloco_async.config.model import HfModelConfig, ModelConfig
from diloco_async.config.schema import load_config
from diloco_async.models import (
    CausalLM,
    build_model,
    embedding_names,
    identity_of,
    load_saved_model,
    plan_of,
    save_final_model,
    trainable_parameters,
)
from diloco_async.models.transformer import ByteGPT
from diloco_async.policy.fragments import FragmentPlan, plan_differences, plan_fragments, specs_of

ROOT = Path(__file__).resolve().parents[2]
TINY_LLAMA = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2}


def tiny_hf(**extra) -> ModelConfig:
    return ModelConfig.model_validate({"kind": "hf", "context": 16,
                                       "hf": {"architecture": "llama", "config": TINY_LLAMA}, **extra})


def batch(vocab: int = 256, b: int = 4, t: int = 16, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randint(0, vocab, (b, t + 1), generator=g)
    return w[:, :-1], w[:, 1:]


def not_a_module(model_cfg, vocab_size):  # a broken factory (tests/ is on sys.path: "test_models:not_a_module")
    return {"vocab_size": vocab_size}


# ------------------------------------------------------------------ building each kind --------


def test_hf_random_init_is_seeded_and_gives_the_loss_contract():
    a, b = build_model(tiny_hf(), 256, seed=3), build_model(tiny_hf(), 256, seed=3)
    c = build_model(tiny_hf(), 256, seed=4)
    pa, pb, pc = trainable_parameters(a), trainable_parameters(b), trainable_parameters(c)
    assert isinstance(a, CausalLM) and pa.keys() == dict(a.named_parameters()).keys()
    assert all(torch.equal(pa[n], pb[n]) for n in pa)
    assert not all(torch.equal(pa[n], pc[n]) for n in pa)
    x, y = batch()
    assert a(x).shape == (4, 16, 256)
    loss = a.loss(x, y)
    assert loss.ndim == 0 and loss.dtype == torch.float32
    assert loss.item() == pytest.approx(math.log(256), abs=0.2)
    assert set(embedding_names(a)) == {"net.model.embed_tokens.weight", "net.lm_head.weight"}


def test_byte_gpt_kind_is_todays_model_unchanged():
    cfg = load_config("configs/default.toml")
    built = build_model(cfg.model, 256, cfg.run.seed)
    torch.manual_seed(cfg.run.seed)
    direct = ByteGPT(cfg.model)  # how Θ^0 was made before model.kind existed
    assert isinstance(built, ByteGPT)
    assert all(torch.equal(p, q) for p, q in zip(built.parameters(), direct.parameters(), strict=True))
    assert plan_of(built, 4).schema_hash == plan_of(direct, 4).schema_hash
    assert identity_of(built)["kind"] == "byte-gpt"


def test_factory_example_builds_trains_and_is_wrapped():
    cfg = ModelConfig.model_validate({"kind": "factory", "factory": "examples.tiny_mlp_lm:build", "context": 16,
                                      "options": {"width": 24, "window": 3}})
    model = build_model(cfg, 256, seed=0)
    assert isinstance(model, CausalLM)  # forward gives logits: the loss is added around it
    assert identity_of(model)["factory"] == "examples.tiny_mlp_lm:build"
    assert identity_of(model)["options"] == {"width": 24, "window": 3}
    x, y = batch()
    x[:, 5:] = 0  # causal: position t must not see later tokens
    logits_a = model(x)
    x2 = x.clone()
    x2[:, 10] = 7
    assert torch.allclose(model(x2)[:, :10], logits_a[:, :10])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    first = model.loss(x, y).item()
    for _ in range(30):
        opt.zero_grad()
        model.loss(x, y).backward()
        opt.step()
    assert model.loss(x, y).item() < first - 0.5
    plan = plan_of(model, 2)
    assert sum(plan.numel(p) for p in range(2)) == sum(p.numel() for p in model.parameters())


def test_lora_plan_holds_only_the_adapter():
    cfg = tiny_hf(lora={"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]})
    model = build_model(cfg, 256, seed=0)
    plan = plan_of(model, 2)
    names = [n for p in range(plan.num_fragments) for n in plan.names(p)]
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names)
    assert len(names) == 2 * 2 * 2  # 2 layers x (q, v) x (A, B)
    assert plan.embedding_names == frozenset()
    full = sum(p.numel() for p in model.parameters())
    assert sum(plan.numel(p) for p in range(2)) < 0.05 * full
    ident = plan.model_identity
    assert ident["lora"]["target_modules"] == ["q_proj", "v_proj"] and len(ident["base_digest"]) == 64
    # the same base: the same digest; another seed: another base, another schema
    assert plan_of(build_model(cfg, 256, seed=0), 2).schema_hash == plan.schema_hash
    other = plan_of(build_model(cfg, 256, seed=1), 2)
    assert other.schema_hash != plan.schema_hash
    assert any(line.startswith("model base_digest") for line in plan_differences(other, plan))


def test_pretrained_folder_and_adapter_artifact_load_back(tmp_path):
    base = build_model(tiny_hf(), 256, seed=5)
    base.net.save_pretrained(str(tmp_path / "base"))
    cfg = ModelConfig.model_validate({"kind": "hf", "context": 16, "hf": {"pretrained": str(tmp_path / "base")},
                                      "lora": {"r": 4, "target_modules": ["q_proj", "v_proj"]}})
    tuned = build_model(cfg, 256, seed=0)
    x, y = batch()
    assert tuned.loss(x, y).item() == pytest.approx(base.loss(x, y).item(), abs=1e-5)  # B = 0 at init
    with torch.no_grad():
        for p in trainable_parameters(tuned).values():
            p.add_(0.05 * torch.randn_like(p))
    out = save_final_model(tuned, cfg, tmp_path / "artifact")
    assert (out / "adapter_config.json").exists() and (out / "LOADING.md").exists()
    assert not (out / "model.safetensors").exists()  # the adapter only
    back = CausalLM(load_saved_model(out), 16, hf=True)
    assert back.loss(x, y).item() == pytest.approx(tuned.loss(x, y).item(), abs=1e-5)


# ------------------------------------------------------------------ identity and the join check ---


def test_plan_differences_name_the_first_differing_tensors():
    a = build_model(tiny_hf(), 256, seed=0)
    wider = dict(TINY_LLAMA, intermediate_size=96)
    b = build_model(tiny_hf(hf={"architecture": "llama", "config": wider}), 256, seed=0)
    pa, pb = plan_of(a, 2), plan_of(b, 2)
    assert pa.schema_hash != pb.schema_hash
    lines = plan_differences(pb, pa)
    assert lines[0].startswith("tensor net.model.layers.0.mlp.down_proj.weight: shape [32, 96]")
    assert any("model config.intermediate_size: 96 here, 64 there" in line for line in lines)
    assert plan_differences(pa, FragmentPlan.from_json(pa.to_json())) == []
    assert FragmentPlan.from_json(pa.to_json()).schema_hash == pa.schema_hash


def test_identity_alone_changes_the_schema():
    specs = specs_of({"w": torch.zeros(4, 4), "b": torch.zeros(4)})
    assert plan_fragments(specs, 2).schema_hash != plan_fragments(specs, 2, identity={"kind": "x"}).schema_hash
    assert plan_fragments(specs, 2, identity={"kind": "x"}).schema_hash == \
        plan_fragments(specs, 2, identity={"kind": "x"}).schema_hash


# ------------------------------------------------------------------ bad input ---------------------


def test_unknown_kind_is_named_by_the_config():
    with pytest.raises(ValueError, match=r"model\.kind.*'transformer'"):
        load_config(None, ['model.kind="transformer"'])


@pytest.mark.parametrize("fields, error, match", [
    ({"kind": "factory", "factory": "no_such_pkg.models:build"}, ValueError,
     r"model\.factory='no_such_pkg\.models:build': module 'no_such_pkg\.models' does not import"),
    ({"kind": "factory", "factory": "examples.tiny_mlp_lm:nope"}, ValueError, r"has no callable 'nope'"),
    ({"kind": "factory", "factory": "test_models:not_a_module"}, TypeError,
     r"model\.factory='test_models:not_a_module' returned a dict, not a torch\.nn\.Module"),
    ({"kind": "hf", "hf": {"pretrained": "/no/such/folder"}}, ValueError,
     r"model\.hf\.pretrained='/no/such/folder': no such folder"),
    ({"kind": "hf", "hf": {"architecture": "llama", "config": TINY_LLAMA},
      "lora": {"target_modules": ["q_proj", "qkv"]}}, ValueError,
     r"model\.lora\.target_modules \['qkv'\] match no module"),
    ({"kind": "hf", "hf": {"architecture": "lama"}}, ValueError, r"model\.hf\.architecture='lama' is not"),
    ({"kind": "hf", "hf": {"architecture": "llama", "config": {"hiden_size": 8}}}, ValueError,
     r"\['hiden_size'\] are not fields of the 'llama' config"),
    ({"kind": "hf", "hf": {"architecture": "llama", "config": dict(TINY_LLAMA, vocab_size=100)}}, ValueError,
     r"vocab_size=100 is smaller than the tokenizer's vocabulary \(256 tokens\)"),
])
def test_bad_model_input_is_named(fields, error, match):
    cfg = ModelConfig.model_validate({"context": 16, **fields})
    with pytest.raises(error, match=match):
        build_model(cfg, 256, seed=0)


@pytest.mark.parametrize("override, match", [
    ('model.factory="not a path"', r"must look like 'package\.module:function'"),
    ('model.lora={target_modules=["q_proj"]}', r"model\.lora needs model\.kind = 'hf'"),
])
def test_bad_model_config_is_named(override, match):
    extra = ['model.kind="factory"'] if "factory" in override else []
    with pytest.raises(ValueError, match=match):
        load_config(None, [*extra, override])


# ------------------------------------------------------------------ recipes -----------------------


@pytest.mark.parametrize("name", ["hf-llama-cpu", "lora-finetune", "gpt2-gpu"])
def test_model_recipes_load(name):
    cfg = load_config(str(ROOT / "configs" / f"{name}.toml"))
    assert cfg.model.kind == "hf"
    if name == "lora-finetune":
        assert cfg.model.lora is not None and cfg.model.hf.pretrained
    if name == "gpt2-gpu":
        assert cfg.learners.count == 8 and cfg.model.hf.architecture == "gpt2"


def test_cpu_recipe_model_has_5_to_20m_parameters():
    cfg = load_config(str(ROOT / "configs" / "hf-llama-cpu.toml"))
    model = build_model(cfg.model, cfg.model.vocab_size, cfg.run.seed)
    n = sum(p.numel() for p in model.parameters())
    assert 5e6 <= n <= 20e6, n


def test_pretrained_from_an_fsspec_url_is_copied_once_into_the_cache(tmp_path):
    import fsspec

    base = build_model(tiny_hf(), 256, seed=8)
    base.net.save_pretrained(str(tmp_path / "saved"))
    fs = fsspec.filesystem("memory")
    url = f"memory://models-{tmp_path.name}/base"
    for f in (tmp_path / "saved").iterdir():
        fs.pipe(f"{url}/{f.name}", f.read_bytes())
    cfg = ModelConfig.model_validate({"kind": "hf", "context": 16,
                                      "hf": {"pretrained": url, "cache_dir": str(tmp_path / "cache")}})
    x, y = batch()
    assert build_model(cfg, 256, seed=0).loss(x, y).item() == pytest.approx(base.loss(x, y).item(), abs=1e-6)
    copies = list((tmp_path / "cache").iterdir())
    assert len(copies) == 1 and (copies[0] / "config.json").exists()
    fs.rm(url, recursive=True)  # the second build reads the cached copy, not the URL
    assert build_model(cfg, 256, seed=0).loss(x, y).item() == pytest.approx(base.loss(x, y).item(), abs=1e-6)
    with pytest.raises(ValueError, match=r"model\.hf\.pretrained='memory://nowhere/x': nothing at that URL"):
        build_model(ModelConfig.model_validate({"kind": "hf", "hf": {"pretrained": "memory://nowhere/x"}}), 256, 0)


# ------------------------------------------------------------------ the Hugging Face Hub ----------


def test_hub_ids_are_told_from_local_folders_and_urls(tmp_path, monkeypatch):
    from diloco_async.config.model import hub_repo_id

    monkeypatch.chdir(tmp_path)
    assert hub_repo_id("org/name") == "org/name" and hub_repo_id("hf://org/na.me-2") == "org/na.me-2"
    for local in (".local/pretrained/llama-cpu", "/abs/folder", "s3://bucket/model", "file:///x/y", "name", None):
        assert hub_repo_id(local) is None, local
    (tmp_path / "org" / "name").mkdir(parents=True)  # a folder of that name wins, as in from_pretrained
    assert hub_repo_id("org/name") is None


def test_hub_fields_are_refused_where_they_mean_nothing():
    with pytest.raises(ValueError, match=r"model\.hf\.revision='v1' needs a Hub id .* \(got '/abs/base'\)"):
        HfModelConfig(pretrained="/abs/base", revision="v1")
    with pytest.raises(ValueError, match=r"model\.hf\.pretrain builds a local folder: .*\(got 'org/name'\)"):
        HfModelConfig.model_validate({"pretrained": "org/name", "pretrain": {"architecture": "llama"}})
    assert HfModelConfig(pretrained="org/name", revision="v1").revision == "v1"


def test_a_hub_id_that_was_not_downloaded_is_refused_naming_it_without_any_request(tmp_path, monkeypatch):
    """Learners only look the snapshot up (local_files_only): nothing is downloaded there; the
    endpoint is a closed port, so a request would fail differently."""
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    cfg = ModelConfig.model_validate({"kind": "hf", "hf": {"pretrained": "org/absent", "cache_dir": str(tmp_path)}})
    with pytest.raises(ValueError, match=r"model\.hf\.pretrained='org/absent': Hub model 'org/absent' \(revision "
                                         r"'main'\) is not in .*: the train flow downloads it once"):
        build_model(cfg, 256, seed=0)
    assert not list(tmp_path.rglob("*.safetensors"))


def test_hub_dataset_urls_parse_like_huggingface_hubs_filesystem():
    from diloco_async.config.data import DataConfig, HubDataUrl, parse_hub_data_url

    assert parse_hub_data_url("hf://datasets/org/name@v2/data/*.jsonl") == HubDataUrl("org/name", "v2", "data/*.jsonl")
    assert parse_hub_data_url("hf://datasets/org/name") == HubDataUrl("org/name", "main", "")
    assert parse_hub_data_url("s3://bucket/x.txt") is None
    with pytest.raises(ValueError, match=r"data\.urls: 'hf://org/model' is not a Hub dataset URL"):
        DataConfig(source="urls", urls=["hf://org/model"])
