"""Store contract on the local backends (file://, memory://) and checkpoint commit rules."""

import os
import uuid

import pytest
import torch

from storage.checkpoint import latest_checkpoint, load_checkpoint, write_checkpoint
from storage.store import IntegrityError, ObjectRef, ObjectStore


@pytest.fixture(params=["file", "memory"])
def store(request, tmp_path):
    if request.param == "file":
        return ObjectStore(f"file://{tmp_path}/store")
    return ObjectStore(f"memory://test-{uuid.uuid4().hex}")


def test_put_get_verified(store):
    ref = store.put("run/a/b.bin", b"hello")
    assert ref.nbytes == 5 and len(ref.sha256) == 64
    assert store.get(ref) == b"hello"
    assert store.exists("run/a/b.bin")
    assert store.list("run") == ["run/a/b.bin"]


def test_exclusive_create_never_overwrites(store):
    ref = store.put("k/x", b"first")
    with pytest.raises(FileExistsError):
        store.put("k/x", b"second")
    assert store.get(ref) == b"first"


def test_digest_and_size_mismatch_detected(store):
    ref = store.put("k/y", b"payload")
    with pytest.raises(IntegrityError, match="sha256"):
        store.get(ObjectRef(ref.key, ref.nbytes, "0" * 64))
    with pytest.raises(IntegrityError, match="size"):
        store.get(ObjectRef(ref.key, ref.nbytes + 1, ref.sha256))


def test_missing_and_delete(store):
    with pytest.raises(FileNotFoundError):
        store.get(ObjectRef("nope", 1, "0" * 64))
    store.put("d/z", b"1")
    store.delete("d/z")
    store.delete("d/z")  # idempotent
    assert not store.exists("d/z")


def test_large_object(store):
    data = os.urandom(8 << 20)
    ref = store.put("big/obj", data)
    assert store.get(ref) == data


def test_bad_keys_rejected(store):
    for key in ["", "../escape", "a/../../b"]:
        with pytest.raises(ValueError):
            store.put(key, b"x")


def test_local_put_leaves_no_temp_files(tmp_path):
    store = ObjectStore(f"file://{tmp_path}/s")
    store.put("a/b", b"x")
    with pytest.raises(FileExistsError):
        store.put("a/b", b"y")
    assert sorted(os.listdir(tmp_path / "s" / "a")) == ["b"]


def _tensors(value: float):
    return {"p000/param/w": torch.full((3,), value), "p000/momentum/w": torch.zeros(3)}


def test_checkpoint_manifest_last_and_latest_skips_incomplete(store):
    write_checkpoint(store, "run", 1, _tensors(1.0), {"versions": {"0": 1}})
    write_checkpoint(store, "run", 2, _tensors(2.0), {"versions": {"0": 2}})
    # checkpoint 3: state written, manifest missing (killed mid-write)
    store.put("run/checkpoints/00000003/state.safetensors", b"partial")
    ck = latest_checkpoint(store, "run")
    assert ck.seq == 2 and ck.manifest["versions"] == {"0": 2}
    assert torch.equal(ck.tensors["p000/param/w"], torch.full((3,), 2.0))


def test_checkpoint_with_corrupt_state_is_skipped(tmp_path):
    store = ObjectStore(f"file://{tmp_path}/s")
    write_checkpoint(store, "run", 1, _tensors(1.0), {})
    write_checkpoint(store, "run", 2, _tensors(2.0), {})
    path = tmp_path / "s" / "run" / "checkpoints" / "00000002" / "state.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # truncated behind the manifest's back
    with pytest.raises(IntegrityError):
        load_checkpoint(store, "run", 2)
    assert latest_checkpoint(store, "run").seq == 1


def test_checkpoint_refuses_non_finite(store):
    bad = _tensors(1.0)
    bad["p000/param/w"][1] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        write_checkpoint(store, "run", 1, bad, {})
    assert latest_checkpoint(store, "run") is None
    assert store.list("run") == []
