"""The sharded data path of an FSDP2 learner group, without processes (DESIGN §3.1).

* a rank reads only the pieces that hold its rows of a published version (ranged reads), and the
  piece digests of all ranks together check against the version's digest; a changed byte is caught;
* the synchronizer reassembles a contribution from its shard objects exactly; a missing or corrupt
  shard object, or rows that do not tile a tensor, refuse it whole with a counted reason.
"""

from __future__ import annotations

import os

import pytest
import torch

from diloco_async.learner.fsdp import local_rows, rows_of
from diloco_async.learner.fsdp_outer import read_own_rows, shard_payload
from diloco_async.protocol.messages import ShardObject, shard_list_digest
from diloco_async.storage.pieces import check_pieces, merge_piece_digests
from diloco_async.storage.store import IntegrityError, ObjectStore
from diloco_async.sync.shard_objects import ShardError, fetch_shards
from diloco_async.sync.work import put_version, rejection_reason

SHAPES = {"a.weight": (4096, 1024), "b.bias": (3,), "c.weight": (5, 7)}  # 16 MiB and more: 5 pieces of 4 MiB


def values(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}


def test_rows_follow_torch_chunk():
    for n in (0, 1, 3, 5, 4096):
        for world in (1, 2, 3, 4):
            chunks = torch.arange(n).chunk(world) if n else ()
            got = [rows_of(n, r, world) for r in range(world)]
            want = [(int(c[0]), int(c[-1]) + 1) for c in chunks if len(c)]
            assert [r for r in got if r[1] > r[0]] == want
            assert got[0][0] == 0 and got[-1][1] == n


def test_each_rank_reads_its_pieces_and_together_they_check(tmp_path):
    store = ObjectStore(f"file://{tmp_path}")
    whole = values()
    ref = put_version(store, "run", 0, 1, whole)
    readers = []
    for rank in range(2):
        rows = local_rows(SHAPES, rank, 2)
        got, reader = read_own_rows(store, ref, SHAPES, rows)
        for n, (a, b) in rows.items():
            assert torch.equal(got[n], whole[n][a:b])
        assert reader.nbytes_read < ref.nbytes  # not the whole object
        readers.append(reader)
    assert set(readers[0].digests) != set(readers[1].digests)
    check_pieces(ref, merge_piece_digests(r.digests for r in readers))  # together: every piece, the digest
    with pytest.raises(IntegrityError, match="read by no reader"):
        check_pieces(ref, readers[0].digests)

    path = os.path.join(str(tmp_path), ref.key)  # one byte of rank 1's rows changed in the store
    with open(path, "r+b") as fh:
        fh.seek(ref.nbytes - 100)
        byte = fh.read(1)
        fh.seek(ref.nbytes - 100)
        fh.write(bytes([byte[0] ^ 0xFF]))
    _, bad = read_own_rows(store, ref, SHAPES, local_rows(SHAPES, 1, 2))
    with pytest.raises(IntegrityError, match="digest"):
        check_pieces(ref, merge_piece_digests([readers[0].digests, bad.digests]))


def put_shards(store: ObjectStore, whole: dict[str, torch.Tensor], world: int = 2,
               rows_of_rank=None) -> list[ShardObject]:
    out = []
    for rank in range(world):
        rows = rows_of_rank(rank) if rows_of_rank else local_rows(SHAPES, rank, world)
        delta = {n: whole[n][a:b] for n, (a, b) in rows.items()}
        data = shard_payload(delta, rows, "fp32", {"rank": str(rank), "world": str(world)})
        ref = store.put(f"run/contrib/p000/r00000001/l-u.rank{rank:03d}of{world:03d}.safetensors", data)
        out.append(ShardObject(key=ref.key, nbytes=ref.nbytes, sha256=ref.sha256))
    return out


def test_a_contribution_is_reassembled_from_its_shards(tmp_path):
    store = ObjectStore(f"file://{tmp_path}")
    whole = values(1)
    shards = put_shards(store, whole)
    got = fetch_shards(store, shards, shard_list_digest(shards), "fp32", SHAPES)
    assert all(torch.equal(got[n], whole[n]) for n in SHAPES)


def test_a_missing_or_corrupt_shard_refuses_the_contribution_whole(tmp_path):
    store = ObjectStore(f"file://{tmp_path}")
    shards = put_shards(store, values(2))
    digest = shard_list_digest(shards)
    with pytest.raises(ShardError) as err:
        fetch_shards(store, shards, "0" * 64, "fp32", SHAPES)
    assert err.value.reason == "shard_digest"

    path = os.path.join(str(tmp_path), shards[0].key)
    with open(path, "r+b") as fh:  # shard 0 corrupted
        fh.seek(shards[0].nbytes - 10)
        fh.write(b"\x00" * 10)
    with pytest.raises(ShardError) as err:
        fetch_shards(store, shards, digest, "fp32", SHAPES)
    assert err.value.reason == "shard_digest" and "shard 0 of 2" in str(err.value)

    store = ObjectStore(f"file://{tmp_path}/other")
    shards = put_shards(store, values(2))
    store.delete(shards[1].key)  # shard 1 missing
    with pytest.raises(ShardError) as err:
        fetch_shards(store, shards, shard_list_digest(shards), "fp32", SHAPES)
    assert err.value.reason == "missing_shard"
    want = f"missing_shard: shard 1 of 2 ({shards[1].key}) is missing"
    assert rejection_reason(err.value, shards[0].key, 60.0) == want  # the reason the round table counts


def test_rows_that_do_not_tile_a_tensor_are_refused(tmp_path):
    store = ObjectStore(f"file://{tmp_path}")

    def gap(rank: int) -> dict[str, tuple[int, int]]:  # rank 1 starts one row late: row 2048 of a.weight is in no shard
        rows = local_rows(SHAPES, rank, 2)
        return {**rows, "a.weight": (2049, 4096)} if rank == 1 else rows

    shards = put_shards(store, values(3), rows_of_rank=gap)
    with pytest.raises(ShardError) as err:
        fetch_shards(store, shards, shard_list_digest(shards), "fp32", SHAPES)
    assert err.value.reason == "shard_layout" and "a.weight" in str(err.value)
