"""A frozen copy of the int8/int4 quantization of ``diloco_async/codec/wire.py`` as it was before
issue 17 vectorised it (main at 98fee35): the reference that tests/unit/test_codec_equivalence.py
compares the fast code with, bit for bit. Do not edit; it is the old format's definition."""

from __future__ import annotations

import math

import torch
from torch import Tensor

QMAX = {"int8": 127, "int4": 7}


def quantize(x: Tensor, qmax: int, block_size: int) -> tuple[Tensor, Tensor]:
    flat = x.detach().reshape(-1).to(device="cpu", dtype=torch.float32)
    n = flat.numel()
    nblocks = math.ceil(n / block_size)
    padded = torch.zeros(nblocks * block_size, dtype=torch.float32)
    padded[:n] = flat
    blocks = padded.view(nblocks, block_size)
    scale = blocks.abs().amax(dim=1) / qmax
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    q = torch.round(blocks / safe[:, None]).clamp_(-qmax, qmax)
    q = torch.nan_to_num(q, nan=0.0)
    return q.reshape(-1)[:n].to(torch.int8), scale.contiguous()


def dequantize(q: Tensor, scale: Tensor, n: int, block_size: int) -> Tensor:
    nblocks = scale.numel()
    padded = torch.zeros(nblocks * block_size, dtype=torch.float32)
    padded[:n] = q.to(torch.float32)
    return (padded.view(nblocks, block_size) * scale[:, None]).reshape(-1)[:n]


def pack_int4(q: Tensor) -> Tensor:
    n = q.numel()
    nib = q.to(torch.int16) & 0xF
    if n % 2:
        nib = torch.cat([nib, torch.zeros(1, dtype=torch.int16)])
    pairs = nib.view(-1, 2)
    return (pairs[:, 0] | (pairs[:, 1] << 4)).to(torch.uint8)


def unpack_int4(packed: Tensor, n: int) -> Tensor:
    b = packed.to(torch.int16)
    nib = torch.stack([b & 0xF, b >> 4], dim=1).reshape(-1)[:n]
    return torch.where(nib >= 8, nib - 16, nib)


def encode_one(x: Tensor, codec: str, block_size: int) -> dict[str, Tensor]:
    """``{"": values, "::scale": scales}`` of one tensor, as the old ``encode`` wrote them."""
    q, scale = quantize(x, QMAX[codec], block_size)
    return {"": pack_int4(q) if codec == "int4" else q, "::scale": scale}


def decode_one(values: Tensor, scale: Tensor, codec: str, shape: tuple[int, ...], block_size: int) -> Tensor:
    n = math.prod(shape)
    q = values.reshape(-1) if codec == "int8" else unpack_int4(values.reshape(-1), n)
    return dequantize(q, scale.reshape(-1), n, block_size).reshape(shape)
