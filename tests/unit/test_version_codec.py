"""Download codecs (diloco_async/codec/versions.py, issue 13 item 3): the same contract as the
upload codecs (round-trip bounds, header checks, corrupted / wrong-shape / NaN payloads rejected
with a reason), and exactness: what a learner rebuilds from a payload in a real fsspec store is
the synchronizer's published value bit for bit."""

from __future__ import annotations

import json
import math

import pytest
import safetensors.torch
import torch

from diloco_async.codec.versions import (
    DOWNLOAD_CODECS,
    DOWNLOAD_MODES,
    CompactForm,
    compact_bytes,
    compress_version,
    published_digest,
    read_compact,
)
from diloco_async.codec.wire import PayloadError
from diloco_async.storage.store import IntegrityError, ObjectRef, ObjectStore

SHAPES = {"w": (7, 19), "b": (64,), "s": (), "odd": (3,)}
QMAX = {"int8": 127, "int4": 7, "int2": 1}


def sample(seed: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = {n: torch.randn(s, generator=gen) * scale for n, s in SHAPES.items()}
    out["w"][0, :] *= 100
    return out


def blockwise_absmax(x: torch.Tensor, block_size: int) -> torch.Tensor:
    flat = x.reshape(-1)
    padded = torch.zeros(math.ceil(flat.numel() / block_size) * block_size)
    padded[: flat.numel()] = flat.abs()
    return padded.view(-1, block_size).amax(dim=1).repeat_interleave(block_size)[: flat.numel()]


def publish(store: ObjectStore, master, prev, codec, mode, block_size=64, base_version=0):
    encoded, published = compress_version(master, prev, codec, mode, block_size)
    data = compact_bytes(encoded, codec, mode, block_size, fragment=0, version=base_version + 1,
                         base_version=base_version if mode == "delta" else None, digest=published_digest(published))
    return store.put(f"run/compact/p000/v{base_version + 1:08d}.{mode}-{codec}.safetensors", data), published


def rebuild(store, ref, codec, mode, base, block_size=64, base_version=0, digest=None, shapes=SHAPES):
    form = CompactForm(codec, mode, block_size, base_version if mode == "delta" else None, digest)
    return read_compact(store, ref, shapes, form, base=base)


@pytest.fixture
def store(tmp_path):
    return ObjectStore(f"file://{tmp_path}/store")


@pytest.mark.parametrize("codec", DOWNLOAD_CODECS)
@pytest.mark.parametrize("mode", DOWNLOAD_MODES)
@pytest.mark.parametrize("block_size", [64, 5])
def test_round_trip_bound_and_exact_rebuild(store, codec, mode, block_size):
    """|Θ^pub − Θ| is within the codec's bound of what was quantized (Θ − Θ^pub_prev for a delta,
    Θ whole), and the learner's rebuild from the stored payload equals Θ^pub bit for bit."""
    prev, step = sample(1), sample(2)
    master = {n: t + 0.01 * step[n] for n, t in prev.items()}
    ref, published = publish(store, master, prev, codec, mode, block_size)
    x = {n: master[n] - prev[n] for n in master} if mode == "delta" else master
    for n in SHAPES:
        err = (published[n] - master[n]).abs().reshape(-1)
        if codec == "fp32":
            bound = x[n].abs().reshape(-1) * 1e-6 + 1e-9  # delta: one fp32 rounding of the addition
        elif codec == "bf16":
            bound = x[n].abs().reshape(-1) * 2 ** -8 + master[n].abs().reshape(-1) * 2 ** -23
        else:
            bound = (blockwise_absmax(x[n], block_size) / QMAX[codec] / 2 * (1 + 1e-5)
                     + master[n].abs().reshape(-1) * 2 ** -23)
        assert torch.all(err <= bound), (n, (err - bound).max())
    got = rebuild(store, ref, codec, mode, prev, block_size, digest=published_digest(published))
    assert got.keys() == published.keys() and all(torch.equal(got[n], published[n]) for n in got)
    assert all(got[n].dtype == torch.float32 and tuple(got[n].shape) == SHAPES[n] for n in got)


@pytest.mark.parametrize("codec", ["int2", "int4", "int8", "bf16"])
def test_error_feedback_keeps_the_published_value_close(codec):
    """Over 50 versions that each move Θ a little, delta mode never lets the gap Θ − Θ^pub grow:
    it stays within one quantization step of the last delta; whole int4 would be far worse."""
    gen = torch.Generator().manual_seed(0)
    master = {n: torch.randn(s, generator=gen) for n, s in SHAPES.items()}
    published = {n: t.clone() for n, t in master.items()}
    for _ in range(50):
        master = {n: t + 0.003 * torch.randn(t.shape, generator=gen) for n, t in master.items()}
        _, published = compress_version(master, published, codec, "delta")
    gap = max(float((master[n] - published[n]).abs().max()) for n in SHAPES)
    _, whole = compress_version(master, None, codec, "whole")
    gap_whole = max(float((master[n] - whole[n]).abs().max()) for n in SHAPES)
    assert gap < 0.01, gap
    if codec in ("int4", "int2"):
        assert gap < gap_whole / 5, (gap, gap_whole)


def _rewrite_meta(data: bytes, **changes) -> bytes:
    tensors = safetensors.torch.load(data)
    n = int.from_bytes(data[:8], "little")
    meta = json.loads(data[8:8 + n])["__metadata__"]
    return safetensors.torch.save(tensors, metadata={**meta, **changes})


def test_int2_payloads_are_checked(store):
    """int2 (downloads only): its own layout checks, and a 2-bit code of 3 is refused."""
    prev, master = sample(1), sample(3, 1.01)
    ref, published = publish(store, master, prev, "int2", "delta")
    digest = published_digest(published)
    assert all(torch.equal(a, b) for a, b in zip(rebuild(store, ref, "int2", "delta", prev, digest=digest).values(),
                                                published.values(), strict=True))
    with pytest.raises(PayloadError, match="codec_header"):
        rebuild(store, ref, "int2", "delta", prev, block_size=32, digest=digest)
    with pytest.raises(PayloadError, match="shape"):
        rebuild(store, ref, "int2", "delta", prev, digest=digest, shapes={**SHAPES, "w": (7, 30)})
    raw = safetensors.torch.load(store.get(ref))
    raw["b"][0] = 0xFF
    n = int.from_bytes(store.get(ref)[:8], "little")
    meta = json.loads(store.get(ref)[8:8 + n])["__metadata__"]
    bad = store.put("run/bad-code", safetensors.torch.save(raw, metadata=meta))
    with pytest.raises(PayloadError, match="range"):
        rebuild(store, bad, "int2", "delta", prev, digest=digest)


def test_bad_payloads_are_rejected_with_a_reason(store):
    """Wrong codec or block size announced, another mode or base version, wrong shapes, a NaN
    payload, bytes that do not match the announced digest, a rebuild from another base: each
    raises with its reason code."""
    prev, master = sample(1), sample(3, 1.01)
    ref, published = publish(store, master, prev, "int4", "delta")
    digest = published_digest(published)
    with pytest.raises(PayloadError, match="codec_header"):
        rebuild(store, ref, "int8", "delta", prev, digest=digest)
    with pytest.raises(PayloadError, match="codec_header"):
        rebuild(store, ref, "int4", "delta", prev, block_size=32, digest=digest)
    with pytest.raises(PayloadError, match="codec_header"):
        rebuild(store, ref, "int4", "delta", prev, base_version=5, digest=digest)
    with pytest.raises(PayloadError, match="codec_header"):
        rebuild(store, ref, "int4", "whole", None, digest=digest)
    whole, whole_pub = publish(store, master, None, "int4", "whole", base_version=7)
    with pytest.raises(PayloadError, match="shape"):
        rebuild(store, whole, "int4", "whole", None, digest=digest, shapes={**SHAPES, "w": (7, 20)})
    with pytest.raises(PayloadError, match="schema"):
        rebuild(store, whole, "int4", "whole", None, digest=digest, shapes={**SHAPES, "extra": (2,)})
    assert rebuild(store, whole, "int4", "whole", None, digest=published_digest(whole_pub)).keys() == SHAPES.keys()
    with pytest.raises(PayloadError, match="shape"):  # a base of other shapes
        rebuild(store, ref, "int4", "delta", {**prev, "w": prev["w"].T.contiguous()}, digest=digest)
    with pytest.raises(PayloadError, match="published_digest"):  # another base: not the synchronizer's value
        rebuild(store, ref, "int4", "delta", sample(9), digest=digest)
    with pytest.raises(IntegrityError):  # the bytes are not the announced ones
        store_ref = ObjectRef(ref.key, ref.nbytes, "0" * 64)
        rebuild(store, store_ref, "int4", "delta", prev, digest=digest)
    raw = safetensors.torch.load(store.get(ref))
    raw["b::scale"][0] = float("nan")
    bad = store.put("run/bad-nan", safetensors.torch.save(raw, metadata={
        "codec": "int4", "block_size": "64", "mode": "delta", "base_version": "0", "published_sha256": digest}))
    with pytest.raises(PayloadError, match="non_finite"):
        rebuild(store, bad, "int4", "delta", prev, digest=digest)
    lying = store.put("run/lying", _rewrite_meta(store.get(ref), published_sha256="f" * 64))
    with pytest.raises(PayloadError, match="published_digest"):
        rebuild(store, lying, "int4", "delta", prev, digest=digest)
    truncated = store.put("run/truncated", store.get(ref)[:50])
    with pytest.raises(PayloadError, match="codec_header"):
        rebuild(store, truncated, "int4", "delta", prev, digest=digest)


def test_compress_refuses_bad_arguments():
    with pytest.raises(ValueError, match="download codec"):
        compress_version(sample(1), sample(1), "int2x", "delta")
    with pytest.raises(ValueError, match="download mode"):
        compress_version(sample(1), sample(1), "int4", "chain")
    with pytest.raises(ValueError, match="previous published value"):
        compress_version(sample(1), None, "int4", "delta")
    inf = sample(1)
    inf["b"][3] = float("inf")
    with pytest.raises(ValueError, match="not finite"):
        compress_version(inf, sample(1), "bf16", "delta")


def test_int4_delta_is_about_a_seventh_of_fp32(store):
    shapes = {"w": (256, 256)}
    gen = torch.Generator().manual_seed(0)
    prev = {"w": torch.randn(shapes["w"], generator=gen)}
    master = {"w": prev["w"] + 0.01 * torch.randn(shapes["w"], generator=gen)}
    encoded, _ = compress_version(master, prev, "int4", "delta")
    nbytes = sum(t.numel() * t.element_size() for t in encoded.values())
    assert nbytes <= 256 * 256 * 4 * 0.15  # 4 bits + a 32-bit scale per 64 elements = 4.5 bits
