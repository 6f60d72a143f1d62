"""Merge math of Decoupled DiLoCo: token weights, anchoring, RDA and the outer step.

Paper §3 and App. D; DESIGN §4.1-4.5, golden values in DESIGN §4.7.

Pure: no I/O, torch only. Every function works on tensors of any floating dtype and does its
arithmetic in the dtype it is given (callers pass float32, the tests float64); weights are plain
Python floats. An *outer gradient* ``Δ`` of a fragment is ``Θ − θ``: the synchronizer's value minus
the learner's value after its inner steps, so a descent step subtracts it.

In place and by chunks: the merge and the outer step write into preallocated buffers
(:data:`CHUNK_ELEMENTS` at a time), anchoring is done on the fly (:class:`AnchoredDelta`), and
the results are bit for bit those of the whole-tensor formulas (same elementwise operations in
the same order; norms stay whole-tensor reductions). ``tests/test_merge_equivalence.py`` checks
this against the previous implementation, ``benchmarks/merge.py`` measures it.

Bad input (mismatched names or shapes, negative or zero total weight, non-finite outer gradients)
raises ``ValueError`` naming the offending value; non-floating tensors raise ``TypeError``.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "token_weight",
    "anchor",
    "AnchoredDelta",
    "check_anchored",
    "MergeWorkspace",
    "weighted_mean",
    "rda",
    "merge_outer_gradients",
    "MERGE_MODES",
    "OuterOptimizer",
    "OuterState",
    "CHUNK_ELEMENTS",
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


#: elements per chunk of the chunked passes (1 MiB of fp32): a multiple of every SIMD width, so
#: each element goes through the same kernel path as in a whole-tensor op (bit-for-bit equal)
CHUNK_ELEMENTS = 1 << 18


def _chunks(numel: int):
    size = CHUNK_ELEMENTS
    for lo in range(0, numel, size):
        yield lo, min(lo + size, numel)


def _flat(t: Tensor) -> Tensor:
    """``t`` as a 1-D tensor in row-major order (a view when contiguous)."""
    return t.reshape(-1)


#: at most this many distinct ``Θ^cur − Θ^base`` (one per base version) are kept per tensor
#: while a merge computes the norms; a round with more bases computes the rest per contribution
MAX_SHARED_DIFFS = 4


class MergeWorkspace:
    """Scratch buffers of one merge, reused by every tensor and by the norm pass and the merge
    (pass one to :func:`check_anchored` and :func:`merge_outer_gradients`): chunk buffers, one
    whole-tensor buffer per dtype and up to :data:`MAX_SHARED_DIFFS` whole-tensor buffers for the
    ``Θ^cur − Θ^base`` of each base version, shared by the contributions on that base (of one
    tensor at a time, or of one chunk at a time). Memory: up to 1 + MAX_SHARED_DIFFS buffers of
    the largest tensor, a few of :data:`CHUNK_ELEMENTS`; freed with the workspace. Not for use by
    two threads at once."""

    def __init__(self) -> None:
        self._chunk: dict[tuple[torch.dtype, int], Tensor] = {}
        self._whole: dict[torch.dtype, Tensor] = {}
        self._diffs_of: str | None = None
        self._diffs: dict[tuple, Tensor] = {}
        self._diff_bufs: dict[tuple[torch.dtype, int], Tensor] = {}
        self._chunk_diffs_at: tuple[str, int] | None = None
        self._chunk_diffs: dict[tuple, Tensor] = {}
        self._chunk_diff_bufs: dict[tuple, Tensor] = {}

    def chunk(self, dtype: torch.dtype, which: int, n: int) -> Tensor:
        buf = self._chunk.get((dtype, which))
        if buf is None or buf.numel() < n:
            buf = self._chunk[(dtype, which)] = torch.empty(max(n, CHUNK_ELEMENTS), dtype=dtype)
        return buf[:n]

    def whole(self, dtype: torch.dtype, shape: tuple[int, ...]) -> Tensor:
        numel = math.prod(shape)
        buf = self._whole.get(dtype)
        if buf is None or buf.numel() < numel:
            self._whole.pop(dtype, None)
            buf = self._whole[dtype] = torch.empty(numel, dtype=dtype)
        return buf[:numel].view(shape)

    def whole_diff(self, name: str, cur: Tensor, base: Tensor, dtype: torch.dtype) -> Tensor | None:
        """``cur − base`` in ``dtype`` (whole tensor), shared while the merge is on ``name``; None
        when :data:`MAX_SHARED_DIFFS` are already kept."""
        if self._diffs_of != name:
            self._diffs_of, self._diffs = name, {}
        key = (id(cur), id(base), dtype)
        diff = self._diffs.get(key)
        if diff is None:
            slot = len(self._diffs)
            if slot >= MAX_SHARED_DIFFS:
                return None
            numel = cur.numel()
            buf = self._diff_bufs.get((dtype, slot))
            if buf is None or buf.numel() < numel:
                self._diff_bufs.pop((dtype, slot), None)
                buf = self._diff_bufs[(dtype, slot)] = torch.empty(numel, dtype=dtype)
            out = buf[:numel].view(cur.shape)
            diff = self._diffs[key] = torch.sub(cur.to(dtype), base.to(dtype), out=out)
        return diff

    def chunk_diff(self, name: str, cur: Tensor, base: Tensor, lo: int, hi: int, dtype: torch.dtype) -> Tensor:
        """``(cur − base)[lo:hi]`` (row-major) in ``dtype``, computed once per chunk and base."""
        if self._chunk_diffs_at != (name, lo):
            self._chunk_diffs_at, self._chunk_diffs = (name, lo), {}
        key = (id(cur), id(base), dtype)
        diff = self._chunk_diffs.get(key)
        if diff is None:
            buf = self._chunk_diff_bufs.get(key)
            if buf is None or buf.numel() < hi - lo:
                buf = self._chunk_diff_bufs[key] = torch.empty(max(hi - lo, CHUNK_ELEMENTS), dtype=dtype)
            c, b = _flat(cur)[lo:hi], _flat(base)[lo:hi]
            diff = self._chunk_diffs[key] = torch.sub(c.to(dtype), b.to(dtype), out=buf[: hi - lo])
        return diff

    def release(self) -> None:
        """Forget the shared differences (their buffers stay for the next tensor): called before
        and after each tensor, so no difference outlives the tensors it was computed from."""
        self._diffs_of, self._diffs = None, {}
        self._chunk_diffs_at, self._chunk_diffs = None, {}


class _Source:
    """One learner's outer gradient of one tensor, read in chunks (a plain tensor or anchored)."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    def slice(self, lo: int, hi: int, ws: MergeWorkspace, dtype: torch.dtype) -> Tensor:
        """Elements ``lo:hi`` (row-major) in ``dtype``; may be a view or a workspace buffer."""
        raise NotImplementedError

    def norm(self, ws: MergeWorkspace, dtype: torch.dtype) -> Tensor:
        """L2 norm over all elements (0-dim, ``dtype``), as ``vector_norm`` of the whole tensor."""
        raise NotImplementedError


