"""Which modules an FSDP2 learner group shards one by one, and a model it cannot shard (DESIGN §3.1)."""

from __future__ import annotations

import pytest
import torch

from diloco_async.config.model import ModelConfig
from diloco_async.inner.workload import Workload, inner_optimizer
from diloco_async.learner.fsdp import fsdp_units, shard_workload
from diloco_async.models import build_model
from diloco_async.models.transformer import ByteGPT
from diloco_async.models.wrapper import CausalLM
from diloco_async.policy.schedules import InnerSchedule

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
