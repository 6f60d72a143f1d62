"""Run checkpoints of a sharded synchronizer (diloco_async/storage/run_checkpoints.py; issue 40 item 3): one
manifest naming one checkpoint per shard with digests, written last; bad ones refused naming the
shard."""

from __future__ import annotations

import threading
import uuid

import pytest
import torch

from diloco_async.storage import keys
from diloco_async.storage.checkpoint import tensor_key, write_checkpoint
from diloco_async.storage.gc import ShardScope, collect_garbage
from diloco_async.storage.run_checkpoints import (
    latest_run_checkpoint,
    list_run_manifest_seqs,
    named_checkpoint,
    open_run_checkpoint,
    write_run_manifest,
)
from diloco_async.storage.store import ObjectStore

RUN = "run"


@pytest.fixture
def store() -> ObjectStore:
    return ObjectStore(f"memory://run-checkpoints-{uuid.uuid4().hex[:8]}")


def checkpoint(store: ObjectStore, shard: int, seq: int, value: float, lease_epoch: int = 1) -> None:
    """Shard ``shard`` (of 2) checkpoints its fragment (p = shard) at ``seq``."""
    tensors = {tensor_key(shard, kind, "w"): torch.full((3,), value) for kind in ("param", "momentum")}
    write_checkpoint(store, keys.synchronizer_root(RUN, shard, 2), seq, tensors,
                     {"versions": {str(shard): seq}, "lease_epoch": lease_epoch, "learners": {}})


def test_a_run_checkpoint_names_each_shards_newest_checkpoint_once_every_shard_has_one(store):
    checkpoint(store, 0, 1, 0.5)
    assert write_run_manifest(store, RUN, 2) is None  # shard 1 has none yet: nothing to name
    checkpoint(store, 1, 1, 1.5)
    assert write_run_manifest(store, RUN, 2) == 1
    assert write_run_manifest(store, RUN, 2) == 1  # the same checkpoints: no new run checkpoint
    checkpoint(store, 1, 2, 2.5)
    assert write_run_manifest(store, RUN, 2) == 2
    rc = open_run_checkpoint(store, RUN, 2, 2, load=True)
    assert {i: c.seq for i, c in rc.shards.items()} == {0: 1, 1: 2}
    whole = rc.combined()
    assert whole.seq == 2 and whole.manifest["versions"] == {"0": 1, "1": 2}
    assert torch.equal(whole.tensors[tensor_key(0, "param", "w")], torch.full((3,), 0.5))
    assert torch.equal(whole.tensors[tensor_key(1, "param", "w")], torch.full((3,), 2.5))
    assert latest_run_checkpoint(store, RUN, 2).seq == 2
    assert set(store.list(keys.checkpoint_prefix(RUN))) == {keys.run_manifest_key(RUN, s) for s in (1, 2)}