class _TensorSource(_Source):
    def __init__(self, t: Tensor) -> None:
        self.t, self.shape, self.dtype = t, tuple(t.shape), t.dtype
        self._flat: Tensor | None = None

    def slice(self, lo: int, hi: int, ws: MergeWorkspace, dtype: torch.dtype) -> Tensor:
        if self._flat is None:
            self._flat = _flat(self.t)
        x = self._flat[lo:hi]
        return x if x.dtype == dtype else x.to(dtype)

    def norm(self, ws: MergeWorkspace, dtype: torch.dtype) -> Tensor:
        return torch.linalg.vector_norm(self.t.to(dtype))


class _AnchoredSource(_Source):
    def __init__(self, owner: AnchoredDelta, name: str) -> None:
        self.owner, self.name = owner, name
        d = owner.delta[name]
        self.shape, self.dtype = tuple(d.shape), d.dtype
        self.on_current = owner.base[name] is owner.current[name]  # Θcur − Θcur = 0: Δ' is Δ
        self._flat: Tensor | None = None

    def slice(self, lo: int, hi: int, ws: MergeWorkspace, dtype: torch.dtype) -> Tensor:
        if self._flat is None:
            self._flat = _flat(self.owner.delta[self.name])
        d = self._flat[lo:hi]
        if self.on_current:
            x = d
        else:
            cur, base = self.owner.current[self.name], self.owner.base[self.name]
            diff = ws.chunk_diff(self.name, cur, base, lo, hi, self.dtype)
            x = torch.add(diff, d, out=ws.chunk(self.dtype, 0, hi - lo))
        return x if x.dtype == dtype else x.to(dtype)

    def whole(self, ws: MergeWorkspace) -> Tensor:
        """All of ``Δ'``: ``Δ`` itself when anchored on the current value, else a scratch buffer."""
        d = self.owner.delta[self.name]
        if self.on_current:
            return d
        cur, base = self.owner.current[self.name], self.owner.base[self.name]
        out = ws.whole(self.dtype, self.shape)
        diff = ws.whole_diff(self.name, cur, base, self.dtype)
        if diff is None:
            return self.owner.write(self.name, out)
        return torch.add(diff, d, out=out)

    def norm(self, ws: MergeWorkspace, dtype: torch.dtype) -> Tensor:
        cached = self.owner._norms.get(self.name)
        if cached is None or cached.dtype != dtype:
            cached = torch.linalg.vector_norm(self.whole(ws).to(dtype))
            if cached.dtype == self.dtype:
                self.owner._norms[self.name] = cached
        return cached

    def non_finite(self, ws: MergeWorkspace) -> int:
        """NaN/Inf elements of ``Δ'``: 0 when its norm is finite, else counted."""
        if bool(torch.isfinite(self.norm(ws, self.dtype))):
            return 0
        return int((~torch.isfinite(self.whole(ws))).sum())


