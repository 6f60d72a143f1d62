"""Merge math of Decoupled DiLoCo: token weights, anchoring, RDA and the outer step.

Paper §3 and App. D; DESIGN §4.1-4.5, golden values in DESIGN §4.7.

Pure: no I/O, torch only. Every function works on tensors of any floating dtype and does its
arithmetic in the dtype it is given (callers pass float32, the tests float64); weights are plain
Python floats. An *outer gradient* ``Δ`` of a fragment is ``Θ − θ``: the synchronizer's value minus
the learner's value after its inner steps, so a descent step subtracts it.

In place and by chunks: the merge and the outer step write into preallocated buffers
(:data:`CHUNK_ELEMENTS` at a time), anchoring is done on the fly (:class:`AnchoredDelta`), and
the results are bit for bit those of the whole-tensor formulas (same elementwise operations in
the same order; norms stay whole-tensor reductions). ``tests/unit/test_merge_equivalence.py`` checks
this against the previous implementation, ``benchmarks/merge.py`` measures it.

Bad input (mismatched names or shapes, negative or zero total weight, non-finite outer gradients)
raises ``ValueError`` naming the offending value; non-floating tensors raise ``TypeError``.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence

import torch
from torch import Tensor

from diloco_async.merge import native as merge_native
from diloco_async.merge.buffers import (
    CHUNK_ELEMENTS,
    MAX_SHARED_DIFFS,
    AnchoredDelta,
    MergeWorkspace,
    _AnchoredSource,
    _check_same_keys,
    _check_shapes,
    _chunks,
    _Source,
    _TensorSource,
    check_anchored,
)
from diloco_async.merge.outer_optimizers import (
    OUTER_OPTIMIZERS,
    DelayedNesterovOuterOptimizer,
    SgdOuterOptimizer,
    make_outer_optimizer,
)
from diloco_async.merge.outer_step import OuterOptimizer, OuterState

__all__ = [
    "token_weight",
    "anchor",
    "AnchoredDelta",
    "check_anchored",
    "merge_and_step",
    "AnchoredNotFinite",
    "MergeWorkspace",
    "weighted_mean",
    "rda",
    "merge_outer_gradients",
    "MERGE_MODES",
    "OuterOptimizer",
    "OuterState",
    "OUTER_OPTIMIZERS",
    "SgdOuterOptimizer",
    "DelayedNesterovOuterOptimizer",
    "make_outer_optimizer",
    "CHUNK_ELEMENTS",
    "MAX_SHARED_DIFFS",
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


def anchor(
    delta: dict[str, Tensor], current: dict[str, Tensor], base: dict[str, Tensor]
) -> dict[str, Tensor]:
    """Re-anchor a learner's outer gradient on the synchronizer's current value (DESIGN §4.1).

    ``Δ' = Θ^cur − θ = (Θ^cur − Θ^base) + Δ`` per tensor, where ``Δ = Θ^base − θ`` is what the
    learner sent against the version ``base`` it started from. :class:`AnchoredDelta` gives the
    same values without materialising them.

    Args:
        delta: the learner's outer gradient ``Δ``, name → tensor.
        current: the synchronizer's current fragment value ``Θ^cur``, same names and shapes.
        base: the fragment value ``Θ^base`` the learner started from, same names and shapes.

    Returns:
        A new dict, name → ``Δ'`` (same shapes, the dtype of ``delta``), in the order of ``delta``.

    Raises:
        ValueError: if the three dicts do not hold the same names with the same shapes.
    """
    return AnchoredDelta(delta, current, base).materialize()


def _probs(n: int, weights: Sequence[float]) -> list[float]:
    """Validate ``weights`` for ``n`` outer gradients and return ``w / Σw`` (Python floats)."""
    if n == 0:
        raise ValueError("cannot merge an empty list of outer gradients")
    if n != len(weights):
        raise ValueError(f"{n} outer gradients but {len(weights)} weights")
    ws = [float(w) for w in weights]
    for i, w in enumerate(ws):
        if not math.isfinite(w) or w < 0:
            raise ValueError(f"weight {i} must be finite and >= 0, got {w}")
    try:
        total = math.fsum(ws)
    except OverflowError:  # each finite, their sum past the largest float
        raise ValueError(f"total weight overflows a float, from weights {ws}") from None
    if total <= 0:
        raise ValueError(f"total weight must be > 0, got {total} from weights {ws}")
    return [w / total for w in ws]


def _check_sources(srcs: Sequence[_Source]) -> None:
    shape = srcs[0].shape
    for i, s in enumerate(srcs):
        if not s.dtype.is_floating_point:
            raise TypeError(f"outer gradient {i} must be a floating tensor, got dtype {s.dtype}")
        if s.shape != shape:
            raise ValueError(f"outer gradient {i} has shape {s.shape}, expected {shape}")


def _mean_into(out: Tensor, srcs: Sequence[_Source], probs: Sequence[float], ws: MergeWorkspace) -> Tensor:
    """``out ← Σ p·Δ`` (``out`` contiguous), chunk by chunk in learner order."""
    flat = out.view(-1)
    parts = _fused_parts(flat, srcs)
    if parts is not None:  # the same operations in one pass (DESIGN §4.5c)
        xs, curs, bases = zip(*parts, strict=True)
        merge_native.accumulate(flat, xs, curs, bases, None, probs)
        return out
    for lo, hi in _chunks(flat.numel()):
        o = flat[lo:hi].zero_()  # by chunk: the chunk is then summed into while in the cache
        for s, p in zip(srcs, probs, strict=True):
            o.add_(s.slice(lo, hi, ws, out.dtype), alpha=p)
    return out


def _fused_parts(flat: Tensor, srcs: Sequence[_Source]) -> list[tuple] | None:
    """Each source's (x, cur, base) for :func:`merge_native.accumulate`, or None when the fused
    kernels cannot replace the chunk loops here (:func:`merge_native.usable`)."""
    if not merge_native.usable(flat):
        return None
    parts = [s.fused_parts() for s in srcs]
    if any(p is None for p in parts) or not all(merge_native.usable(*p, out=flat) for p in parts):
        return None
    return parts


def _direction_into(flat: Tensor, srcs: Sequence[_Source], probs: Sequence[float], norms: Sequence[Tensor | None],
                    ws: MergeWorkspace) -> Tensor:
    """``flat ← Σ p·Δ/‖Δ‖`` over the sources with a norm, chunk by chunk in learner order (or in
    one fused pass, the same operations: DESIGN §4.5c); returns ``‖flat‖`` (0-dim,
    ``torch.linalg.vector_norm``'s value, from the fused pass where it can give it)."""
    parts = _fused_parts(flat, srcs)
    if parts is not None:
        live = [(part, p, n.item()) for part, p, n in zip(parts, probs, norms, strict=True) if n is not None]
        xs, curs, bases = ([part[k] for part, _, _ in live] for k in range(3))
        _, norm = merge_native.accumulate(flat, xs, curs, bases, [n for _, _, n in live], [p for _, p, _ in live],
                                          want_norm=True)
        return torch.linalg.vector_norm(flat) if norm is None else norm
    dtype = flat.dtype
    for lo, hi in _chunks(flat.numel()):
        o = flat[lo:hi].zero_()
        unit = ws.chunk(dtype, 1, hi - lo)
        for s, p, n in zip(srcs, probs, norms, strict=True):
            if n is not None:
                torch.div(s.slice(lo, hi, ws, dtype), n, out=unit)
                o.add_(unit, alpha=p)
    return torch.linalg.vector_norm(flat)


def _rda_into(out: Tensor, srcs: Sequence[_Source], probs: Sequence[float], eps: float, ws: MergeWorkspace,
              deferred: dict[str, Tensor] | None = None, name: str = "") -> Tensor:
    """``out ← RDA`` (``out`` contiguous) in two passes: the norms, then the direction by chunks.

    The per-element operations and their order are those of the previous whole-tensor code: the
    norms are whole-tensor ``vector_norm`` reductions (a chunked sum of squares is a different
    reduction order), ``Δ/‖Δ‖`` and the weighted sums elementwise, learner by learner. With
    ``deferred``, the final ``out.mul_(scale)`` is left to the caller: ``deferred[name] = scale``."""
    dtype = out.dtype
    radial = torch.zeros((), dtype=dtype)
    norms: list[Tensor | None] = []
    for s, p in zip(srcs, probs, strict=True):
        n = s.norm(ws, dtype)
        radial.add_(n, alpha=p)
        norms.append(n if n.item() > 0 else None)
    dir_norm = _direction_into(out.view(-1), srcs, probs, norms, ws)
    if dir_norm.item() < eps:
        return _mean_into(out, srcs, probs, ws)
    scale = radial / dir_norm
    if deferred is not None:
        deferred[name] = scale
        return out
    return out.mul_(scale)


def _check_out(buf: Tensor, like: _Source, name: str) -> Tensor:
    if tuple(buf.shape) != like.shape or buf.dtype != like.dtype or not buf.is_contiguous():
        raise ValueError(f"out[{name!r}] must be contiguous {like.dtype} of shape {like.shape}")
    return buf


def _new_out(like: _Source) -> Tensor:
    return torch.empty(like.shape, dtype=like.dtype)


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
    probs = _probs(len(deltas), weights)
    srcs = [_TensorSource(d) for d in deltas]
    _check_sources(srcs)
    return _mean_into(_new_out(srcs[0]), srcs, probs, MergeWorkspace())


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
        A new tensor of the common shape (computed in place, by chunks; memory: the result and
        two chunk buffers).

    Raises:
        ValueError, TypeError: as :func:`weighted_mean`.
    """
    probs = _probs(len(deltas), weights)
    srcs = [_TensorSource(d) for d in deltas]
    _check_sources(srcs)
    return _rda_into(_new_out(srcs[0]), srcs, probs, eps, MergeWorkspace())


def merge_outer_gradients(
    deltas: Sequence[Mapping[str, Tensor] | AnchoredDelta],
    weights: Sequence[float],
    mode: str = "rda",
    embedding_names: Collection[str] = (),
    *,
    out: Mapping[str, Tensor] | None = None,
    workspace: MergeWorkspace | None = None,
    deferred_scales: dict[str, Tensor] | None = None,
    names: Collection[str] | None = None,
) -> dict[str, Tensor]:
    """Merge M learners' outer gradients of one fragment, tensor by tensor (DESIGN §4.4).

    Each tensor is merged with :func:`rda` (``mode="rda"``) or :func:`weighted_mean`
    (``mode="mean"``); names in ``embedding_names`` always use the weighted mean. Bit for bit the
    whole-tensor formulas, computed in place, by chunks.

    Args:
        deltas: M dicts name → outer gradient, all with the same names (anchored, DESIGN §4.1),
            or :class:`AnchoredDelta` (anchored on the fly, never materialised).
        weights: M weights, one per learner.
        mode: ``"rda"`` or ``"mean"``.
        embedding_names: tensors merged with the weighted mean whatever the mode; names that are
            not in the fragment are ignored.
        out: keyword-only; name → contiguous tensor of each result's shape and dtype (the first
            learner's dtype) to write into, e.g. reused buffers. Default: new tensors.
        workspace: keyword-only; scratch buffers (:class:`MergeWorkspace`), default new ones.
        deferred_scales: keyword-only; if given, RDA results skip their last step, ``·s`` with
            ``s = ‖mean‖/‖direction‖`` (0-dim), and ``s`` is put here by name: the merged value is
            ``result[name] * s`` (``OuterOptimizer.step_shared(grad_scales=...)`` applies it).
        names: keyword-only; merge only these tensors (default all; ``out`` needs only them).

    Returns:
        A dict name → merged tensor (``out``'s when given), in the first learner's order.

    Raises:
        ValueError: an unknown mode, no deltas, differing name sets, errors of :func:`weighted_mean`.
        TypeError: a non-floating outer gradient.
    """
    if mode not in MERGE_MODES:
        raise ValueError(f"unknown merge mode {mode!r}; expected one of {MERGE_MODES}")
    probs = _probs(len(deltas), weights)  # an empty list, a length mismatch or bad weights, first
    for i, d in enumerate(deltas[1:], start=1):
        _check_same_keys(d, deltas[0], f"merge_outer_gradients(learner {i} vs learner 0)")
    embeddings = frozenset(embedding_names)
    ws = MergeWorkspace() if workspace is None else workspace
    result = {}
    for name in deltas[0] if names is None else [n for n in deltas[0] if n in names]:
        ws.release()
        srcs = [_AnchoredSource(d, name) if isinstance(d, AnchoredDelta) else _TensorSource(d[name])
                for d in deltas]
        _check_sources(srcs)
        buf = _new_out(srcs[0]) if out is None else _check_out(out[name], srcs[0], name)
        mean = mode == "mean" or name in embeddings
        result[name] = (_mean_into(buf, srcs, probs, ws) if mean
                        else _rda_into(buf, srcs, probs, 1e-12, ws, deferred_scales, name))
        ws.release()
    return result


class AnchoredNotFinite(ValueError):
    """:func:`merge_and_step` found NaN/Inf in an anchored outer gradient. ``bad`` has, for each
    contribution, name → NaN/Inf elements of the tensor checked (as :func:`check_anchored`)."""

    def __init__(self, bad: list[dict[str, int]]) -> None:
        super().__init__(f"non-finite anchored outer gradients: {bad}")
        self.bad = bad


def merge_and_step(optimizer: OuterOptimizer, anchored: Sequence[AnchoredDelta], weights: Sequence[float],
                   mode: str = "rda", embedding_names: Collection[str] = (), *,
                   workspace: MergeWorkspace | None = None) -> dict[str, Tensor]:
    """Check, merge and step one tensor at a time (DESIGN §4.5a): for each tensor of the fragment,
    the norms and finite checks of every ``Δ'`` (:func:`check_anchored`), its merge
    (:func:`merge_outer_gradients`, into the optimizer's pool, RDA's last product deferred) and its
    outer step (``optimizer.step_shared_from``, finite result required, ``g`` kept as the
    momentum), one right after the other, so that the tensor's ``Δ'`` and ``g`` are still in the
    cache when they are read again. Bit for bit ``check_anchored`` of all, then
    ``merge_outer_gradients(deferred_scales=s)``, then ``step_shared(g, require_finite=True,
    consume=True, grad_scales=s)``.

    Args:
        optimizer: the fragment's outer optimizer (its tensors' names and shapes).
        anchored: M contributions, each with the optimizer's names and shapes.
        weights, mode, embedding_names: as :func:`merge_outer_gradients`.
        workspace: keyword-only; scratch buffers, default new ones.

    Returns:
        name → the new value ``Θ`` (the optimizer's own tensors, as ``step_shared``).

    Raises:
        AnchoredNotFinite: a ``Δ'`` with NaN/Inf (found before the optimizer changes).
        ValueError: no contributions, bad weights (negative, non-finite, a zero or overflowing
            total, not one per contribution), an unknown mode, names or shapes that are not the
            optimizer's; and as ``step_shared``.
        TypeError: a contribution that is not an :class:`AnchoredDelta`, or a non-floating
            outer gradient. On any error the optimizer is left unchanged.
    """
    if mode not in MERGE_MODES:
        raise ValueError(f"unknown merge mode {mode!r}; expected one of {MERGE_MODES}")
    _probs(len(anchored), weights)  # an empty list, a length mismatch or bad weights: before any work
    ws = MergeWorkspace() if workspace is None else workspace
    params = optimizer.shared_state().params
    for i, a in enumerate(anchored):
        if not isinstance(a, AnchoredDelta):
            raise TypeError(f"contribution {i} must be an AnchoredDelta, got {type(a).__name__}")
        _check_same_keys(a, params, "merge_and_step(contribution vs optimizer)")
        _check_shapes(a.delta, params, "merge_and_step(contribution vs optimizer)")
        for name, t in a.delta.items():
            if not t.dtype.is_floating_point:
                raise TypeError(f"contribution {i}: outer gradient {name!r} must be a floating tensor, got {t.dtype}")
    out = optimizer.empty_like_params()  # from the pool: no fresh pages once warm

    def grad_of(name: str) -> tuple[Tensor, Tensor | None]:
        bad = check_anchored(anchored, workspace=ws, names=(name,))
        if any(bad):
            raise AnchoredNotFinite(bad)
        buf = out[name] if out[name].dtype == anchored[0].delta[name].dtype else None
        scales: dict[str, Tensor] = {}
        g = merge_outer_gradients(anchored, weights, mode, embedding_names, out=None if buf is None else {name: buf},
                                  workspace=ws, deferred_scales=scales, names=(name,))
        return g[name], scales.get(name)

    return optimizer.step_shared_from(grad_of, require_finite=True, consume=True)
