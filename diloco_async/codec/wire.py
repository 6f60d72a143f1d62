"""Wire encoding of outer gradients (DESIGN §6).

A learner encodes the outer gradient of one fragment with one codec; the synchronizer decodes it
to float32 before anchoring. The encoded form is a flat ``dict[str, Tensor]`` saved with
safetensors (no pickle), so it can be stored as one object.

Codecs and encoded entries, per tensor ``name`` with ``n`` elements:

========  ==============================  ============================================
codec     ``name``                        ``name::scale``
========  ==============================  ============================================
fp32      float32, original shape         —
bf16      bfloat16, original shape        —
int8      int8, shape ``(n,)``, in ±127   float32, shape ``(ceil(n / block_size),)``
int4      uint8, shape ``(ceil(n/2),)``   float32, shape ``(ceil(n / block_size),)``
int2      uint8, shape ``(ceil(n/4),)``   float32, shape ``(ceil(n / block_size),)``
========  ==============================  ============================================

``int8``/``int4``/``int2`` are blockwise absmax quantization over the flattened tensor: block ``k``
holds elements ``[k·B, (k+1)·B)`` (the last block may be short), ``scale_k = absmax_k / q`` with
``q = 127`` (int8), ``q = 7`` (int4) or ``q = 1`` (int2: the ternary levels {-1, 0, +1}·scale, why
in :mod:`diloco_async.codec.int2`), and each value is ``round(x / scale_k)`` clamped to ``[-q, q]``;
a block of zeros has scale 0. ``int4`` packs two signed 4-bit values per byte, element ``2i`` in
the low nibble and ``2i+1`` in the high nibble (two's complement; an odd ``n`` pads one zero
nibble); ``int2`` packs four 2-bit values per byte, element ``4i+j`` in bits ``2j..2j+1``. The
round-trip error is at most ``scale_k / 2`` per element, i.e. ``absmax_k / 254`` (int8),
``absmax_k / 14`` (int4) and ``absmax_k / 2`` (int2). Non-finite inputs stay non-finite after a
round trip (NaN/Inf poison their block's scale), so the receiver's finiteness check still
rejects them.

In bytes (:func:`encode_to_bytes`), the safetensors metadata holds the caller's string metadata plus
``codec`` and ``block_size``. Names may not contain ``::``.
"""

from __future__ import annotations

import json
import math
import struct
import sys
from collections.abc import Mapping

import safetensors.torch
import torch
from torch import Tensor

from diloco_async.codec import native as codec_native
from diloco_async.codec.blocks import dequantize, quantize, scale_blocks
from diloco_async.codec.int2 import int2_packed_numel, pack_int2, unpack_int2_levels
from diloco_async.codec.int2 import unpack_int2 as unpack_int2  # noqa: F401 - re-exported (tests, callers)

__all__ = [
    "CODECS",
    "DEFAULT_BLOCK_SIZE",
    "SCALE_SUFFIX",
    "encode",
    "encoded_to_bytes",
    "decode",
    "encode_to_bytes",
    "decode_from_bytes",
    "read_payload",
    "PayloadError",
    "check_header",
    "encoded_nbytes",
]

CODECS = ("fp32", "bf16", "int8", "int4", "int2")
DEFAULT_BLOCK_SIZE = 64
SCALE_SUFFIX = "::scale"
"""Suffix of the per-block float32 scales of a quantized tensor (``name::scale``)."""

_QMAX = {"int8": 127, "int4": 7, "int2": 1}
_PAD = {"int8": 1, "int4": 2, "int2": 4}  # values per packed byte: quantize pads to whole bytes
_HEADER_MAX_BYTES = 100 << 20  # safetensors' own limit on the JSON header
# dtype of a payload's value entries
_ST_DTYPE = {"fp32": "F32", "bf16": "BF16", "int8": "I8", "int4": "U8", "int2": "U8"}
_ST_ITEMSIZE = {"F32": 4, "BF16": 2, "I8": 1, "U8": 1}  # bytes per element of each safetensors dtype


class PayloadError(ValueError):
    """A contribution's bytes do not fit what was announced and configured.

    ``reason`` is the counted code: ``codec_header`` (unreadable header, or codec / block size
    other than announced and configured), ``schema`` (missing or unexpected tensors), ``shape``,
    ``dtype`` or ``non_finite``; the message names every offending tensor.
    """

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail
_RESERVED_METADATA = ("codec", "block_size")


