"""The update guard, the codec header check and the pace and schedule policies (issue 14, items
3-4), as pure functions: plain values and a fake clock, no server."""

from __future__ import annotations

import math
import statistics

import pytest
import safetensors.torch
import torch

from diloco_async.codec import wire
from diloco_async.config.guard import GuardConfig
from diloco_async.config.schema import load_config
from diloco_async.learner.faults import poison_outer_gradient
from diloco_async.policy.guard import (
    NO_DIRECTION_CHECK,
    DirectionCheck,
    DirectionGuard,
    LearnerDirections,
    NormGuard,
    cosine_at_size,
    direction_factor,
    leave_one_out_cosines,
    non_finite_tensors,
    sustained_anti_alignment,
    tensor_norms,
)
from diloco_async.policy.pace import PaceLimits, bounded_advance, clamp_step_times, implausible_contribution
from diloco_async.policy.rounds import RoundState, schedule_shift, stuck_round_reason
from diloco_async.storage.store import ObjectStore
from diloco_async.sync.work import merge_and_publish

SPECS = {"w": (4, 8), "b": (8,)}


def test_norm_guard_warm_up_then_median_bound():
    g = NormGuard(GuardConfig(norm_warmup=3, norm_multiple=10.0, warmup_max_rms=1.0), {"w": 100})
    assert g.bound("w") == (pytest.approx(10.0), pytest.approx(g.bound("w")[1]))  # 1.0 rms x sqrt(100)
    assert g.check({"w": 9.0}).status == "accept"
    bad = g.check({"w": 11.0})
    assert bad.status == "reject" and bad.reason.startswith("norm_outlier: w norm 11 > bound 10 (warm-up")
    for norm in (0.1, 0.2, 0.3):
        g.record({"w": norm})
    assert g.bound("w")[0] == pytest.approx(2.0)  # 10 x median 0.2
    assert g.check({"w": 1.9}).status == "accept"
    assert g.check({"w": 2.1}).status == "reject"
    assert g.check({"w": math.nan}).status == "reject"
    assert g.check({"w": math.inf}).status == "reject"


def test_norm_guard_learning_rate_warm_up_meets_only_the_ceiling():
    """Norms grow with the learning rate over its warm-up; a median of those would reject the first
    honest contribution at full rate (the CI failure of 2026-12-01: 0.150 > 10 x median 0.0144)."""
    g = NormGuard(GuardConfig(norm_warmup=2, norm_multiple=10.0, warmup_max_rms=1.0), {"w": 100})
    for norm in (0.01, 0.01, 0.02):  # contributions begun inside the learning-rate warm-up
        assert g.check({"w": norm}, lr_warmup=True).status == "accept"
    assert g.check({"w": 9.9}, lr_warmup=True).status == "accept"  # only the 1.0-rms ceiling holds
    bad = g.check({"w": 10.5}, lr_warmup=True)
    assert bad.status == "reject" and "learning-rate warm-up" in bad.reason
    assert g.accepted["w"] == 0  # checking records nothing


def test_norm_guard_median_is_robust_and_the_ceiling_holds():
    g = NormGuard(GuardConfig(norm_warmup=1, norm_window=5, warmup_max_rms=1.0), {"w": 100})
    for norm in (0.1, 0.1, 0.1, 5.0, 5.0):  # two large ones of five do not move the median
        g.record({"w": norm})
    assert g.bound("w")[0] == pytest.approx(1.0)
    for _ in range(5):
        g.record({"w": 5.0})
    assert g.bound("w")[0] == pytest.approx(10.0)  # 10 x 5 = 50, held to the 1.0-rms ceiling


def test_norm_guard_floor_and_clip():
    g = NormGuard(GuardConfig(norm_warmup=1, min_rms=0.01, norm_action="clip"), {"w": 100, "b": 4})
    g.record({"w": 0.0, "b": 0.0})
    assert g.bound("w")[0] == pytest.approx(0.1)  # floor 0.01 rms x sqrt(100)
    v = g.check({"w": 0.4, "b": 0.01})
    assert v.status == "clip" and v.scales == {"w": pytest.approx(0.25)} and "w norm" in v.reason


def test_tensor_norms_and_non_finite():
    t = {"a": torch.tensor([3.0, 4.0]), "b": torch.tensor([1.0, math.nan, math.inf])}
    assert tensor_norms({"a": t["a"]}) == {"a": pytest.approx(5.0)}
    assert non_finite_tensors(t) == {"b": 2}
    assert tensor_norms({"x": torch.full((4,), 3e38)})["x"] == pytest.approx(6e38)  # float64: no overflow


def deltas() -> dict[str, torch.Tensor]:
    return {n: torch.randn(s) for n, s in SPECS.items()}


@pytest.mark.parametrize("codec", wire.CODECS)
def test_header_of_an_honest_payload_passes(codec):
    data = wire.encode_to_bytes(deltas(), codec, {"fragment": "0"})
    wire.check_header(data, codec, SPECS)


def reason_of(data, codec="int8", specs=SPECS, block_size=wire.DEFAULT_BLOCK_SIZE) -> str:
    with pytest.raises(wire.PayloadError) as err:
        wire.check_header(data, codec, specs, block_size)
    return str(err.value)


