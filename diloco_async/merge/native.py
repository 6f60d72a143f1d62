"""Fused float32 passes of the merge in C (DESIGN §4.5c), with the conditions for using them.

Part of :mod:`diloco_async.merge.core`. Each function here computes exactly what the torch code beside
its call computes (the same float32 operations in the same order, ``merge_kernels.c``), in one
pass over memory instead of one per torch op. They are used only when :func:`usable` says so:
the kernels are built (:mod:`diloco_async.kernels.build`, the only I/O, once per process), torch
runs its AVX2 or AVX512 kernels (whose rounding the C code matches: fused multiply-adds where
torch uses them) and every tensor is a contiguous float32 CPU tensor; otherwise the callers run
their torch code. Pure apart from that one-time build.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from diloco_async.kernels import build as native_build

__all__ = ["usable", "norm_lanes", "accumulate", "anchor_into", "outer_step", "NesterovSettings", "STEP_OK",
           "STEP_BAD_GRAD", "STEP_NOT_FINITE"]

#: torch CPU capabilities whose elementwise kernels round as the C code does
CAPABILITIES = ("AVX2", "AVX512")
STEP_OK, STEP_BAD_GRAD, STEP_NOT_FINITE = 0, 1, 2

_F, _P, _I64, _I32 = ctypes.c_float, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
_FP = ctypes.POINTER(_P)
_lib: list = []  # [the typed library or None], set on first use
_lanes: list[int] = []  # [torch's norm lanes as checked, or 0], set on first use
#: torch's Vectorized<float> width by CPU capability: the lanes of its float32 2-norm
NORM_LANES = {"AVX2": 8, "AVX512": 16}
#: threads per kernel call; None: torch's (``torch.get_num_threads()``)
THREADS: int | None = None


def _threads() -> int:
    return torch.get_num_threads() if THREADS is None else THREADS


def _typed() -> ctypes.CDLL | None:
    if _lib:
        return _lib[0]
    lib = None
    if torch.backends.cpu.get_cpu_capability() in CAPABILITIES:
        lib = native_build.kernels()
    if lib is not None:
        lib.dl_accumulate.argtypes = [_P, _I64, _I32, _FP, _FP, _FP, ctypes.POINTER(_F), ctypes.POINTER(_F), _I32, _I32,
                                      _I32, ctypes.POINTER(_F)]
        lib.dl_accumulate.restype = None
        lib.dl_anchor.argtypes = [_P, _I64, _P, _P, _P, _I32, _I32, ctypes.POINTER(_F)]
        lib.dl_anchor.restype = None
        lib.dl_outer_step.argtypes = [_P, _P, _I64, _I64, _P, _P, _P, _F, _I32, _F, _F, _I32, _I32]
        lib.dl_outer_step.restype = _I32
    _lib.append(lib)
    return lib


def reset() -> None:
    """Forget the kernels (tests: the next call loads them again, reading the environment)."""
    _lib.clear()
    _lanes.clear()
    native_build.reset()


def usable(*tensors: Tensor | None, out: Tensor | None = None) -> bool:
    """Whether the fused kernels may replace the torch code on these tensors (None entries are
    ignored): built, torch on AVX2/AVX512, each a contiguous float32 CPU tensor, and ``out`` (if
    given, also checked so) not overlapping any of them."""
    if (_lib[0] if _lib else _typed()) is None:
        return False
    f32 = torch.float32
    for t in tensors:
        if t is not None and not (t.dtype is f32 and t.is_cpu and t.is_contiguous()):
            return False
    if out is None:
        return True
    return out.dtype is f32 and out.is_cpu and out.is_contiguous() and not _overlaps(out, tensors)


def norm_lanes() -> int:
    """The lanes of torch's float32 2-norm (``linalg.vector_norm``) that the kernels reproduce,
    so that :func:`anchor_into` and :func:`accumulate` can give it in the pass that writes their
    output: 8 with AVX2, 16 or 8 with AVX512 (whichever torch's norm turns out to fold, checked
    once per process: the kernels' norm must be torch's, bit for bit, on random tensors of several
    sizes); 0 (not reproduced: the callers use torch's) when the kernels are not usable, no
    width passes the check, or torch runs more than one thread (the norm is then taken outside
    the kernels, which may split their work)."""
    if _threads() != 1:
        return 0
    if not _lanes:
        _lanes.append(_checked_lanes())
    return _lanes[0]


def _checked_lanes() -> int:
    """The first lane count, of the CPU capability's width then the other widths of
    :data:`NORM_LANES`, whose kernel norm is torch's bit for bit on random tensors of several
    sizes; 0 when none is. Torch does not always reduce at its capability's width: on an AMD EPYC
    that torch reports as AVX512, its float32 2-norm folds 8 lanes, not 16."""
    if not usable():
        return 0
    own = NORM_LANES.get(torch.backends.cpu.get_cpu_capability(), 0)
    if not own:
        return 0
    lib = _typed()
    for lanes in dict.fromkeys([own, *sorted(NORM_LANES.values(), reverse=True)]):
        gen = torch.Generator().manual_seed(20261203)
        for n in (lanes, 37 * lanes, 8192 + 5 * lanes, 3 * 8192 + 61 * lanes):
            x = torch.randn(n, generator=gen).mul_(3.0)
            out, norm = torch.empty(n), _F()
            zero = torch.zeros(n)
            lib.dl_anchor(out.data_ptr(), n, x.data_ptr(), zero.data_ptr(), zero.data_ptr(), 1, lanes,
                          ctypes.byref(norm))
            if norm.value != torch.linalg.vector_norm(out).item():
                break
        else:
            return lanes
    return 0


def _overlaps(out: Tensor, others: Sequence[Tensor | None]) -> bool:
    lo = out.data_ptr()
    hi = lo + 4 * out.numel()
    for t in others:
        if t is not None:
            start = t.data_ptr()
            if start < hi and lo < start + 4 * t.numel():
                return True
    return False


def accumulate(out: Tensor, xs: Sequence[Tensor], curs: Sequence[Tensor | None], bases: Sequence[Tensor | None],
               norms: Sequence[float] | None, probs: Sequence[float], *, want_norm: bool = False
               ) -> Tensor | tuple[Tensor, Tensor | None]:
    """``out ← Σ_j p_j · (x'_j / n_j)`` element by element in learner order, from ``out = 0``, with
    ``x'_j = (cur_j − base_j) + x_j`` where ``cur_j`` is given, else ``x_j``; without ``norms``,
    no division (the weighted mean). As ``o.zero_(); o.add_(x' / n, alpha=p)`` per learner.

    Args:
        out: contiguous float32, ``numel`` N, not overlapping any input.
        xs, curs, bases: M float32 tensors of N elements each (``curs``/``bases`` entries None for
            a plain outer gradient).
        norms: M positive float32 norms (0-dim values as Python floats), or None.
        probs: M weights ``w/Σw``.

        want_norm: keyword-only; also return ``out``'s float32 2-norm as ``linalg.vector_norm``
            gives it, computed in the same pass where :func:`norm_lanes` allows (else None).

    Returns:
        ``out``; with ``want_norm``, ``(out, norm)`` (a 0-dim float32 tensor or None).

    Raises:
        ValueError: an input not usable (:func:`usable`), of another size, or overlapping ``out``.
    """
    m, n = len(xs), out.numel()
    items = [*xs, *curs, *bases]
    if not usable(out, *items) or any(t is not None and t.numel() != n for t in items) or _overlaps(out, items):
        raise ValueError("accumulate needs contiguous float32 CPU tensors of one size, out apart from the inputs")
    ptrs = (_P * m)(*(x.data_ptr() for x in xs))
    cptrs = (_P * m)(*(None if c is None else c.data_ptr() for c in curs))
    bptrs = (_P * m)(*(None if b is None else b.data_ptr() for b in bases))
    fn = (_F * m)(*(norms if norms is not None else [1.0] * m))
    fp = (_F * m)(*probs)
    lanes = _lanes_for(n) if want_norm else 0
    norm = torch.empty((), dtype=torch.float32) if lanes else None  # written by the kernel
    _typed().dl_accumulate(out.data_ptr(), n, m, ptrs, cptrs, bptrs, fn, fp, int(norms is not None),
                           _threads(), lanes, _float_ptr(norm))
    return (out, norm) if want_norm else out


def _float_ptr(t: Tensor | None):
    return ctypes.cast(t.data_ptr() if t is not None else None, ctypes.POINTER(_F))


def _lanes_for(n: int) -> int:
    lanes = norm_lanes()
    return lanes if lanes and n % lanes == 0 else 0


def anchor_into(out: Tensor, cur: Tensor, base: Tensor, delta: Tensor, *, want_norm: bool = False
                ) -> Tensor | tuple[Tensor, Tensor | None]:
    """``out ← (cur − base) + delta`` (float32, N elements each, ``out`` apart from the inputs);
    with ``want_norm``, ``(out, norm)``: ``out``'s 2-norm as :func:`accumulate` gives it."""
    n = out.numel()
    if not usable(out, cur, base, delta) or {cur.numel(), base.numel(), delta.numel()} != {n} or _overlaps(
            out, [cur, base, delta]):
        raise ValueError("anchor_into needs contiguous float32 CPU tensors of one size, out apart from the inputs")
    lanes = _lanes_for(n) if want_norm else 0
    norm = torch.empty((), dtype=torch.float32) if lanes else None  # written by the kernel
    _typed().dl_anchor(out.data_ptr(), n, cur.data_ptr(), base.data_ptr(), delta.data_ptr(), _threads(), lanes,
                       _float_ptr(norm))
    return (out, norm) if want_norm else out


@dataclass(frozen=True)
class NesterovSettings:
    """The scalars of one fused outer step: momentum ``mu``, ``neg_lr`` (−η), whether a non-finite
    result is reported (``require_finite``), and the chunk length in elements."""

    mu: float
    neg_lr: float
    require_finite: bool
    chunk: int


def outer_step(new_p: Tensor, new_b: Tensor, p: Tensor, b: Tensor, g: Tensor, scale: Tensor | None,
               step: NesterovSettings) -> int:
    """One tensor's Nesterov step with momentum (``step``: μ, −η, the finite check), by chunks of
    ``step.chunk`` elements:
    ``gc = g·scale`` (or ``g``), ``nb = b·μ + gc``, ``new_p = p + (−η)·(gc + μ·nb)`` as torch rounds
    them (``OuterOptimizer._step_tensor``); ``new_b`` may be ``g`` itself.

    Returns:
        :data:`STEP_OK`; :data:`STEP_BAD_GRAD` where the torch code raises for a non-finite ``g``;
        :data:`STEP_NOT_FINITE` for a non-finite result (only with ``require_finite``).

    Raises:
        ValueError: a tensor not usable, sizes that differ, or ``new_p`` overlapping an input.
        MemoryError: no memory for the per-chunk flags (a few bytes per chunk).
    """
    n = p.numel()
    if not usable(new_p, new_b, p, b, g, scale) or {new_b.numel(), b.numel(), g.numel(), new_p.numel()} != {n} or (
            _overlaps(new_p, [new_b, p, b, g]) or _overlaps(new_b, [p, b]) or (
            new_b.data_ptr() != g.data_ptr() and _overlaps(new_b, [g]))):
        raise ValueError("outer_step needs contiguous float32 CPU tensors of one size, outputs apart from inputs")
    s = 1.0 if scale is None else float(scale.item())
    status = _typed().dl_outer_step(new_p.data_ptr(), new_b.data_ptr(), n, step.chunk, p.data_ptr(), b.data_ptr(),
                                  g.data_ptr(), s, int(scale is not None), step.mu, step.neg_lr,
                                  int(step.require_finite), _threads())
    if status < 0:
        raise MemoryError(f"outer_step: no memory for the finite flags of {n} elements")
    return status
