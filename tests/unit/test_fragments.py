import pytest

from diloco_async.config.schema import ModelConfig
from diloco_async.models.transformer import ByteGPT, embedding_names
from diloco_async.policy.fragments import FragmentPlan, TensorSpec, fragment_offset, plan_fragments, specs_of


def test_balanced_greedy_largest_first():
    specs = [TensorSpec("a", (100,)), TensorSpec("b", (60,)), TensorSpec("c", (50,)), TensorSpec("d", (10,))]
    plan = plan_fragments(specs, 2)
    # a -> 0; b -> 1; c -> 1 (60 < 100); d -> 0 (100 < 110)
    assert plan.names(0) == ["a", "d"] and plan.names(1) == ["b", "c"]
    assert plan.numel(0) == 110 and plan.numel(1) == 110
    assert plan.numel_fraction(0) == pytest.approx(0.5)


def test_plan_is_deterministic_and_round_trips():
    model = ByteGPT(ModelConfig())
    specs = specs_of({n: p.detach() for n, p in model.named_parameters()})
    p1 = plan_fragments(specs, 4, embedding_names(model))
    p2 = plan_fragments(list(reversed(specs)), 4, embedding_names(model))
    assert p1.schema_hash == p2.schema_hash
    again = FragmentPlan.from_json(p1.to_json())
    assert again == p1 and again.schema_hash == p1.schema_hash
    names = [n for p in range(4) for n in p1.names(p)]
    assert sorted(names) == sorted(s.name for s in specs)  # disjoint and complete


def test_plan_errors():
    specs = [TensorSpec("a", (1,)), TensorSpec("b", (2,))]
    with pytest.raises(ValueError, match="exceeds"):
        plan_fragments(specs, 3)
    with pytest.raises(ValueError):
        plan_fragments(specs, 0)
    with pytest.raises(ValueError, match="embedding"):
        plan_fragments(specs, 1, ["zzz"])


def test_offsets_spread_over_h():
    assert [fragment_offset(p, 4, 24) for p in range(4)] == [0, 6, 12, 18]
    assert [fragment_offset(p, 24, 24) for p in range(24)] == list(range(24))