def test_header_block_size_must_be_the_configured_one():
    encoded = wire.encode(deltas(), "int8", block_size=64)
    huge = safetensors.torch.save(encoded, metadata={"codec": "int8", "block_size": str(2**40)})
    assert reason_of(huge).startswith("codec_header: block_size '1099511627776', configured 64")
    assert reason_of(wire.encode_to_bytes(deltas(), "int4", block_size=32), "int4").startswith("codec_header")
    assert reason_of(wire.encode_to_bytes(deltas(), "bf16"), "int8").startswith("codec_header: payload codec")


def test_header_names_every_missing_and_unexpected_tensor():
    d = deltas()
    d["extra"] = torch.zeros(3)
    del d["b"]
    msg = reason_of(wire.encode_to_bytes(d, "fp32"), "fp32")
    assert msg == "schema: missing ['b'], unexpected ['extra']"
    msg = reason_of(wire.encode_to_bytes(deltas(), "int8"), "int8", {"w": (4, 8)})
    assert msg == "schema: missing [], unexpected ['b', 'b::scale']"


def test_header_dtype_and_shape_reasons():
    d = deltas()
    assert reason_of(wire.encode_to_bytes(d, "bf16"), "bf16", {"w": (8, 4), "b": (8,)}).startswith("shape: w [4, 8]")
    fp16 = safetensors.torch.save({n: t.half() for n, t in d.items()}, metadata={"codec": "fp32", "block_size": "64"})
    assert reason_of(fp16, "fp32").startswith("dtype: w 'F16' != 'F32'; b 'F16'")


@pytest.mark.parametrize("data", [b"", b"\x00" * 7, (10**12).to_bytes(8, "little") + b"{}",
                                  (5).to_bytes(8, "little") + b"[1,2]", (3).to_bytes(8, "little") + b"{{{"])
def test_header_garbage_is_a_codec_header_error(data):
    assert reason_of(data).startswith("codec_header")


def limits() -> PaceLimits:
    return PaceLimits(initial_steps_per_s=10.0, tolerance=4.0, floor_steps_per_s=1.0, warmup_s=2.0, burst_steps=5,
                      max_tokens_per_step=100)


def test_pace_limits_from_config():
    cfg = load_config(None, ["learners.batch_size=4", "model.context=16"])
    assert PaceLimits.from_config(cfg).max_tokens_per_step == 2 * 4 * 16
    cfg = load_config(None, ["guard.max_tokens_per_step=7"])
    assert PaceLimits.from_config(cfg).max_tokens_per_step == 7
    # a learner of 2 ranks with the larger of two per-learner batch sizes
    cfg = load_config(None, ["learners.count=2", "learners.batch_size=[4, 8]", "learners.nproc_per_learner=2",
                             "model.context=16"])
    assert PaceLimits.from_config(cfg).max_tokens_per_step == 2 * 2 * 8 * 16


def test_bounded_advance_by_wall_time():
    lim = limits().bound(None)  # the initial bound: 10 steps/s
    assert lim.steps_within(2.0) == 25 and lim.steps_within(-1.0) == 5
    assert lim.tokens_within(2.0) == 2500
    assert bounded_advance(100, 10**12, lim.steps_within(2.0)) == (125, True)
    assert bounded_advance(100, 120, lim.steps_within(2.0)) == (120, False)
    assert bounded_advance(100, 3, lim.steps_within(2.0)) == (3, False)  # a decrease is the caller's call


def test_implausible_contribution():
    kw = {"learner_step": 40, "since_anchor_s": 1.0, "bound": limits().bound(None)}
    assert implausible_contribution(c_steps=4, c_tokens=400, **kw) is None
    assert implausible_contribution(c_steps=4, c_tokens=401, **kw).startswith("implausible_tokens")
    assert implausible_contribution(c_steps=55, c_tokens=100, **kw) is None  # 40 + 5 + 10
    why = implausible_contribution(c_steps=56, c_tokens=100, **kw)
    assert why == ("implausible_steps: c_steps 56 > step 40 + burst left 5 + what 1.0s allow at 10 steps/s (initial, "
                   "pace not measured yet) = 55")


def test_step_times_clamped_to_the_peers():
    assert clamp_step_times([], max_s=60, multiple=8) == []
    assert clamp_step_times([0.1, 0.12, 1e6], max_s=60, multiple=8) == [0.1, 0.12, pytest.approx(0.96)]
    assert clamp_step_times([0.1, 1e6], max_s=60, multiple=8) == [0.1, pytest.approx(0.8)]  # lower median
    assert clamp_step_times([1e6], max_s=60, multiple=8) == [60]
    assert clamp_step_times([0.1, 0.4], max_s=60, multiple=8) == [0.1, 0.4]  # a slow honest learner keeps its time


def test_schedule_shift_only_when_out_of_reach():
    assert schedule_shift(g=100, shift=0, next_due=[104, 106], sync_every=4) == (0, None)
    assert schedule_shift(g=100, shift=0, next_due=[108, 110], sync_every=4) == (0, None)  # 2H ahead: in reach
    shift, why = schedule_shift(g=100, shift=0, next_due=[10**12 + 4, 10**12 + 6], sync_every=4)
    assert shift == 10**12 - 100 and "schedule shifted" in why  # the next round is due H steps past g + shift
    assert schedule_shift(g=101, shift=shift, next_due=[10**12 + 4], sync_every=4) == (shift, None)
    assert schedule_shift(g=5, shift=3, next_due=[], sync_every=4) == (3, None)


