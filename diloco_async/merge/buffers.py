"""Buffers of the in-place merge: anchoring on the fly, chunking, the shared scratch space.

Part of :mod:`diloco_async.merge.core` (DESIGN §4.1, §4.5a): :class:`AnchoredDelta` yields a learner's
anchored outer gradient ``Δ' = (Θ^cur − Θ^base) + Δ`` chunk by chunk without materialising it,
:func:`check_anchored` computes the norms and finite checks of a round in one pass per tensor,
and :class:`MergeWorkspace` holds the scratch buffers that the passes reuse. Pure: torch only.

Bit-for-bit equality with whole-tensor code rests on two facts: elementwise operations give the
same bits per element whatever the chunking (chunks are :data:`CHUNK_ELEMENTS` long, a multiple
of every SIMD width), and norms are never computed by chunks (a chunked sum of squares is a
different reduction order), always as ``vector_norm`` of the whole tensor.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence

import torch
from torch import Tensor

from diloco_async.merge import native as merge_native
from diloco_async.merge.buffer_pool import BufferPool

__all__ = ["CHUNK_ELEMENTS", "MAX_SHARED_DIFFS", "MergeWorkspace", "AnchoredDelta", "check_anchored"]


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
    two threads at once.

    Args:
        pool: where its buffers come from (:class:`~diloco_async.merge.buffer_pool.BufferPool`, e.g. the
            fragment's, so that the next merge reuses them without fresh pages); default
            ``torch.empty``.
        keep_bytes: bytes of anchored ``Δ'`` that :func:`check_anchored` may keep whole (in the
            :class:`AnchoredDelta`, freed with it) so that the merge reads them instead of
            anchoring again; default 0 (none kept).
    """

    def __init__(self, pool: BufferPool | None = None, keep_bytes: int = 0) -> None:
        self._pool = pool
        self._keep_bytes = keep_bytes
        self._sharing: dict[tuple[int, int], int] = {}  # (id Θcur, id Θbase) → contributions, this tensor
        self._chunk: dict[tuple[torch.dtype, int], Tensor] = {}
        self._whole: dict[torch.dtype, Tensor] = {}
        self._diffs_of: str | None = None
        self._diffs: dict[tuple, Tensor] = {}
        self._diff_bufs: dict[tuple[torch.dtype, int], Tensor] = {}
        self._chunk_diffs_at: tuple[str, int] | None = None
        self._chunk_diffs: dict[tuple, Tensor] = {}
        self._chunk_diff_bufs: dict[tuple, Tensor] = {}

    def _new(self, numel: int, dtype: torch.dtype) -> Tensor:
        return torch.empty(numel, dtype=dtype) if self._pool is None else self._pool.empty((numel,), dtype)

    def keep(self, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor | None:
        """A new whole buffer for a kept ``Δ'`` while the ``keep_bytes`` budget lasts, else None."""
        numel = math.prod(shape)
        nbytes = numel * dtype.itemsize
        if nbytes > self._keep_bytes:
            return None
        self._keep_bytes -= nbytes
        return self._new(numel, dtype).view(shape)

    def sharing(self, cur: Tensor, base: Tensor) -> int:
        """Contributions of the current tensor anchored on ``base`` (as set by
        :func:`check_anchored`; 2 when unknown, so the difference is shared)."""
        return self._sharing.get((id(cur), id(base)), 2)

    def chunk(self, dtype: torch.dtype, which: int, n: int) -> Tensor:
        buf = self._chunk.get((dtype, which))
        if buf is None or buf.numel() < n:
            buf = self._chunk[(dtype, which)] = self._new(max(n, CHUNK_ELEMENTS), dtype)
        return buf[:n]

    def whole(self, dtype: torch.dtype, shape: tuple[int, ...]) -> Tensor:
        numel = math.prod(shape)
        buf = self._whole.get(dtype)
        if buf is None or buf.numel() < numel:
            self._whole.pop(dtype, None)
            buf = self._whole[dtype] = self._new(numel, dtype)
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
                buf = self._diff_bufs[(dtype, slot)] = self._new(numel, dtype)
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
                buf = self._chunk_diff_bufs[key] = self._new(max(hi - lo, CHUNK_ELEMENTS), dtype)
            c, b = _flat(cur)[lo:hi], _flat(base)[lo:hi]
            diff = self._chunk_diffs[key] = torch.sub(c.to(dtype), b.to(dtype), out=buf[: hi - lo])
        return diff

    def release(self) -> None:
        """Forget the shared differences (their buffers stay for the next tensor): called before
        and after each tensor, so no difference outlives the tensors it was computed from."""
        self._diffs_of, self._diffs = None, {}
        self._chunk_diffs_at, self._chunk_diffs = None, {}
        self._sharing = {}


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

    def fused_parts(self) -> tuple[Tensor, Tensor | None, Tensor | None] | None:
        """1-D views (x, cur, base) with all of it ``(cur − base) + x`` (cur and base None: ``x``
        itself) for the fused kernels, or None when a tensor is not contiguous."""
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

    def fused_parts(self) -> tuple[Tensor, None, None] | None:
        return (self.t.view(-1), None, None) if self.t.is_contiguous() else None


class _AnchoredSource(_Source):
    def __init__(self, owner: AnchoredDelta, name: str) -> None:
        self.owner, self.name = owner, name
        d = owner.delta[name]
        self.shape, self.dtype = tuple(d.shape), d.dtype
        self.on_current = owner.base[name] is owner.current[name]  # Θcur − Θcur = 0: Δ' is Δ
        self._flat: Tensor | None = None

    def slice(self, lo: int, hi: int, ws: MergeWorkspace, dtype: torch.dtype) -> Tensor:
        kept = self.owner._kept.get(self.name)
        if self._flat is None:
            self._flat = _flat(self.owner.delta[self.name] if kept is None else kept)
        d = self._flat[lo:hi]
        if self.on_current or kept is not None:  # Δ itself, or Δ' kept whole by check_anchored
            x = d
        else:
            cur, base = self.owner.current[self.name], self.owner.base[self.name]
            diff = ws.chunk_diff(self.name, cur, base, lo, hi, self.dtype)
            x = torch.add(diff, d, out=ws.chunk(self.dtype, 0, hi - lo))
        return x if x.dtype == dtype else x.to(dtype)

    def fused_parts(self) -> tuple[Tensor, Tensor | None, Tensor | None] | None:
        kept = self.owner._kept.get(self.name)
        d = self.owner.delta[self.name] if kept is None else kept
        whole = (d,) if self.on_current or kept is not None else (d, self.owner.current[self.name],
                                                                  self.owner.base[self.name])
        if not all(t.is_contiguous() for t in whole):
            return None
        return whole[0].view(-1), *(t.view(-1) for t in whole[1:]), *(None,) * (3 - len(whole))

    def whole(self, ws: MergeWorkspace, *, want_norm: bool = False) -> Tensor:
        """All of ``Δ'``: ``Δ`` itself when anchored on the current value, else a scratch buffer.
        With ``want_norm``, a norm the fused kernel computed as it wrote ``Δ'`` is kept as
        :meth:`norm`'s (``torch.linalg.vector_norm``'s bits, :func:`merge_native.norm_lanes`)."""
        d = self.owner.delta[self.name]
        if self.on_current:
            return d
        kept = self.owner._kept.get(self.name)
        if kept is not None:
            return kept
        cur, base = self.owner.current[self.name], self.owner.base[self.name]
        out = ws.keep(self.shape, self.dtype)
        if out is not None:
            self.owner._kept[self.name] = out
        else:
            out = ws.whole(self.dtype, self.shape)
        if merge_native.usable(cur, base, d, out=out):  # one fused pass, the same operations (DESIGN §4.5c)
            if not want_norm:
                return merge_native.anchor_into(out, cur, base, d)
            out, norm = merge_native.anchor_into(out, cur, base, d, want_norm=True)
            if norm is not None:
                self.owner._norms[self.name] = norm
            return out
        if ws.sharing(cur, base) <= 1:  # alone on its base: Θcur − Θbase by chunks, in the cache
            d_flat, out_flat = _flat(d), out.view(-1)
            for lo, hi in _chunks(d.numel()):
                torch.add(ws.chunk_diff(self.name, cur, base, lo, hi, self.dtype), d_flat[lo:hi], out=out_flat[lo:hi])
            return out
        diff = ws.whole_diff(self.name, cur, base, self.dtype)
        if diff is None:
            return self.owner.write(self.name, out)
        return torch.add(diff, d, out=out)

    def norm(self, ws: MergeWorkspace, dtype: torch.dtype) -> Tensor:
        cached = self.owner._norms.get(self.name)
        if cached is None or cached.dtype != dtype:
            x = self.whole(ws, want_norm=dtype == self.dtype)
            cached = self.owner._norms.get(self.name)  # computed as Δ' was written, if it could be
            if cached is None or cached.dtype != dtype:
                cached = torch.linalg.vector_norm(x.to(dtype))
            if cached.dtype == self.dtype:
                self.owner._norms[self.name] = cached
        return cached

    def non_finite(self, ws: MergeWorkspace) -> int:
        """NaN/Inf elements of ``Δ'``: 0 when its norm is finite, else counted."""
        if math.isfinite(self.norm(ws, self.dtype).item()):
            return 0
        return int((~torch.isfinite(self.whole(ws))).sum())


def check_anchored(anchored: Sequence[AnchoredDelta], *, workspace: MergeWorkspace | None = None,
                   names: Collection[str] | None = None) -> list[dict[str, int]]:
    """The norms and finite checks of several :class:`AnchoredDelta`, tensor by tensor, sharing
    ``Θ^cur − Θ^base`` among those on the same base (the first pass of an RDA merge).

    Args:
        anchored: the contributions of one round.
        workspace: keyword-only; buffers to use (and keep for the merge), default new ones.
        names: keyword-only; only these tensors (default all of them).

    Returns:
        For each, name → number of NaN/Inf elements of ``Δ'``, for every tensor that has any.
        The norms are kept for :func:`merge_outer_gradients`.
    """
    ws = MergeWorkspace() if workspace is None else workspace
    bad: list[dict[str, int]] = [{} for _ in anchored]
    names_of: dict[str, None] = {}
    for a in anchored:
        names_of.update(dict.fromkeys(a.delta))
    for name in names_of if names is None else [n for n in names_of if n in names]:
        ws.release()
        for a in anchored:
            if name in a.delta:
                key = (id(a.current[name]), id(a.base[name]))
                ws._sharing[key] = ws._sharing.get(key, 0) + 1
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
        norms: keyword-only; name → ``torch.linalg.vector_norm(Δ[name])`` (0-dim, Δ's dtype) where
            already known, e.g. from the contribution's verification: used as the norm of ``Δ'``
            where ``Δ'`` is ``Δ`` (anchored on the current value), so the merge does not read
            ``Δ`` once more for it; ignored elsewhere. They must be exactly that value.

    Raises:
        ValueError: if the three dicts do not hold the same names with the same shapes.
    """

    def __init__(self, delta: Mapping[str, Tensor], current: Mapping[str, Tensor],
                 base: Mapping[str, Tensor], *, norms: Mapping[str, Tensor] | None = None) -> None:
        _check_same_keys(delta, current, "anchor(delta, current)")
        _check_same_keys(delta, base, "anchor(delta, base)")
        _check_shapes(delta, current, "anchor(delta, current)")
        _check_shapes(delta, base, "anchor(delta, base)")
        self.delta, self.current, self.base = delta, current, base
        self._norms: dict[str, Tensor] = {
            n: v for n, v in (norms or {}).items()
            if n in delta and base[n] is current[n] and v.dim() == 0 and v.dtype == delta[n].dtype}
        self._kept: dict[str, Tensor] = {}  # name → Δ' kept whole by check_anchored (read only)

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
        if merge_native.usable(cur, base, dd, out=flat_out):  # one fused pass, the same operations
            merge_native.anchor_into(flat_out, cur, base, dd)
            return out
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


def _all_finite(x: Tensor) -> bool:
    """No NaN/Inf in ``x``: one reduction (a finite sum has finite terms), the exact check only
    when the sum is not finite (it may overflow)."""
    return bool(torch.isfinite(x.sum())) or bool(torch.isfinite(x).all())


def _check_finite(tensors: Mapping[str, Tensor], what: str) -> None:
    for name, t in tensors.items():
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"{what}: tensor {name!r} has non-finite values (NaN or Inf)")