def _check_codec(codec: str) -> None:
    if codec not in CODECS:
        raise ValueError(f"unknown codec {codec!r}; expected one of {CODECS}")


def _check_block_size(block_size: int) -> None:
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")


def _quantize(x: Tensor, qmax: int, block_size: int) -> tuple[Tensor, Tensor]:
    """Flattened ``x`` → (int8 values in ``[-qmax, qmax]``, shape ``(n,)``; float32 scales, shape
    ``(ceil(n / block_size),)``); see :func:`diloco_async.codec.blocks.quantize`."""
    q, scale = quantize(x, qmax, block_size)
    return q, scale


_dequantize = dequantize


#: int4 packing works on 16-bit words (two int8 values, element ``2i`` in the low byte); on a
#: big-endian host it falls back to strided byte views, which give the same bytes more slowly
_LITTLE_ENDIAN = sys.byteorder == "little"


def _pack_int4(q: Tensor, consume: bool = False) -> Tensor:
    """int8 values in ``[-7, 7]``, shape ``(n,)`` → uint8, shape ``(ceil(n/2),)``: element ``2i``
    in the low nibble, ``2i+1`` in the high one (two's complement).

    On a little-endian host each pair is one 16-bit word ``w = e0 | e1 << 8``: masked to its two
    nibbles, ``w · 0x110`` holds ``nib0 | nib1 << 4`` in its high byte (the two partial products
    do not overlap, ``nib1 << 16`` falls off), an arithmetic shift brings it down. With
    ``consume`` (``q`` of even length, owned by the caller and not used again) the words are
    worked on in place."""
    n = q.numel()
    if not _LITTLE_ENDIAN:
        u = q.view(torch.uint8)
        packed = torch.bitwise_and(u[0::2], 0xF)
        packed[: n // 2] |= u[1::2] << 4  # uint8 shift: the high bits fall off
        return packed
    if n % 2:
        q, consume = torch.cat([q, q.new_zeros(1)]), True
    word = q.view(torch.int16)  # low byte: element 2i, high byte: element 2i+1
    if consume:
        word &= 0x0F0F
    else:
        word = word & 0x0F0F
    word *= 0x0110
    word >>= 8  # -128..127: the packed byte, sign-extended
    return word.to(torch.int8).view(torch.uint8)


def _unpack_int4(packed: Tensor, n: int, scratch: Tensor | None = None) -> Tensor:
    """Inverse of :func:`_pack_int4`: uint8 ``(ceil(n/2),)`` → int8 values, shape ``(n,)``; each
    nibble ``v`` is sign-extended as ``(v ^ 8) - 8`` (bytewise, no shifts of 8-bit lanes).
    ``scratch``: optional memory of at least ``ceil(n/2)`` int16 for a shifted copy (e.g. the
    decoded output's, which is written only after this returns)."""
    if not _LITTLE_ENDIAN:
        b = packed.view(torch.int8)
        return torch.stack(((b << 4) >> 4, b >> 4), dim=1).reshape(-1)[:n]
    word = packed.to(torch.int16)  # 0..255
    if scratch is None:
        word |= word << 4  # low byte: the low nibble (junk above it); high byte: the high nibble
    else:
        word |= torch.bitwise_left_shift(word, 4, out=scratch.view(torch.int16)[: word.numel()])
    word &= 0x0F0F
    word ^= 0x0808
    q = word.view(torch.int8)
    q -= 8
    return q if q.numel() == n else q[:n]


def encode(tensors: dict[str, Tensor], codec: str, block_size: int = DEFAULT_BLOCK_SIZE) -> dict[str, Tensor]:
    """Encode outer gradients for the wire (DESIGN §6); layout in the module docstring.

    Args:
        tensors: name → floating tensor of any shape and device.
        codec: one of :data:`CODECS`.
        block_size: elements per quantization block (int8/int4/int2 only), ≥ 1.

    Returns:
        A flat dict of contiguous CPU tensors that share no memory, ready for
        ``safetensors.torch.save``.

    Raises:
        ValueError: for an unknown codec, a bad block size, or a name containing ``::``.
        TypeError: for a non-floating tensor.
    """
    _check_codec(codec)
    _check_block_size(block_size)
    out: dict[str, Tensor] = {}
    for name, t in tensors.items():
        if "::" in name:
            raise ValueError(f"tensor name {name!r} may not contain '::' (reserved for {SCALE_SUFFIX})")
        if not t.is_floating_point():
            raise TypeError(f"tensor {name!r} must be floating point to encode, got dtype {t.dtype}")
        if codec == "fp32":
            out[name] = t.detach().to(device="cpu", dtype=torch.float32, copy=True).contiguous()
        elif codec == "bf16":
            out[name] = t.detach().to(device="cpu", dtype=torch.bfloat16, copy=True).contiguous()
        else:
            fast = codec_native.quantize_packed(t.detach(), _QMAX[codec], block_size)  # None: torch's turn
            if fast is not None:
                out[name], out[name + SCALE_SUFFIX] = fast
                continue
            q, scale = quantize(t, _QMAX[codec], block_size, pad_multiple=_PAD[codec])
            out[name] = (_pack_int4(q, consume=True) if codec == "int4" else
                         pack_int2(q, consume=True) if codec == "int2" else q)
            out[name + SCALE_SUFFIX] = scale
    return out


def _entry(encoded: Mapping[str, Tensor], key: str, dtype: torch.dtype, numel: int, codec: str) -> Tensor:
    if key not in encoded:
        raise ValueError(f"{codec} payload is missing tensor {key!r}")
    t = encoded[key]
    if t.dtype != dtype:
        raise ValueError(f"{codec} payload: {key!r} has dtype {t.dtype}, expected {dtype}")
    if t.numel() != numel:
        raise ValueError(f"{codec} payload: {key!r} has {t.numel()} elements, expected {numel}")
    return t


def decode(
    encoded: dict[str, Tensor],
    codec: str,
    specs: dict[str, tuple[int, ...]],
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> dict[str, Tensor]:
    """Decode what :func:`encode` produced back to float32 tensors (DESIGN §6).

    Args:
        encoded: the flat dict of encoded entries.
        codec: the codec announced for this payload, one of :data:`CODECS`.
        specs: name → expected shape of every tensor; the payload must hold exactly these.
        block_size: the block size the payload was encoded with (int8/int4/int2 only).

    Returns:
        name → float32 CPU tensor of the announced shape, in the order of ``specs``.

    Raises:
        ValueError: for an unknown codec or bad block size, a missing or unexpected entry, or an
            entry whose dtype, element count or (fp32/bf16) shape does not fit the spec.
    """
    _check_codec(codec)
    _check_block_size(block_size)
    expected_keys = set()
    out: dict[str, Tensor] = {}
    for name, shape in specs.items():
        shape = tuple(int(s) for s in shape)
        n = math.prod(shape)
        if codec in ("fp32", "bf16"):
            t = _entry(encoded, name, torch.float32 if codec == "fp32" else torch.bfloat16, n, codec)
            if tuple(t.shape) != shape:
                raise ValueError(f"{codec} payload: {name!r} has shape {tuple(t.shape)}, expected {shape}")
            out[name] = t.to(torch.float32, copy=True)
            expected_keys.add(name)
        else:
            scale_key = name + SCALE_SUFFIX
            scale = _entry(encoded, scale_key, torch.float32, math.ceil(n / block_size), codec)
            values = torch.empty(n, dtype=torch.float32)  # the output, and the unpacking's scratch before
            wire = _entry(encoded, name, torch.int8 if codec == "int8" else torch.uint8,
                          codec_native.packed_numel(n, _QMAX[codec]), codec)
            expected_keys.update((name, scale_key))
            if codec_native.dequantize_packed(wire.reshape(-1), n, _QMAX[codec], block_size, scale.reshape(-1), values):
                out[name] = values.reshape(shape)
                continue
            if codec == "int2":  # the levels straight from a table, then scaled
                unpack_int2_levels(_entry(encoded, name, torch.uint8, int2_packed_numel(n), codec), n, values)
                out[name] = scale_blocks(values, scale.reshape(-1), n, block_size).reshape(shape)
                expected_keys.update((name, scale_key))
                continue
            if codec == "int8":
                q = _entry(encoded, name, torch.int8, n, codec).reshape(-1)
            else:
                q = _unpack_int4(_entry(encoded, name, torch.uint8, math.ceil(n / 2), codec).reshape(-1), n, values)
            out[name] = dequantize(q, scale.reshape(-1), n, block_size, values).reshape(shape)
            expected_keys.update((name, scale_key))
    unexpected = sorted(set(encoded) - expected_keys)
    if unexpected:
        raise ValueError(f"{codec} payload has entries not in the announced specs: {unexpected}")
    return out


def encode_to_bytes(
    tensors: dict[str, Tensor],
    codec: str,
    metadata: dict[str, str] | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> bytes:
    """Encode outer gradients and serialize them with ``safetensors.torch.save``.

    Args:
        tensors, codec, block_size: as :func:`encode`.
        metadata: string key → string value stored in the safetensors header, next to ``codec``
            and ``block_size``, which this function sets.

    Returns:
        The safetensors bytes.

    Raises:
        ValueError: as :func:`encode`; also if ``metadata`` sets ``codec`` or ``block_size`` to a
            different value, or holds a non-string key or value.
    """
    _check_codec(codec)
    _check_block_size(block_size)
    return encoded_to_bytes(encode(tensors, codec, block_size), codec, metadata, block_size)


def encoded_to_bytes(encoded: dict[str, Tensor], codec: str, metadata: dict[str, str] | None = None,
                     block_size: int = DEFAULT_BLOCK_SIZE) -> bytes:
    """Serialize what :func:`encode` returned (for ``codec`` and ``block_size``) as
    :func:`encode_to_bytes` does. A learner encodes each tensor of an outer gradient as soon as
    it is taken, so no fp32 copy of the whole fragment waits for the upload.

    Raises:
        ValueError: ``metadata`` holds a non-string key or value, or sets ``codec`` or
            ``block_size`` to a different value.
    """
    meta = dict(metadata or {})
    for k, v in meta.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise ValueError(f"metadata must map str to str, got {k!r}: {v!r}")
    for k, v in (("codec", codec), ("block_size", str(block_size))):
        if k in meta and meta[k] != v:
            raise ValueError(f"metadata {k}={meta[k]!r} conflicts with the encoding's {k}={v!r}")
        meta[k] = v
    return safetensors.torch.save(encoded, metadata=meta)


def _header_metadata(data: bytes) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors blob that has already deserialized cleanly."""
    (header_len,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + header_len])
    return dict(header.get("__metadata__") or {})


def read_payload(data: bytes, codec: str) -> tuple[dict[str, Tensor], dict[str, str], int]:
    """The entries of bytes written by :func:`encode_to_bytes`, not decoded, with the header
    metadata and the block size.

    Raises:
        ValueError: for corrupted or truncated bytes, a codec other than ``codec``, or a missing
            or invalid ``block_size``.
    """
    _check_codec(codec)
    try:
        encoded = safetensors.torch.load(bytes(data))
        meta = _header_metadata(data)
    except Exception as e:  # safetensors raises SafetensorError (or others) on malformed input
        raise ValueError(f"cannot read safetensors payload ({len(data)} bytes): {e}") from e
    if meta.get("codec") != codec:
        raise ValueError(f"payload was encoded with codec {meta.get('codec')!r}, announced {codec!r}")
    try:
        block_size = int(meta.get("block_size", ""))
    except ValueError:
        raise ValueError(f"payload metadata has no valid block_size: {meta.get('block_size')!r}") from None
    _check_block_size(block_size)
    return encoded, meta, block_size


def decode_from_bytes(
    data: bytes, codec: str, specs: dict[str, tuple[int, ...]]
) -> tuple[dict[str, Tensor], dict[str, str]]:
    """Deserialize and decode bytes written by :func:`encode_to_bytes` (``data``, safetensors bytes)
    announced with ``codec`` (it must equal the codec recorded in the bytes) and ``specs`` (name →
    expected shape, as :func:`decode`): (name → float32 tensor of its shape, the header metadata
    including ``codec`` and ``block_size``).

    Raises:
        ValueError: for corrupted or truncated bytes, missing or mismatched ``codec`` /
            ``block_size`` metadata, and everything :func:`decode` raises.
    """
    encoded, meta, block_size = read_payload(data, codec)
    return decode(encoded, codec, specs, block_size=block_size), meta


def _expected_layout(codec: str, specs: Mapping[str, tuple[int, ...]], block_size: int) -> dict[str, tuple[str, list]]:
    """Entry name → (safetensors dtype, shape) that :func:`encode` writes for ``specs``."""
    out: dict[str, tuple[str, list]] = {}
    for name, shape in specs.items():
        shape = [int(s) for s in shape]
        n = math.prod(shape)
        if codec in ("fp32", "bf16"):
            out[name] = (_ST_DTYPE[codec], shape)
        else:
            packed = {"int8": n, "int4": math.ceil(n / 2), "int2": int2_packed_numel(n)}[codec]
            out[name] = (_ST_DTYPE[codec], [packed])
            out[name + SCALE_SUFFIX] = ("F32", [math.ceil(n / block_size)])
    return out


def encoded_nbytes(codec: str, specs: Mapping[str, tuple[int, ...]], block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """Bytes of the tensors :func:`encode` writes for ``specs`` (name → shape): the values and,
    for int8/int4/int2, the float32 block scales (layout in the module docstring). A payload of
    :func:`encode_to_bytes` is this plus its safetensors header (8 bytes of length, then the JSON
    of names, shapes and metadata: a few hundred bytes). What the capacity plan
    (:mod:`diloco_async.capacity`) counts on the wire.

    Raises:
        ValueError: an unknown codec or a bad block size.
    """
    _check_codec(codec)
    _check_block_size(block_size)
    return sum(_ST_ITEMSIZE[dtype] * math.prod(shape)
               for dtype, shape in _expected_layout(codec, specs, block_size).values())


def _read_header(data: bytes) -> dict:
    if len(data) < 8:
        raise PayloadError("codec_header", f"{len(data)} bytes is too short for a safetensors header")
    (header_len,) = struct.unpack("<Q", data[:8])
    if header_len > min(len(data) - 8, _HEADER_MAX_BYTES):
        raise PayloadError("codec_header", f"header length {header_len} exceeds the {len(data)}-byte payload")
    try:
        header = json.loads(bytes(data[8 : 8 + header_len]))
    except (ValueError, RecursionError) as e:
        raise PayloadError("codec_header", f"unreadable header: {type(e).__name__}") from None
    if not isinstance(header, dict):
        raise PayloadError("codec_header", "the header is not a JSON object")
    return header


def check_header(data: bytes, codec: str, specs: Mapping[str, tuple[int, ...]],
                 block_size: int = DEFAULT_BLOCK_SIZE) -> None:
    """Check a payload's safetensors header against the announced codec, the configured block size
    and the expected tensors *before* anything is allocated from it (issue 14, defect 4).

    Reads only the JSON header (at most 100 MiB, and never more than the payload holds).

    Raises:
        PayloadError: ``codec_header`` for an unreadable header, a codec other than ``codec`` or
            (int8/int4/int2) a block size other than ``block_size``; ``schema`` naming every missing
            and every unexpected entry; ``dtype`` and ``shape`` naming every entry that differs.
    """
    _check_codec(codec)
    header = _read_header(data)
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or meta.get("codec") != codec:
        got = meta.get("codec") if isinstance(meta, dict) else meta
        raise PayloadError("codec_header", f"payload codec {got!r}, announced {codec!r}")
    if codec in _QMAX and meta.get("block_size") != str(block_size):
        raise PayloadError("codec_header", f"block_size {meta.get('block_size')!r}, configured {block_size}")
    want = _expected_layout(codec, specs, block_size)
    missing, unexpected = sorted(set(want) - set(header)), sorted(set(header) - set(want))
    if missing or unexpected:
        raise PayloadError("schema", f"missing {missing}, unexpected {unexpected}")
    info = {k: v if isinstance(v, dict) else {} for k, v in header.items()}
    bad_dtype = [f"{k} {info[k].get('dtype')!r} != {d!r}" for k, (d, _) in want.items() if info[k].get("dtype") != d]
    if bad_dtype:
        raise PayloadError("dtype", "; ".join(bad_dtype))
    bad_shape = [f"{k} {info[k].get('shape')!r} != {s!r}" for k, (_, s) in want.items() if info[k].get("shape") != s]
    if bad_shape:
        raise PayloadError("shape", "; ".join(bad_shape))
