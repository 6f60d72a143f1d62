"""Outer gradients held in their wire encoding until they are needed (issue 17 item 3).

The synchronizer checks a contribution when it arrives (decoding it one tensor at a time) and
keeps it as :class:`EncodedTensors` until its merge decodes it again: a contribution waiting for
its merge holds the codec's bytes (bf16: half of fp32, int4: about a seventh), not fp32's.
Pure: torch only.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from torch import Tensor

from diloco_async.codec.wire import SCALE_SUFFIX, decode, read_payload

__all__ = ["EncodedTensors", "load_encoded"]


@dataclass(frozen=True)
class EncodedTensors:
    """Tensors held in their encoding (the entries :func:`~diloco_async.codec.wire.encode` writes),
    decoded when asked.

    Attributes:
        encoded: the entries, as read from the payload (checked against ``specs`` when decoded).
        codec: one of :data:`~diloco_async.codec.wire.CODECS`.
        specs: name → shape of each tensor.
        block_size: of the int8/int4/int2 scales.
    """

    encoded: dict[str, Tensor]
    codec: str
    specs: dict[str, tuple[int, ...]]
    block_size: int

    @property
    def nbytes(self) -> int:
        """Bytes held by the encoded entries."""
        return sum(t.numel() * t.element_size() for t in self.encoded.values())

    def decode(self) -> dict[str, Tensor]:
        """name → new float32 tensor, as :func:`~diloco_async.codec.wire.decode` (the same values at every call)."""
        return decode(self.encoded, self.codec, self.specs, block_size=self.block_size)

    def iter_decoded(self) -> Iterator[tuple[str, Tensor]]:
        """(name, new float32 tensor) in the order of ``specs``, one at a time (one tensor's fp32 in
        memory, not the payload's). Raises ValueError as :func:`~diloco_async.codec.wire.decode` (an
        unexpected entry before anything is decoded)."""
        quantized = self.codec not in ("fp32", "bf16")
        expected = set(self.specs) | ({n + SCALE_SUFFIX for n in self.specs} if quantized else set())
        unexpected = sorted(set(self.encoded) - expected)
        if unexpected:
            raise ValueError(f"{self.codec} payload has entries not in the announced specs: {unexpected}")
        for name, shape in self.specs.items():
            part = {k: self.encoded[k] for k in (name, name + SCALE_SUFFIX) if k in self.encoded}
            yield name, decode(part, self.codec, {name: shape}, block_size=self.block_size)[name]


def load_encoded(data: bytes, codec: str, specs: dict[str, tuple[int, ...]]) -> tuple[EncodedTensors, dict[str, str]]:
    """Read the entries of bytes written by :func:`~diloco_async.codec.wire.encode_to_bytes` without
    decoding them: (the payload as :class:`EncodedTensors` of ``specs``, name → shape; the header
    metadata including ``codec`` and ``block_size``).

    Raises:
        ValueError: as :func:`~diloco_async.codec.wire.read_payload`; the entries' dtypes and sizes are
            checked when they are decoded.
    """
    encoded, meta, block_size = read_payload(data, codec)
    return EncodedTensors(encoded, codec, {k: tuple(int(x) for x in v) for k, v in specs.items()}, block_size), meta