def check_anchored(anchored: Sequence[AnchoredDelta], *,
                   workspace: MergeWorkspace | None = None) -> list[dict[str, int]]:
    """The norms and finite checks of several :class:`AnchoredDelta`, tensor by tensor, sharing
    ``Θ^cur − Θ^base`` among those on the same base (the first pass of an RDA merge).

    Args:
        anchored: the contributions of one round.
        workspace: keyword-only; buffers to use (and keep for the merge), default new ones.

    Returns:
        For each, name → number of NaN/Inf elements of ``Δ'``, for every tensor that has any.
        The norms are kept for :func:`merge_outer_gradients`.
    """
    ws = MergeWorkspace() if workspace is None else workspace
    bad: list[dict[str, int]] = [{} for _ in anchored]
    names: dict[str, None] = {}
    for a in anchored:
        names.update(dict.fromkeys(a.delta))
    for name in names:
        ws.release()
        for i, a in enumerate(anchored):
            if name in a.delta:
                count = _AnchoredSource(a, name).non_finite(ws)
                if count:
                    bad[i][name] = count
        ws.release()
    return bad


class AnchoredDelta:
    """A learner's outer gradient anchored on the current value, computed on demand (DESIGN §4.1).

    Holds references to ``Δ``, ``Θ^cur`` and ``Θ^base`` (never copies them, never writes them) and
    yields ``Δ' = (Θ^cur − Θ^base) + Δ`` chunk by chunk into preallocated buffers, so a merge of M
    contributions never holds M anchored copies. The values are those of :func:`anchor`, bit for
    bit, given finite ``Θ^cur`` and ``Θ^base`` (the synchronizer's values always are): anchored on
    the current value itself (``base[name] is current[name]``), ``Δ'`` is ``Δ`` (``0 + Δ``, equal
    up to the sign of a zero, which no merge result depends on). :func:`merge_outer_gradients`
    accepts it in place of a dict.

    Args:
        delta: the learner's outer gradient ``Δ``, name → tensor (any floating dtype; ``Δ'`` has it).
        current: ``Θ^cur``, the same names and shapes.
        base: ``Θ^base``, the same names and shapes.

    Raises:
        ValueError: if the three dicts do not hold the same names with the same shapes.
    """

    def __init__(self, delta: Mapping[str, Tensor], current: Mapping[str, Tensor],
                 base: Mapping[str, Tensor]) -> None:
        _check_same_keys(delta, current, "anchor(delta, current)")
        _check_same_keys(delta, base, "anchor(delta, base)")
        _check_shapes(delta, current, "anchor(delta, current)")
        _check_shapes(delta, base, "anchor(delta, base)")
        self.delta, self.current, self.base = delta, current, base
        self._norms: dict[str, Tensor] = {}

    def __iter__(self):
        return iter(self.delta)

    def __len__(self) -> int:
        return len(self.delta)

    def write(self, name: str, out: Tensor, lo: int = 0, hi: int | None = None) -> Tensor:
        """Write ``Δ'[name]`` (elements ``lo:hi`` in row-major order, default all) into ``out``,
        exactly as :func:`anchor` computes it.

        Args:
            name: a tensor of the fragment.
            out: a contiguous tensor of ``hi − lo`` elements and the dtype of ``Δ[name]`` (any
                shape: the whole tensor's shape, or 1-D for a slice).

        Returns:
            ``out``, holding the values.
        """
        d = self.delta[name]
        hi = d.numel() if hi is None else hi
        whole = lo == 0 and hi == d.numel() and tuple(out.shape) == tuple(d.shape)
        cur, base, dd = self.current[name], self.base[name], d
        if not whole:
            cur, base, dd = _flat(cur)[lo:hi], _flat(base)[lo:hi], _flat(d)[lo:hi]
        if cur.dtype != d.dtype:
            cur = cur.to(d.dtype)
        if base.dtype != d.dtype:
            base = base.to(d.dtype)
        flat_out = out if whole else out.view(-1)
        torch.sub(cur, base, out=flat_out)
        flat_out.add_(dd)
        return out

    def check(self) -> dict[str, int]:
        """name → number of NaN/Inf elements of ``Δ'``, for every tensor that has any
        (:func:`check_anchored` of this one)."""
        return check_anchored([self])[0]

    def materialize(self) -> dict[str, Tensor]:
        """``Δ'`` as new tensors, name → tensor (what :func:`anchor` returns)."""
        return {name: self.write(name, torch.empty(d.shape, dtype=d.dtype)) for name, d in self.delta.items()}


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
    total = math.fsum(ws)
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
    flat.zero_()
    for lo, hi in _chunks(flat.numel()):
        o = flat[lo:hi]
        for s, p in zip(srcs, probs, strict=True):
            o.add_(s.slice(lo, hi, ws, out.dtype), alpha=p)
    return out


