"""PREVIOUS IMPLEMENTATION of ``diloco_async/merge/core.py`` (main at 98fee35), frozen for comparison.

Kept verbatim, except this docstring, only as the reference that ``tests/unit/test_merge_equivalence.py``
and ``benchmarks/merge.py`` compare the in-place merge against (bit for bit, and for speed and
memory as context). Not used by the library; do not edit or "fix" it.

Original module docstring follows.

Merge math of Decoupled DiLoCo: token weights, anchoring, RDA and the outer step.

Paper §3 and App. D; DESIGN §4.1-4.5, golden values in DESIGN §4.7.

Pure: no I/O, torch only. Every function works on tensors of any floating dtype and does its
arithmetic in the dtype it is given (callers pass float32, the tests float64); weights are plain
Python floats. An *outer gradient* ``Δ`` of a fragment is ``Θ − θ``: the synchronizer's value minus
the learner's value after its inner steps, so a descent step subtracts it.

Bad input (mismatched names or shapes, negative or zero total weight, non-finite outer gradients)
raises ``ValueError`` naming the offending value; non-floating tensors raise ``TypeError``.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence

import torch
from torch import Tensor

__all__ = [
    "token_weight",
    "anchor",
    "weighted_mean",
    "rda",
    "merge_outer_gradients",
    "MERGE_MODES",
    "OuterOptimizer",
]

MERGE_MODES = ("rda", "mean")
"""Names accepted by :func:`merge_outer_gradients` (``"mean"`` is the ablation, DESIGN §4.4)."""


def token_weight(c_tokens: int, c_steps: int) -> float:
    """Weight of one contribution, ``c_tokens² / c_steps`` (DESIGN §4.2).

    That is the number of tokens times the tokens per inner step, so a learner that did more work
    with larger batches counts more.

    Args:
        c_tokens: tokens the learner trained on since its base version (≥ 0).
        c_steps: inner steps it took in that time (≥ 1; a contribution with no step is not
            admitted).

    Returns:
        The weight as a float (units: tokens²/step).

    Raises:
        ValueError: if ``c_steps < 1`` or ``c_tokens < 0``.
    """
    if c_steps < 1 or c_tokens < 0:
        raise ValueError(
            f"token_weight needs c_tokens >= 0 and c_steps >= 1, got c_tokens={c_tokens}, c_steps={c_steps}"
        )
    return float(c_tokens) * float(c_tokens) / float(c_steps)


def _check_same_keys(a: Mapping[str, Tensor], b: Mapping[str, Tensor], what: str) -> None:
    if set(a) != set(b):
        missing = sorted(set(b) - set(a))
        extra = sorted(set(a) - set(b))
        raise ValueError(f"{what}: tensor names differ (missing {missing}, unexpected {extra})")


def _check_shapes(a: Mapping[str, Tensor], b: Mapping[str, Tensor], what: str) -> None:
    for name, t in a.items():
        if tuple(t.shape) != tuple(b[name].shape):
            raise ValueError(
                f"{what}: shape of {name!r} differs: {tuple(t.shape)} vs {tuple(b[name].shape)}"
            )


def anchor(
    delta: dict[str, Tensor], current: dict[str, Tensor], base: dict[str, Tensor]
) -> dict[str, Tensor]:
    """Re-anchor a learner's outer gradient on the synchronizer's current value (DESIGN §4.1).

    ``Δ' = Θ^cur − θ = (Θ^cur − Θ^base) + Δ`` per tensor, where ``Δ = Θ^base − θ`` is what the
    learner sent against the version ``base`` it started from.

    Args:
        delta: the learner's outer gradient ``Δ``, name → tensor.
        current: the synchronizer's current fragment value ``Θ^cur``, same names and shapes.
        base: the fragment value ``Θ^base`` the learner started from, same names and shapes.

    Returns:
        A new dict, name → ``Δ'`` (same shapes, the dtype of ``delta``), in the order of ``delta``.

    Raises:
        ValueError: if the three dicts do not hold the same names with the same shapes.
    """
    _check_same_keys(delta, current, "anchor(delta, current)")
    _check_same_keys(delta, base, "anchor(delta, base)")
    _check_shapes(delta, current, "anchor(delta, current)")
    _check_shapes(delta, base, "anchor(delta, base)")
    out = {}
    for name, d in delta.items():
        out[name] = (current[name].to(d.dtype) - base[name].to(d.dtype)) + d
    return out


def _normalised_weights(deltas: Sequence[Tensor], weights: Sequence[float]) -> list[float]:
    """Validate ``deltas``/``weights`` and return ``w / Σw`` (float64 Python floats)."""
    if len(deltas) == 0:
        raise ValueError("cannot merge an empty list of outer gradients")
    if len(deltas) != len(weights):
        raise ValueError(f"{len(deltas)} outer gradients but {len(weights)} weights")
    ws = [float(w) for w in weights]
    for i, w in enumerate(ws):
        if not math.isfinite(w) or w < 0:
            raise ValueError(f"weight {i} must be finite and >= 0, got {w}")
    total = math.fsum(ws)
    if total <= 0:
        raise ValueError(f"total weight must be > 0, got {total} from weights {ws}")
    shape = tuple(deltas[0].shape)
    for i, d in enumerate(deltas):
        if not d.is_floating_point():
            raise TypeError(f"outer gradient {i} must be a floating tensor, got dtype {d.dtype}")
        if tuple(d.shape) != shape:
            raise ValueError(f"outer gradient {i} has shape {tuple(d.shape)}, expected {shape}")
    return [w / total for w in ws]


def _mean(deltas: Sequence[Tensor], probs: Sequence[float]) -> Tensor:
    out = torch.zeros_like(deltas[0])
    for d, p in zip(deltas, probs, strict=True):
        out.add_(d.to(out.dtype), alpha=p)
    return out


def weighted_mean(deltas: Sequence[Tensor], weights: Sequence[float]) -> Tensor:
    """Weighted mean of outer gradients, ``Σ w·Δ / Σ w`` (DESIGN §4.4, used for embeddings).

    Args:
        deltas: M tensors of one shape (any floating dtype; the result has the first one's dtype).
        weights: M finite weights ≥ 0 with a positive sum (e.g. :func:`token_weight`).

    Returns:
        A new tensor of the common shape.

    Raises:
        ValueError: on empty input, a length mismatch, a negative or non-finite weight, a zero
            total weight, or differing shapes.
        TypeError: if a delta is not a floating tensor.
    """
    probs = _normalised_weights(deltas, weights)
    return _mean(deltas, probs)


def rda(deltas: Sequence[Tensor], weights: Sequence[float], eps: float = 1e-12) -> Tensor:
    """Radial-Directional Averaging of one tensor's outer gradients (paper App. D, DESIGN §4.4).

    ``RDA = (Σ w‖Δ‖ / Σ w) · φ(Σ w·φ(Δ) / Σ w)`` with ``φ(x) = x/‖x‖`` and ``φ(0) = 0``: the
    weighted mean norm along the weighted mean direction, so near-orthogonal updates are not
    shrunk the way a plain mean shrinks them. Norms are L2 over all elements of the tensor.
    If the directional mean has norm ``< eps`` (the directions cancel), the result is
    :func:`weighted_mean` instead.

    Args:
        deltas: M tensors of one shape (any floating dtype; the result has the first one's dtype).
        weights: M finite weights ≥ 0 with a positive sum.
        eps: threshold on the norm of the directional mean for the fallback.

    Returns:
        A new tensor of the common shape.

    Raises:
        ValueError, TypeError: as :func:`weighted_mean`.
    """
    probs = _normalised_weights(deltas, weights)
    dtype = deltas[0].dtype
    radial = torch.zeros((), dtype=dtype, device=deltas[0].device)
    direction = torch.zeros_like(deltas[0])
    for d, p in zip(deltas, probs, strict=True):
        d = d.to(dtype)
        norm = torch.linalg.vector_norm(d)
        radial.add_(norm, alpha=p)
        if norm.item() > 0:
            direction.add_(d / norm, alpha=p)
    dir_norm = torch.linalg.vector_norm(direction)
    if dir_norm.item() < eps:
        return _mean(deltas, probs)
    return direction.mul_(radial / dir_norm)


def merge_outer_gradients(
    deltas: Sequence[dict[str, Tensor]],
    weights: Sequence[float],
    mode: str = "rda",
    embedding_names: Collection[str] = (),
) -> dict[str, Tensor]:
    """Merge M learners' outer gradients of one fragment, tensor by tensor (DESIGN §4.4).

    Each tensor is merged with :func:`rda` (``mode="rda"``) or :func:`weighted_mean`
    (``mode="mean"``); names in ``embedding_names`` always use the weighted mean.

    Args:
        deltas: M dicts name → outer gradient, all with the same names (anchored, DESIGN §4.1).
        weights: M weights, one per learner.
        mode: ``"rda"`` or ``"mean"``.
        embedding_names: tensors merged with the weighted mean whatever the mode; names that are
            not in the fragment are ignored.

    Returns:
        A new dict name → merged tensor, in the order of the first learner's dict.

    Raises:
        ValueError: for an unknown mode, no deltas, differing name sets, and the errors of
            :func:`weighted_mean`.
    """
    if mode not in MERGE_MODES:
        raise ValueError(f"unknown merge mode {mode!r}; expected one of {MERGE_MODES}")
    if len(deltas) == 0:
        raise ValueError("cannot merge an empty list of outer gradients")
    if len(deltas) != len(weights):
        raise ValueError(f"{len(deltas)} outer gradients but {len(weights)} weights")
    for i, d in enumerate(deltas[1:], start=1):
        _check_same_keys(d, deltas[0], f"merge_outer_gradients(learner {i} vs learner 0)")
    embeddings = frozenset(embedding_names)
    out = {}
    for name in deltas[0]:
        per_learner = [d[name] for d in deltas]
        if mode == "mean" or name in embeddings:
            out[name] = weighted_mean(per_learner, weights)
        else:
            out[name] = rda(per_learner, weights)
    return out


class OuterOptimizer:
    """The outer Nesterov step of one fragment (DESIGN §4.5), on ``torch.optim.SGD``.

    ``b ← μb + g; Θ ← Θ − η(g + μb)``, exactly as ``torch.optim.SGD(lr=η, momentum=μ,
    nesterov=True)``; on the first step torch sets ``b = g``. The optimizer owns copies of the
    fragment's values as leaf tensors: float32, or float64 when given float64 (set ``dtype`` to
    force one).

    Args:
        params: name → the fragment's current value ``Θ`` (copied; the caller's tensors are not
            touched).
        lr: outer learning rate η (> 0). DiLoCo's default 0.7.
        momentum: Nesterov momentum μ (0 < μ < 1). DiLoCo's default 0.9.
        dtype: keyword-only; the dtype of the optimizer's state. ``None``: float64 stays float64,
            anything else becomes float32.

    Raises:
        ValueError: for ``lr``/``momentum`` out of range, an empty or non-finite ``params``.
    """

    def __init__(
        self,
        params: dict[str, Tensor],
        lr: float = 0.7,
        momentum: float = 0.9,
        *,
        dtype: torch.dtype | None = None,
    ) -> None:
        if not (math.isfinite(lr) and lr > 0):
            raise ValueError(f"outer lr must be finite and > 0, got {lr}")
        if not (0 < momentum < 1):
            raise ValueError(f"outer momentum must be in (0, 1) for Nesterov, got {momentum}")
        if not params:
            raise ValueError("OuterOptimizer needs at least one tensor")
        _check_finite(params, "initial params")
        self._lr = float(lr)
        self._mu = float(momentum)
        self._params: dict[str, Tensor] = {}
        for name, t in params.items():
            want = dtype or (torch.float64 if t.dtype == torch.float64 else torch.float32)
            self._params[name] = t.detach().to(dtype=want, copy=True).requires_grad_(True)
        self._opt = self._new_sgd()
        self._steps = 0

    def _new_sgd(self) -> torch.optim.SGD:
        return torch.optim.SGD(list(self._params.values()), lr=self._lr, momentum=self._mu, nesterov=True)

    @property
    def steps_taken(self) -> int:
        """Outer steps taken since construction, or the count restored by :meth:`load_state`."""
        return self._steps

    @property
    def lr(self) -> float:
        """Outer learning rate η."""
        return self._lr

    @property
    def mu(self) -> float:
        """Nesterov momentum μ."""
        return self._mu

    def _check_like_params(self, tensors: Mapping[str, Tensor], what: str) -> None:
        _check_same_keys(tensors, self._params, what)
        _check_shapes(tensors, self._params, what)
        _check_finite(tensors, what)

    def step(self, outer_grad: dict[str, Tensor]) -> dict[str, Tensor]:
        """Apply one outer step with the merged outer gradient ``g``.

        Args:
            outer_grad: name → ``g``, the same names and shapes as the params; cast to the
                optimizer's dtype and device.

        Returns:
            name → the new value ``Θ`` (detached clones).

        Raises:
            ValueError: if names or shapes differ or a value is NaN/Inf; the state is then left
                unchanged.
        """
        self._check_like_params(outer_grad, "outer step")
        for name, p in self._params.items():
            p.grad = outer_grad[name].detach().to(dtype=p.dtype, device=p.device, copy=True)
        self._opt.step()
        for p in self._params.values():
            p.grad = None
        self._steps += 1
        return self.params()

    def params(self) -> dict[str, Tensor]:
        """name → current value ``Θ`` (detached clones, the optimizer's dtype)."""
        return {name: p.detach().clone() for name, p in self._params.items()}

    def momentum(self) -> dict[str, Tensor]:
        """name → momentum buffer ``b`` (detached clones; zeros before the first step)."""
        out = {}
        for name, p in self._params.items():
            buf = self._opt.state.get(p, {}).get("momentum_buffer")
            out[name] = torch.zeros_like(p.detach()) if buf is None else buf.detach().clone()
        return out

    def load_state(
        self,
        params: dict[str, Tensor],
        momentum: dict[str, Tensor] | None = None,
        *,
        steps_taken: int | None = None,
    ) -> None:
        """Restore values and momentum exactly, e.g. from a checkpoint.

        After ``load_state(o.params(), o.momentum())`` the next step equals ``o``'s next step bit
        for bit. Without ``momentum`` the optimizer is fresh: its next step is a first step
        (``b = g``), as after construction.

        Args:
            params: name → value ``Θ``, the optimizer's names and shapes.
            momentum: name → buffer ``b``, or ``None`` for a fresh optimizer.
            steps_taken: the step count to report; default 0 without momentum, else unchanged.

        Raises:
            ValueError: on differing names or shapes, non-finite values, or a negative
                ``steps_taken``; the state is then left unchanged.
        """
        self._check_like_params(params, "load_state(params)")
        if momentum is not None:
            self._check_like_params(momentum, "load_state(momentum)")
        if steps_taken is not None and steps_taken < 0:
            raise ValueError(f"steps_taken must be >= 0, got {steps_taken}")
        with torch.no_grad():
            for name, p in self._params.items():
                p.copy_(params[name].detach().to(dtype=p.dtype, device=p.device))
        self._opt = self._new_sgd()
        if momentum is not None:
            for name, p in self._params.items():
                buf = momentum[name].detach().to(dtype=p.dtype, device=p.device, copy=True)
                self._opt.state[p]["momentum_buffer"] = buf
        if steps_taken is not None:
            self._steps = int(steps_taken)
        elif momentum is None:
            self._steps = 0


def _check_finite(tensors: Mapping[str, Tensor], what: str) -> None:
    for name, t in tensors.items():
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"{what}: tensor {name!r} has non-finite values (NaN or Inf)")
