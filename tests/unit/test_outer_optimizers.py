"""Pluggable outer optimizers (DESIGN §4.5b): closed-form steps on tiny tensors, Delayed Nesterov
at N = 1 equal to Nesterov bit for bit, exact resume from (params, momentum, steps), the
non-finite rollback guarantee, and the config keys that choose them."""

from __future__ import annotations

import pytest
import torch

from diloco_async.config.schema import load_config
from diloco_async.merge.core import (
    OUTER_OPTIMIZERS,
    DelayedNesterovOuterOptimizer,
    OuterOptimizer,
    SgdOuterOptimizer,
    make_outer_optimizer,
)


def grads(seed: int, steps: int) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [{"w": torch.randn(3, 5, generator=gen), "b": torch.randn(7, generator=gen)} for _ in range(steps)]


def start() -> dict[str, torch.Tensor]:
    return {"w": torch.linspace(-1, 1, 15).view(3, 5), "b": torch.arange(7.0)}


def test_sgd_closed_form_and_zero_momentum():
    opt = SgdOuterOptimizer({"x": torch.tensor([1.0, 2.0])}, lr=0.5, momentum=0.0)
    assert opt.step({"x": torch.tensor([2.0, -4.0])})["x"].tolist() == [0.0, 4.0]
    assert opt.step({"x": torch.tensor([1.0, 1.0])})["x"].tolist() == [-0.5, 3.5]  # no momentum carried
    assert opt.steps_taken == 2 and opt.momentum()["x"].tolist() == [0.0, 0.0]
    assert opt.shared_state().momentum["x"].tolist() == [0.0, 0.0]  # checkpointed as zeros


def test_delayed_nesterov_closed_form():
    """N = 2, η = 1, μ = 0.5 on a scalar: plain steps in between, the momentum once per period."""
    opt = DelayedNesterovOuterOptimizer({"x": torch.tensor([0.0])}, lr=1.0, momentum=0.5, period=2)
    seen = []
    for g in (1.0, 1.0, 2.0, 0.0):
        seen.append((opt.step({"x": torch.tensor([g])})["x"].item(), opt.momentum()["x"].item()))
    # t=1: Θ = -1 (plain), b = g/N = 0.5
    # t=2: m = μ·0 + (1 + 1)/2 = 1, Θ = -1 - (1 + μ·m) = -2.5, b = μm = 0.5
    # t=3: Θ = -2.5 - 2 = -4.5 (plain), b = 0.5 + 2/2 = 1.5
    # t=4: m = μ·1 + (2 + 0)/2 = 1.5, Θ = -4.5 - (0 + 0.75) = -5.25, b = 0.75
    assert seen == [(-1.0, 0.5), (-2.5, 0.5), (-4.5, 1.5), (-5.25, 0.75)]


def test_delayed_nesterov_with_period_one_is_nesterov_bit_for_bit():
    nesterov = OuterOptimizer(start(), lr=0.7, momentum=0.9)
    delayed = DelayedNesterovOuterOptimizer(start(), lr=0.7, momentum=0.9, period=1)
    for g in grads(1, 6):
        a, b = nesterov.step(g), delayed.step(g)
        assert all(torch.equal(a[n], b[n]) for n in a)


@pytest.mark.parametrize("kind", OUTER_OPTIMIZERS)
def test_resume_from_params_momentum_and_steps_is_exact(kind):
    """What a checkpoint keeps (Θ, b, the step count) continues bit for bit, mid-period too."""
    gs = grads(2, 7)
    first = make_outer_optimizer(kind, start(), 0.7, 0.9, period=3)
    for g in gs[:4]:  # 4 steps: one into delayed-nesterov's second period
        first.step(g)
    resumed = make_outer_optimizer(kind, start(), 0.7, 0.9, period=3)
    resumed.load_state(first.params(), first.momentum(), steps_taken=first.steps_taken)
    for g in gs[4:]:
        a, b = first.step(g), resumed.step(g)
        assert all(torch.equal(a[n], b[n]) for n in a), kind
    assert all(torch.equal(first.momentum()[n], resumed.momentum()[n]) for n in a)


@pytest.mark.parametrize("kind", OUTER_OPTIMIZERS)
def test_non_finite_leaves_the_state_unchanged(kind):
    opt = make_outer_optimizer(kind, start(), 2.0, 0.9, period=2)
    opt.step(grads(3, 1)[0])
    before = {n: t.clone() for n, t in opt.params().items()}
    mom = {n: t.clone() for n, t in opt.momentum().items()}
    bad = grads(4, 1)[0]
    bad["b"][3] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        opt.step(bad)
    huge = {"w": torch.full((3, 5), -3e38), "b": torch.zeros(7)}  # finite g; Θ - η·g overflows (η = 2)
    with pytest.raises(ValueError, match=r"non-finite values after the outer step in \['w'\]"):
        opt.step_shared(huge, require_finite=True)
    assert opt.steps_taken == 1
    assert all(torch.equal(opt.params()[n], before[n]) for n in before)
    assert all(torch.equal(opt.momentum()[n], mom[n]) for n in mom)