def _rda_into(out: Tensor, srcs: Sequence[_Source], probs: Sequence[float], eps: float, ws: MergeWorkspace) -> Tensor:
    """``out ← RDA`` (``out`` contiguous) in two passes: the norms, then the direction by chunks.

    The per-element operations and their order are those of the previous whole-tensor code: the
    norms are whole-tensor ``vector_norm`` reductions (a chunked sum of squares is a different
    reduction order), ``Δ/‖Δ‖`` and the weighted sums elementwise, learner by learner."""
    dtype = out.dtype
    radial = torch.zeros((), dtype=dtype)
    norms: list[Tensor | None] = []
    for s, p in zip(srcs, probs, strict=True):
        n = s.norm(ws, dtype)
        radial.add_(n, alpha=p)
        norms.append(n if n.item() > 0 else None)
    flat = out.view(-1)
    flat.zero_()
    for lo, hi in _chunks(flat.numel()):
        o = flat[lo:hi]
        unit = ws.chunk(dtype, 1, hi - lo)
        for s, p, n in zip(srcs, probs, norms, strict=True):
            if n is not None:
                torch.div(s.slice(lo, hi, ws, dtype), n, out=unit)
                o.add_(unit, alpha=p)
    dir_norm = torch.linalg.vector_norm(out)
    if dir_norm.item() < eps:
        return _mean_into(out, srcs, probs, ws)
    return out.mul_(radial / dir_norm)


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
) -> dict[str, Tensor]:
    """Merge M learners' outer gradients of one fragment, tensor by tensor (DESIGN §4.4).

    Each tensor is merged with :func:`rda` (``mode="rda"``) or :func:`weighted_mean`
    (``mode="mean"``); names in ``embedding_names`` always use the weighted mean. The values
    are bit for bit those of the whole-tensor formulas; the work is done in place, by chunks.

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

    Returns:
        A dict name → merged tensor (the tensors of ``out`` when given), in the order of the
        first learner's dict. Memory beyond the result: two chunk buffers, and with
        :class:`AnchoredDelta` one buffer of the largest tensor (for its exact norm).

    Raises:
        ValueError: for an unknown mode, no deltas, differing name sets, and the errors of
            :func:`weighted_mean`.
        TypeError: a non-floating outer gradient.
    """
    if mode not in MERGE_MODES:
        raise ValueError(f"unknown merge mode {mode!r}; expected one of {MERGE_MODES}")
    if len(deltas) == 0:
        raise ValueError("cannot merge an empty list of outer gradients")
    if len(deltas) != len(weights):
        raise ValueError(f"{len(deltas)} outer gradients but {len(weights)} weights")
    for i, d in enumerate(deltas[1:], start=1):
        _check_same_keys(d, deltas[0], f"merge_outer_gradients(learner {i} vs learner 0)")
    probs = _probs(len(deltas), weights)
    embeddings = frozenset(embedding_names)
    ws = MergeWorkspace() if workspace is None else workspace
    result = {}
    for name in deltas[0]:
        ws.release()
        srcs = [_AnchoredSource(d, name) if isinstance(d, AnchoredDelta) else _TensorSource(d[name])
                for d in deltas]
        _check_sources(srcs)
        buf = _new_out(srcs[0]) if out is None else out[name]
        if tuple(buf.shape) != srcs[0].shape or buf.dtype != srcs[0].dtype or not buf.is_contiguous():
            raise ValueError(f"out[{name!r}] must be contiguous {srcs[0].dtype} of shape {srcs[0].shape}")
        if mode == "mean" or name in embeddings:
            result[name] = _mean_into(buf, srcs, probs, ws)
        else:
            result[name] = _rda_into(buf, srcs, probs, 1e-12, ws)
        ws.release()
    return result