def test_stuck_round_reasons_on_a_fake_clock():
    kw = {"opened_s": 100.0, "timeout_s": 300.0, "unreachable_wait_s": 5.0}
    assert stuck_round_reason(now_s=104.0, unreachable_since_s=100.0, **kw) is None
    assert stuck_round_reason(now_s=105.0, unreachable_since_s=100.0, **kw).startswith("quorum_unreachable")
    assert stuck_round_reason(now_s=399.0, unreachable_since_s=None, **kw) is None
    assert stuck_round_reason(now_s=400.0, unreachable_since_s=None, **kw).startswith("round_timeout")
    # enough learners live: only rejected contributions stand in the way, so no wait
    why = stuck_round_reason(now_s=100.0, unreachable_since_s=100.0, enough_live=True, **kw)
    assert why.startswith("quorum_unreachable") and "rejected" in why
    assert stuck_round_reason(now_s=104.0, unreachable_since_s=None, enough_live=True, **kw) is None


def test_quorum_reachable_counts_pending_and_silent_live_learners_not_rejected_ones():
    st = RoundState(0, 1, 0.0, min_quorum=3)
    for lid in "abc":
        st.announce(lid, f"k/{lid}", 0.0)
    st.settle("a", True)
    st.settle("b", False)
    assert not st.quorum_reachable(["a", "b", "c"])  # b was rejected and cannot announce again
    assert st.quorum_reachable(["a", "b", "c", "d"])  # d has not announced yet
    st.settle("c", True)
    assert st.quorum_reachable(["a", "b", "c", "d"]) and not st.quorum_reachable(["a", "b", "c"])


@pytest.mark.parametrize("mode", ["none", "scale", "sign_flip", "constant"])
def test_poison_modes(mode):
    d = deltas()
    out = poison_outer_gradient(d, mode)
    n_in, n_out = tensor_norms(d), tensor_norms(out)
    ratio = {"scale": 1e6}.get(mode, 1.0)
    assert all(n_out[k] == pytest.approx(n_in[k] * ratio, rel=1e-5) for k in d)
    if mode == "sign_flip":
        assert all(torch.equal(out[k], -d[k]) for k in d)
    if mode == "constant":
        assert all(bool((out[k] == out[k].flatten()[0]).all()) for k in d)
    with pytest.raises(ValueError, match="unknown poison mode"):
        poison_outer_gradient(d, "bogus")


@pytest.mark.parametrize("piece", [7, 1 << 17])
def test_leave_one_out_cosines_by_pieces_equal_the_whole_fragment_formula(piece, monkeypatch):
    """Summed piece by piece (pieces that end inside tensors, several tensors, a zero outer
    gradient, bf16 ones), the cosines are those of whole-fragment float64 vectors (to float32's
    precision)."""
    import diloco_async.policy.guard as guard

    monkeypatch.setattr(guard, "COSINE_PIECE_ELEMENTS", piece)
    gen = torch.Generator().manual_seed(3)
    shapes = {"a": (13, 5), "b": (29,), "c": (3, 4, 2)}
    common = {n: torch.randn(s, generator=gen) for n, s in shapes.items()}
    deltas = [{n: (common[n] + 0.8 * torch.randn(s, generator=gen)) * (i + 1) for n, s in shapes.items()}
              for i in range(5)]
    deltas[2] = {n: torch.zeros(s) for n, s in shapes.items()}
    deltas[4] = {n: t.to(torch.bfloat16) for n, t in deltas[4].items()}
    weights = [1.0, 3.0, 2.0, 0.5, 4.0]
    got = leave_one_out_cosines(deltas, weights)
    vec = [torch.cat([d[n].to(torch.float64).reshape(-1) for n in shapes]) for d in deltas]
    probs = [w / sum(weights) for w in weights]
    units = [v / v.norm() if v.norm() > 0 else torch.zeros_like(v) for v in vec]
    for i, v in enumerate(vec):
        rest = sum(p * u for j, (p, u) in enumerate(zip(probs, units, strict=True)) if j != i)
        if float(v.norm()) == 0:
            assert got[i] is None
        else:
            assert got[i] == pytest.approx(float(v @ rest / (v.norm() * rest.norm())), rel=1e-5, abs=1e-6)


def test_leave_one_out_cosines_and_factor():
    x, y = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])
    # three agree along x (one also along y), one is their negative
    deltas = [{"w": x}, {"w": 2 * x}, {"w": x + y}, {"w": -x}]
    cos = leave_one_out_cosines(deltas, [1.0, 1.0, 1.0, 1.0])
    u = [x, x, (x + y) / math.sqrt(2), -x]
    for i, d in enumerate(deltas):  # against the direct formula
        ref = sum(u[j] for j in range(4) if j != i)
        expected = float(d["w"] @ ref / (d["w"].norm() * ref.norm()))
        assert cos[i] == pytest.approx(expected, abs=1e-6)
    assert cos[3] < -0.9 and min(cos[:3]) > 0
    assert leave_one_out_cosines(deltas[:2], [1.0, 1.0]) == [None, None]  # no majority in a pair
    assert leave_one_out_cosines([{"w": x}, {"w": x}, {"w": torch.zeros(2)}], [1, 1, 1])[2] is None
    huge = {"w": torch.full((100,), 1e19)}  # float32 products overflow: computed in float64 instead
    assert leave_one_out_cosines([huge, huge, huge], [1, 1, 1]) == [pytest.approx(1.0)] * 3
    with_nan = [{"w": torch.tensor([float("nan"), 1.0])}, {"w": x}, {"w": y}]  # no made-up cosine
    assert leave_one_out_cosines(with_nan, [1, 1, 1])[0] is None
    assert direction_factor(0.4, 0.4, 0.5) == 1.0  # the usual agreement: full weight
    assert direction_factor(0.1, 0.4, 0.5) == pytest.approx(0.5)  # a quarter of it: half the weight
    assert direction_factor(-0.4, 0.4, 0.5) == 0.0  # a sign flip: left out
    assert direction_factor(-0.4, None, 0.5) == 1.0  # warming up
    assert direction_factor(-0.4, 0.4, 0.0) == 1.0  # guard off