@pytest.mark.parametrize("kind", OUTER_OPTIMIZERS)
def test_restore_by_reference_rolls_back_a_step(kind):
    opt = make_outer_optimizer(kind, start(), 0.7, 0.9, period=2)
    opt.step(grads(5, 1)[0])
    saved = opt.shared_state()
    p0 = {n: t.clone() for n, t in saved.params.items()}
    opt.step(grads(6, 1)[0])
    opt.restore(saved)
    assert opt.steps_taken == 1 and all(torch.equal(opt.params()[n], p0[n]) for n in p0)


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown outer optimizer 'adam'"):
        make_outer_optimizer("adam", start(), 0.7, 0.9)
    with pytest.raises(ValueError, match="period"):
        make_outer_optimizer("delayed-nesterov", start(), 0.7, 0.9, period=0)
    with pytest.raises(ValueError, match="momentum"):
        make_outer_optimizer("delayed-nesterov", start(), 0.7, 0.0)
    assert make_outer_optimizer("sgd", start(), 0.7, 0.0).steps_taken == 0  # sgd takes any momentum


def test_config_keys_choose_the_optimizer():
    cfg = load_config(None, ['synchronizer.outer_optimizer="delayed-nesterov"', "synchronizer.outer_momentum_every=8"])
    assert cfg.synchronizer.outer_optimizer == "delayed-nesterov" and cfg.synchronizer.outer_momentum_every == 8
    assert load_config(None).synchronizer.outer_optimizer == "nesterov"
    with pytest.raises(ValueError, match="synchronizer.outer_optimizer"):
        load_config(None, ['synchronizer.outer_optimizer="adam"'])
    with pytest.raises(ValueError, match="synchronizer.outer_momentum_every"):
        load_config(None, ["synchronizer.outer_momentum_every=0"])


def test_taking_back_the_whole_lookahead_leaves_a_plain_outer_gradient_step():
    """A drain's last round (issue 44, docs/end-of-run.md): after Nesterov steps, taking back the
    whole look-ahead of the last one gives Θ_prev − η·g; half of it is halfway; b is unchanged."""
    gen = torch.Generator().manual_seed(3)
    start = {"w": torch.randn(6, 4, generator=gen, dtype=torch.float64), "v": torch.randn(5, generator=gen,
                                                                                         dtype=torch.float64)}
    grads = [{k: torch.randn(t.shape, generator=gen, dtype=torch.float64) for k, t in start.items()} for _ in range(3)]
    for share in (1.0, 0.5):
        opt = OuterOptimizer(start, lr=0.7, momentum=0.9)
        for g in grads[:2]:
            opt.step(g)
        before = opt.params()
        opt.step(grads[2])
        momentum = opt.momentum()
        got = opt.take_back_lookahead(share)
        for k in start:
            want = before[k] - 0.7 * (grads[2][k] + (1 - share) * 0.9 * momentum[k])
            torch.testing.assert_close(got[k], want)
            torch.testing.assert_close(opt.params()[k], want)
            torch.testing.assert_close(opt.momentum()[k], momentum[k])
        assert opt.steps_taken == 3


@pytest.mark.parametrize("share", [-0.1, 1.5, float("nan")])
def test_take_back_lookahead_refuses_a_share_outside_0_1_and_changes_nothing(share):
    opt = OuterOptimizer({"w": torch.ones(3)}, lr=0.7, momentum=0.9)
    opt.step({"w": torch.ones(3)})
    before = opt.params()
    with pytest.raises(ValueError, match="share must be in"):
        opt.take_back_lookahead(share)
    torch.testing.assert_close(opt.params()["w"], before["w"])


@pytest.mark.parametrize("name", ["sgd", "delayed-nesterov"])
def test_take_back_lookahead_leaves_sgd_and_delayed_nesterov_as_they_are(name):
    """SGD has no look-ahead; DN's comes once per period, not with the last step."""
    opt = make_outer_optimizer(name, {"w": torch.ones(3)}, lr=0.7, momentum=0.9, period=4)
    opt.step({"w": torch.full((3,), 0.5)})
    before = opt.params()
    torch.testing.assert_close(opt.take_back_lookahead(1.0)["w"], before["w"])
