"""Packing of the ``int2`` wire codec (DESIGN §6): four 2-bit values per byte.

Part of :mod:`diloco_async.codec.wire` (import it from there). Pure: torch only.

Levels: ``int2`` is the blockwise absmax scheme of ``int8``/``int4`` with ``q = 1``, i.e. the
symmetric ternary levels ``{-1, 0, +1}·scale_k``. Of the four 2-bit codes only three are used
(two's complement ``0b11 = -1``, ``0b00 = 0``, ``0b01 = +1``; ``0b10 = -2`` is never written).
Why ternary and not four levels: (1) zero stays exact, so blocks of zeros, padding and small
entries cost no bias; (2) it is symmetric, so the rounding error has zero mean for symmetric
inputs, where an asymmetric grid (``{-2, -1, 0, 1}``) would bias every block towards one sign;
(3) it is the same formula and the same decoder as int8/int4, so the same contract (round trip
error at most ``scale_k / 2 = absmax_k / 2``, non-finite values stay non-finite) holds unchanged.
A four-level grid without zero (``{±0.5, ±1.5}·s``) would buy a finer grid at the price of
losing exact zeros and the shared code path; the paper's int2 row (a collapse) is about 2 bits
on the wire, which both give.
"""

from __future__ import annotations

import functools
import sys

import torch
from torch import Tensor

__all__ = ["pack_int2", "unpack_int2", "unpack_int2_levels", "int2_packed_numel"]

#: the fast paths view four int8 values as one 32-bit word, element ``4i`` in its low byte; on a
#: big-endian host strided byte views give the same bytes
_LITTLE_ENDIAN = sys.byteorder == "little"


def int2_packed_numel(n: int) -> int:
    """Bytes of ``n`` packed int2 values: ``ceil(n / 4)``."""
    return (n + 3) // 4


#: ``w · _FOLD`` gathers the four 2-bit codes of a word ``w`` (code ``j`` in bits ``8j..8j+1``)
#: into its top byte: code ``j`` shifted by ``24 - 6j`` lands in bits ``24 + 2j``; the other
#: partial products land in disjoint fields below bit 24 (no carries) or fall off above bit 31
_FOLD = (1 << 24) | (1 << 18) | (1 << 12) | (1 << 6)


def pack_int2(q: Tensor, consume: bool = False) -> Tensor:
    """int8 values in ``[-1, 1]``, shape ``(n,)`` → uint8, shape ``(ceil(n/4),)``.

    Element ``4i + j`` goes to bits ``2j..2j+1`` of byte ``i`` (two's complement, low bits
    first); a short last byte is padded with zero codes. Vectorised: on a little-endian host the
    four values of a byte are one 32-bit word (element ``4i + j`` in its byte ``j``), masked to
    the codes and folded by one multiplication (:data:`_FOLD`); elsewhere strided byte views give
    the same bytes more slowly. With ``consume`` (``q`` owned by the caller, its length a multiple
    of 4, not used again) the words are worked on in place."""
    n = q.numel()
    pad = (-n) % 4
    flat = q.reshape(-1)
    if pad:
        flat, consume = torch.cat([flat, flat.new_zeros(pad)]), True
    if not _LITTLE_ENDIAN:
        quads = flat.view(torch.uint8).view(-1, 4) & 0x3  # -1 -> 0b11, 0 -> 0b00, 1 -> 0b01
        packed = quads[:, 0].clone()
        for j in (1, 2, 3):
            packed |= quads[:, j] << (2 * j)
        return packed
    word = flat.view(torch.int32)
    if consume:
        word &= 0x03030303
    else:
        word = word & 0x03030303
    word *= _FOLD  # wraps modulo 2**32, as the fold needs
    word >>= 24  # -128..127: the packed byte, sign-extended
    return word.to(torch.int8).view(torch.uint8)


def unpack_int2(packed: Tensor, n: int, scratch: Tensor | None = None) -> Tensor:
    """Inverse of :func:`pack_int2`: uint8 ``(ceil(n/4),)`` → int8 values, shape ``(n,)``; each
    code ``c`` is sign-extended as ``(c ^ 2) - 2`` (``0b10``, never written, reads as -2).
    ``scratch``: optional memory of at least ``ceil(n/4)`` int32 for the shifted copies (e.g.
    the decoded output's, which is written only after this returns)."""
    flat = packed.reshape(-1)
    if not _LITTLE_ENDIAN:
        b = flat.view(torch.int8)
        out = torch.empty(b.numel(), 4, dtype=torch.int8)
        for j in range(4):  # code j to the top of the byte, then back down, sign-extended
            torch.bitwise_left_shift(b, 6 - 2 * j, out=out[:, j])
            out[:, j] >>= 6
        return out.reshape(-1)[:n]
    word = flat.to(torch.int32)  # 0..255
    if scratch is None:
        spread = word << 6
    else:
        spread = torch.bitwise_left_shift(word, 6, out=scratch.view(torch.int32)[: word.numel()])
    word |= spread  # byte 1 holds code 1 in its low bits (junk above)
    torch.bitwise_left_shift(word, 12, out=spread)
    word |= spread  # bytes 2 and 3 hold codes 2 and 3 in their low bits
    word &= 0x03030303
    word ^= 0x02020202
    q = word.view(torch.int8)  # byte j of word i: element 4i + j
    q -= 2
    return q if q.numel() == n else q[:n]


@functools.lru_cache(maxsize=1)
def _levels_table() -> tuple[Tensor, Tensor]:
    """The float32 levels of every packed byte: ``(256, 4)``, row ``b`` holding its four values
    (code ``j`` of ``b`` as ``(c ^ 2) - 2``), and the same memory as ``(256,)`` complex128, one
    16-byte element per row (read only, shared)."""
    byte = torch.arange(256, dtype=torch.int32)
    rows = torch.stack([(((byte >> (2 * j)) & 3) ^ 2) - 2 for j in range(4)], dim=1).to(torch.float32)
    rows = rows.contiguous()
    return rows, rows.view(torch.complex128).reshape(256)


def unpack_int2_levels(packed: Tensor, n: int, out: Tensor | None = None) -> Tensor:
    """:func:`unpack_int2` straight to float32: uint8 ``(ceil(n/4),)`` → float32 ``(n,)`` (into
    ``out``, float32 ``(n,)``, if given), the same values as ``unpack_int2(packed, n).float()``.

    Each byte's four values are one row of a 256-row table, copied as one 16-byte element
    (``index_select`` on its complex128 view: the bits are moved, never computed on, so they
    are exactly the float32 levels whatever the host's byte order). One pass over the packed
    bytes and one over the output, where the arithmetic unpacking takes eight over int32 words
    and a widening copy (issue 17, item 4)."""
    flat = packed.reshape(-1)
    if out is None:
        out = torch.empty(n, dtype=torch.float32)
    rows, wide = _levels_table()
    whole = n // 4
    if whole:
        torch.index_select(wide, 0, flat[:whole].to(torch.int32), out=out[: 4 * whole].view(torch.complex128))
    if n > 4 * whole:  # a short last byte
        out[4 * whole:] = rows[int(flat[whole]), : n - 4 * whole]
    return out
