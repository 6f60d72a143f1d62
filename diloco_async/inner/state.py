"""A learner's own inner state, for an exact restore after a restart (DESIGN §5, cases C02, C03).

Captured: parameters θ, AdamW state (``exp_avg``, ``exp_avg_sq`` and ``step`` of every
parameter; with ``learners.optimizer = "muon"`` Muon's ``momentum_buffer`` of each hidden matrix
instead, :mod:`diloco_async.inner.optimizers`), the data sampler's RNG state, the base copy
Θ^base of every fragment with its version, and the per-fragment counters (steps, tokens, compute
seconds) since each base. Restoring writes the optimizer's per-parameter state entries explicitly:
AdamW and Muon create them lazily, so a restore that only copied into existing entries of a fresh
optimizer would silently drop the moments (C02).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from diloco_async.inner.base_file import BaseFile

__all__ = ["InnerState", "capture", "restore", "state_meta", "parse_meta"]


@dataclass
class InnerState:
    """Everything a learner needs to continue exactly where it stopped.

    Attributes:
        tensors: flat name → tensor map (safetensors-ready): ``param/{n}``, ``exp_avg/{n}``,
            ``exp_avg_sq/{n}``, ``adam_step/{n}`` (float32 scalars), ``muon_momentum/{n}`` (Muon's
            parameters), ``base/{p}/{n}`` and ``rng``
            (uint8 generator state).
        meta: JSON-ready: ``step`` (local step), ``base_versions`` {p: v}, ``counters``
            {p: [c_steps, c_tokens, c_secs]}.
    """

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    meta: dict = field(default_factory=dict)


def capture(params: dict[str, torch.nn.Parameter], opt: torch.optim.Optimizer, gen: torch.Generator, *,
            step: int, base_tensors: dict[int, dict[str, torch.Tensor]], base_versions: dict[int, int],
            counters: dict[int, tuple[int, int, float]]) -> InnerState:
    """The inner state as a flat name → tensor map, **without copies** (issue 17 item 3): the
    parameters, AdamW moments and base copies are the live tensors themselves (detached views),
    so the caller serializes the state before they are mutated in place (e.g. with
    :func:`diloco_async.storage.checkpoint.spool_state`; a learner's
    :class:`~diloco_async.learner.spool.StateSpooler` writes it while training goes on, and the
    optimizer step waits until the parameters and moments are written). Tensors on another device stay there; the
    writer brings them to CPU one at a time. A base held in a local file
    (:class:`~diloco_async.inner.base_file.BaseFile`) enters as :class:`~diloco_async.inner.base_file.LazyTensor`
    entries, read one at a time by the writer. Only the small AdamW step counters and the RNG
    state are copied."""
    t: dict[str, torch.Tensor] = {}
    for name, p in params.items():
        t[f"param/{name}"] = p.detach()
        st = opt.state.get(p, {})
        if "exp_avg" in st:
            t[f"exp_avg/{name}"] = st["exp_avg"].detach()
            t[f"exp_avg_sq/{name}"] = st["exp_avg_sq"].detach()
            t[f"adam_step/{name}"] = torch.as_tensor(st["step"], dtype=torch.float32).detach().clone().reshape(())
        elif "momentum_buffer" in st:  # a Muon parameter (learners.optimizer = "muon")
            t[f"muon_momentum/{name}"] = st["momentum_buffer"].detach()
    for p_idx, tensors in base_tensors.items():
        for name in tensors:  # a base kept in a local file stays there until written out
            t[f"base/{p_idx}/{name}"] = (tensors.lazy(name) if isinstance(tensors, BaseFile)
                                         else tensors[name].detach())
    t["rng"] = gen.get_state().clone()
    return InnerState(t, state_meta(step, base_versions, counters))


def state_meta(step: int, base_versions: dict[int, int], counters: dict[int, tuple[int, int, float]]) -> dict:
    """An inner state's bookkeeping, JSON-ready (:attr:`InnerState.meta`)."""
    return {"step": int(step), "base_versions": {str(k): int(v) for k, v in base_versions.items()},
            "counters": {str(k): [int(c[0]), int(c[1]), float(c[2])] for k, c in counters.items()}}


def parse_meta(meta: dict) -> tuple[int, dict[int, int], dict[int, tuple[int, int, float]]]:
    """(local step, base versions, counters) of :func:`state_meta`'s dict."""
    versions = {int(k): int(v) for k, v in meta["base_versions"].items()}
    counters = {int(k): (int(c[0]), int(c[1]), float(c[2])) for k, c in meta["counters"].items()}
    return int(meta["step"]), versions, counters


def restore(state: InnerState, params: dict[str, torch.nn.Parameter], opt: torch.optim.Optimizer,
            gen: torch.Generator) -> tuple[int, dict[int, dict[str, torch.Tensor]], dict[int, int],
                                              dict[int, tuple[int, int, float]]]:
    """Write a captured state back into the model, the optimizer and the generator.

    The state's tensors are taken over, not copied (the AdamW moments and base copies become
    them where they already are on the parameters' device): ``state`` is consumed.

    Returns:
        (local step, base tensors by fragment, base versions by fragment, counters by fragment).

    Raises:
        ValueError: a parameter is missing or has another shape.
    """
    t = state.tensors
    with torch.no_grad():
        for name, p in params.items():
            value = t.get(f"param/{name}")
            if value is None or value.shape != p.shape:
                raise ValueError(f"inner state lacks parameter {name} of shape {tuple(p.shape)}")
            p.copy_(value)
            if f"exp_avg/{name}" in t:
                step_value = t[f"adam_step/{name}"].clone().to(torch.float32)
                opt.state[p] = {"step": step_value, "exp_avg": t[f"exp_avg/{name}"].to(p.device),
                                "exp_avg_sq": t[f"exp_avg_sq/{name}"].to(p.device)}
            elif f"muon_momentum/{name}" in t:
                opt.state[p] = {"momentum_buffer": t[f"muon_momentum/{name}"].to(p.device)}
    gen.set_state(t["rng"].clone())
    base_tensors: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in t.items():
        if key.startswith("base/"):
            _, p_idx, name = key.split("/", 2)
            base_tensors.setdefault(int(p_idx), {})[name] = value
    step, versions, counters = parse_meta(state.meta)
    return step, base_tensors, versions, counters
