"""Ranged reads of an object, checked piece by piece against its digest (DESIGN §3.1, §5).

An object's digest (:mod:`diloco_async.storage.digest`) is the sha256 of the sha256 of each of its pieces of
:data:`~diloco_async.storage.digest.PIECE_NBYTES` (one piece: that piece's plain sha256). A reader that wants
only some byte ranges reads the whole pieces that hold them (:class:`PieceReader`, one ranged
request per piece), hashes each one, and hands the bytes of its ranges to a sink. The piece
digests it took are checked against the object's digest once every piece is accounted for
(:func:`check_pieces`): by this reader alone when it read them all, or by several readers that
each read some (the ranks of a sharded learner group gather theirs first,
:func:`merge_piece_digests`). A piece two readers both read must have the same digest in both.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Mapping

from diloco_async.storage.digest import PIECE_NBYTES, digest_of_pieces
from diloco_async.storage.refs import IntegrityError, ObjectRef

__all__ = ["piece_count", "pieces_over", "PieceReader", "merge_piece_digests", "check_pieces"]


def piece_count(nbytes: int) -> int:
    """Pieces of an object of ``nbytes`` bytes (at least one: an empty object is one empty piece)."""
    return max(1, -(-nbytes // PIECE_NBYTES))


def pieces_over(ranges: Iterable[tuple[int, int]]) -> list[int]:
    """Sorted indices of the pieces that hold any byte of ``ranges`` (``[start, end)`` each; empty ones hold none)."""
    out: set[int] = set()
    for start, end in ranges:
        if end > start:
            out.update(range(start // PIECE_NBYTES, (end - 1) // PIECE_NBYTES + 1))
    return sorted(out)


class PieceReader:
    """Reads byte ranges of the object ``ref`` names from ``get_range(key, start, end)``, whole
    pieces at a time; :attr:`digests` holds the raw sha256 of every piece read (index → 32 bytes).

    Args:
        ref: the object (its size bounds the last piece; its digest is checked by :func:`check_pieces`).
        get_range: a ranged read, e.g. :meth:`diloco_async.storage.store.ObjectStore.get_range`.
    """

    def __init__(self, ref: ObjectRef, get_range: Callable[[str, int, int], bytes]) -> None:
        self.ref, self._get_range = ref, get_range
        self.digests: dict[int, bytes] = {}
        self.nbytes_read = 0
        self._last: tuple[int, memoryview] | None = None  # the piece read last, kept for the next call

    def read(self, ranges: Iterable[tuple[int, int]], sink: Callable[[int, memoryview], None]) -> None:
        """Call ``sink(offset, bytes)`` with the bytes of each range (``[start, end)``), in pieces,
        reading each piece once: the piece read last is kept for the next call, an older one is
        read again when a range needs its bytes (its digest must not change).

        Raises:
            IntegrityError: a range past the object's end, or a piece shorter than it must be
                (``size_mismatch``), or a piece read twice with two digests.
            FileNotFoundError: no object under the key.
        """
        ranges = [(a, b) for a, b in ranges if b > a]
        if any(a < 0 or b > self.ref.nbytes for a, b in ranges):
            raise IntegrityError(f"{self.ref.key}: ranges {ranges} reach past its {self.ref.nbytes} bytes",
                                 reason="size_mismatch")
        for index in pieces_over(ranges):
            lo, hi = index * PIECE_NBYTES, min((index + 1) * PIECE_NBYTES, self.ref.nbytes)
            data = self._piece(index, lo, hi)
            for a, b in ranges:
                s, e = max(a, lo), min(b, hi)
                if e > s:
                    sink(s, data[s - lo:e - lo])


    def _piece(self, index: int, lo: int, hi: int) -> memoryview:
        if self._last is not None and self._last[0] == index:
            return self._last[1]
        data = memoryview(self._get_range(self.ref.key, lo, hi))
        if len(data) != hi - lo:
            raise IntegrityError(f"{self.ref.key}: piece {index} is {len(data)} bytes, expected {hi - lo}",
                                 reason="size_mismatch")
        digest = hashlib.sha256(data).digest()
        if self.digests.setdefault(index, digest) != digest:
            raise IntegrityError(f"{self.ref.key}: piece {index} changed between two reads")
        self.nbytes_read += len(data)
        self._last = (index, data)
        return data


def merge_piece_digests(parts: Iterable[Mapping[int, bytes]], key: str = "") -> dict[int, bytes]:
    """One index → digest map from several readers' :attr:`PieceReader.digests`.

    Raises:
        IntegrityError: two readers read one piece with different digests.
    """
    out: dict[int, bytes] = {}
    for part in parts:
        for index, digest in part.items():
            if out.setdefault(int(index), digest) != digest:
                raise IntegrityError(f"{key}: piece {index} has two digests among the readers")
    return out


def check_pieces(ref: ObjectRef, digests: Mapping[int, bytes]) -> None:
    """Check that ``digests`` (index → raw sha256) covers every piece of ``ref`` and that they
    make its digest.

    Raises:
        IntegrityError: a piece was read by no one (``size_mismatch``), or the digest differs
            (``digest``): some byte read is not the object's.
    """
    n = piece_count(ref.nbytes)
    missing = [i for i in range(n) if i not in digests]
    if missing:
        raise IntegrityError(f"{ref.key}: pieces {missing[:8]} of {n} were read by no reader", reason="size_mismatch")
    seen = digest_of_pieces([digests[i] for i in range(n)])
    if seen != ref.sha256:
        raise IntegrityError(f"{ref.key}: the pieces read have digest {seen[:16]}..., expected {ref.sha256[:16]}...")