def test_direction_guard_warms_up_and_keeps_only_whole_positive_cosines():
    g = DirectionGuard(GuardConfig(direction_warmup=3, norm_window=5))
    for cos in (0.3, 0.5):
        g.record(cos, 1.0)
    assert g.reference() is None  # 2 of 3
    g.record(-0.2, 1.0)  # a negative cosine never feeds the median
    g.record(0.01, 0.1)  # nor one merged with reduced weight
    assert g.reference() is None
    g.record(0.4, 1.0)
    assert g.reference() == pytest.approx(0.4)
    for _ in range(5):
        g.record(0.05, 1.0)  # learners that hardly agree: the guard does not judge
    assert g.reference() is None
    assert DirectionGuard(GuardConfig(direction_warmup=1, direction_fraction=0.0)).reference() is None


def test_a_short_honest_outer_gradient_keeps_its_weight_and_a_short_flip_still_loses_it():
    """Issue 47: a slow learner's outer gradient of 1 step agrees less with a round of 16-step
    ones (its noise is a larger part of it); judged against what one of its size shows, it keeps
    its full weight, while judged against the 16-step reference it lost part of it."""
    torch.manual_seed(0)
    trend = torch.randn(20_000)

    def honest(k: int) -> dict[str, torch.Tensor]:  # k steps: k mean steps and √k steps of noise
        return {"w": k * 0.02 * trend + k ** 0.5 * 0.1 * torch.randn(20_000)}

    steps = [16, 16, 16, 16, 1]
    raw, weights = [honest(k) for k in steps], [float(k) for k in steps]
    cos = leave_one_out_cosines(raw, weights)
    reference = statistics.median(cos[:4])
    assert cos[4] < 0.5 * reference  # the short one agrees less ...
    assert direction_factor(cos[4], reference, 0.5) < 0.8  # ... and by the long ones' measure lost weight
    assert direction_factor(cos[4], reference, 0.5, token_ratio=1 / 16) == 1.0  # by its own size: none
    flipped = leave_one_out_cosines([*raw[:4], {"w": -raw[4]["w"]}], weights)[4]
    assert direction_factor(flipped, reference, 0.5, token_ratio=1 / 16) == 0.0
    assert direction_factor(0.1, 0.4, 0.5, token_ratio=4.0) == direction_factor(0.1, 0.4, 0.5)  # never stricter


def test_direction_reference_brings_short_contributions_to_the_median_size():
    g = DirectionGuard(GuardConfig(direction_warmup=3, norm_window=8))
    for _ in range(3):
        g.record(0.4, 1.0, c_tokens=1600)
    for _ in range(3):
        g.record(0.1, 1.0, c_tokens=100)  # the median size is 850: 0.1 at 100 tokens is 0.28 at 850
    assert g.reference_tokens() == 850
    at_850 = 1 / math.sqrt(1 + (1 / 0.1 ** 2 - 1) * 100 / 850)
    assert cosine_at_size(0.1, 100, 850) == pytest.approx(at_850) and 0.28 < at_850 < 0.29
    # the median of 0.28 and 0.4, not of 0.1 and 0.4: the short ones do not drag the reference down
    assert g.reference() == pytest.approx((at_850 + 0.4) / 2)
    check = g.check(LearnerDirections(1))
    assert check.reference_tokens == 850 and check.token_ratio(425) == pytest.approx(0.5)
    assert NO_DIRECTION_CHECK.token_ratio(400) == 1.0


def _direction_round():
    """A fragment and one round of it: three honest outer gradients along a shared trend, the
    negative of a fourth ("flip") and a constant tensor of the usual size ("const")."""
    from diloco_async.policy.fragments import plan_fragments, specs_of
    from diloco_async.protocol.messages import Announcement
    from diloco_async.sync.state import Contribution, new_fragments

    torch.manual_seed(0)
    params = {"w": torch.randn(64, 32)}
    sc = load_config(None, ["synchronizer.num_fragments=1"]).synchronizer
    f = new_fragments(plan_fragments(specs_of(params), 1), params, sc)[0]
    trend = torch.randn(64, 32) * 1e-2  # the descent direction all honest learners share
    honest = [trend + torch.randn(64, 32) * 1e-2 for _ in range(4)]
    rms = float(trend.pow(2).mean().sqrt())
    deltas = {"a": honest[0], "b": honest[1], "c": honest[2], "flip": -honest[3], "const": torch.full((64, 32), rms)}

    def contribution(lid, delta):
        ann = Announcement(learner_id=lid, fragment=0, round_n=2, base_version=0, c_steps=8, c_tokens=8 * 64,
                           compute_s=1.0, key=f"k/{lid}", nbytes=1, sha256="0" * 64, codec="fp32",
                           update_id=f"u-{lid}")
        return Contribution(ann, {"w": delta})

    return f, [contribution(k, v) for k, v in deltas.items()]


