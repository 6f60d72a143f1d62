"""A sharded learner group's contribution, reassembled from its shard objects (DESIGN §3.1).

A learner group sharded with FSDP2 puts one object per rank for a contribution (each holds the
rows of dim 0 that rank holds of every tensor of the fragment, named in its ``rows`` metadata)
and announces them all (``Announcement.shards``). :func:`fetch_shards` reads every shard object
(size and digest checked, as any contribution), decodes it, and puts the rows of each tensor
back in order into the whole tensor: the merge, the update guard and RDA then see exactly the
whole outer gradient a DDP group would have sent (RDA's norm is that of the whole tensor, taken
after reassembly). Any shard that is missing, corrupt, of another layout, or rows that leave a
gap or overlap, refuse the whole contribution with a reason (:class:`ShardError`); nothing of
it is merged.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

import torch

from diloco_async.codec import wire
from diloco_async.codec.held import EncodedTensors
from diloco_async.protocol.messages import ShardObject, shard_list_digest
from diloco_async.storage.store import IntegrityError, ObjectRef, ObjectStore

__all__ = ["ShardError", "fetch_shards", "reassemble"]


class ShardError(wire.PayloadError):
    """A shard object of a contribution refuses it whole. ``reason``: ``missing_shard`` (no object
    at a shard's key), ``shard_digest`` (a shard's size or digest, or the shard list's digest,
    differ from the announcement) or ``shard_layout`` (a shard's rank, group size or rows do not
    fit the fragment's tensors)."""


def _read_shard(store: ObjectStore, s: ShardObject, rank: int, world: int, codec: str,
                shapes: Mapping[str, tuple[int, ...]], block_size: int) -> dict[str, tuple[int, int, torch.Tensor]]:
    """One shard object: name → (start row, stop row, encoded rows)."""
    where = f"shard {rank} of {world} ({s.key})"
    try:
        data = store.get(ObjectRef(s.key, s.nbytes, s.sha256))
    except FileNotFoundError:
        raise ShardError("missing_shard", f"{where} is missing") from None
    except IntegrityError as err:
        raise ShardError("shard_digest", f"{where}: {err}") from None
    encoded, meta, bs = wire.read_payload(data, codec)
    del data
    if meta.get("rank") != str(rank) or meta.get("world") != str(world) or bs != block_size:
        raise ShardError("shard_layout", f"{where} says rank {meta.get('rank')} of {meta.get('world')}, block size "
                         f"{bs} (expected block size {block_size})")
    try:
        rows = {n: (int(a), int(b)) for n, (a, b) in json.loads(meta["rows"]).items()}
    except (KeyError, ValueError, TypeError) as err:
        raise ShardError("shard_layout", f"{where} has no readable rows ({err})") from None
    if set(rows) != set(shapes):
        raise ShardError("shard_layout", f"{where} names tensors {sorted(set(rows) ^ set(shapes))[:5]} unlike the "
                         "fragment's")
    held = {n: r for n, r in rows.items() if r[1] > r[0]}
    bad = [n for n, (a, b) in held.items() if not 0 <= a < b <= shapes[n][0]]
    if bad:
        raise ShardError("shard_layout", f"{where}: rows {[(n, held[n]) for n in bad[:3]]} outside the tensors")
    specs = {n: (b - a, *shapes[n][1:]) for n, (a, b) in held.items()}
    decoded = EncodedTensors(encoded, codec, specs, block_size).decode()  # PayloadError: schema, shape, dtype
    return {n: (a, b, decoded[n]) for n, (a, b) in held.items()}


def reassemble(parts: list[dict[str, tuple[int, int, torch.Tensor]]],
               shapes: Mapping[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """The whole tensors from the shards' rows (``parts``: one per rank, name → (start, stop, rows)).

    Raises:
        ShardError: ``shard_layout`` where the rows of a tensor leave a gap or overlap.
    """
    out = {}
    for name, shape in shapes.items():
        pieces = sorted((a, b, t) for part in parts for n, (a, b, t) in part.items() if n == name)
        pos = 0
        for a, b, _ in pieces:
            if a != pos:
                raise ShardError("shard_layout", f"tensor {name}: rows {[(x, y) for x, y, _ in pieces]} do not tile "
                                 f"[0, {shape[0]})")
            pos = b
        if pos != shape[0]:
            raise ShardError("shard_layout", f"tensor {name}: rows end at {pos}, expected {shape[0]}")
        out[name] = torch.cat([t for _, _, t in pieces]).reshape(shape) if len(pieces) != 1 else pieces[0][2]
    return out


def fetch_shards(store: ObjectStore, shards: list[ShardObject], sha256: str, codec: str,
                 shapes: dict[str, tuple[int, ...]], block_size: int = wire.DEFAULT_BLOCK_SIZE
                 ) -> dict[str, torch.Tensor]:
    """The whole outer gradient (name → float32 tensor of ``shapes``) of a sharded group's
    contribution, from its ``shards`` (rank order) announced with digest ``sha256``.

    Raises:
        ShardError: a shard missing or corrupt, another layout, or ``sha256`` is not the list's digest.
        PayloadError: a shard's tensors do not decode to its rows (``schema``, ``shape``, ``dtype``).
        ValueError: a shard's payload is unreadable.
    """
    if shard_list_digest(shards) != sha256:
        raise ShardError("shard_digest", "the announcement's sha256 is not the digest of its shard list")
    world = len(shards)
    parts = [_read_shard(store, s, r, world, codec, shapes, block_size) for r, s in enumerate(shards)]
    return reassemble(parts, shapes)
