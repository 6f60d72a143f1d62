"""One store contract, run against every backend: memory://, file://, S3 (moto server on
loopback) and GCS (fake-gcs-server on loopback). DESIGN §5, STYLE habit 6."""

from __future__ import annotations

import hashlib
import os
import uuid

import pytest

from diloco_async.storage.faults import FaultyStore, SimulatedCrash
from diloco_async.storage.retry import RetryPolicy
from diloco_async.storage.store import IntegrityError, ObjectRef, ObjectStore
from tests.digest_reference import reference_digest

from storage_servers import make_bucket

MiB = 1 << 20
PART = 5 * MiB  # the S3 minimum, so "large" objects of a few parts stay cheap
BACKENDS = ["memory", "file", "s3", "gs"]


def open_store(kind: str, request, tmp_path, **retry) -> ObjectStore:
    policy = RetryPolicy(**{"timeout_s": 30.0, "retries": 2, "backoff_s": 0.05, **retry})
    if kind == "memory":
        return ObjectStore(f"memory://contract-{uuid.uuid4().hex}", policy=policy, part_nbytes=PART)
    if kind == "file":
        return ObjectStore(f"file://{tmp_path}/store", policy=policy, part_nbytes=PART)
    server = request.getfixturevalue("s3_endpoint" if kind == "s3" else "gcs_endpoint")
    bucket = make_bucket(kind, server.storage_options)
    return ObjectStore(f"{kind}://{bucket}/root", server.storage_options, policy=policy, part_nbytes=PART)


@pytest.fixture(params=BACKENDS)
def store(request, tmp_path) -> ObjectStore:
    return open_store(request.param, request, tmp_path)


def blob(nbytes: int, seed: int = 0) -> bytes:
    return hashlib.shake_256(f"blob-{seed}".encode()).digest(nbytes)


def test_write_once_read_verified(store):
    ref = store.put("run/a/b.bin", b"hello")
    assert ref == ObjectRef("run/a/b.bin", 5, hashlib.sha256(b"hello").hexdigest())
    assert store.get(ref) == b"hello"
    assert store.get_unverified("run/a/b.bin") == b"hello"
    assert store.exists("run/a/b.bin") and not store.exists("run/a/other")


def test_empty_object(store):
    ref = store.put("e/empty", b"")
    assert ref.nbytes == 0 and store.get(ref) == b""


def test_json_round_trip(store):
    store.put_json("m/manifest.json", {"b": [1, 2], "a": "x"})
    assert store.get_json("m/manifest.json") == {"a": "x", "b": [1, 2]}


def test_list_sorted_relative_recursive_and_prefix_exact(store):
    for key in ["r/p001/v00000002", "r/p001/v00000001", "r/p000/v00000001", "rx/other", "r2/x"]:
        store.put(key, key.encode())
    assert store.list("r") == ["r/p000/v00000001", "r/p001/v00000001", "r/p001/v00000002"]
    assert store.list("r/p001") == ["r/p001/v00000001", "r/p001/v00000002"]
    assert store.list("nothing/here") == []
    assert store.sizes("r/p000") == {"r/p000/v00000001": len(b"r/p000/v00000001")}


def test_folders_are_the_names_directly_under_a_prefix(store):
    for key in ["run-b/config.json", "run-a/config.json", "run-a/checkpoints/00000001/manifest.json", "top.json"]:
        store.put(key, key.encode())
    assert store.folders() == ["run-a", "run-b"]  # not the object at the root, not the nested folders
    assert store.folders("run-a") == ["checkpoints"]
    assert store.folders("nothing/here") == []


def test_exclusive_create_refused_on_existing_key(store):
    ref = store.put("k/x", b"first")
    with pytest.raises(FileExistsError):
        store.put("k/x", b"second")
    assert store.get(ref) == b"first"


def test_exclusive_create_refused_for_large_object(store):
    first = blob(2 * PART + 123, seed=1)
    ref = store.put("k/big", first)
    with pytest.raises(FileExistsError):
        store.put("k/big", blob(2 * PART + 123, seed=2))
    with pytest.raises(FileExistsError):
        with store.open_writer("k/big") as w:
            w.write(blob(3 * PART, seed=3))
    assert store.get(ref) == first
    assert store.list("k") == ["k/big"]


def test_racing_writers_exactly_one_wins(store):
    """Writers racing on one key: one publishes, the others get FileExistsError, and the key
    holds exactly the winner's bytes (no mix, no overwrite)."""
    import concurrent.futures

    payloads = [blob(1000, seed=i) for i in range(4)]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(store.put, "race/k", p) for p in payloads]
    won = [f.result() for f in futures if f.exception() is None]
    lost = [f.exception() for f in futures if f.exception() is not None]
    assert len(won) == 1 and len(lost) == 3 and all(isinstance(e, FileExistsError) for e in lost)
    assert store.get(won[0]) in payloads


def test_digest_and_size_mismatch_detected(store):
    ref = store.put("k/y", b"payload")
    with pytest.raises(IntegrityError, match="sha256"):
        store.get(ObjectRef(ref.key, ref.nbytes, "0" * 64))
    with pytest.raises(IntegrityError, match="size"):
        store.get(ObjectRef(ref.key, ref.nbytes + 1, ref.sha256))
    big = store.put("k/big", blob(PART + 1))
    with pytest.raises(IntegrityError, match="sha256"):
        store.get(ObjectRef(big.key, big.nbytes, "0" * 64))
    with pytest.raises(IntegrityError, match="size"):
        store.verify(ObjectRef(big.key, big.nbytes - 1, big.sha256))


