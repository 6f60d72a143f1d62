"""Fragmentation modes (``synchronizer.fragmentation``, DESIGN §4.6): balanced, tensor, layer.
Every tensor in exactly one of P fragments, deterministic, the mode in the schema hash, and the
same plan on the learner's and the synchronizer's side."""

from __future__ import annotations

import pytest

from diloco_async.config.schema import ModelConfig, config_differences, load_config
from diloco_async.models.build import plan_of
from diloco_async.models.transformer import ByteGPT, embedding_names
from diloco_async.policy.fragments import (
    FRAGMENTATIONS,
    FragmentPlan,
    TensorSpec,
    layer_of,
    plan_differences,
    plan_fragments,
    specs_of,
)

MODEL = ModelConfig(n_layer=4)


def model_specs() -> tuple[list[TensorSpec], list[str]]:
    model = ByteGPT(MODEL)
    return specs_of({n: p.detach() for n, p in model.named_parameters()}), embedding_names(model)


@pytest.mark.parametrize("mode", FRAGMENTATIONS)
@pytest.mark.parametrize("num_fragments", [1, 2, 3, 4])
def test_every_tensor_in_exactly_one_of_p_fragments_deterministically(mode, num_fragments):
    specs, emb = model_specs()
    plan = plan_fragments(specs, num_fragments, emb, mode=mode)
    assert plan.num_fragments == num_fragments and plan.mode == mode
    assert all(plan.fragments[p] for p in range(num_fragments))
    names = [n for p in range(num_fragments) for n in plan.names(p)]
    assert sorted(names) == sorted(s.name for s in specs) and len(set(names)) == len(names)
    again = plan_fragments(specs, num_fragments, emb, mode=mode)
    assert again == plan and again.schema_hash == plan.schema_hash
    back = FragmentPlan.from_json(plan.to_json())
    assert back == plan and back.schema_hash == plan.schema_hash


def test_tensor_mode_is_contiguous_runs_in_model_order_cut_by_count():
    specs = [TensorSpec(f"t{i}", (10 ** (i % 3),)) for i in range(10)]  # sizes 1, 10, 100, ...: bytes ignored
    plan = plan_fragments(specs, 3, mode="tensor")
    assert [sorted(plan.names(p), key=lambda n: int(n[1:])) for p in range(3)] == [
        ["t0", "t1", "t2", "t3"], ["t4", "t5", "t6"], ["t7", "t8", "t9"]]


def test_layer_mode_keeps_layers_whole_with_embeddings_and_head_at_the_ends():
    specs, emb = model_specs()
    plan = plan_fragments(specs, 2, emb, mode="layer")
    first, second = set(plan.names(0)), set(plan.names(1))
    for s in specs:
        key = layer_of(s.name)
        if key in ("blocks.0", "blocks.1"):
            assert s.name in first, s.name
        elif key in ("blocks.2", "blocks.3"):
            assert s.name in second, s.name
    assert {"tok_emb.weight", "pos_emb.weight"} <= first  # before the first layer: with it
    assert {"ln_f.weight", "ln_f.bias"} <= second  # after the last layer: with it
    six = plan_fragments(specs, 6, emb, mode="layer")  # P > 4 layers: the input and output layers stand alone
    assert six.names(0) == ["pos_emb.weight", "tok_emb.weight"] and set(six.names(5)) == {"ln_f.weight", "ln_f.bias"}
    assert all(layer_of(n) == f"blocks.{p - 1}" for p in range(1, 5) for n in six.names(p))
    with pytest.raises(ValueError, match=r"num_fragments=7 exceeds the number of layers \(6\)"):
        plan_fragments(specs, 7, emb, mode="layer")


def test_layer_mode_tensors_between_layers_join_the_one_before():
    names = ["emb", "l.0.a", "l.0.b", "mid", "l.1.a", "norm", "head"]
    plan = plan_fragments([TensorSpec(n, (2,)) for n in names], 2, mode="layer")
    assert plan.names(0) == ["emb", "l.0.a", "l.0.b", "mid"] and plan.names(1) == ["head", "l.1.a", "norm"]


def test_layer_of_names_the_numbered_layer():
    assert layer_of("blocks.3.attn.qkv.weight") == "blocks.3"
    assert layer_of("model.layers.11.mlp.up_proj.weight") == "model.layers.11"
    assert layer_of("transformer.h.0.ln_1.weight") == "transformer.h.0"
    assert layer_of("tok_emb.weight") is None and layer_of("lm_head.weight") is None
    assert layer_of("w2v.weight") is None  # digits inside a component are no layer index


def test_mode_is_in_the_schema_hash_and_balanced_hashes_as_before():
    specs, emb = model_specs()
    plans = {m: plan_fragments(specs, 2, emb, mode=m) for m in FRAGMENTATIONS}
    assert "fragmentation" not in plans["balanced"].to_json()  # unchanged hash of existing runs
    assert plans["balanced"].schema_hash == plan_fragments(specs, 2, emb).schema_hash
    assert len({p.schema_hash for p in plans.values()}) == 3
    same = FragmentPlan(plans["balanced"].fragments, plans["balanced"].embedding_names, mode="tensor")
    assert same.schema_hash != plans["balanced"].schema_hash  # same cut, other mode: still refused
    assert "fragmentation: 'balanced' here, 'tensor' there" in plan_differences(plans["balanced"], same)
    with pytest.raises(ValueError, match="unknown fragmentation 'strided'"):
        plan_fragments(specs, 2, emb, mode="strided")


def test_learner_and_synchronizer_derive_the_same_plan_from_the_config():
    """Both sides call ``plan_of(model, num_fragments, fragmentation)`` on the same model (the
    synchronizer in ``sync.state.initial_state``, the learner in ``learner.process``); the hash
    is what the join compares."""
    from diloco_async.sync.state import initial_state

    cfg = load_config(None, ["synchronizer.fragmentation=layer", "synchronizer.num_fragments=2"])
    _params, sync_plan = initial_state(cfg)
    assert sync_plan.mode == "layer"
    from diloco_async.models import build_run_model

    learner_plan = plan_of(build_run_model(cfg), 2, cfg.synchronizer.fragmentation)
    assert learner_plan.schema_hash == sync_plan.schema_hash
    assert plan_of(build_run_model(cfg), 2).schema_hash != sync_plan.schema_hash


def test_a_resume_with_another_mode_names_the_field():
    a = load_config(None, ["synchronizer.fragmentation=tensor"])
    b = load_config(None, ["synchronizer.fragmentation=layer"])
    assert config_differences(a.public_dict(), b.public_dict()) == ["synchronizer.fragmentation: 'tensor' -> 'layer'"]
    with pytest.raises(ValueError, match="synchronizer.fragmentation"):
        load_config(None, ["synchronizer.fragmentation=strided"])
