"""The vectorised int8/int4 codecs write the same bytes and decode to the same values, bit for
bit, as the frozen pre-issue-17 implementation in tests/codec_reference.py (issue 17, item 4)."""

from __future__ import annotations

import json
import math
import struct

import pytest
import safetensors.torch
import torch

from diloco_async.codec import int2 as codec_int2
from diloco_async.codec import wire as codec
from tests import codec_reference as ref

BLOCK_SIZES = [1, 2, 3, 5, 64, 1000]
SIZES = [1, 2, 3, 63, 64, 65, 127, 1000, 4097, (1 << 18) + 1, 2 * (1 << 18) + 77]  # several cache steps


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _header(data: bytes) -> dict:
    (nbytes,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + nbytes])


def _body_nbytes(data: bytes) -> int:
    (nbytes,) = struct.unpack("<Q", data[:8])
    return len(data) - 8 - nbytes


def _cases(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = {f"randn{n}": torch.randn(n, generator=gen) * 10 ** float(torch.randint(-6, 6, (1,), generator=gen))
           for n in SIZES}
    special = torch.randn(700, generator=gen)
    special[:64] = 0.0  # a block of zeros: scale 0
    special[64:128] = -0.0  # negative zero
    special[128:140] = torch.tensor([3.0e38, -3.4e38, 1e-45, -1e-45, 1e-40, 7.0, -7.0, 0.5, -0.5, 2.5, -2.5, 1.5])
    special[200:210] = 1e-42  # subnormal block maxima
    special[300] = float("nan")
    special[400] = float("inf")
    special[401] = float("-inf")
    special[500], special[501] = float("inf"), float("-inf")
    out["special"] = special
    out["subnormal"] = torch.randn(300, generator=gen) * 1e-40  # subnormal scales alone: the careful path
    out["tiny"] = torch.randn(300, generator=gen) * 1e-37  # normal maxima, subnormal maxima / qmax
    out["halves"] = torch.arange(-70, 71, dtype=torch.float32) / 2  # ties: round half to even
    out["matrix"] = torch.randn(37, 19, generator=gen)
    out["bf16_input"] = torch.randn(333, generator=gen).to(torch.bfloat16)
    out["scalar"] = torch.tensor(-2.0)
    return out


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("little_endian", [True, False])
def test_same_bytes_and_values_as_the_reference(kind, block_size, little_endian, monkeypatch):
    monkeypatch.setattr(codec, "_LITTLE_ENDIAN", little_endian)
    tensors = _cases(block_size)
    meta = {"codec": kind, "block_size": str(block_size)}
    expected: dict[str, torch.Tensor] = {}
    for name, x in tensors.items():
        one = ref.encode_one(x, kind, block_size)
        expected[name], expected[name + codec.SCALE_SUFFIX] = one[""], one["::scale"]
    data = codec.encode_to_bytes(tensors, kind, block_size=block_size)
    want = safetensors.torch.save(expected, metadata=meta)
    # safetensors writes the metadata keys in a random order (a Rust HashMap), old code and new
    # alike: the header is compared as JSON, the tensor bytes after it byte for byte
    assert _header(data) == _header(want)
    assert len(data) == len(want) and data[-_body_nbytes(want):] == want[-_body_nbytes(want):]

    specs = {name: tuple(x.shape) for name, x in tensors.items()}
    decoded, _ = codec.decode_from_bytes(data, kind, specs)
    for name, shape in specs.items():
        want = ref.decode_one(expected[name], expected[name + codec.SCALE_SUFFIX], kind, shape, block_size)
        got = decoded[name]
        assert got.dtype == torch.float32 and tuple(got.shape) == shape and got.is_contiguous()
        assert _bits(got) == _bits(want), name


@pytest.mark.parametrize("n", [0, 1, 2, 7, 8, 1001])
def test_int4_pack_and_unpack_every_level(n):
    levels = torch.arange(-7, 8, dtype=torch.int8)
    q = levels.repeat(math.ceil(n / 15) if n else 0)[:n]
    for little_endian in (True, False):
        codec._LITTLE_ENDIAN = little_endian
        try:
            packed = codec._pack_int4(q)
            assert packed.dtype == torch.uint8 and torch.equal(packed, ref.pack_int4(q))
            assert torch.equal(codec._unpack_int4(packed, n), ref.unpack_int4(packed, n).to(torch.int8))
        finally:
            codec._LITTLE_ENDIAN = True


@pytest.mark.parametrize("n", [0, 1, 3, 4, 5, 8, 1001])
@pytest.mark.parametrize("little_endian", [True, False])
def test_int2_pack_and_unpack_every_level(n, little_endian, monkeypatch):
    """int2 has no frozen reference (it is new): each byte is checked against the layout spelled out
    value by value (element 4i + j in bits 2j..2j+1, two's complement)."""
    monkeypatch.setattr(codec_int2, "_LITTLE_ENDIAN", little_endian)
    q = torch.tensor([-1, 0, 1], dtype=torch.int8).repeat(math.ceil(n / 3) if n else 0)[:n]
    packed = codec.pack_int2(q)
    assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(n / 4)
    want = [sum((int(q[4 * i + j]) & 3) << (2 * j) for j in range(4) if 4 * i + j < n) for i in range(packed.numel())]
    assert packed.tolist() == want
    assert torch.equal(codec.unpack_int2(packed, n), q)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_int2_uses_the_shared_quantizer_with_qmax_one(block_size):
    """int2 = the int8/int4 quantizer (frozen reference) at qmax 1, packed four to a byte."""
    for name, x in _cases(block_size).items():
        q_ref, scale_ref = ref.quantize(x, 1, block_size)
        enc = codec.encode({name: x}, "int2", block_size)
        assert _bits(enc[name + codec.SCALE_SUFFIX]) == _bits(scale_ref), name
        assert torch.equal(codec.unpack_int2(enc[name], x.numel()), q_ref), name
        got = codec.decode(enc, "int2", {name: tuple(x.shape)}, block_size)[name]
        want = ref.dequantize(q_ref, scale_ref, x.numel(), block_size).reshape(x.shape)
        assert _bits(got) == _bits(want), name
