"""A learner's inner state survives a save/load round trip exactly (cases C02 and C03)."""

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from diloco_async.config.schema import ModelConfig
from diloco_async.inner.state import InnerState, capture, restore
from diloco_async.models.transformer import ByteGPT


def make(seed: int = 0):
    torch.manual_seed(seed)
    model = ByteGPT(ModelConfig(n_layer=1, d_model=16, n_head=2, context=8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return model, opt, torch.Generator().manual_seed(7)


def step(model, opt, gen):
    x = torch.randint(0, 256, (4, 9), generator=gen)
    loss = model.loss(x[:, :-1], x[:, 1:])
    opt.zero_grad()
    loss.backward()
    opt.step()


def test_restore_mid_inner_loop_is_bit_exact():
    model, opt, gen = make()
    params = dict(model.named_parameters())
    for _ in range(30):  # inner step 30 of H = 50
        step(model, opt, gen)
    base = {0: {n: torch.zeros_like(p) for n, p in list(params.items())[:2]}}
    state = capture(params, opt, gen, step=30, base_tensors=base, base_versions={0: 5},
                    counters={0: (30, 30 * 32, 1.5)})
    # through the bytes a store would hold
    state = InnerState(st_load(st_save(state.tensors)), state.meta)
    step(model, opt, gen)
    expected = {n: p.detach().clone() for n, p in params.items()}

    fresh, fresh_opt, fresh_gen = make(seed=123)  # different init, empty AdamW state
    fparams = dict(fresh.named_parameters())
    local_step, base_t, versions, counters = restore(state, fparams, fresh_opt, fresh_gen)
    assert local_step == 30 and versions == {0: 5} and counters == {0: (30, 960, 1.5)}
    assert torch.equal(base_t[0][next(iter(base[0]))], torch.zeros_like(next(iter(base[0].values()))))
    for n, p in fparams.items():
        st = fresh_opt.state[p]
        assert float(st["step"]) == 30.0
        assert torch.equal(st["exp_avg"], state.tensors[f"exp_avg/{n}"])
        assert torch.equal(st["exp_avg_sq"], state.tensors[f"exp_avg_sq/{n}"])
    step(fresh, fresh_opt, fresh_gen)  # the next inner update equals the never-killed run's
    for n, p in fparams.items():
        assert torch.equal(p.detach(), expected[n]), n


def test_base_comes_from_the_state_not_from_current_weights():
    # C03: the outer gradient after a restart is taken against the stored base (1.0), not
    # against the weights present at restart (0.85).
    model, opt, gen = make()
    params = dict(model.named_parameters())
    name = "ln_f.bias"
    with torch.no_grad():
        params[name].fill_(0.85)
    base = {0: {name: torch.full_like(params[name], 1.0)}}
    state = capture(params, opt, gen, step=30, base_tensors=base, base_versions={0: 5}, counters={0: (30, 1, 0.1)})
    _, base_t, versions, _ = restore(state, params, opt, gen)
    with torch.no_grad():
        params[name].fill_(0.8)  # steps 31..50
    delta = base_t[0][name] - params[name]
    assert torch.allclose(delta, torch.full_like(delta, 0.2)) and versions[0] == 5