def _four_writers_at_once(store: ObjectStore, got: list[int | None]) -> None:
    """Four threads each write the run checkpoint at once; what each got is appended to ``got``."""
    threads = [threading.Thread(target=lambda: got.append(write_run_manifest(store, RUN, 2))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def test_shards_writing_at_once_take_distinct_numbers(store):
    checkpoint(store, 0, 1, 0.5)
    checkpoint(store, 1, 1, 1.5)
    got: list[int | None] = []
    checkpoint(store, 0, 2, 0.7)
    _four_writers_at_once(store, got)
    assert set(got) == {1} and list_run_manifest_seqs(store, RUN) == [1]  # one manifest for one set
    checkpoint(store, 1, 2, 1.7)
    _four_writers_at_once(store, got)
    assert list_run_manifest_seqs(store, RUN)[-1] in got[4:]
    newest = store.get_json(keys.run_manifest_key(RUN, list_run_manifest_seqs(store, RUN)[-1]))
    assert {s: e["seq"] for s, e in newest["checkpoints"].items()} == {"0": 2, "1": 2}


def forge(store: ObjectStore, seq: int, change) -> None:
    """Run checkpoint ``seq``: a copy of run checkpoint 1 changed by ``change``."""
    doc = store.get_json(keys.run_manifest_key(RUN, 1))
    change(doc["checkpoints"])
    store.put_json(keys.run_manifest_key(RUN, seq), {**doc, "seq": seq})


def test_a_bad_run_checkpoint_is_refused_naming_the_shard(store):
    checkpoint(store, 0, 1, 0.5)
    checkpoint(store, 1, 1, 1.5)
    assert write_run_manifest(store, RUN, 2) == 1
    forge(store, 2, lambda c: c.update({"2": dict(c["1"])}))
    with pytest.raises(ValueError, match="run checkpoint 2 of run run names synchronizer shard 2, which never "
                                         r"started: the run has synchronizer\.shards=2"):
        open_run_checkpoint(store, RUN, 2, 2)
    forge(store, 3, lambda c: c.pop("1"))
    with pytest.raises(ValueError, match="names no checkpoint of synchronizer shard 1"):
        open_run_checkpoint(store, RUN, 2, 3)
    forge(store, 4, lambda c: c["1"].update(seq=7))
    with pytest.raises(ValueError, match="names checkpoint 7 of synchronizer shard 1, which is not in the store"):
        open_run_checkpoint(store, RUN, 2, 4)
    forge(store, 5, lambda c: c["0"].update(manifest_sha256="0" * 64))
    with pytest.raises(ValueError, match="checkpoint 1 of synchronizer shard 0, whose manifest does not match"):
        open_run_checkpoint(store, RUN, 2, 5)
    with pytest.raises(ValueError, match="run checkpoint 9 of run run does not exist"):
        open_run_checkpoint(store, RUN, 2, 9)
    assert latest_run_checkpoint(store, RUN, 2).seq == 1  # the bad newer ones are skipped
    root1 = keys.synchronizer_root(RUN, 1, 2)
    store.delete(keys.checkpoint_state_key(root1, 1))  # shard 1's state lost: run checkpoint 1 no longer verifies
    with pytest.raises(ValueError, match="checkpoint 1 of synchronizer shard 1, whose state does not verify"):
        open_run_checkpoint(store, RUN, 2, 1)
    assert latest_run_checkpoint(store, RUN, 2) is None


def test_a_shard_collects_its_own_fragments_behind_the_checkpoint_the_run_checkpoint_names(store):
    """Versions and contributions lie under the run's root, checkpoints under each shard's: shard 0
    deletes fragment 0's old versions and contributions and its own old checkpoints, behind the
    checkpoint the newest run checkpoint names (not behind a newer one of its own), and leaves
    fragment 1 and shard 1 alone."""
    for p in range(2):
        for v in range(6):
            store.put(keys.version_key(RUN, p, v), b"v" * 10)
        for n in range(1, 6):
            store.put(keys.contribution_key(RUN, p, n, "L", "n0"), b"c" * 10)
    roots = [keys.synchronizer_root(RUN, i, 2) for i in range(2)]
    for seq, (shard, version) in enumerate([(0, 2), (0, 4)], start=1):
        write_checkpoint(store, roots[shard], seq, {tensor_key(shard, "param", "w"): torch.ones(2)},
                         {"versions": {str(shard): version}, "next_round": {str(shard): version + 1}})
    write_checkpoint(store, roots[1], 1, {tensor_key(1, "param", "w"): torch.ones(2)},
                     {"versions": {"1": 3}, "next_round": {"1": 4}})
    assert write_run_manifest(store, RUN, 2) == 1
    write_checkpoint(store, roots[0], 3, {tensor_key(0, "param", "w"): torch.ones(2)},  # not named by a run
                     {"versions": {"0": 5}, "next_round": {"0": 6}})                   # checkpoint yet
    assert named_checkpoint(store, RUN, 0) == 2 and named_checkpoint(store, RUN, 1) == 1
    done = collect_garbage(store, roots[0], keep_checkpoints=1, orphan_age_s=None,
                           shard=ShardScope(RUN, named_checkpoint(store, RUN, 0)))
    left = set(store.list(RUN))
    assert {v for v in range(6) if keys.version_key(RUN, 0, v) in left} == {4, 5}  # behind checkpoint 2's v4
    assert {n for n in range(1, 6) if keys.contribution_key(RUN, 0, n, "L", "n0") in left} == {4, 5}
    assert all(keys.version_key(RUN, 1, v) in left for v in range(6))  # fragment 1 is shard 1's
    assert all(keys.contribution_key(RUN, 1, n, "L", "n0") in left for n in range(1, 6))
    assert done.deleted_checkpoints == [1] and done.kept_checkpoints == [2, 3]
    assert open_run_checkpoint(store, RUN, 2, 1).seq == 1  # the run checkpoint still verifies
