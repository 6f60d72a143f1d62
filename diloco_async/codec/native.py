"""The int8/int4/int2 codecs in one pass each way, in C (``codec_kernels.c``; DESIGN §6).

Part of :mod:`diloco_async.codec.wire` (which calls these first and runs its torch code when they
return None). The C code computes the same bits as the torch code: the same float32 divisions
and multiplications, round half to even, the same packing. It is used when the kernels are built
(:mod:`diloco_async.kernels.build`, once per process; ``DILOCO_NATIVE=0`` turns it off) and the
input is a contiguous float32 CPU tensor. A tensor with a NaN, an Inf or a subnormal block scale
goes to the torch code, which treats those blocks as the reference does.
"""

from __future__ import annotations

import ctypes
import math
from pathlib import Path

import torch
from torch import Tensor

from diloco_async.kernels import build as native_build

__all__ = ["SOURCE", "quantize_packed", "dequantize_packed", "available"]

#: the C source of these kernels, shipped in the package
SOURCE = Path(native_build.__file__).with_name("codec_kernels.c")
_P, _I64, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
_lib: list = []  # [the typed library or None], set on first use
_BITS = {127: 8, 7: 4, 1: 2}  # qmax → bits per value on the wire


def _typed() -> ctypes.CDLL | None:
    if _lib:
        return _lib[0]
    lib = native_build.kernels(SOURCE)
    if lib is not None:
        lib.dl_quantize.argtypes = [_P, _I64, _I64, _I32, _I32, _P, _P, _P]
        lib.dl_quantize.restype = _I32
        lib.dl_dequantize.argtypes = [_P, _I64, _I64, _I32, _P, _P]
        lib.dl_dequantize.restype = None
    _lib.append(lib)
    return lib


def available() -> bool:
    """Whether the C kernels are built and loaded (building them on the first call)."""
    return _typed() is not None


def reset() -> None:
    """Forget the kernels (tests: the next call loads them again, reading the environment)."""
    _lib.clear()


def packed_numel(n: int, qmax: int) -> int:
    """Bytes on the wire of ``n`` values with levels ``[-qmax, qmax]`` (int8: n, int4: ceil(n/2),
    int2: ceil(n/4))."""
    return -(-n * _BITS[qmax] // 8)


def quantize_packed(x: Tensor, qmax: int, block_size: int) -> tuple[Tensor, Tensor] | None:
    """``x`` (read flattened) → (the wire's values: int8 ``(n,)`` for qmax 127, else uint8 packed
    ``(ceil(n·bits/8),)``; float32 scales ``(ceil(n / block_size),)``), or None when the torch
    code must run instead (no kernels, not a contiguous float32 CPU tensor, or a NaN, Inf or
    subnormal scale). ``qmax``: 127, 7 or 1."""
    lib = _typed()
    if lib is None or x.dtype != torch.float32 or x.device.type != "cpu" or not x.is_contiguous():
        return None
    n = x.numel()
    bits = _BITS[qmax]
    scale = torch.empty(math.ceil(n / block_size), dtype=torch.float32)
    out = torch.empty(packed_numel(n, qmax), dtype=torch.int8 if bits == 8 else torch.uint8)
    scratch = out if bits == 8 else torch.empty(n, dtype=torch.int8)  # the levels before packing
    if n and lib.dl_quantize(x.data_ptr(), n, block_size, qmax, bits, scale.data_ptr(), out.data_ptr(),
                             scratch.data_ptr()):
        return None
    return out, scale


def dequantize_packed(packed: Tensor, n: int, qmax: int, block_size: int, scale: Tensor, out: Tensor) -> bool:
    """Decode the wire's values (as :func:`quantize_packed` makes them: ``packed`` contiguous,
    int8 or uint8 of the right length; ``scale`` contiguous float32 ``(ceil(n / block_size),)``)
    into float32 ``out`` ``(n,)``; False (nothing written) when the kernels are unavailable."""
    lib = _typed()
    if lib is None or not (packed.is_contiguous() and scale.is_contiguous() and out.is_contiguous()):
        return False
    if packed.numel() != packed_numel(n, qmax) or scale.numel() != math.ceil(n / block_size) \
            or scale.dtype != torch.float32 or out.dtype != torch.float32 or out.numel() != n:
        raise ValueError(f"dequantize_packed: {packed.numel()} bytes, {scale.numel()} scales and {out.numel()} "
                         f"outputs do not fit n={n}, qmax={qmax}, block_size={block_size}")
    if n:
        lib.dl_dequantize(packed.data_ptr(), n, block_size, _BITS[qmax], scale.data_ptr(), out.data_ptr())
    return True
