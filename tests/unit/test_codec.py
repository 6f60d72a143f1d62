"""Wire codecs of outer gradients (DESIGN §6): round-trip error, validation, sizes."""

from __future__ import annotations

import math

import pytest
import safetensors.torch
import torch

from diloco_async.codec.wire import (
    CODECS,
    SCALE_SUFFIX,
    decode,
    decode_from_bytes,
    encode,
    encode_to_bytes,
    encoded_nbytes,
)

SHAPES = {"w": (7, 19), "b": (64,), "s": (), "odd": (3,)}  # 133, 64, 1, 3 elements


def sample(seed: int = 0, shapes=SHAPES) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = {name: torch.randn(shape, generator=gen) * 3 for name, shape in shapes.items()}
    out["w"][0, :] *= 100  # blocks of very different magnitude
    return out


def blockwise_absmax(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """Per-element absmax of the element's block, shape ``(numel,)``."""
    flat = x.reshape(-1)
    n = flat.numel()
    padded = torch.zeros(math.ceil(n / block_size) * block_size)
    padded[:n] = flat.abs()
    per_block = padded.view(-1, block_size).amax(dim=1)
    return per_block.repeat_interleave(block_size)[:n]


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("block_size", [64, 5])
def test_round_trip_error(codec, block_size):
    x = sample()
    y = decode(encode(x, codec, block_size), codec, SHAPES, block_size)
    assert list(y) == list(SHAPES)
    for name, shape in SHAPES.items():
        assert y[name].dtype == torch.float32 and tuple(y[name].shape) == shape
        err = (y[name] - x[name]).abs().reshape(-1)
        if codec == "fp32":
            assert torch.equal(y[name], x[name])
        elif codec == "bf16":
            assert torch.all(err <= 1e-2 * x[name].abs().reshape(-1))
        else:
            qmax = {"int8": 127, "int4": 7, "int2": 1}[codec]
            bound = blockwise_absmax(x[name], block_size) / qmax
            assert torch.all(err <= bound * (1 + 1e-6)), (name, (err - bound).max())


@pytest.mark.parametrize("codec", ["int8", "int4", "int2"])
def test_zero_blocks_and_ragged_tail(codec):
    x = torch.zeros(150)
    x[64:128] = torch.linspace(-1, 1, 64)
    x[149] = 0.5  # the short last block (22 elements)
    enc = encode({"x": x}, codec)
    scale = enc["x" + SCALE_SUFFIX]
    assert scale.shape == (3,) and scale[0] == 0
    y = decode(enc, codec, {"x": (150,)})["x"]
    assert torch.all(y[:64] == 0)
    assert torch.isfinite(y).all()
    assert (y - x).abs().max() <= {"int8": 1 / 127, "int4": 1 / 7, "int2": 1 / 2}[codec]


def test_int4_packs_two_values_per_byte_and_exact_levels():
    x = torch.tensor([-7.0, 7.0, -1.0, 0.0, 3.0])  # absmax 7: every value is a level
    enc = encode({"x": x}, "int4", block_size=64)
    assert enc["x"].dtype == torch.uint8 and enc["x"].shape == (3,)
    assert torch.equal(decode(enc, "int4", {"x": (5,)})["x"], x)


def test_int2_packs_four_values_per_byte_and_ternary_levels():
    x = torch.tensor([-2.0, 2.0, -1.1, 0.0, 1.1, 0.2, -1.0])  # absmax 2: levels -2, 0, +2; -1.0 ties to 0
    enc = encode({"x": x}, "int2", block_size=64)
    assert enc["x"].dtype == torch.uint8 and enc["x"].shape == (2,)
    assert enc["x"].tolist() == [0b00_11_01_11, 0b00_00_00_01]  # 4i+j in bits 2j..2j+1, -1 as 0b11
    assert decode(enc, "int2", {"x": (7,)})["x"].tolist() == [-2.0, 2.0, -2.0, 0.0, 2.0, 0.0, 0.0]


def test_int2_keeps_zero_mean_on_symmetric_input():
    x = torch.randn(64 * 500, generator=torch.Generator().manual_seed(3))
    y = decode(encode({"x": x}, "int2"), "int2", {"x": (x.numel(),)})["x"]
    assert set(torch.unique(y.view(-1, 64) / y.view(-1, 64).abs().amax(dim=1, keepdim=True)).tolist()) == {-1, 0, 1}
    assert abs(float((y - x).mean())) < 0.02  # symmetric grid: no bias towards one sign


@pytest.mark.parametrize("codec", ["int8", "int4", "int2"])
def test_non_finite_stays_non_finite(codec):
    x = torch.ones(130)
    x[3] = float("nan")
    x[70] = float("inf")
    y = decode(encode({"x": x}, codec), codec, {"x": (130,)})["x"]
    assert not torch.isfinite(y[:64]).any() and not torch.isfinite(y[64:128]).any()
    assert torch.isfinite(y[128:]).all()


def test_encoded_is_saveable_even_for_shared_storage():
    base = torch.randn(4, 4)
    tied = {"emb": base, "head": base, "view": base[1]}  # tied embeddings share memory
    for codec in CODECS:
        enc = encode(tied, codec)
        safetensors.torch.save(enc)
        assert all(t.is_contiguous() for t in enc.values())


@pytest.mark.parametrize("codec", CODECS)
def test_bytes_round_trip_with_metadata(codec):
    x = sample(1)
    data = encode_to_bytes(x, codec, {"learner": "3", "fragment": "1"}, block_size=32)
    y, meta = decode_from_bytes(data, codec, SHAPES)
    assert meta == {"learner": "3", "fragment": "1", "codec": codec, "block_size": "32"}
    direct = decode(encode(x, codec, 32), codec, SHAPES, 32)
    assert all(torch.equal(y[name], direct[name]) for name in SHAPES)


def test_byte_size_ordering():
    x = {"w": torch.randn(256, 256)}
    sizes = [len(encode_to_bytes(x, c, {})) for c in CODECS]
    assert sizes[0] > sizes[1] > sizes[2] > sizes[3] > sizes[4], dict(zip(CODECS, sizes, strict=True))
    n = 256 * 256
    assert sizes[0] >= 4 * n and sizes[3] < n  # int4: 0.5 B/value + 4 B per 64 values
    assert n // 4 + n // 16 <= sizes[4] < n // 4 + n // 16 + 1024  # int2: 0.25 B/value + 4 B per 64 values


# --- validation -------------------------------------------------------------------------------


@pytest.mark.parametrize("codec", CODECS)
def test_decode_rejects_wrong_shape(codec):
    enc = encode({"w": torch.randn(4, 6)}, codec)
    with pytest.raises(ValueError, match="'w'"):
        decode(enc, codec, {"w": (4, 7)})
    if codec in ("fp32", "bf16"):  # same number of elements, different shape
        with pytest.raises(ValueError, match="shape"):
            decode(enc, codec, {"w": (6, 4)})


@pytest.mark.parametrize("codec", CODECS)
def test_decode_rejects_missing_and_unexpected(codec):
    enc = encode({"w": torch.randn(8)}, codec)
    with pytest.raises(ValueError, match="missing"):
        decode(enc, codec, {"w": (8,), "b": (2,)})
    with pytest.raises(ValueError, match="not in the announced specs"):
        decode(enc, codec, {})
    if codec in ("int8", "int4", "int2"):
        no_scale = {k: v for k, v in enc.items() if not k.endswith(SCALE_SUFFIX)}
        with pytest.raises(ValueError, match="missing"):
            decode(no_scale, codec, {"w": (8,)})


def test_decode_rejects_wrong_dtype():
    enc = encode({"w": torch.randn(8)}, "int8")
    with pytest.raises(ValueError, match="dtype"):
        decode(enc, "bf16", {"w": (8,)})


def test_unknown_codec():
    with pytest.raises(ValueError, match="codec"):
        encode({"w": torch.randn(2)}, "fp8")
    with pytest.raises(ValueError, match="codec"):
        decode({}, "fp8", {})
    with pytest.raises(ValueError, match="codec"):
        decode_from_bytes(b"", "fp8", {})


def test_encode_rejects_bad_input():
    with pytest.raises(ValueError, match="::"):
        encode({"a::scale": torch.randn(2)}, "int8")
    with pytest.raises(ValueError, match="block_size"):
        encode({"a": torch.randn(2)}, "int8", block_size=0)
    with pytest.raises(TypeError):
        encode({"a": torch.arange(3)}, "fp32")
    with pytest.raises(ValueError, match="conflicts"):
        encode_to_bytes({"a": torch.randn(2)}, "int8", {"codec": "bf16"})


@pytest.mark.parametrize("codec", CODECS)
def test_codec_mismatch_in_bytes(codec):
    data = encode_to_bytes({"w": torch.randn(8)}, codec, {})
    other = next(c for c in CODECS if c != codec)
    with pytest.raises(ValueError, match="announced"):
        decode_from_bytes(data, other, {"w": (8,)})


def test_bytes_without_codec_metadata():
    data = safetensors.torch.save({"w": torch.randn(8)})
    with pytest.raises(ValueError, match="codec"):
        decode_from_bytes(data, "fp32", {"w": (8,)})


@pytest.mark.parametrize("codec", CODECS)
def test_truncated_and_corrupted_bytes(codec):
    data = encode_to_bytes({"w": torch.randn(100)}, codec, {"k": "v"})
    for bad in (b"", data[:4], data[:8], data[:20], data[: len(data) // 2], data[:-1]):
        with pytest.raises(ValueError):
            decode_from_bytes(bad, codec, {"w": (100,)})
    garbage = bytearray(data)
    garbage[8:16] = b"\xff" * 8  # break the JSON header
    with pytest.raises(ValueError):
        decode_from_bytes(bytes(garbage), codec, {"w": (100,)})
    huge_header = (2**63).to_bytes(8, "little") + data[8:]
    with pytest.raises(ValueError):
        decode_from_bytes(huge_header, codec, {"w": (100,)})


@pytest.mark.parametrize("codec", CODECS)
def test_held_payload_decodes_as_the_bytes_do_one_tensor_at_a_time(codec):
    """EncodedTensors (what the synchronizer keeps until a merge) decodes to decode_from_bytes's
    tensors bit for bit, whole or one tensor at a time, and refuses an entry not in the specs."""
    from diloco_async.codec.held import load_encoded

    gen = torch.Generator().manual_seed(5)
    tensors = {"a": torch.randn(37, 5, generator=gen), "b": torch.randn(300, generator=gen)}
    specs = {k: tuple(t.shape) for k, t in tensors.items()}
    data = encode_to_bytes(tensors, codec)
    plain, _ = decode_from_bytes(data, codec, specs)
    held, meta = load_encoded(data, codec, specs)
    assert meta["codec"] == codec
    for got in (held.decode(), dict(held.iter_decoded()), held.decode()):
        assert list(got) == ["a", "b"]
        for k in plain:
            assert torch.equal(got[k], plain[k])
    if codec != "fp32":
        assert held.nbytes < 0.55 * sum(t.numel() * 4 for t in tensors.values())
    held_more, _ = load_encoded(data, codec, {"a": specs["a"]})  # "b" is not announced
    with pytest.raises(ValueError, match="not in the announced specs"):
        next(held_more.iter_decoded())


@pytest.mark.parametrize("codec", CODECS)
def test_encoded_nbytes_is_the_payload_less_its_header(codec):
    """What the capacity plan counts on the wire is what encode_to_bytes writes, header aside (odd sizes:
    a short last block, an int4/int2 pad)."""
    tensors = {"w": torch.randn(33, 7), "b": torch.randn(5), "e": torch.randn(129)}
    for block_size in (1, 16, 64):
        data = encode_to_bytes(tensors, codec, block_size=block_size)
        header = int.from_bytes(data[:8], "little")
        assert encoded_nbytes(codec, {k: tuple(t.shape) for k, t in tensors.items()}, block_size) == \
            len(data) - 8 - header
    with pytest.raises(ValueError, match="int3"):
        encoded_nbytes("int3", {"w": (4,)})