@pytest.mark.parametrize("weight_fraction", [None, 0.3])
def test_merge_leaves_out_a_sign_flip_and_weights_down_a_constant(weight_fraction):
    """merge_and_publish with a warm direction guard judging each round alone (direction_memory
    1): a learner sending the negative of its own outer gradient is dropped as a
    direction_outlier, one sending a constant tensor of the usual norm keeps little or no weight,
    the honest ones keep theirs; with the weight ramp at the anti-aligned bound's fraction (0.5)
    and at 0.3."""
    f, contribs = _direction_round()
    res = merge_and_publish(ObjectStore(f"memory://dir-{id(f)}"), "r", f, 2, contribs, "rda",
                            directions=DirectionCheck(reference=0.5, fraction=0.5, memory=1,
                                                      weight_fraction=weight_fraction))
    assert res.ok, res.reason
    dropped = dict(res.dropped)
    assert dropped["flip"].startswith("direction_outlier: cosine -")
    assert {"a", "b", "c"} <= set(res.merged) and "flip" not in res.merged
    assert res.factors["a"] == res.factors["b"] == res.factors["c"] == 1.0, res.cosines
    assert res.factors["const"] < 0.3 and "const" not in dropped  # about 0 agreement: little or no weight
    assert abs(res.cosines["const"]) < 0.25, res.cosines


def test_the_weight_ramp_and_the_anti_aligned_bound_have_their_own_fractions():
    """guard.direction_weight_fraction sets where the weight ramp ends for a contribution of the usual
    size, guard.direction_weight_size_power lowers it for a smaller one (issue 47: at 0.5 for every
    size the ramp cut 20-32% of a tenth-speed learner's tokens), while guard.direction_fraction
    still sets the anti-aligned bound and turns the guard off."""
    cfg = GuardConfig()
    assert (cfg.direction_fraction, cfg.direction_weight_fraction, cfg.direction_weight_size_power) == (0.5, 0.5, 0.5)
    guard = DirectionGuard(GuardConfig(direction_warmup=1, direction_weight_fraction=0.3,
                                       direction_weight_size_power=0.0))
    guard.record(0.5, 1.0, 100)
    check = guard.check(LearnerDirections(4))
    assert (check.reference, check.fraction, check.weight()) == (0.5, 0.5, 0.3)
    assert check.weight(0.25) == 0.3  # power 0: one fraction for every size
    assert direction_factor(0.16, check.reference, check.weight()) == 1.0  # 0.32 of the usual: full weight
    assert direction_factor(0.16, check.reference, check.fraction) == pytest.approx(0.64)  # the old ramp
    assert direction_factor(0.06, check.reference, check.weight()) == pytest.approx(0.4)
    assert direction_factor(-0.01, check.reference, check.weight()) == 0.0
    assert DirectionCheck(reference=0.5, fraction=0.5).weight() == 0.5  # no weight fraction given: the same
    assert DirectionCheck(reference=0.5, fraction=0.0, weight_fraction=0.3).weight() == 0.0  # guard off
    assert direction_factor(0.01, 0.5, DirectionCheck(fraction=0.5, weight_fraction=0.0).weight()) == 1.0


def test_a_smaller_contribution_loses_weight_only_further_under_its_usual_cosine():
    """With guard.direction_weight_size_power p, a contribution of a quarter of the usual c_tokens
    loses weight under 0.5 x 0.25^p of the cosine usual for its size (cosine_at_size), one of the
    usual size or more under 0.5; the default p = 0.5 halves the fraction at a quarter."""
    guard = DirectionGuard(GuardConfig(direction_warmup=1))
    guard.record(0.5, 1.0, 100)
    check = guard.check(LearnerDirections(4))
    assert check.size_power == 0.5 and check.reference_tokens == 100
    r = check.token_ratio(25)
    assert r == 0.25 and check.weight(r) == pytest.approx(0.25) and check.weight(check.token_ratio(400)) == 0.5
    usual = cosine_at_size(0.5, 1.0, 0.25)  # what an honest quarter-size outer gradient shows: about 0.28
    assert 0.27 < usual < 0.28
    cos = 0.2 * usual  # a fifth of its usual agreement
    assert direction_factor(cos, check.reference, check.weight(r), r) == pytest.approx(0.8)  # 0.2 / 0.25
    assert direction_factor(cos, check.reference, 0.5, r) == pytest.approx(0.4)  # one fraction for all: 0.2 / 0.5
    assert direction_factor(0.2 * 0.5, check.reference, check.weight(1.0), 1.0) == pytest.approx(0.4)
    assert direction_factor(-0.01, check.reference, check.weight(r), r) == 0.0  # pointing away: none


