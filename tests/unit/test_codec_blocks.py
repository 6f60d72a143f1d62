"""The fast paths of diloco_async/codec/blocks.py give the frozen reference's bits (issue 17, item 4)
where they are most likely to drift: the int32 absmax with several NaN payloads in one block, and
the rounding by ``M + x / scale`` at every tie of the int8 range."""

from __future__ import annotations

import pytest
import torch

from diloco_async.codec import blocks as codec_blocks
from tests import codec_reference as ref


def _bits(t: torch.Tensor) -> list[int]:
    return t.contiguous().reshape(-1).view(torch.int32 if t.dtype == torch.float32 else torch.uint8).tolist()


@pytest.mark.parametrize("qmax", [127, 7, 1])
@pytest.mark.parametrize("block_size", [4, 64])
def test_nan_payloads_and_signs_give_the_reference_scales(qmax, block_size):
    gen = torch.Generator().manual_seed(qmax + block_size)
    x = torch.randn(block_size * 6 + 3, generator=gen)
    bits = x.view(torch.int32)
    # several NaN payloads (quiet, signalling, negative) in one block; NaN after Inf; -0.0 blocks
    bits[1], bits[2], bits[3] = 0x7FC00001, 0x7F800001, -0x003FFF00  # 0xFFC00100
    bits[block_size + 1], bits[block_size + 2] = 0x7F800000, 0x7FFFFFFF  # +Inf, then a NaN
    bits[2 * block_size: 3 * block_size] = torch.iinfo(torch.int32).min  # -0.0
    x[3 * block_size + 1] = float("-inf")
    bits[6 * block_size + 1] = 0x7FC0ABCD  # in the short last block
    q, scale = codec_blocks.quantize(x, qmax, block_size)
    q_ref, scale_ref = ref.quantize(x, qmax, block_size)
    assert _bits(scale) == _bits(scale_ref)
    assert torch.equal(q, q_ref)


def test_every_tie_of_the_int8_range_rounds_half_to_even():
    # scale exactly 1 (absmax 127 = qmax): x / scale is x itself, every k + 1/2 in (-127, 127) a tie
    ties = torch.arange(-253, 254, 2, dtype=torch.float32) / 2
    x = torch.cat([torch.tensor([127.0]), ties, torch.tensor([-126.5, 0.5, -0.5, 1.5, -1.5])])
    block_size = x.numel()
    q, scale = codec_blocks.quantize(x, 127, block_size)
    q_ref, scale_ref = ref.quantize(x, 127, block_size)
    assert scale.tolist() == [1.0] and _bits(scale) == _bits(scale_ref)
    assert torch.equal(q, q_ref)
    assert torch.equal(q[1:-5].to(torch.float32), torch.round(ties))


@pytest.mark.parametrize("qmax", [127, 7, 1])
@pytest.mark.parametrize("chunk_elems", [64, 256, 1 << 20])
@pytest.mark.parametrize("special", [False, True])
def test_several_steps_give_the_reference_bits(qmax, chunk_elems, special, monkeypatch):
    # a tensor quantized over several steps (small CHUNK_ELEMS) or one, with a short last block;
    # ``special`` puts a NaN, an Inf, a subnormal block and a zero block in later steps (careful path)
    monkeypatch.setattr(codec_blocks, "CHUNK_ELEMS", chunk_elems)
    block_size = 16
    gen = torch.Generator().manual_seed(qmax + chunk_elems)
    x = torch.randn(block_size * 50 + 7, generator=gen)
    if special:
        x[block_size * 20 + 3] = float("nan")
        x[block_size * 33] = float("-inf")
        x[block_size * 40: block_size * 41] = 1e-42  # subnormal scale
        x[block_size * 45: block_size * 46] = 0.0
    q, scale = codec_blocks.quantize(x, qmax, block_size, pad_multiple=4)
    q_ref, scale_ref = ref.quantize(x, qmax, block_size)
    assert _bits(scale) == _bits(scale_ref)
    assert q.numel() == -(-x.numel() // 4) * 4 and not q[x.numel():].any()
    assert torch.equal(q[: x.numel()], q_ref)


@pytest.mark.parametrize("extra", [0, 1, 2, 3])
def test_int2_levels_table_gives_every_byte_the_arithmetic_unpacking(extra):
    from diloco_async.codec import int2 as codec_int2

    packed = torch.cat([torch.arange(256, dtype=torch.uint8), torch.tensor([0b10_01_11_00], dtype=torch.uint8)])
    n = 4 * 256 + extra  # every byte value whole, then a short last byte of ``extra`` values
    want = codec_int2.unpack_int2(packed[: -(-n // 4)], n).to(torch.float32)
    got = codec_int2.unpack_int2_levels(packed[: -(-n // 4)], n)
    assert got.dtype == torch.float32 and got.shape == (n,)
    assert _bits(got) == _bits(want)
    out = torch.full((n,), float("nan"))
    assert codec_int2.unpack_int2_levels(packed[: -(-n // 4)], n, out) is out and _bits(out) == _bits(want)