class OuterOptimizer:
    """The outer Nesterov step of one fragment (DESIGN §4.5), in place and by chunks.

    ``b ← μb + g; Θ ← Θ − η(g + μb)``, bit for bit as ``torch.optim.SGD(lr=η, momentum=μ,
    nesterov=True)`` (the same elementwise operations in the same order); on the first step
    ``b = g``. The optimizer owns its values: float32, or float64 when given float64 (set
    ``dtype`` to force one).

    A step writes the new ``Θ`` and ``b`` into new tensors chunk by chunk, checking ``g`` (and,
    if asked, the result) for NaN/Inf in the same pass; the state is switched only once the
    whole step succeeded, so a bad input leaves it unchanged without any rollback copy. The
    tensors it replaced are never written again: :meth:`step_shared`, :meth:`shared_state`
    hand them out without a copy.

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
            self._params[name] = t.detach().to(dtype=want, copy=True).contiguous()
        self._momentum: dict[str, Tensor] | None = None  # None before the first step: b = g
        self._steps = 0

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
                optimizer's dtype.

        Returns:
            name → the new value ``Θ`` (detached clones).

        Raises:
            ValueError: if names or shapes differ or a value is NaN/Inf; the state is then left
                unchanged.
        """
        return {name: t.clone() for name, t in self.step_shared(outer_grad).items()}

    def step_shared(self, outer_grad: Mapping[str, Tensor], *, require_finite: bool = False,
                    consume: bool = False) -> dict[str, Tensor]:
        """:meth:`step` without the copy: the new ``Θ`` tensors are the optimizer's own.

        They are never written again (the next step writes new tensors), so they may be kept,
        published and read from other threads; the caller must not write to them.

        Args:
            outer_grad: as :meth:`step`.
            require_finite: keyword-only; also refuse a step whose result has NaN/Inf
                (``ValueError`` "non-finite values after the outer step in [names]").
            consume: keyword-only; ``outer_grad``'s tensors are the caller's to give away (e.g.
                a merge's output): each one that is contiguous and of the optimizer's dtype is
                overwritten with the new momentum ``b`` and kept as it, instead of a new tensor.
                The caller must not use them afterwards, even when the step is refused.

        Returns:
            name → the new value ``Θ`` (the optimizer's dtype, contiguous).

        Raises:
            ValueError: as :meth:`step`, and for a non-finite result with ``require_finite``; the
                state is then left unchanged.
        """
        _check_same_keys(outer_grad, self._params, "outer step")
        _check_shapes(outer_grad, self._params, "outer step")
        mu, neg_lr = self._mu, -self._lr
        new_params: dict[str, Tensor] = {}
        new_momentum: dict[str, Tensor] = {}
        not_finite: list[str] = []
        for name, p in self._params.items():
            g = outer_grad[name].detach()
            if g.dtype != p.dtype or g.device != p.device:
                g = g.to(dtype=p.dtype, device=p.device)
            in_place = consume and g.is_contiguous() and g.dtype == p.dtype and g.device == p.device
            g_flat, p_flat = _flat(g), p.view(-1)
            b_flat = None if self._momentum is None else self._momentum[name].view(-1)
            new_p = torch.empty_like(p)
            new_b = g if in_place else torch.empty_like(p)
            np_flat, nb_flat = new_p.view(-1), new_b.view(-1)
            n_tmp = min(CHUNK_ELEMENTS, p.numel())
            g_copy = torch.empty(n_tmp, dtype=p.dtype) if in_place else None
            tmp = torch.empty(n_tmp, dtype=p.dtype)
            finite = True
            for lo, hi in _chunks(p.numel()):
                gc, nb = g_flat[lo:hi], nb_flat[lo:hi]
                # with require_finite, a non-finite g always makes the result non-finite (IEEE: a
                # finite x + y has finite x and y), so g is only looked at when the result is not
                if not require_finite and not _all_finite(gc):
                    raise ValueError(f"outer step: tensor {name!r} has non-finite values (NaN or Inf)")
                if g_copy is not None:  # gc is about to become b: keep g of this chunk
                    gc = g_copy[: hi - lo].copy_(gc)
                if b_flat is None:  # torch's first step: b = g
                    if g_copy is None:
                        nb.copy_(gc)
                else:  # buf.mul_(momentum).add_(grad, alpha=1 - dampening)
                    torch.mul(b_flat[lo:hi], mu, out=nb).add_(gc, alpha=1)
                t = torch.add(gc, nb, alpha=mu, out=tmp[: hi - lo])  # grad.add(buf, alpha=momentum)
                npc = torch.add(p_flat[lo:hi], t, alpha=neg_lr, out=np_flat[lo:hi])  # param.add_(grad, alpha=-lr)
                if require_finite and finite and not _all_finite(npc):
                    if not _all_finite(gc):
                        raise ValueError(f"outer step: tensor {name!r} has non-finite values (NaN or Inf)")
                    finite = False
            if not finite:
                not_finite.append(name)
            new_params[name], new_momentum[name] = new_p, new_b
        if not_finite:
            raise ValueError(f"non-finite values after the outer step in {not_finite}")
        self._params, self._momentum = new_params, new_momentum
        self._steps += 1
        return dict(new_params)

    def params(self) -> dict[str, Tensor]:
        """name → current value ``Θ`` (detached clones, the optimizer's dtype)."""
        return {name: p.clone() for name, p in self._params.items()}

    def momentum(self) -> dict[str, Tensor]:
        """name → momentum buffer ``b`` (detached clones; zeros before the first step)."""
        if self._momentum is None:
            return {name: torch.zeros_like(p) for name, p in self._params.items()}
        return {name: b.clone() for name, b in self._momentum.items()}

    def shared_state(self) -> OuterState:
        """The current state without copies (the tensors are never written again; do not write
        them): for :meth:`restore`, and the momentum to keep or checkpoint."""
        return OuterState(dict(self._params), None if self._momentum is None else dict(self._momentum),
                          self._steps)

    def restore(self, state: OuterState) -> None:
        """Go back to a state of :meth:`shared_state` (no copy, no check: it was this one's)."""
        self._params = dict(state.params)
        self._momentum = None if state.momentum is None else dict(state.momentum)
        self._steps = state.steps_taken

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
            params: name → value ``Θ``, the optimizer's names and shapes (copied).
            momentum: name → buffer ``b`` (copied), or ``None`` for a fresh optimizer.
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
        self._params = {name: params[name].detach().to(dtype=p.dtype, device=p.device, copy=True).contiguous()
                        for name, p in self._params.items()}
        if momentum is not None:
            self._momentum = {name: momentum[name].detach().to(dtype=p.dtype, device=p.device, copy=True)
                              .contiguous() for name, p in self._params.items()}
        else:
            self._momentum = None
        if steps_taken is not None:
            self._steps = int(steps_taken)
        elif momentum is None:
            self._steps = 0


@dataclass(frozen=True)
class OuterState:
    """An :class:`OuterOptimizer`'s state by reference: name → ``Θ``, name → ``b`` (None before
    the first step) and the step count. The tensors are shared and must not be written."""

    params: dict[str, Tensor]
    momentum: dict[str, Tensor] | None
    steps_taken: int


def _all_finite(x: Tensor) -> bool:
    """No NaN/Inf in ``x``: one reduction (a finite sum has finite terms), the exact check only
    when the sum is not finite (it may overflow)."""
    return bool(torch.isfinite(x.sum())) or bool(torch.isfinite(x).all())


def _check_finite(tensors: Mapping[str, Tensor], what: str) -> None:
    for name, t in tensors.items():
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"{what}: tensor {name!r} has non-finite values (NaN or Inf)")