@pytest.mark.parametrize("weight_fraction", [None, 0.3])
def test_merge_weighs_a_weakly_agreeing_contribution_by_the_weight_ramp(weight_fraction):
    """A contribution that agrees weakly with its round (a fifth of the shared trend under its
    noise: cosine about 0.17 against a usual 0.5) loses weight on a ramp up to 0.5 of the usual
    agreement and keeps it all on one up to 0.3 (merge_and_publish uses DirectionCheck.weight)."""
    from diloco_async.sync.state import Contribution

    f, contribs = _direction_round()
    honest = [c for c in contribs if c.ann.learner_id in ("a", "b", "c")]
    trend = sum(c.delta["w"] for c in honest) / 3
    torch.manual_seed(1)
    weak = 0.2 * trend + torch.randn(64, 32) * float(trend.pow(2).mean().sqrt())
    weak_ann = honest[0].ann.model_copy(update={"learner_id": "weak", "key": "k/weak", "update_id": "u-weak"})
    res = merge_and_publish(ObjectStore(f"memory://dirw-{id(f)}"), "r", f, 2,
                            [*honest, Contribution(weak_ann, {"w": weak})], "rda",
                            directions=DirectionCheck(reference=0.5, fraction=0.5, memory=1,
                                                      weight_fraction=weight_fraction))
    assert res.ok, res.reason
    cosine = res.cosines["weak"]
    assert 0.15 < cosine < 0.25, res.cosines
    ramp = 0.5 if weight_fraction is None else weight_fraction
    assert res.factors["weak"] == pytest.approx(min(1.0, cosine / (ramp * 0.5)))
    assert (res.factors["weak"] == 1.0) == (weight_fraction == 0.3)


