"""Merge math against the golden values of DESIGN §4.7, the outer-step bug report, and properties."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from diloco_async.merge.core import (
    OuterOptimizer,
    anchor,
    merge_outer_gradients,
    rda,
    token_weight,
    weighted_mean,
)

F64 = torch.float64
TOL = 1e-6


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=F64)


def assert_close(actual: torch.Tensor, expected, tol: float = TOL) -> None:
    expected = torch.as_tensor(expected, dtype=actual.dtype)
    torch.testing.assert_close(actual, expected, rtol=0, atol=tol)


# --- DESIGN §4.7 golden values ---------------------------------------------------------------


def test_token_weight_golden():
    assert token_weight(30, 1) == 900
    assert token_weight(10, 1) == 100
    assert token_weight(12, 4) == 36


def test_rda_orthogonal_keeps_norm():
    out = rda([t(2, 0), t(0, 2)], [1, 1])
    assert_close(out, [1.414214, 1.414214])
    assert torch.linalg.vector_norm(out).item() == pytest.approx(2.0, abs=TOL)
    assert torch.linalg.vector_norm(weighted_mean([t(2, 0), t(0, 2)], [1, 1])).item() == pytest.approx(
        math.sqrt(2), abs=TOL
    )


def test_rda_weighted():
    assert_close(rda([t(2, 0), t(0, 2)], [3, 1]), [1.897367, 0.632456])


def test_rda_with_zero_delta():
    assert_close(rda([t(0, 0), t(1, 0)], [1, 1]), [0.5, 0.0])


def test_rda_cancelling_falls_back_to_mean():
    assert_close(rda([t(2), t(-4)], [1, 1]), [-1.0])


def test_rda_all_zero_is_zero():
    assert_close(rda([t(0, 0), t(0, 0)], [1, 2]), [0.0, 0.0])


def test_sixteen_near_orthogonal_deltas():
    gen = torch.Generator().manual_seed(0)
    deltas = []
    for _ in range(16):
        v = torch.randn(4096, generator=gen, dtype=F64)
        deltas.append(2 * v / torch.linalg.vector_norm(v))
    weights = [1.0] * 16
    assert torch.linalg.vector_norm(rda(deltas, weights)).item() == pytest.approx(2.0, abs=TOL)
    assert torch.linalg.vector_norm(weighted_mean(deltas, weights)).item() == pytest.approx(0.5, abs=0.05)


def _one_round_inputs():
    theta_global = {"w": t(0, 0)}
    learner_a = {"w": t(-2, 0)}
    learner_b = {"w": t(0, -2)}
    deltas = [{"w": theta_global["w"] - th["w"]} for th in (learner_a, learner_b)]
    weights = [token_weight(30, 1), token_weight(10, 1)]
    return theta_global, deltas, weights


def test_one_round_end_to_end():
    theta_global, deltas, weights = _one_round_inputs()
    g = merge_outer_gradients(deltas, weights, mode="rda")
    assert_close(g["w"], [1.987767, 0.220863])
    opt = OuterOptimizer(theta_global, lr=0.7, momentum=0.9)
    assert opt.params()["w"].dtype == F64
    assert_close(opt.step(g)["w"], [-2.643731, -0.293748])
    assert_close(opt.step(g)["w"], [-6.414526, -0.712725])
    assert_close(opt.momentum()["w"], [3.776758, 0.419640])
    assert opt.steps_taken == 2


def test_one_round_plain_weighted_mean():
    _, deltas, weights = _one_round_inputs()
    assert_close(merge_outer_gradients(deltas, weights, mode="mean")["w"], [1.8, 0.2])
    # Embedding tensors take the weighted mean even in RDA mode.
    assert_close(merge_outer_gradients(deltas, weights, mode="rda", embedding_names={"w"})["w"], [1.8, 0.2])


def test_anchoring():
    current, base, theta = {"w": t(1, 1)}, {"w": t(1.5, 1)}, {"w": t(1.2, 0.9)}
    local = {"w": base["w"] - theta["w"]}
    assert_close(local["w"], [0.3, 0.1])
    anchored = anchor(local, current, base)
    assert_close(anchored["w"], [-0.2, 0.1])
    assert_close(anchored["w"], current["w"] - theta["w"])


def test_merge_mixes_rda_and_embedding_mean_per_tensor():
    deltas = [{"emb": t(2, 0), "w": t(2, 0)}, {"emb": t(0, 2), "w": t(0, 2)}]
    out = merge_outer_gradients(deltas, [1, 1], embedding_names=("emb", "not-in-fragment"))
    assert list(out) == ["emb", "w"]
    assert_close(out["emb"], [1.0, 1.0])
    assert_close(out["w"], [1.414214, 1.414214])


# --- bug-report numbers (outer step from 1.0 with constant delta 0.1) --------------------------


def test_fresh_outer_step():
    opt = OuterOptimizer({"w": t(1.0)})
    assert_close(opt.step({"w": t(0.1)})["w"], [0.867])


def test_three_steps_momentum_and_restore():
    g = {"w": t(0.1)}
    opt = OuterOptimizer({"w": t(1.0)})
    assert opt.momentum()["w"].item() == 0.0
    assert_close(opt.step(g)["w"], [0.867])
    assert_close(opt.step(g)["w"], [0.6773])
    assert_close(opt.momentum()["w"], [0.19])
    saved_params, saved_momentum = opt.params(), opt.momentum()
    uninterrupted = opt.step(g)["w"]
    assert_close(uninterrupted, [0.43657])

    restored = OuterOptimizer({"w": t(123.0)})
    restored.load_state(saved_params, saved_momentum, steps_taken=2)
    assert restored.steps_taken == 2
    assert torch.equal(restored.step(g)["w"], uninterrupted)
    assert torch.equal(restored.momentum()["w"], opt.momentum()["w"])

    fresh = OuterOptimizer({"w": t(0.0)})
    fresh.load_state(saved_params, None)
    lost_momentum = fresh.step(g)["w"]
    assert_close(lost_momentum, [0.5443])
    assert not torch.allclose(lost_momentum, uninterrupted)


def test_restore_before_first_step_keeps_first_step_semantics():
    g = {"w": t(0.3, -0.2)}
    a = OuterOptimizer({"w": t(1.0, 2.0)})
    b = OuterOptimizer({"w": t(0.0, 0.0)})
    b.load_state(a.params(), a.momentum())
    for _ in range(3):
        assert torch.equal(a.step(g)["w"], b.step(g)["w"])


def test_restore_float32_bit_exact():
    gen = torch.Generator().manual_seed(1)
    grads = [{"w": torch.randn(5, 3, generator=gen)} for _ in range(4)]
    a = OuterOptimizer({"w": torch.randn(5, 3, generator=gen)})
    for g in grads[:2]:
        a.step(g)
    b = OuterOptimizer(a.params())
    b.load_state(a.params(), a.momentum())
    for g in grads[2:]:
        assert torch.equal(a.step(g)["w"], b.step(g)["w"])


def test_token_weighted_mean_then_outer_step():
    wa, wb = 3000.0, 1000.0  # weights proportional to tokens
    g = weighted_mean([t(0.3), t(-0.1)], [wa, wb])
    assert_close(g, [0.2])
    assert_close(OuterOptimizer({"w": t(1.0)}).step({"w": g})["w"], [0.734])


def test_outer_optimizer_does_not_alias_caller_tensors():
    theta = {"w": t(1.0, 2.0)}
    g = {"w": t(0.1, 0.1)}
    opt = OuterOptimizer(theta)
    out = opt.step(g)
    assert torch.equal(theta["w"], t(1.0, 2.0))
    assert torch.equal(g["w"], t(0.1, 0.1))
    out["w"].add_(100)
    assert not torch.equal(opt.params()["w"], out["w"])


def test_outer_optimizer_float32_by_default():
    opt = OuterOptimizer({"w": torch.ones(2, dtype=torch.bfloat16)})
    assert opt.params()["w"].dtype == torch.float32
    assert opt.step({"w": torch.ones(2, dtype=torch.bfloat16)})["w"].dtype == torch.float32


# --- properties -------------------------------------------------------------------------------

finite = st.floats(min_value=-10, max_value=10, allow_nan=False, allow_infinity=False)
pos_weight = st.floats(min_value=0.1, max_value=1000, allow_nan=False, allow_infinity=False)


@st.composite
def learners(draw, min_size=1, max_size=6, dim=(1, 8)):
    m = draw(st.integers(min_size, max_size))
    n = draw(st.integers(*dim))
    deltas = [t(*draw(st.lists(finite, min_size=n, max_size=n))) for _ in range(m)]
    weights = draw(st.lists(pos_weight, min_size=m, max_size=m))
    return deltas, weights


@settings(max_examples=60, deadline=None)
@given(learners(), st.floats(min_value=0.01, max_value=100))
def test_rda_keeps_a_common_norm(data, norm):
    deltas, weights = data
    deltas = [d + 1e-3 for d in deltas]  # keep every vector away from zero
    deltas = [norm * d / torch.linalg.vector_norm(d) for d in deltas]
    out = rda(deltas, weights)
    direction = sum(w * d / norm for d, w in zip(deltas, weights, strict=True)) / sum(weights)
    if torch.linalg.vector_norm(direction).item() > 1e-9:  # not the cancelling fallback
        assert torch.linalg.vector_norm(out).item() == pytest.approx(norm, rel=1e-9)


@settings(max_examples=60, deadline=None)
@given(learners(min_size=2), st.randoms(use_true_random=False))
def test_merge_ignores_learner_order(data, rnd):
    deltas, weights = data
    order = list(range(len(deltas)))
    rnd.shuffle(order)
    for fn in (rda, weighted_mean):
        a = fn(deltas, weights)
        b = fn([deltas[i] for i in order], [weights[i] for i in order])
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


@settings(max_examples=60, deadline=None)
@given(learners(), st.floats(min_value=1e-3, max_value=1e6))
def test_merge_ignores_weight_scale(data, c):
    deltas, weights = data
    for fn in (rda, weighted_mean):
        a = fn(deltas, weights)
        b = fn(deltas, [c * w for w in weights])
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


# --- validation -------------------------------------------------------------------------------


@pytest.mark.parametrize("c_tokens, c_steps", [(10, 0), (10, -1), (-1, 1)])
def test_token_weight_rejects(c_tokens, c_steps):
    with pytest.raises(ValueError, match=f"c_tokens={c_tokens}, c_steps={c_steps}"):
        token_weight(c_tokens, c_steps)


@pytest.mark.parametrize("fn", [weighted_mean, rda])
@pytest.mark.parametrize(
    "deltas, weights",
    [
        ([], []),
        ([t(1.0)], [1.0, 2.0]),
        ([t(1.0), t(2.0)], [1.0, -1.0]),
        ([t(1.0), t(2.0)], [0.0, 0.0]),
        ([t(1.0), t(2.0)], [1.0, float("nan")]),
        ([t(1.0), t(2.0, 3.0)], [1.0, 1.0]),
    ],
    ids=["empty", "length", "negative", "zero-total", "nan-weight", "shape"],
)
def test_merge_rejects(fn, deltas, weights):
    with pytest.raises(ValueError):
        fn(deltas, weights)


def test_anchor_rejects_mismatch():
    with pytest.raises(ValueError, match="names"):
        anchor({"a": t(1.0)}, {"b": t(1.0)}, {"a": t(1.0)})
    with pytest.raises(ValueError, match="shape"):
        anchor({"a": t(1.0)}, {"a": t(1.0)}, {"a": t(1.0, 2.0)})


def test_merge_outer_gradients_rejects():
    with pytest.raises(ValueError, match="mode"):
        merge_outer_gradients([{"a": t(1.0)}], [1.0], mode="median")
    with pytest.raises(ValueError):
        merge_outer_gradients([], [])
    with pytest.raises(ValueError, match="names"):
        merge_outer_gradients([{"a": t(1.0)}, {"b": t(1.0)}], [1.0, 1.0])


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_outer_optimizer_refuses_non_finite_and_keeps_state(bad):
    opt = OuterOptimizer({"w": t(1.0, 2.0)})
    opt.step({"w": t(0.1, 0.1)})
    before_p, before_m = opt.params(), opt.momentum()
    with pytest.raises(ValueError, match="non-finite"):
        opt.step({"w": t(0.1, bad)})
    assert torch.equal(opt.params()["w"], before_p["w"])
    assert torch.equal(opt.momentum()["w"], before_m["w"])
    assert opt.steps_taken == 1


def test_outer_optimizer_rejects_mismatch():
    opt = OuterOptimizer({"w": t(1.0, 2.0)})
    with pytest.raises(ValueError, match="names"):
        opt.step({"v": t(0.1, 0.1)})
    with pytest.raises(ValueError, match="shape"):
        opt.step({"w": t(0.1)})
    with pytest.raises(ValueError):
        opt.load_state({"w": t(1.0, 2.0)}, {"w": t(1.0)})
    with pytest.raises(ValueError):
        OuterOptimizer({"w": t(1.0)}, lr=0.0)
    with pytest.raises(ValueError):
        OuterOptimizer({"w": t(1.0)}, momentum=1.0)
    assert opt.steps_taken == 0