def test_missing_keys(store):
    with pytest.raises(FileNotFoundError):
        store.get(ObjectRef("nope", 1, "0" * 64))
    with pytest.raises(FileNotFoundError):
        store.get(ObjectRef("nope", 3 * PART, "0" * 64))
    with pytest.raises(FileNotFoundError):
        store.get_unverified("nope")


def test_delete_is_idempotent(store):
    store.put("d/z", b"1")
    store.delete("d/z")
    store.delete("d/z")
    assert not store.exists("d/z")
    assert store.list("d") == []
    store.put("d/z", b"2")  # a deleted key may be written again


def test_large_object_in_parts(store):
    data = blob(2 * PART + 7, seed=4)  # three parts, the last one short
    ref = store.put("big/obj", data)
    assert ref.nbytes == len(data) and ref.sha256 == reference_digest(data)
    assert store.get(ref) == data
    assert store.sizes("big") == {"big/obj": len(data)}


def test_streamed_put_and_get(store, tmp_path):
    data = blob(2 * PART + 99, seed=5)
    with store.open_writer("s/streamed") as w:
        for i in range(0, len(data), 1_000_003):  # writes that straddle part boundaries
            w.write(data[i:i + 1_000_003])
    assert w.ref == ObjectRef("s/streamed", len(data), reference_digest(data))
    src = tmp_path / "src.bin"
    src.write_bytes(data[: PART + 5])
    ref2 = store.put_from_file("s/from-file", src)
    out = tmp_path / "sub" / "out.bin"
    store.get_to_file(w.ref, out)
    assert out.read_bytes() == data
    store.get_to_file(ref2, out)
    assert out.read_bytes() == data[: PART + 5]
    with pytest.raises(IntegrityError):
        store.get_to_file(ObjectRef(ref2.key, ref2.nbytes, "0" * 64), tmp_path / "bad.bin")
    assert not (tmp_path / "bad.bin").exists()
    assert sorted(os.listdir(tmp_path / "sub")) == ["out.bin"]


def test_exception_mid_stream_publishes_nothing(store):
    """C11: the serializer raises after ~60 % of the object; nothing appears at the key."""
    data = blob(3 * PART, seed=6)
    with pytest.raises(RuntimeError, match="serializer"):
        with store.open_writer("c11/fragment") as w:
            w.write(data[: int(0.6 * len(data))])
            raise RuntimeError("serializer failed")
    assert not store.exists("c11/fragment")
    assert store.list("c11") == []
    ref = store.put("c11/fragment", data)  # a retry produces the complete object
    assert store.get(ref) == data


def test_torn_write_leaves_nothing(store):
    """A crash after part of an object went through the real write path (and no cleanup ran):
    no object under the final key, not even a short one."""
    faulty = FaultyStore(store)
    for key, nbytes in [("torn/small", 1000), ("torn/large", 2 * PART + 5)]:
        faulty.faults.tear(after_nbytes=nbytes // 2)
        with pytest.raises(SimulatedCrash):
            faulty.put(key, blob(nbytes))
        assert not store.exists(key)
        with pytest.raises(FileNotFoundError):
            store.get_unverified(key)
    assert store.list("torn") == []
    assert faulty.faults.injected["tear"] == 2
    ref = store.put("torn/large", blob(2 * PART + 5))
    assert store.get(ref) == blob(2 * PART + 5)


def test_bad_keys_rejected(store):
    for key in ["", "/", "../escape", "a/../../b", "a/.tmp-123"]:
        with pytest.raises(ValueError):
            store.put(key, b"x")


def test_child_store_shares_objects(store):
    child = store.child("run-1")
    ref = child.put("a/b", b"x")
    assert store.get(ObjectRef("run-1/a/b", ref.nbytes, ref.sha256)) == b"x"
    assert child.list("a") == ["a/b"]
    assert repr(child).endswith("/run-1')")


def test_repr_and_logs_hold_no_credentials(caplog):
    secret = "s3cr3t-" + uuid.uuid4().hex
    store = ObjectStore(f"memory://creds-{uuid.uuid4().hex}", {"key": secret, "secret": secret},
                        policy=RetryPolicy(backoff_s=0.01))
    faulty = FaultyStore(store)
    faulty.faults.fail("put", times=1)
    with caplog.at_level("DEBUG", logger="diloco"):
        faulty.put("k", b"x")
    assert "retrying" in caplog.text
    assert secret not in repr(store) and secret not in repr(faulty) and secret not in caplog.text


def test_s3_aborted_upload_leaves_no_pending_parts(s3_endpoint, request, tmp_path):
    store = open_store("s3", request, tmp_path)
    with pytest.raises(RuntimeError):
        with store.open_writer("x/y") as w:
            w.write(blob(2 * PART + 1))
            raise RuntimeError("boom")
    bucket = store.root.split("/")[0]
    uploads = store.fs.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads", [])
    assert uploads == []
    assert store.counters["aborted_uploads"] == 1


def test_s3_store_reads_credentials_from_environment(s3_endpoint):
    assert os.environ["AWS_DEFAULT_REGION"] == "us-east-1"
    options = s3_endpoint.storage_options
    assert "region_name" not in options["client_kwargs"]
