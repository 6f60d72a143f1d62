"""learners.optimizer = "muon": which parameters Muon trains, that it trains, its inner-state round
trip, the schedule reaching both groups, and the models it refuses (DESIGN §3, issue 44 item 4)."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from diloco_async.config.model import ModelConfig
from diloco_async.config.schema import Config, config_hash
from diloco_async.inner.optimizers import MuonWithAdamW, check_inner_optimizer, muon_parameter_names
from diloco_async.inner.state import InnerState
from diloco_async.inner.workload import Workload, optimizer_of
from diloco_async.models import build_model
from diloco_async.models.transformer import ByteGPT
from diloco_async.policy.schedules import InnerSchedule

TINY_LLAMA = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2}
TEXT = torch.tensor(list(b"to be or not to be, that is the question: whether 'tis nobler in the mind " * 8))


def byte_gpt(seed: int = 0, tie: bool = True) -> ByteGPT:
    torch.manual_seed(seed)
    return ByteGPT(ModelConfig(n_layer=2, d_model=16, n_head=2, context=16, tie_embeddings=tie))


def workload(model: torch.nn.Module, seed: int = 7) -> Workload:
    opt = optimizer_of("muon", model, lr=3e-3, weight_decay=0.1, what="test")
    w = Workload(model, opt, torch.Generator().manual_seed(seed), batch_size=4, context=16,
                 schedule=InnerSchedule("constant", 3e-3, 0), grad_clip=1.0)
    w.shard = TEXT.numpy().astype("uint16")
    return w


@pytest.mark.parametrize("tie", [True, False])
def test_byte_gpt_split_muon_takes_the_hidden_matrices_adamw_the_rest(tie):
    model = byte_gpt(tie=tie)
    names = muon_parameter_names(model)
    params = dict(model.named_parameters())
    assert names and all(params[n].dim() == 2 for n in names)
    assert not {"tok_emb.weight", "pos_emb.weight", "head.weight"} & set(names)
    hidden_2d = {n for n, p in params.items() if p.dim() == 2 and n.startswith("blocks.")}
    assert set(names) == hidden_2d  # every block matrix, nothing else
    opt = optimizer_of("muon", model, lr=1e-3, weight_decay=0.1)
    assert isinstance(opt, MuonWithAdamW) and isinstance(opt.muon, torch.optim.Muon)
    adamw_ids = {id(p) for g in opt.adamw.param_groups for p in g["params"]}
    assert {n for n, p in params.items() if id(p) in adamw_ids} == set(params) - set(names)


def test_hf_llama_split_leaves_embeddings_head_and_norms_to_adamw():
    cfg = ModelConfig.model_validate({"kind": "hf", "context": 16, "hf": {"architecture": "llama",
                                                                         "config": TINY_LLAMA}})
    model = build_model(cfg, 256, seed=0)
    names = muon_parameter_names(model)
    assert not any("embed_tokens" in n or "lm_head" in n or "norm" in n for n in names)
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
        assert sum(proj in n for n in names) == TINY_LLAMA["num_hidden_layers"], proj
    assert len(names) == 7 * TINY_LLAMA["num_hidden_layers"]


def test_muon_lowers_the_loss_on_the_byte_gpt_and_holds_muon_state():
    w = workload(byte_gpt())
    first = [w.step(i) for i in range(3)]
    for i in range(3, 60):
        last = w.step(i)
    assert last < sum(first) / 3 - 1.0, (first, last)
    hidden = muon_parameter_names(w.model)
    for n in hidden:  # Muon, not AdamW, stepped the hidden matrices
        assert set(w.optimizer.state[w.params[n]]) == {"momentum_buffer"}
    assert "exp_avg" in w.optimizer.state[w.params["tok_emb.weight"]]


def test_one_lr_sets_both_groups():
    w = workload(byte_gpt())
    w.schedule = InnerSchedule("constant", 5e-3, 0)
    w.step(0)
    lrs = {g["lr"] for opt in w.optimizer.optimizers for g in opt.param_groups}
    assert lrs == {5e-3} and len(w.optimizer.optimizers) == 2
    assert all(g["adjust_lr_fn"] == "match_rms_adamw" for g in w.optimizer.muon.param_groups)


def test_inner_state_round_trip_gives_the_same_next_step():
    w = workload(byte_gpt())
    for i in range(5):
        w.step(i)
    state = w.capture(step=5, base_tensors={}, base_versions={}, counters={})
    assert any(k.startswith("muon_momentum/") for k in state.tensors)
    assert any(k.startswith("exp_avg/") for k in state.tensors)
    state = InnerState(st_load(st_save(state.tensors)), state.meta)  # through the bytes a store holds
    w.step(5)
    expected = {n: p.detach().clone() for n, p in w.params.items()}

    fresh = workload(byte_gpt(seed=123), seed=99)  # other init, other sampler, empty optimizer state
    step, *_ = fresh.restore(state)
    fresh.step(step)
    for n, p in fresh.params.items():
        assert torch.equal(p, expected[n]), n


def test_default_adamw_hashes_as_before_and_muon_changes_the_hash():
    base = Config()
    muon = Config.model_validate({**base.public_dict(), "learners": {**base.public_dict()["learners"],
                                                                       "optimizer": "muon"}})
    assert base.learners.optimizer == "adamw" and muon.learners.optimizer == "muon"
    d = base.public_dict()
    d["learners"].pop("optimizer")  # a config from before the field existed
    assert config_hash(Config.model_validate(d)) == config_hash(base)
    assert config_hash(muon) != config_hash(base)


def test_an_unknown_optimizer_is_refused_naming_it():
    with pytest.raises(ValidationError, match="sgd"):
        Config.model_validate({"learners": {"optimizer": "sgd"}})


def only_embedding_and_head(model_cfg, vocab_size):  # a factory model ("test_inner_muon:...")
    return torch.nn.Sequential(torch.nn.Embedding(vocab_size, 8), torch.nn.Linear(8, vocab_size))


def test_muon_on_a_model_without_hidden_matrices_is_refused_before_the_run_starts(tmp_path):
    cfg = Config.model_validate({"run": {"workdir": str(tmp_path / "runs")},
                                 "model": {"kind": "factory", "factory": "test_inner_muon:only_embedding_and_head",
                                           "context": 8},
                                 "learners": {"optimizer": "muon"}})
    with pytest.raises(ValueError, match=r"learners.optimizer = 'muon'.*model 'factory' has none"):
        check_inner_optimizer(cfg)
    from diloco_async.run import RunProcesses
    with pytest.raises(ValueError, match="'muon'"):
        RunProcesses(cfg)
    assert not (tmp_path / "runs").exists()  # nothing started, no run folder
    adamw = Config.model_validate({**cfg.public_dict(), "learners": {"optimizer": "adamw"}})
    check_inner_optimizer(adamw)  # the same model trains with AdamW


def test_muon_with_an_fsdp_group_is_refused_naming_it():
    with pytest.raises(ValidationError, match="learners.optimizer='muon'.*use ddp"):
        Config.model_validate({"learners": {"optimizer": "muon", "parallelism": "fsdp", "checkpoint_every_s": 0,
                                              "nproc_per_learner": 2}})


def tiny_lora(targets: list[str]) -> torch.nn.Module:
    cfg = ModelConfig.model_validate({"kind": "hf", "context": 16, "lora": {"r": 4, "target_modules": targets},
                                      "hf": {"architecture": "llama", "config": TINY_LLAMA}})
    return build_model(cfg, 256, seed=0)


def test_lora_muon_trains_the_adapter_matrices_only():
    model = tiny_lora(["q_proj", "v_proj"])
    names = muon_parameter_names(model)
    assert len(names) == 2 * 2 * 2 and all(".lora_A." in n or ".lora_B." in n for n in names)
    opt = optimizer_of("muon", model, lr=1e-3, weight_decay=0.0)
    assert opt.adamw is None and opt.optimizers == [opt.muon]  # nothing else trains


def test_lora_on_the_embeddings_alone_has_no_hidden_matrix_and_is_refused():
    model = tiny_lora(["embed_tokens"])
    assert any("lora_embedding" in n for n, p in model.named_parameters() if p.requires_grad)
    with pytest.raises(ValueError, match=r"model 'hf' has none.*lora_embedding"):
        optimizer_of("muon", model, lr=1e-3, weight_decay=0.0, what="'hf'")
