"""Part sizes of multi-part uploads, chosen from the object size and the backend's limits.

A backend that writes large objects in parts bounds them: S3 takes at most 10,000 parts of
5 MiB to 5 GiB each (the last may be smaller), GCS resumable uploads take non-final parts in
multiples of 256 KiB. The store's ``part_nbytes`` is a preference; these pure functions turn it
into a part size that fits, so any object the backend allows is written:

* :func:`part_nbytes_for`: the object size is known (``put``, ``put_from_file``): one part size,
  the preferred one unless the part count would pass ``max_parts``;
* :func:`streaming_part_nbytes`: the size is unknown (a streamed writer): parts grow, doubling
  every tenth of ``max_parts``, so a stream reaches the backend's largest object before it runs
  out of part numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PartLimits", "S3_LIMITS", "GCS_LIMITS", "NO_LIMITS", "part_nbytes_for", "streaming_part_nbytes",
           "max_object_nbytes"]

MiB = 1 << 20
GiB = 1 << 30
TiB = 1 << 40


@dataclass(frozen=True)
class PartLimits:
    """What a backend allows of an object written in parts.

    Attributes:
        max_parts: most parts in one upload (None: unbounded).
        min_part_nbytes: smallest non-final part, bytes.
        max_part_nbytes: largest part, bytes (None: unbounded).
        max_object_nbytes: largest object, bytes (None: ``max_parts * max_part_nbytes``, or unbounded).
        quantum_nbytes: non-final parts are a multiple of this many bytes.

    Raises:
        ValueError: a bound that is not positive, or a minimum above the maximum.
    """

    max_parts: int | None = None
    min_part_nbytes: int = 1
    max_part_nbytes: int | None = None
    max_object_nbytes: int | None = None
    quantum_nbytes: int = 1

    def __post_init__(self) -> None:
        bounds = (self.max_parts, self.max_part_nbytes, self.max_object_nbytes)
        if self.min_part_nbytes < 1 or self.quantum_nbytes < 1 or any(b is not None and b < 1 for b in bounds):
            raise ValueError(f"part limits must be positive, got {self}")
        if self.max_part_nbytes is not None and self.max_part_nbytes < self.min_part_nbytes:
            raise ValueError(f"max_part_nbytes {self.max_part_nbytes} < min_part_nbytes {self.min_part_nbytes}")


#: Amazon S3 multipart upload limits (10,000 parts, 5 MiB..5 GiB each, the last part may be smaller)
S3_LIMITS = PartLimits(max_parts=10_000, min_part_nbytes=5 * MiB, max_part_nbytes=5 * GiB)
#: GCS resumable uploads: no part count, chunks of 256 KiB multiples, objects up to 5 TiB
GCS_LIMITS = PartLimits(max_object_nbytes=5 * TiB, quantum_nbytes=256 * 1024)
#: local files and memory
NO_LIMITS = PartLimits()


def max_object_nbytes(limits: PartLimits) -> int | None:
    """The largest object ``limits`` allow, bytes (None: unbounded)."""
    if limits.max_object_nbytes is not None:
        return limits.max_object_nbytes
    if limits.max_parts is not None and limits.max_part_nbytes is not None:
        return limits.max_parts * limits.max_part_nbytes
    return None


def _round_up(nbytes: int, quantum: int) -> int:
    return -(-nbytes // quantum) * quantum


def part_nbytes_for(object_nbytes: int, preferred_nbytes: int, limits: PartLimits) -> int:
    """Size of every non-final part of an object of ``object_nbytes`` bytes.

    The preferred size, raised to the backend's minimum, and raised further (to a multiple of
    the quantum) when ``object_nbytes / preferred`` would need more than ``max_parts`` parts.

    Raises:
        ValueError: a negative size, a preference below 1 byte, or an object larger than the
            backend allows (the message names both sizes).
    """
    if object_nbytes < 0 or preferred_nbytes < 1:
        raise ValueError(f"object_nbytes must be >= 0 and preferred_nbytes >= 1, got {object_nbytes}, "
                         f"{preferred_nbytes}")
    largest = max_object_nbytes(limits)
    if largest is not None and object_nbytes > largest:
        raise ValueError(f"object of {object_nbytes} bytes is larger than the backend allows ({largest} bytes)")
    nbytes = max(preferred_nbytes, limits.min_part_nbytes)
    if limits.max_parts is not None:
        nbytes = max(nbytes, -(-object_nbytes // limits.max_parts))
    nbytes = _round_up(nbytes, limits.quantum_nbytes)
    if limits.max_part_nbytes is not None:
        nbytes = min(nbytes, limits.max_part_nbytes)
    return nbytes


def streaming_part_nbytes(part_number: int, preferred_nbytes: int, limits: PartLimits) -> int:
    """Size of part ``part_number`` (1-based) of a stream whose total size is not known.

    Parts start at the preferred size (at least the backend's minimum) and double every
    ``max_parts // 10`` parts, up to ``max_part_nbytes``: on S3 with 16 MiB parts a stream
    reaches 10 TiB within its 10,000 parts, while a small one keeps small parts.

    Raises:
        ValueError: ``part_number`` < 1, or past ``max_parts`` (the stream is larger than the
            backend allows).
    """
    if part_number < 1:
        raise ValueError(f"part_number must be >= 1, got {part_number}")
    nbytes = _round_up(max(preferred_nbytes, limits.min_part_nbytes), limits.quantum_nbytes)
    if limits.max_parts is None:
        return nbytes
    if part_number > limits.max_parts:
        raise ValueError(f"part {part_number} is past the backend's limit of {limits.max_parts} parts")
    step = max(limits.max_parts // 10, 1)
    nbytes <<= (part_number - 1) // step
    if limits.max_part_nbytes is not None:
        nbytes = min(nbytes, limits.max_part_nbytes)
    return nbytes
