"""Which synchronizer shard owns which fragment (issue 40; DESIGN §2.2). Pure: no I/O.

Fragments are independent (each has its own rounds, versions, momentum and outer optimizer), so
the fragment plan is divided among S synchronizer processes without changing the math: fragment
``p`` belongs to shard ``p mod S``. Balanced fragments are near equal in size, so this round-robin
assignment gives every shard near the same share of the model (the capacity plan,
:mod:`diloco_async.capacity`, assumes exactly this assignment).
"""

from __future__ import annotations

__all__ = ["shard_of", "fragments_of", "assignment", "check_shard"]


def check_shard(shard: int, shards: int) -> None:
    """Raises ValueError naming the values unless ``0 <= shard < shards`` and ``shards >= 1``."""
    if shards < 1:
        raise ValueError(f"synchronizer.shards={shards} must be at least 1")
    if not 0 <= shard < shards:
        raise ValueError(f"shard {shard} is outside [0, {shards}) for synchronizer.shards={shards}")


def shard_of(fragment: int, shards: int) -> int:
    """The shard that owns ``fragment``: ``fragment mod shards``.

    Raises:
        ValueError: ``shards`` < 1 or a negative ``fragment``.
    """
    if shards < 1 or fragment < 0:
        raise ValueError(f"fragment {fragment} on synchronizer.shards={shards}: need fragment >= 0, shards >= 1")
    return fragment % shards


def fragments_of(shard: int, shards: int, num_fragments: int) -> list[int]:
    """The fragments shard ``shard`` of ``shards`` owns, ascending (never empty).

    Raises:
        ValueError: ``shard`` outside ``[0, shards)``, or more shards than ``num_fragments`` (a shard
            would own nothing).
    """
    check_shard(shard, shards)
    if shards > num_fragments:
        raise ValueError(f"synchronizer.shards={shards} exceeds synchronizer.num_fragments={num_fragments}")
    return list(range(shard, num_fragments, shards))


def assignment(shards: int, num_fragments: int) -> dict[int, list[int]]:
    """Every shard's fragments: ``{shard: fragments_of(shard)}`` (what ``{run_id}/shards.json`` records).

    Raises:
        ValueError: as :func:`fragments_of`.
    """
    return {i: fragments_of(i, shards, num_fragments) for i in range(shards)}