@pytest.mark.parametrize("size_power", [0.0, 0.5])
def test_merge_judges_a_smaller_contribution_by_the_ramp_of_its_size(size_power):
    """A weakly agreeing contribution of a quarter of the usual c_tokens is judged against the
    cosine usual for its size, under 0.5 x 0.25^size_power of it (merge_and_publish passes each
    contribution's token ratio to DirectionCheck.weight)."""
    from diloco_async.sync.state import Contribution

    f, contribs = _direction_round()
    honest = [c for c in contribs if c.ann.learner_id in ("a", "b", "c")]
    trend = sum(c.delta["w"] for c in honest) / 3
    torch.manual_seed(2)
    weak = 0.04 * trend + torch.randn(64, 32) * float(trend.pow(2).mean().sqrt())
    usual_tokens = honest[0].ann.c_tokens
    weak_ann = honest[0].ann.model_copy(update={"learner_id": "weak", "key": "k/weak", "update_id": "u-weak",
                                                "c_tokens": usual_tokens // 4})
    res = merge_and_publish(ObjectStore(f"memory://dirs-{id(f)}-{size_power}"), "r", f, 2,
                            [*honest, Contribution(weak_ann, {"w": weak})], "rda",
                            directions=DirectionCheck(reference=0.5, fraction=0.5, memory=1,
                                                      reference_tokens=usual_tokens, size_power=size_power))
    assert res.ok, res.reason
    cosine = res.cosines["weak"]
    usual = cosine_at_size(0.5, 1.0, 0.25)
    assert 0 < cosine < 0.5 * 0.5 * usual, res.cosines  # under both ramps
    ramp = 0.5 * 0.25 ** size_power
    assert res.factors["weak"] == pytest.approx(cosine / (ramp * usual))
    assert res.factors["a"] == res.factors["b"] == res.factors["c"] == 1.0, res.cosines


def test_a_run_stored_before_the_weight_ramp_had_its_own_field_resumes_as_it_was_trained():
    """A stored config.json without guard.direction_weight_fraction (runs before b578543) loads with
    the ramp at direction_fraction for every size, as it was trained, and hashes as it did then, so
    its checkpoints verify; one stored with the fraction but without guard.direction_weight_size_power
    loads with power 0; a new run at the defaults (power 0.5) hashes differently."""
    import hashlib
    import json

    from diloco_async.config.schema import Config, _training_dict, config_hash

    old = Config().public_dict()
    del old["guard"]["direction_weight_fraction"], old["guard"]["direction_weight_size_power"]
    canonical = json.dumps(_training_dict(old), sort_keys=True, separators=(",", ":"))
    hash_then = hashlib.sha256(canonical.encode()).hexdigest()
    resumed = load_config(None, [], base=old)
    assert resumed.guard.direction_weight_fraction == resumed.guard.direction_fraction == 0.5
    assert resumed.guard.direction_weight_size_power == 0.0
    assert config_hash(resumed) == hash_then
    assert "direction_weight_fraction" not in old["guard"]  # the caller's dict is left as it was
    assert config_hash(Config()) != hash_then  # the new default (power 0.5) computes differently
    again = load_config(None, ["guard.direction_weight_size_power=0.5"], base=old)  # an override still applies
    assert again.guard.direction_weight_size_power == 0.5 and config_hash(again) == config_hash(Config())
    between = Config().public_dict()  # stored with the fraction (0.3 then) but before the power
    between["guard"]["direction_weight_fraction"] = 0.3
    del between["guard"]["direction_weight_size_power"]
    canonical = json.dumps(_training_dict(between), sort_keys=True, separators=(",", ":"))
    from_then = load_config(None, [], base=between)
    assert (from_then.guard.direction_weight_fraction, from_then.guard.direction_weight_size_power) == (0.3, 0.0)
    assert config_hash(from_then) == hashlib.sha256(canonical.encode()).hexdigest()


def test_norm_guard_bound_scales_with_the_steps_a_contribution_covers():
    """A learner that missed rounds sends one outer gradient over all their steps: its bound is
    the per-step median times its c_steps (the ceiling still holds)."""
    g = NormGuard(GuardConfig(norm_warmup=2, norm_multiple=10.0, warmup_max_rms=1.0), {"w": 10_000})
    for _ in range(3):
        g.record({"w": 0.12}, steps=12)  # 0.01 per step
    assert g.bound("w", steps=12)[0] == pytest.approx(1.2)
    assert g.check({"w": 3.0}, steps=48).status == "accept"  # four rounds' worth: bound 10 x 0.01 x 48 = 4.8
    assert g.check({"w": 3.0}, steps=12).status == "reject"
    assert g.bound("w", steps=10**9)[0] == pytest.approx(100.0)  # the 1.0-rms ceiling


def test_anti_aligned_once_keeps_zero_weight_again_is_left_out():
    """direction_memory: one anti-aligned round of a learner whose record points with the others
    keeps it in at zero weight; a learner whose mean cosine points away is left out."""
    assert not sustained_anti_alignment((), -0.5, -0.2, memory=4)  # nothing known yet: not judged alone
    assert sustained_anti_alignment((-0.4,), -0.5, -0.2, memory=4)  # twice in a row
    assert not sustained_anti_alignment((0.5, 0.4, 0.6), -0.5, -0.2, memory=4)  # honest record, one noisy round
    assert sustained_anti_alignment((0.9, 0.9, 0.9, -0.5, -0.6, -0.4), -0.5, -0.2, memory=4)  # only the last 3 count
    assert not sustained_anti_alignment((-0.9,), 0.1, -0.2, memory=4)  # not anti-aligned now
    assert sustained_anti_alignment((), -0.5, -0.2, memory=1)  # memory 1: judged on this round alone
    rec = LearnerDirections(memory=3)
    for cos in (0.1, None, float("nan"), 0.2, 0.3, 0.4):
        rec.record("a", cos)
    assert rec.snapshot() == {"a": (0.2, 0.3, 0.4)}


def test_merge_keeps_a_first_time_anti_aligned_learner_at_zero_weight():
    """The round of the test above with direction_memory 4: the flip has no record yet, so it is
    merged at zero weight; with a record that points away it is left out."""
    f, contribs = _direction_round()
    first = merge_and_publish(ObjectStore(f"memory://dir1-{id(f)}"), "r", f, 2, contribs, "rda",
                              directions=DirectionCheck(reference=0.5, fraction=0.5, memory=4))
    assert first.ok and "flip" in first.merged and first.factors["flip"] == 0.0, first.dropped
    f, contribs = _direction_round()
    again = merge_and_publish(ObjectStore(f"memory://dir2-{id(f)}"), "r", f, 2, contribs, "rda",
                              directions=DirectionCheck(0.5, 0.5, {"flip": (-0.6,), "a": (0.5,)}, memory=4))
    assert again.ok and "flip" not in again.merged
    assert dict(again.dropped)["flip"].startswith("direction_outlier")
    assert dict(again.dropped)["flip"].endswith("its learner's previous cosines: -0.600)")  # why it was judged so


class _HonestLearner:
    """A learner at ``rate`` steps/s from step 0 at its join (t = 0), as the synchronizer's
    registry sees it: each heartbeat is composed when the previous answer came back plus the
    heartbeat period, and reaches the synchronizer ``delays_s[k]`` seconds later."""

    def __init__(self, rate: float, delays_s: list[float], period_s: float = 0.25, pace: PaceLimits | None = None
                 ) -> None:
        from diloco_async.protocol.messages import JoinRequest
        from diloco_async.sync.learners import LearnerRegistry

        self.rate, self.delays_s, self.period_s = rate, delays_s, period_s
        self.pace = pace or PaceLimits(initial_steps_per_s=100.0, tolerance=4.0, floor_steps_per_s=10.0,
                                       warmup_s=3.0, burst_steps=64, max_tokens_per_step=64)
        self.registry = LearnerRegistry(self.pace)
        self.clamped_at: list[float] = []  # receipt times (s) of the clamped heartbeats
        self.refused_at: list[float] = []
        self.registry.join(JoinRequest(learner_id="a"), 0.0, None)
        self.clamped: list[str] = []
        self.refusals: list[str] = []

    def step_at(self, t_s: float) -> int:
        return math.floor(self.rate * t_s)

    def run(self) -> None:
        from diloco_async.protocol.messages import Heartbeat

        answered_s = 0.0  # the join's answer
        for delay_s in self.delays_s:
            composed_s = answered_s + self.period_s
            received_s = composed_s + delay_s
            step = self.step_at(composed_s)
            _, _, clamped = self.registry.heartbeat(
                Heartbeat(learner_id="a", step=step, tokens_total=step * 64), received_s)
            self.clamped += clamped
            self.clamped_at += [received_s] * bool(clamped)
            answered_s = received_s
            # a lone learner announces every step it took (c_steps = its whole step count) right now
            info = self.registry.learners["a"]
            for now_s in (received_s, received_s + 0.1):
                c = self.step_at(now_s)
                why = implausible_contribution(c_steps=c, c_tokens=c * 64, learner_step=info.step,
                                               since_anchor_s=now_s - info.anchor_s,
                                               bound=self.registry.pace_bound("a"))
                if why:
                    self.refusals.append(why)
                    self.refused_at.append(now_s)


@pytest.mark.parametrize("delays_s", [[0.001] * 40, [0.001] * 10 + [1.0] + [0.001] * 10,
                                      [0.001] * 5 + [0.6, 0.001, 2.0, 0.4, 0.001] * 3])
def test_an_honest_learner_near_the_pace_bound_is_never_clamped_or_refused_when_heartbeats_are_late(delays_s):
    """A heartbeat's step is read when it is composed, the pace allowance counts from the
    message before it (it was composed after that one was answered), not from its own receipt:
    a heartbeat delayed in transit (a busy event loop, a slow link) made a learner at 90 steps/s
    look like it ran faster than 100 steps/s + 64 (clamped heartbeats, and contributions refused
    as implausible_steps, a lone fast learner's first contribution included)."""
    learner = _HonestLearner(90.0, delays_s)
    learner.run()
    assert learner.clamped == [] and learner.refusals == []


def test_a_learner_faster_than_the_initial_bound_is_clamped_only_until_its_pace_is_measured():
    """Counting from the message before a heartbeat widens each heartbeat's window by one period,
    not the steps credited: before its pace is measured a learner is credited at most burst_steps
    + initial_steps_per_s x the seconds (100 steps/s here; the burst is spent once, not granted
    per heartbeat). A learner at 300 steps/s is clamped and its contributions are refused in its
    warm-up (3 s heard stepping). Changed by issue 47: it was refused for as long as it ran at that
    pace (the bound was a fixed 100 steps/s); now its measured pace sets its bound after the
    warm-up (4 x about 120 steps/s), the steps it held back are credited within a few seconds, and
    a learner steadily at 300 steps/s is not told from an honest fast one."""
    learner = _HonestLearner(300.0, [0.001] * 40)
    learner.run()
    assert "implausible_steps" in learner.clamped and learner.refusals
    assert all(r.startswith("implausible_steps") for r in learner.refusals)
    # the warm-up ends 3 s after its first step (0.25 s); the ~600 steps held back by then are
    # credited at the bound's surplus over its pace (~160 steps/s), in about 4 s
    assert max(learner.clamped_at + learner.refused_at) < 3.25 + 4.0 < 10.0  # 10 s run
    bound = learner.registry.pace_bound("a")  # 4 x a measured pace that lags (it counts the clamped warm-up)
    assert bound.reason.startswith("4 x measured") and bound.steps_per_s > 4 * 100.0


def test_after_a_resume_the_pace_allowance_counts_across_the_gap():
    """A synchronizer restored from a checkpoint written 20 s ago (its clock has another origin)
    lets the learners' first heartbeats report the 20 s of steps they took meanwhile: counted
    from the restore, a learner at 90 steps/s was clamped (and its next contribution refused)
    after every restart."""
    from diloco_async.protocol.messages import Heartbeat

    learner = _HonestLearner(90.0, [0.001] * 40)
    learner.run()  # 40 heartbeats: ~10 s of training
    reg, written_s = learner.registry, 10.05
    ledgers, learners = reg.to_manifest(written_s)
    assert learners["a"]["anchor_age_s"] == pytest.approx(written_s - reg.learners["a"].anchor_s)
    reg.restore(ledgers, learners, 5000.0, checkpoint_age_s=20.0)  # 20 s later, on another clock
    step = learner.step_at(written_s + 20.3)
    _, _, clamped = reg.heartbeat(Heartbeat(learner_id="a", step=step, tokens_total=step * 64), 5000.3)
    assert clamped == [] and reg.learners["a"].step == step
    reg.restore(ledgers, learners, 5000.0)  # a checkpoint of unknown age: from the restore, as before
    _, _, clamped = reg.heartbeat(Heartbeat(learner_id="a", step=step, tokens_total=step * 64), 5000.3)
    assert clamped == ["implausible_steps", "implausible_tokens"]


def test_a_heartbeat_resent_or_delivered_late_does_not_move_the_window():
    """The same heartbeat resent over HTTP after the WebSocket closed (same step), and an older
    one delivered after a newer one (lower step), leave the step and the window where the
    newest new step put them: either would start the window after that step was reached."""
    from diloco_async.protocol.messages import Heartbeat

    learner = _HonestLearner(90.0, [0.001] * 8)
    learner.run()
    reg = learner.registry
    info = reg.learners["a"]
    step, anchor_s, seen_s = info.step, info.anchor_s, info.last_seen_s
    for late_step, at_s in ((step, seen_s + 1.0), (step - 20, seen_s + 1.1)):  # a resend, then an older one
        reg.heartbeat(Heartbeat(learner_id="a", step=late_step, tokens_total=late_step * 64), at_s)
        assert (info.step, info.anchor_s, info.last_seen_s) == (step, anchor_s, at_s)
    now_s = seen_s + 1.2  # the learner trained on meanwhile: its next heartbeat and contribution pass
    new = learner.step_at(now_s)
    _, _, clamped = reg.heartbeat(Heartbeat(learner_id="a", step=new, tokens_total=new * 64), now_s)
    assert clamped == [] and info.step == new
