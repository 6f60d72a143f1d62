"""The outer loop of a learner group sharded with FSDP2, shard by shard (DESIGN §3.1).

No rank holds a whole fragment. Each rank keeps Θ^base of its own rows of every parameter
(:attr:`ShardedOuter.base`, fp32 on the host), and at the step boundaries rank 0 decides:

* **contribute** (:meth:`ShardedOuter.contribute`): each rank takes Δ = Θ^base − θ on its rows of
  the fragment's tensors, encodes it in the round's codec and puts it as an object of its own
  (``keys.contribution_shard_key``: one object per fragment, round and rank; the metadata names
  the rows it holds of each tensor). The refs are gathered to rank 0, which announces the group's
  contribution naming every shard object (``Announcement.shards``); a rank whose put failed
  makes the whole contribution unannounced, never partial.
* **adopt** (:meth:`ShardedOuter.adopt`): each rank reads only the byte ranges of its rows of
  the published fp32 version (safetensors: the header gives each tensor's offsets, and a tensor's
  rows ``[a, b)`` are one contiguous range), in whole pieces of the object's digest
  (:class:`diloco_async.storage.pieces.PieceReader`); the ranks all-gather the digests of the pieces they read,
  and each checks that together they make the version's digest before it writes anything.
"""

from __future__ import annotations

import json
import logging
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from diloco_async.codec import wire
from diloco_async.learner.fsdp import local_rows, local_shards
from diloco_async.policy.fragments import FragmentPlan
from diloco_async.protocol.messages import VersionInfo
from diloco_async.storage import keys
from diloco_async.storage.pieces import PieceReader, check_pieces, merge_piece_digests
from diloco_async.storage.store import IntegrityError, ObjectRef, ObjectStore

__all__ = ["ContributionOrder", "ShardedUpload", "ShardedOuter", "read_own_rows", "shard_payload"]

log = logging.getLogger("diloco.learner")

#: the most bytes a version's safetensors header may take (a longer one is refused as corrupt)
MAX_HEADER_BYTES = 64 << 20


@dataclass(frozen=True)
class ContributionOrder:
    """What rank 0 tells every rank to contribute at a step boundary: fragment, round, the base
    version Δ is taken against, the codec, the update id (names the shard objects) and the counters."""

    fragment: int
    round_n: int
    base_version: int
    codec: str
    update_id: str
    c_steps: int
    c_tokens: int
    compute_s: float


@dataclass(frozen=True)
class ShardedUpload:
    """A contribution whose shards every rank put: the order and the refs by rank (rank 0 only);
    ``shards`` is None when a rank could not put its shard (nothing is announced)."""

    order: ContributionOrder
    shards: list[ObjectRef] | None


def read_own_rows(store: ObjectStore, ref: ObjectRef, shapes: Mapping[str, tuple[int, ...]],
                  rows: Mapping[str, tuple[int, int]]) -> tuple[dict[str, torch.Tensor], PieceReader]:
    """This rank's rows of the fp32 version at ``ref``: name → float32 tensor of shape
    ``(b - a, *shape[1:])`` for rows ``rows[name] = (a, b)``, read in whole pieces with ranged
    reads (the header's pieces too), not checked yet: the reader's piece digests go to
    :func:`diloco_async.storage.pieces.check_pieces`, with the other ranks'.

    Raises:
        IntegrityError: a header that does not parse or does not name these fp32 tensors of these
            shapes, or a piece shorter than it must be. FileNotFoundError: the version was collected.
    """
    reader = PieceReader(ref, store.get_range)
    head = bytearray(8)
    reader.read([(0, 8)], lambda off, b: head.__setitem__(slice(off, off + len(b)), b))
    (header_len,) = struct.unpack("<Q", bytes(head))
    if not 0 < header_len <= min(MAX_HEADER_BYTES, ref.nbytes - 8):
        raise IntegrityError(f"{ref.key}: header of {header_len} bytes in an object of {ref.nbytes}")
    raw = bytearray(header_len)
    reader.read([(8, 8 + header_len)], lambda off, b: raw.__setitem__(slice(off - 8, off - 8 + len(b)), b))
    try:
        header = json.loads(bytes(raw))
    except ValueError as err:
        raise IntegrityError(f"{ref.key}: unreadable header ({err})") from None
    if (header.get("__metadata__") or {}).get("codec", "fp32") != "fp32":
        raise IntegrityError(f"{ref.key}: a version must be fp32, got {header['__metadata__'].get('codec')!r}")
    if set(header) - {"__metadata__"} != set(shapes):
        raise IntegrityError(f"{ref.key}: tensors {sorted((set(header) - {'__metadata__'}) ^ set(shapes))[:5]} differ "
                             "from the fragment's")
    out, spans = {}, []  # spans: (start byte, end byte, target byte view)
    for name, shape in shapes.items():
        entry = header[name]
        if entry.get("dtype") != "F32" or tuple(entry.get("shape", ())) != tuple(shape):
            raise IntegrityError(f"{ref.key}: tensor {name} is {entry.get('dtype')} {entry.get('shape')}, expected "
                                 f"F32 {list(shape)}")
        a, b = rows[name]
        row_nbytes = 4 * math.prod(shape[1:])
        t = torch.empty((b - a, *shape[1:]), dtype=torch.float32)
        out[name] = t
        start = 8 + header_len + int(entry["data_offsets"][0]) + a * row_nbytes
        if b > a:
            spans.append((start, start + (b - a) * row_nbytes, t.view(torch.uint8).reshape(-1).numpy()))

    def sink(off: int, data: memoryview) -> None:
        for s, e, view in spans:
            lo, hi = max(s, off), min(e, off + len(data))
            if hi > lo:
                view[lo - s:hi - s] = np.frombuffer(data[lo - off:hi - off], dtype=np.uint8)

    reader.read([(s, e) for s, e, _ in spans], sink)
    return out, reader


