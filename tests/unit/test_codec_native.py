"""The int8/int4/int2 codecs' C kernels (diloco_async/kernels/codec_kernels.c): used where they can be,
the same bytes and values as the torch code, and the torch code where they cannot be
(tests/unit/test_codec_equivalence.py checks both against the frozen reference)."""

from __future__ import annotations

import os

import pytest
import torch

from diloco_async.codec import native as codec_native
from diloco_async.codec import wire as codec
from diloco_async.kernels import build as native_build

CODECS = ("int8", "int4", "int2")


@pytest.fixture
def torch_only():
    """Within the block, the codecs run their torch code (as without a compiler)."""
    codec_native.reset()
    codec_native._lib.append(None)
    yield
    codec_native.reset()


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _inputs() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    out = [torch.randn(n, generator=gen) * 10.0 ** e for n in (1, 2, 3, 5, 63, 65, 4097) for e in (-30, 0, 30)]
    ties = torch.arange(-300, 300, dtype=torch.float32) * 0.5  # x / scale lands on .5: half to even
    zeros = torch.randn(700, generator=gen)
    zeros[64:192] = 0.0
    zeros[3] = -0.0
    out += [ties, zeros, torch.tensor([3.4e38, -3.4e38, 1.0, 0.0])]
    return out


def test_the_kernels_are_built_and_used_here():
    """On this machine (gcc, AVX2/AVX512) the kernels load and take a plain float32 tensor; the
    equivalence tests therefore exercise them. DILOCO_NATIVE=0 in the environment turns them off."""
    if os.environ.get("DILOCO_NATIVE") == "0":
        pytest.skip("DILOCO_NATIVE=0: the torch code is under test")
    if native_build._compiler() is None:
        pytest.skip("no C compiler (CC, cc, gcc) on this machine: the torch code is used, and under test")
    assert codec_native.available(), native_build.unavailable_reason(codec_native.SOURCE)
    assert codec_native.quantize_packed(torch.randn(100), 7, 64) is not None


@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize("block_size", [1, 3, 64, 100])
def test_same_bytes_and_values_as_the_torch_code(name, block_size, torch_only):
    xs = _inputs()
    slow = [codec.encode({"w": x}, name, block_size) for x in xs]
    slow_values = [codec.decode(e, name, {"w": tuple(x.shape)}, block_size)["w"] for e, x in zip(slow, xs, strict=True)]
    codec_native.reset()
    for x, enc, values in zip(xs, slow, slow_values, strict=True):
        fast = codec.encode({"w": x}, name, block_size)
        assert fast.keys() == enc.keys()
        for key in enc:
            assert (fast[key].dtype, fast[key].shape) == (enc[key].dtype, enc[key].shape), key
            assert _bits(fast[key]) == _bits(enc[key]), (name, block_size, x.numel(), key)
        assert _bits(codec.decode(enc, name, {"w": tuple(x.shape)}, block_size)["w"]) == _bits(values)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 1e-41])
def test_non_finite_or_subnormal_blocks_go_to_the_torch_code(bad):
    """A NaN/Inf element or a subnormal block scale: the kernel declines (None) and the codec's
    torch code writes the bytes; decoding those bytes (NaN scales included) is the same either way."""
    x = torch.randn(300)
    x[70:128] = 0.0
    x[64:70] = bad  # block 1: NaN, Inf, or a scale of 1e-41 / q (subnormal)
    for name in CODECS:
        assert codec_native.quantize_packed(x, codec._QMAX[name], 64) is None
        enc = codec.encode({"w": x}, name, 64)
        fast = codec.decode(enc, name, {"w": (300,)}, 64)["w"]
        codec_native.reset()
        codec_native._lib.append(None)
        try:
            slow = codec.decode(enc, name, {"w": (300,)}, 64)["w"]
        finally:
            codec_native.reset()
        assert _bits(fast) == _bits(slow)


def test_dequantize_refuses_a_payload_of_the_wrong_length():
    if not codec_native.available():
        pytest.skip("no kernels: the codec's own checks cover the torch code")
    packed, scale = codec_native.quantize_packed(torch.randn(100), 7, 64)
    with pytest.raises(ValueError, match="do not fit"):
        codec_native.dequantize_packed(packed[:-1], 100, 7, 64, scale, torch.empty(100))
