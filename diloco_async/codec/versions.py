"""Compressed downloads: published fragment versions in a compact codec (issue 13 item 3).

With ``synchronizer.download_codec`` other than ``fp32``, the synchronizer keeps two values of a
fragment: its *master* value Θ (the outer optimizer's own fp32 tensors, never rounded) and the
*published* value Θ^pub, which is what learners adopt and what every merge anchors on. Each new
version ``v`` (after version ``b``, the fragment's previous one) is published as

* ``delta`` mode: the payload ``E = Q(Θ_v − Θ^pub_b)`` and ``Θ^pub_v = Θ^pub_b + D(E)`` — error
  feedback: what ``Q`` lost (``Θ_v − Θ^pub_v``) stays in the master value and travels with the
  next delta;
* ``whole`` mode: ``E = Q(Θ_v)`` and ``Θ^pub_v = D(E)`` (no chain).

``Q``/``D`` are :func:`diloco_async.codec.wire.encode` / ``decode`` (fp32/bf16/int8/int4, blockwise
absmax), and the addition is one fp32 ``torch.add`` on the CPU, so the learner that applies ``E``
to its copy of ``Θ^pub_b`` gets ``Θ^pub_v`` bit for bit; the payload's header carries the sha256
of ``Θ^pub_v``'s bytes (:func:`published_digest`) and a learner checks it. ``Θ^pub_v`` is also
published whole in fp32 at the version's usual key (learners that join late or miss a version
download it; the synchronizer reads old bases back from it), so anchoring stays exact: the value
a learner adopted is always the synchronizer's ``history[v]``.

Payload layout: the codec's safetensors entries (:mod:`diloco_async.codec.wire`) with metadata
``codec``, ``block_size``, ``mode`` (``delta``/``whole``), ``base_version`` (``-1`` for whole),
``fragment``, ``version`` and ``published_sha256``.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass

import safetensors.torch
import torch
from torch import Tensor

from diloco_async.codec import wire
from diloco_async.storage.store import ObjectRef, ObjectStore

__all__ = ["DOWNLOAD_CODECS", "DOWNLOAD_MODES", "compress_version", "compact_bytes", "read_compact", "CompactForm",
           "published_digest", "apply_decoded"]

DOWNLOAD_CODECS = ("fp32", "bf16", "int8", "int4", "int2")
DOWNLOAD_MODES = ("delta", "whole")


# -- int2: downloads only (error feedback makes a 3-level delta usable) ------------------------
#: int2 layout, per tensor ``name`` of n elements: ``name`` uint8 ``(ceil(n/4),)``, element ``4i+j``
#: in bits ``2j..2j+1`` as ``q + 1`` with ``q = round(x / scale_k)`` in {-1, 0, 1} (``scale_k`` =
#: the block's absmax, as int8/int4 with q = 1); ``name::scale`` float32 ``(ceil(n / block_size),)``.
_INT2_SHIFTS = torch.tensor([0, 2, 4, 6], dtype=torch.uint8)


def _encode_int2(tensors: Mapping[str, Tensor], block_size: int) -> dict[str, Tensor]:
    out: dict[str, Tensor] = {}
    for name, t in tensors.items():
        q, scale = wire._quantize(t, 1, block_size)  # int8 in {-1, 0, 1}
        u = (q + 1).to(torch.uint8)
        pad = (-u.numel()) % 4
        if pad:
            u = torch.cat([u, torch.ones(pad, dtype=torch.uint8)])
        out[name] = (u.view(-1, 4) << _INT2_SHIFTS).sum(dim=1, dtype=torch.uint8)
        out[name + wire.SCALE_SUFFIX] = scale
    return out


def _decode_int2(encoded: Mapping[str, Tensor], shapes: Mapping[str, tuple[int, ...]],
                 block_size: int) -> dict[str, Tensor]:
    """Raises PayloadError ``schema``/``dtype``/``shape`` (layout) or ``range`` (a code of 3)."""
    want = {}
    for name, shape in shapes.items():
        n = math.prod(shape)
        want[name] = (torch.uint8, (n + 3) // 4)
        want[name + wire.SCALE_SUFFIX] = (torch.float32, -(-n // block_size))
    if set(encoded) != set(want):
        raise wire.PayloadError("schema", f"missing {sorted(set(want) - set(encoded))}, unexpected "
                                f"{sorted(set(encoded) - set(want))}")
    bad = [k for k, (dt, _) in want.items() if encoded[k].dtype != dt]
    if bad:
        raise wire.PayloadError("dtype", f"{bad}")
    bad = [k for k, (_, n) in want.items() if tuple(encoded[k].shape) != (n,)]
    if bad:
        raise wire.PayloadError("shape", f"{bad}")
    out = {}
    for name, shape in shapes.items():
        n = math.prod(shape)
        codes = ((encoded[name][:, None] >> _INT2_SHIFTS) & 3).reshape(-1)[:n]
        if bool((codes == 3).any()):
            raise wire.PayloadError("range", f"{name}: a 2-bit code of 3 (only 0, 1, 2 are written)")
        q = codes.to(torch.int8) - 1
        out[name] = wire._dequantize(q, encoded[name + wire.SCALE_SUFFIX], n, block_size).reshape(shape)
    return out


def _check_mode(mode: str) -> None:
    if mode not in DOWNLOAD_MODES:
        raise ValueError(f"unknown download mode {mode!r}; expected one of {DOWNLOAD_MODES}")


def apply_decoded(decoded: Mapping[str, Tensor], base: Mapping[str, Tensor] | None) -> dict[str, Tensor]:
    """Θ^pub from a decoded payload: ``decoded`` itself (whole mode, ``base`` None) or
    ``base + decoded`` (delta mode), each one fp32 CPU ``torch.add``: synchronizer and learner
    call this same function, so both get the same bits.

    Raises:
        KeyError: ``base`` lacks a name of ``decoded``.
    """
    if base is None:
        return dict(decoded)
    return {n: torch.add(base[n], d) for n, d in decoded.items()}


def published_digest(tensors: Mapping[str, Tensor]) -> str:
    """sha256 (hex) of the fp32 bytes of ``tensors`` in name order (names included), to check
    that a reconstructed Θ^pub is the synchronizer's bit for bit."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().to(device="cpu", dtype=torch.float32).contiguous()
        h.update(name.encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()


def compress_version(master: Mapping[str, Tensor], published_prev: Mapping[str, Tensor] | None, codec: str,
                     mode: str, block_size: int = wire.DEFAULT_BLOCK_SIZE,
                     ) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """(encoded payload entries, Θ^pub) of a new version whose master value is ``master``.

    Args:
        master: Θ_v, name → fp32 tensor (CPU).
        published_prev: Θ^pub of the previous version (delta mode; ignored for whole).
        codec: one of :data:`DOWNLOAD_CODECS`. mode: one of :data:`DOWNLOAD_MODES`.
        block_size: quantization block (int8/int4).

    Returns:
        The flat dict of :func:`diloco_async.codec.wire.encode` and the new published value (fp32,
        master's shapes), exactly what a learner reconstructs from the payload.

    Raises:
        ValueError: unknown codec or mode, delta mode without ``published_prev``, or a non-finite
            published value.
    """
    _check_mode(mode)
    if codec not in DOWNLOAD_CODECS:
        raise ValueError(f"unknown download codec {codec!r}; expected one of {DOWNLOAD_CODECS}")
    if mode == "delta":
        if published_prev is None:
            raise ValueError("delta mode needs the previous published value")
        x = {n: torch.sub(t, published_prev[n]) for n, t in master.items()}
    else:
        x = dict(master)
    shapes = {n: tuple(t.shape) for n, t in master.items()}
    if codec == "int2":
        encoded = _encode_int2(x, block_size)
        decoded = _decode_int2(encoded, shapes, block_size)
    else:
        encoded = wire.encode(x, codec, block_size)
        decoded = wire.decode(encoded, codec, shapes, block_size)
    published = apply_decoded(decoded, published_prev if mode == "delta" else None)
    bad = sorted(n for n, t in published.items() if not bool(torch.isfinite(t).all()))
    if bad:
        raise ValueError(f"the compressed version is not finite in {bad[:5]}")
    return encoded, published


def compact_bytes(encoded: Mapping[str, Tensor], codec: str, mode: str, block_size: int, *, fragment: int,
                  version: int, base_version: int | None, digest: str) -> bytes:
    """The safetensors bytes of a compact payload (layout in the module docstring)."""
    _check_mode(mode)
    meta = {"codec": codec, "block_size": str(block_size), "mode": mode, "fragment": str(fragment),
            "version": str(version), "base_version": str(-1 if base_version is None else base_version),
            "published_sha256": digest}
    return safetensors.torch.save(dict(encoded), metadata=meta)


def _decode_payload(data: bytes, codec: str, shapes: Mapping[str, tuple[int, ...]],
                    block_size: int) -> tuple[dict[str, Tensor], dict[str, str]]:
    """(decoded fp32 tensors, header metadata) of a compact payload; the header is checked first."""
    if codec != "int2":
        wire.check_header(data, codec, shapes, block_size)
        return wire.decode_from_bytes(data, codec, dict(shapes))
    meta = wire._read_header(data).get("__metadata__") or {}
    if not isinstance(meta, dict) or meta.get("codec") != codec or meta.get("block_size") != str(block_size):
        raise wire.PayloadError("codec_header", f"payload codec {meta.get('codec')!r} block_size "
                                f"{meta.get('block_size')!r}, announced {codec!r} {block_size}")
    try:
        encoded = safetensors.torch.load(bytes(data))
    except Exception as err:  # noqa: BLE001 - safetensors raises its own error types
        raise wire.PayloadError("codec_header", f"unreadable payload: {err}") from None
    return _decode_int2(encoded, shapes, block_size), meta


@dataclass(frozen=True)
class CompactForm:
    """How a compact payload was announced: its ``codec``, ``mode`` (``whole`` or ``delta``),
    ``block_size`` (elements), the version a delta applies to (``base_version``, None for whole)
    and the :func:`published_digest` of the value it rebuilds (``digest``, hex sha256)."""

    codec: str
    mode: str
    block_size: int
    base_version: int | None
    digest: str


def read_compact(store: ObjectStore, ref: ObjectRef, shapes: Mapping[str, tuple[int, ...]], form: CompactForm,
                 base: Mapping[str, Tensor] | None = None) -> dict[str, Tensor]:
    """Download a compact payload and rebuild Θ^pub (fp32, the names and shapes of ``shapes``).

    Args:
        store, ref: where the payload is (size and sha256 verified).
        form: the payload as announced (codec, mode, block size, base version, digest).
        base: Θ^pub of ``form.base_version``, the version the delta applies to (delta mode).

    Raises:
        FileNotFoundError: collected. diloco_async.storage.store.IntegrityError: size or digest of the payload.
        diloco_async.codec.wire.PayloadError: ``codec_header`` (codec, block size, mode, base version
            other than announced), ``schema``, ``dtype``, ``shape`` (also of the base), ``non_finite``, or
            ``published_digest`` (the rebuilt value is not the synchronizer's).
        ValueError: otherwise undecodable.
    """
    codec, mode, block_size, base_version, digest = (form.codec, form.mode, form.block_size, form.base_version,
                                                     form.digest)
    _check_mode(mode)
    if mode == "delta" and base is None:
        raise ValueError("a delta payload needs the base it applies to")
    if base is not None:
        bad_base = sorted(n for n, shape in shapes.items() if n not in base or tuple(base[n].shape) != tuple(shape))
        if bad_base:
            raise wire.PayloadError("shape", f"the base does not hold {bad_base[:5]} in the fragment's shapes")
    data = store.get(ref)
    decoded, meta = _decode_payload(data, codec, shapes, block_size)
    want_base = str(-1 if mode == "whole" or base_version is None else base_version)
    if meta.get("mode") != mode or meta.get("base_version") != want_base:
        raise wire.PayloadError("codec_header", f"payload mode {meta.get('mode')!r} base "
                                f"{meta.get('base_version')!r}, announced {mode!r} base {want_base}")
    bad = sorted(n for n, t in decoded.items() if not bool(torch.isfinite(t).all()))
    if bad:
        raise wire.PayloadError("non_finite", f"NaN/Inf in {bad[:5]}")
    published = apply_decoded(decoded, base if mode == "delta" else None)
    got = published_digest(published)
    if got != digest or meta.get("published_sha256") != digest:
        raise wire.PayloadError("published_digest", f"rebuilt value {got[:12]}…, announced {digest[:12]}…")
    return published