def shard_payload(delta: Mapping[str, torch.Tensor], rows: Mapping[str, tuple[int, int]], codec: str,
                  meta: Mapping[str, str]) -> bytes:
    """One rank's shard of a contribution as a wire payload (:func:`~diloco_async.codec.wire.encode_to_bytes`):
    the tensors of which it holds rows (``delta``: name → float32 rows), with metadata ``meta``
    and ``rows`` (JSON name → [start, stop] of dim 0, every tensor of the fragment, empty ones too)."""
    held = {n: t.contiguous() for n, t in delta.items() if t.shape[0] > 0}
    return wire.encode_to_bytes(held, codec, {**meta, "rows": json.dumps({n: list(r) for n, r in rows.items()})})


class ShardedOuter:
    """One rank's side of a sharded group's outer loop; every method is a collective of the group.

    Args:
        store: the run's object store.
        learner_id: the group's learner id (names its shard objects).
        rank, world: this rank and the group's size.
        plan: the fragment plan (whole shapes).
        params: the sharded parameters by name (``DTensor``; their local shards are read and written).
    """

    def __init__(self, store: ObjectStore, learner_id: str, rank: int, world: int, plan: FragmentPlan,
                 params: Mapping[str, torch.Tensor]) -> None:
        self.store, self.learner_id, self.rank, self.world, self.plan = store, learner_id, rank, world, plan
        self.run_id = ""  # rank 0's, from the join (start)
        self.shapes = {p: {s.name: tuple(s.shape) for s in plan.fragments[p]} for p in range(plan.num_fragments)}
        self.rows = {p: local_rows(self.shapes[p], rank, world) for p in range(plan.num_fragments)}
        self.local = local_shards(params)
        self.base: dict[int, dict[str, torch.Tensor]] = {}  # fragment -> this rank's rows of Θ^base (fp32, host)
        self.bytes_read = 0

    def adopt(self, versions: list[VersionInfo], rebase: bool = False) -> None:
        """θ ← Θ^new on this rank's rows of each version's fragment, and Θ^base ← Θ^new; nothing
        is written unless every rank read its rows and the pieces read by all make each version's digest.
        ``rebase`` (a restored inner state moved onto the versions named at join): θ ← θ + (Θ^new −
        Θ^base) instead, so the progress since the saved base is kept (as a one-process learner's
        ``_rebase_to_join``).

        Raises:
            IntegrityError, FileNotFoundError, ValueError: on any rank (each rank raises; the group ends).
        """
        read, errors, mine = {}, [], []
        for v in versions:
            ref = ObjectRef(v.key, v.nbytes, v.sha256)
            try:
                tensors, reader = read_own_rows(self.store, ref, self.shapes[v.fragment], self.rows[v.fragment])
                read[v.fragment] = tensors
                mine.append(reader.digests)
                self.bytes_read += reader.nbytes_read
            except Exception as err:  # noqa: BLE001 - every rank must reach the gather, then all raise
                errors.append(f"rank {self.rank}: fragment {v.fragment} v{v.version}: {type(err).__name__}: {err}")
                mine.append({})
        gathered: list = [None] * self.world
        dist.all_gather_object(gathered, (mine, errors))
        failed = [e for _, errs in gathered for e in errs]
        if failed:
            raise IntegrityError("sharded adoption failed: " + "; ".join(failed))
        for i, v in enumerate(versions):
            check_pieces(ObjectRef(v.key, v.nbytes, v.sha256), merge_piece_digests((g[0][i] for g in gathered), v.key))
        with torch.no_grad():
            for p, tensors in read.items():
                for name, t in tensors.items():
                    if rebase:
                        self.local[name].add_(t - self.base[p][name])
                    else:
                        self.local[name].copy_(t, non_blocking=True)
                self.base[p] = tensors

    def contribute(self, orders: list[ContributionOrder]) -> list[ShardedUpload]:
        """Take, encode and put this rank's shard of each order's outer gradient; returns, on rank
        0, the uploads with every rank's ref (an empty list elsewhere)."""
        mine: list[ObjectRef | None] = []
        for o in orders:
            mine.append(self._put_shard(o))
        gathered: list = [None] * self.world if self.rank == 0 else []
        dist.gather_object(mine, gathered if self.rank == 0 else None, dst=0)
        if self.rank != 0:
            return []
        out = []
        for i, o in enumerate(orders):
            refs = [g[i] for g in gathered]
            out.append(ShardedUpload(o, None if any(r is None for r in refs) else refs))
        return out

    def _put_shard(self, o: ContributionOrder) -> ObjectRef | None:
        p = o.fragment
        base = self.base[p]
        with torch.no_grad():
            delta = {n: base[n] - self.local[n].detach().to("cpu", torch.float32) for n in self.shapes[p]}
        meta = {"learner": self.learner_id, "fragment": str(p), "round": str(o.round_n),
                "base_version": str(o.base_version), "rank": str(self.rank), "world": str(self.world)}
        key = keys.contribution_shard_key(self.run_id, p, o.round_n, self.learner_id, o.update_id, self.rank,
                                          self.world)
        try:
            return self.store.put(key, shard_payload(delta, self.rows[p], o.codec, meta))
        except Exception as err:  # noqa: BLE001 - reported to rank 0 as a missing ref: nothing is announced
            log.warning("%s rank %d: shard of fragment %d round %d not uploaded (%s: %s)", self.learner_id, self.rank,
                        p, o.round_n, type(err).__name__, err)
            return None
