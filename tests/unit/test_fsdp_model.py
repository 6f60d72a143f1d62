"""Which modules an FSDP2 learner group shards one by one, and a model it cannot shard (DESIGN §3.1)."""

from __future__ import annotations

import pytest
import torch

from diloco_async.config.model import ModelConfig
from diloco_async.config.schema import load_config
from diloco_async.inner.workload import Workload, inner_optimizer
from diloco_async.learner.fsdp import fsdp_units, shard_workload
from diloco_async.models import build_model
from diloco_async.models.transformer import ByteGPT
from diloco_async.models.wrapper import CausalLM
from diloco_async.policy.schedules import InnerSchedule
from diloco_async.run import RunProcesses
from diloco_async.storage import keys
from diloco_async.storage.store import ObjectStore

TINY_LLAMA = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
              "num_key_value_heads": 2}


def test_byte_gpt_units_are_its_blocks():
    model = ByteGPT(ModelConfig(n_layer=3, d_model=16, n_head=2, context=8))
    assert fsdp_units(model) == list(model.blocks)


def test_hf_units_are_its_decoder_layers():
    cfg = ModelConfig.model_validate({"kind": "hf", "context": 16, "hf": {"architecture": "llama",
                                                                         "config": TINY_LLAMA}})
    model = build_model(cfg, 256, seed=0)
    units = fsdp_units(model)
    assert [type(u).__name__ for u in units] == ["LlamaDecoderLayer"] * 3
    assert units == list(model.net.model.layers)


class WithHook(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.b(self.a(x))

    def fsdp_units(self):
        return [self.a]


def test_a_factory_model_names_its_units_by_a_hook_else_the_root_alone():
    hooked = CausalLM(WithHook(), 8, hf=False)
    assert fsdp_units(hooked) == [hooked.net.a]
    plain = CausalLM(torch.nn.Sequential(torch.nn.Linear(4, 4)), 8, hf=False)
    assert fsdp_units(plain) == []


def test_a_0_dim_parameter_cannot_be_sharded_and_is_named():
    model = torch.nn.Module()
    model.scale = torch.nn.Parameter(torch.tensor(1.0))
    model.w = torch.nn.Parameter(torch.ones(4, 2))
    opt = inner_optimizer(model.parameters(), lr=1e-3, weight_decay=0.0)
    workload = Workload(model, opt, torch.Generator(), batch_size=1, context=4,
                        schedule=InnerSchedule("constant", 1e-3, 0), grad_clip=1.0)
    with pytest.raises(ValueError, match="parameter scale is 0-dim"):
        shard_workload(workload, 0, 2)


def scalar_gain_model(cfg, vocab_size: int) -> torch.nn.Module:
    """A factory model (``model.factory``) with a 0-dim trainable parameter, ``gain``."""
    net = torch.nn.Sequential(torch.nn.Embedding(vocab_size, 8), torch.nn.Linear(8, vocab_size))
    net.gain = torch.nn.Parameter(torch.tensor(1.0))
    return net


def sharded_config(tmp_path, *extra: str):
    return load_config(None, [f'run.store="file://{tmp_path}/store"', f'run.workdir="{tmp_path}/runs"',
                              'learners.parallelism="fsdp"', "learners.nproc_per_learner=2", "learners.count=2",
                              *extra])


def test_a_run_whose_model_fsdp_cannot_shard_is_refused_before_anything_starts(tmp_path):
    cfg = sharded_config(tmp_path, 'model.kind="factory"',
                         'model.factory="tests.unit.test_fsdp_model:scalar_gain_model"')
    with pytest.raises(ValueError) as err:
        RunProcesses(cfg)
    assert "model.kind='factory'" in str(err.value) and "parameter net.gain is 0-dim" in str(err.value)
    assert not (tmp_path / "runs").exists()  # nothing started, nothing written


def test_a_resumed_run_whose_groups_cannot_serve_their_saved_state_is_refused(tmp_path):
    store = ObjectStore(f"file://{tmp_path}/store")
    prefix = keys.learner_prefix("run-x", "learner-1")
    store.put_json(keys.state_manifest_key(prefix, 3), {"format": "dcp", "world": 2, "seq": 3, "files": {}})
    with pytest.raises(ValueError) as err:
        RunProcesses(sharded_config(tmp_path, "learners.nproc_per_learner=3"), resume_url=f"{store.url}/run-x")
    assert "run-x/learners/learner-1: sharded inner state 3 was saved by a group of 2 ranks; this group has 3" in \
        str(err.value)
    assert not (tmp_path / "runs").exists()
    RunProcesses(sharded_config(tmp_path), resume_url=f"{store.url}/run-x")  # 2 ranks serve it
