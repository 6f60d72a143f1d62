"""Blockwise absmax quantization of the ``int8``/``int4``/``int2`` wire codecs (DESIGN §6).

Part of :mod:`diloco_async.codec.wire` (import it from there; the layout is in its docstring). Pure:
torch only. Written for speed at the same bits (issue 17, item 4): each full-size step is one
torch kernel over a whole chunk, in place on a buffer this module owns where it can, so that a
round trip makes as few passes over memory as its arithmetic needs:

* encode: ``|x|`` into a scratch chunk (as int32 bits), the per-block ``amax`` of it, ``M + x / scale`` into the
  same scratch in one ``addcdiv`` (the rounding, see :data:`_ROUNDING_MAGIC`), the narrowing
  copy of its low bytes to int8 (four float passes);
* decode: the widening copy of the int8 values into the float32 output and one in-place
  multiply by the block scales (two float passes).

The bits are those of tests/codec_reference.py (a division, not a multiplication by the
reciprocal; round half to even; a short last block zero-padded for its absmax).
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

__all__ = ["quantize", "dequantize", "scale_blocks"]

#: elements quantized per step (a whole number of blocks): bounds the float32 scratch at 4 MiB
CHUNK_ELEMS = 1 << 20
_FLOAT32_TINY = torch.finfo(torch.float32).tiny
#: ``M = 1.5 · 2²³``: for ``|v| < 2²²``, ``fl(v + M) = M + round(v)`` (round half to even: the float
#: grid there is the integers), and its bits as an int32 are ``0x4B400000 + round(v)``, so their
#: low byte is ``round(v)`` as an int8 for ``|round(v)| ≤ 127``
_ROUNDING_MAGIC = 1.5 * 2.0**23


@functools.lru_cache(maxsize=8)
def _magic_row(block_size: int) -> Tensor:
    """``(1, block_size)`` float32 of :data:`_ROUNDING_MAGIC` (read only, shared)."""
    return torch.full((1, block_size), _ROUNDING_MAGIC, dtype=torch.float32)


def _divisors(scale: Tensor) -> tuple[Tensor, bool]:
    """Block scales → (the divisors: the scales with 0 replaced by 1, careful).

    ``careful`` is True when a divisor is subnormal or not finite (NaN/Inf input): only then can
    ``|x / divisor|`` pass ``qmax·(1 + 2⁻²³)`` or be NaN, so only then are the clamp and the NaN
    cleaning needed. One ``aminmax`` over the scales decides it; the ``where`` that replaces
    zeros runs only when a block is all zeros (or NaN)."""
    if scale.numel() == 0:
        return scale, False
    lo, hi = (float(v) for v in torch.aminmax(scale))
    safe = scale
    if not lo > 0:  # a zero scale (or NaN, which fails every comparison)
        safe = torch.where(scale == 0, 1.0, scale)
        lo, hi = (float(v) for v in torch.aminmax(safe))
    return safe, not (lo >= _FLOAT32_TINY and hi < math.inf)


def _block_absmax(blocks: Tensor, steps: list[tuple[int, int]], scratch: Tensor, scale: Tensor,
                  exact_nan: bool = False) -> None:
    """``scale[k] = amax(|blocks[k]|)`` for the full blocks ``(nfull, B)``, step by step in ``scratch``.

    On the bits: with the sign bit cleared, the int32 order of float32 bits is the order of the
    magnitudes (``+0`` lowest, ``+Inf`` above every finite value, NaNs above ``+Inf``), and an int32
    ``amax`` is much cheaper than a float one (no NaN propagation). A block holding a NaN gets a
    NaN either way, but which NaN payload could differ when a block holds several: with
    ``exact_nan`` the float ``amax`` of ``|x|`` (the reference's) is used instead."""
    if exact_nan:
        for r0, r1 in steps:
            torch.amax(torch.abs(blocks[r0:r1], out=scratch[: r1 - r0]), dim=1, out=scale[r0:r1])
        return
    bits, work, amax = blocks.view(torch.int32), scratch.view(torch.int32), scale.view(torch.int32)
    if len(steps) == 1:  # the whole tensors: each slice would be one more dispatch
        torch.amax(torch.bitwise_and(bits, 0x7FFFFFFF, out=work), dim=1, out=amax)
        return
    for r0, r1 in steps:
        torch.amax(torch.bitwise_and(bits[r0:r1], 0x7FFFFFFF, out=work[: r1 - r0]), dim=1, out=amax[r0:r1])


def _round_rows(rows: Tensor, divisors: Tensor, out: Tensor, work: Tensor, qmax: int, careful: bool) -> None:
    """``out = round(rows / divisors)`` (int8, half to even) for rows ``(r, B)`` and ``divisors``
    ``(r, 1)``, through the float32 ``work`` ``(r, B)``."""
    if careful:  # NaN/Inf blocks carry a non-finite scale, subnormal ones can overflow qmax
        torch.div(rows, divisors, out=work)
        work.round_().clamp_(-qmax, qmax).nan_to_num_(nan=0.0)
        out.copy_(work)
    else:  # M + x / scale in one kernel: its low byte is round(x / scale)
        torch.addcdiv(_magic_row(rows.shape[1]), rows, divisors, out=work)
        out.copy_(work.view(torch.int32))


def quantize(x: Tensor, qmax: int, block_size: int, pad_multiple: int = 1) -> tuple[Tensor, Tensor]:
    """Flattened ``x`` → (int8 values in ``[-qmax, qmax]``, shape ``(m,)`` with ``m`` = ``n``
    rounded up to a multiple of ``pad_multiple``, zeros after the first ``n``; float32 scales,
    shape ``(ceil(n / block_size),)``).

    ``x`` may have any shape, floating dtype and device (it is read as float32 on the CPU). Works
    over whole blocks, about :data:`CHUNK_ELEMS` elements per step, so that the float32 scratch
    stays small; only a short last block is copied (zero-padded). A tensor of one step is worked
    on whole (the per-call overhead of slicing is a few percent of a round trip, issue 17)."""
    flat = x.detach().reshape(-1)
    if flat.device.type != "cpu" or flat.dtype != torch.float32:
        flat = flat.to(device="cpu", dtype=torch.float32)
    n, bs = flat.numel(), block_size
    nfull, tail = divmod(n, bs)
    blocks = (flat[: nfull * bs] if tail else flat).view(nfull, bs)
    rows_per_step = max(1, CHUNK_ELEMS // bs)
    steps = [(r0, min(r0 + rows_per_step, nfull)) for r0 in range(0, nfull, rows_per_step)]
    scale = torch.empty(nfull + (1 if tail else 0), dtype=torch.float32)
    scale_full = scale[:nfull] if tail else scale
    scratch = torch.empty(max(1, min(rows_per_step, nfull)), bs, dtype=torch.float32)
    _block_absmax(blocks, steps, scratch, scale_full)
    last = None
    if tail:
        last = torch.zeros(1, bs, dtype=torch.float32)
        last[0, :tail] = flat[nfull * bs:]
        torch.amax(last.abs(), dim=1, out=scale[nfull:])
    scale.div_(qmax)
    safe, careful = _divisors(scale)
    if careful and nfull and bool(scale_full.isnan().any()):  # NaN blocks: the reference's payload
        _block_absmax(blocks, steps, scratch, scale_full, exact_nan=True)
        scale_full.div_(qmax)
        safe, careful = _divisors(scale)
    padded = -(-n // pad_multiple) * pad_multiple
    q = torch.empty(padded, dtype=torch.int8)
    if padded > n:
        q[n:] = 0
    q_rows = (q[: nfull * bs] if padded > nfull * bs else q).view(nfull, bs)
    divisors = safe[:, None]
    if len(steps) == 1:
        _round_rows(blocks, divisors[:nfull] if tail else divisors, q_rows, scratch, qmax, careful)
    else:
        for r0, r1 in steps:
            _round_rows(blocks[r0:r1], divisors[r0:r1], q_rows[r0:r1], scratch[: r1 - r0], qmax, careful)
    if last is not None:
        q_last = torch.empty(1, bs, dtype=torch.int8)
        _round_rows(last, divisors[nfull:], q_last, scratch[:1], qmax, careful)
        q[nfull * bs: n] = q_last[0, :tail]
    return q, scale


def dequantize(q: Tensor, scale: Tensor, n: int, block_size: int, out: Tensor | None = None) -> Tensor:
    """int8 values (at least ``n``; the first ``n`` are used) and float32 scales → float32
    ``(n,)``: ``float(q) * scale``, converted into the output (``out``, float32 ``(n,)``, or a new
    tensor), then scaled in place."""
    if out is None:
        out = torch.empty(n, dtype=torch.float32)
    out.copy_(q if q.numel() == n else q[:n])
    return scale_blocks(out, scale, n, block_size)


def scale_blocks(values: Tensor, scale: Tensor, n: int, block_size: int) -> Tensor:
    """``values[i] *= scale[i // block_size]`` in place for float32 ``values`` ``(n,)`` (the
    unscaled levels) and float32 ``scale`` (at least ``ceil(n / block_size)``); returns ``values``."""
    nfull = n // block_size
    head = nfull * block_size
    if n == head:  # whole blocks: no slices (each is a dispatch of its own)
        values.view(nfull, block_size).mul_((scale if scale.numel() == nfull else scale[:nfull]).unsqueeze(1))
        return values
    if nfull:
        values[:head].view(nfull, block_size).mul_(scale[:nfull, None])
    values[head:].mul_(scale[nfull])
    return values
