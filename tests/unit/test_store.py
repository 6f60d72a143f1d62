"""Local-store specifics, checkpoint commit rules and garbage collection.

The backend contract is test_storage_contract.py.
"""

import json
import os
import threading
import time
import uuid

import pytest
import torch

from diloco_async.storage import keys
from diloco_async.storage.checkpoint import latest_checkpoint, load_checkpoint, write_checkpoint
from diloco_async.storage.retry import RetryPolicy
from diloco_async.storage.store import IntegrityError, ObjectStore


@pytest.fixture(params=["file", "memory"])
def store(request, tmp_path):
    if request.param == "file":
        return ObjectStore(f"file://{tmp_path}/store")
    return ObjectStore(f"memory://test-{uuid.uuid4().hex}")


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
    store.put(keys.checkpoint_state_key("run", 3), b"partial")
    ck = latest_checkpoint(store, "run")
    assert ck.seq == 2 and ck.manifest["versions"] == {"0": 2}
    assert torch.equal(ck.tensors["p000/param/w"], torch.full((3,), 2.0))


def test_checkpoint_written_consuming_its_tensors_is_the_same_bytes_and_lets_each_go(store):
    """consume=True (the synchronizer's checkpoints): the same state file, bit for bit, and each
    tensor dropped from the dict once written, so one a merge replaced meanwhile is freed early."""
    import gc
    import weakref

    big = torch.arange(1 << 16, dtype=torch.float32)
    tensors = {**_tensors(3.0), "p001/param/big": big}
    watch = weakref.ref(big)
    del big
    write_checkpoint(store, "run", 1, dict(tensors), {"versions": {"0": 1}})
    write_checkpoint(store, "run", 2, tensors, {"versions": {"0": 1}}, consume=True)
    assert tensors == {}
    gc.collect()
    assert watch() is None  # nothing else held it
    one, two = (store.get_json(keys.state_manifest_key(keys.checkpoint_prefix("run"), s))["state"] for s in (1, 2))
    assert one["sha256"] == two["sha256"] and one["nbytes"] == two["nbytes"]
    assert torch.equal(load_checkpoint(store, "run", 2).tensors["p001/param/big"], torch.arange(1 << 16).float())


def test_checkpoint_with_corrupt_state_is_skipped(tmp_path):
    store = ObjectStore(f"file://{tmp_path}/s")
    write_checkpoint(store, "run", 1, _tensors(1.0), {})
    write_checkpoint(store, "run", 2, _tensors(2.0), {})
    path = tmp_path / "s" / keys.checkpoint_state_key("run", 2)
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


# -- garbage collection (diloco_async/storage/gc.py) ----------------------------------------------------------

from diloco_async.storage.gc import collect_garbage  # noqa: E402


def _run_layout(store, run="run"):
    """Versions 1..5 of fragments 0 and 1, contributions of rounds 1..5, checkpoints 1..4 (4 is
    the newest complete one: p0 at v4, p1 at v3, next rounds 5 and 4) and 5 in progress."""
    store.put_json(keys.plan_key(run), {"plan": 1})
    store.put(keys.state_file_key(keys.learner_prefix(run, "A"), 1), b"inner")
    for p in (0, 1):
        for v in range(1, 6):
            store.put(keys.version_key(run, p, v), b"v" * (10 + v))
        for n in range(1, 6):
            for learner in ("A", "B"):
                store.put(keys.contribution_key(run, p, n, learner, "n0"), b"c" * n)
    for seq in range(1, 5):
        manifest = {"versions": {"0": seq, "1": max(seq - 1, 1)}, "next_round": {"0": seq + 1, "1": seq},
                    "version_refs": {"0": {str(v): {} for v in range(max(seq - 1, 1), seq + 1)},
                                     "1": {str(max(seq - 1, 1)): {}}}}
        write_checkpoint(store, run, seq, _tensors(float(seq)), manifest)
    store.put(keys.checkpoint_state_key(run, 5), b"half a checkpoint")


def test_gc_deletes_behind_the_newest_verified_checkpoint(store):
    _run_layout(store)
    before = store.sizes("run")
    dry = collect_garbage(store, "run", keep_checkpoints=2, dry_run=True)
    assert store.sizes("run") == before
    report = collect_garbage(store, "run", keep_checkpoints=2)
    assert (report.deleted, report.deleted_nbytes) == (dry.deleted, dry.deleted_nbytes)
    assert report.checkpoint == 4 and report.deleted_checkpoints == [1, 2] and report.kept_checkpoints == [3, 4, 5]
    left = set(store.list("run"))
    assert {keys.version_key("run", p, v) for p in (0, 1) for v in (3, 4, 5)} <= left
    assert not {keys.version_key("run", p, v) for p in (0, 1) for v in (1, 2)} & left
    kept_rounds = {0: range(4, 6), 1: range(3, 6)}  # next_round - 1 and later
    for p in (0, 1):
        for n in range(1, 6):
            assert (keys.contribution_key("run", p, n, "A", "n0") in left) == (n in kept_rounds[p])
    assert {keys.plan_key("run"), keys.state_file_key(keys.learner_prefix("run", "A"), 1),
            keys.checkpoint_state_key("run", 5)} <= left
    assert report.deleted == {"globals": 4, "contrib": 10, "checkpoints": 4}
    assert report.nbytes == sum(before.values()) - sum(store.sizes("run").values())
    assert latest_checkpoint(store, "run").seq == 4
    again = collect_garbage(store, "run", keep_checkpoints=2)
    assert again.objects == 0


def test_gc_keeps_the_versions_learners_are_still_reading(store):
    """``keep_versions`` (the synchronizer's read leases, issue 47): a version behind the floor that a
    live learner may still be reading is kept with its compact form and counted; contributions are
    not versions and go as before."""
    _run_layout(store)
    store.put(keys.compact_key("run", 0, 1, "bf16", "whole"), b"compact v1")
    store.put(keys.compact_key("run", 0, 2, "bf16", "whole"), b"compact v2")
    report = collect_garbage(store, "run", keep_checkpoints=2, keep_versions={0: {1}, 1: {2, 9}})
    left = set(store.list("run"))
    assert {keys.version_key("run", 0, 1), keys.compact_key("run", 0, 1, "bf16", "whole"),
            keys.version_key("run", 1, 2)} <= left
    assert not {keys.version_key("run", 0, 2), keys.version_key("run", 1, 1),
                keys.compact_key("run", 0, 2, "bf16", "whole")} & left
    assert report.kept_for_reads == 3 and report.deleted["globals"] == 2 and report.deleted["compact"] == 1
    assert report.deleted["contrib"] == 10  # as without leases
    assert collect_garbage(store, "run", keep_checkpoints=2).deleted == {"globals": 2, "compact": 1}  # lease over


def test_gc_keeps_at_least_the_newest_verified_checkpoint(tmp_path):
    store = ObjectStore(f"file://{tmp_path}/s")
    _run_layout(store)
    # checkpoint 4's state rots behind its manifest: 3 is now the newest that verifies
    path = tmp_path / "s" / keys.checkpoint_state_key("run", 4)
    path.write_bytes(path.read_bytes()[:-1])
    report = collect_garbage(store, "run", keep_checkpoints=1)
    assert report.checkpoint == 3 and report.kept_checkpoints == [3, 4, 5] and report.deleted_checkpoints == [1, 2]
    assert latest_checkpoint(store, "run").seq == 3
    assert store.exists(keys.version_key("run", 0, 2))  # checkpoint 3 still names v2 of p0


def test_gc_verifies_the_newest_checkpoint_without_loading_it(tmp_path):
    """gc (in a running synchronizer) checks the newest checkpoint's digest as it streams by and
    keeps no tensor: one flipped byte (same size) makes it fall back to the previous one."""
    store = ObjectStore(f"file://{tmp_path}/s")
    _run_layout(store)
    path = tmp_path / "s" / keys.checkpoint_state_key("run", 4)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))
    light = latest_checkpoint(store, "run", load=False)
    assert (light.seq, light.tensors) == (3, {}) and light.manifest["seq"] == 3
    assert latest_checkpoint(store, "run").seq == 3 and latest_checkpoint(store, "run").tensors
    assert collect_garbage(store, "run", keep_checkpoints=1).checkpoint == 3


def test_gc_without_a_verified_checkpoint_deletes_nothing(store):
    store.put(keys.version_key("run", 0, 1), b"v1")
    store.put(keys.checkpoint_state_key("run", 1), b"no manifest")
    report = collect_garbage(store, "run")
    assert report.checkpoint is None and report.objects == 0 and "nothing deleted" in report.reason
    assert len(store.list("run")) == 2
    with pytest.raises(ValueError, match="keep_checkpoints"):
        collect_garbage(store, "run", keep_checkpoints=0)


def test_gc_removes_temp_files_of_dead_writers_past_the_age_threshold(tmp_path):
    """Defect 12 on file://: temporary files of uploads that never finished are collected once
    idle longer than orphan_age_s (also without any checkpoint), younger ones and other runs'
    ones are left alone, and a dry run only reports."""
    store = ObjectStore(f"file://{tmp_path}/s")
    store.put(keys.version_key("run", 0, 1), b"v1")
    folder = tmp_path / "s" / os.path.dirname(keys.version_key("run", 0, 1))
    now = time.time()

    def temp(path, nbytes, age_s):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x" * nbytes)
        os.utime(path, (now - age_s, now - age_s))
        return path

    dead = temp(folder / ".tmp-dead", 10, 2 * 3600)
    deep = temp(tmp_path / "s" / "run" / "contrib" / "p0" / "r1" / ".tmp-dead2", 5, 3 * 86400)
    young = temp(folder / ".tmp-young", 3, 60)
    other_run = temp(tmp_path / "s" / "other" / ".tmp-dead", 1, 3 * 86400)
    assert store.list("run") == [keys.version_key("run", 0, 1)]  # listings never show them
    assert collect_garbage(store, "run").deleted == {"temp_file": 1}  # default: a day
    assert not deep.exists() and dead.exists()
    dry = collect_garbage(store, "run", orphan_age_s=3600, dry_run=True)
    assert dry.deleted == {"temp_file": 1} and dry.deleted_nbytes == {"temp_file": 10} and dead.exists()
    report = collect_garbage(store, "run", orphan_age_s=3600)
    assert report.deleted == {"temp_file": 1} and report.checkpoint is None
    assert not dead.exists() and young.exists() and other_run.exists()
    assert store.list("run") == [keys.version_key("run", 0, 1)]
    with pytest.raises(ValueError, match="orphan_age_s"):
        collect_garbage(store, "run", orphan_age_s=-1)


def test_writer_copies_reused_buffers_and_straddles_parts():
    store = ObjectStore(f"memory://writer-{uuid.uuid4().hex}", part_nbytes=256 << 10)
    buf, expected = bytearray(100_000), b""
    with store.open_writer("w") as w:
        for i in range(10):  # the caller reuses one buffer: what was written must not change
            buf[:] = bytes([i]) * len(buf)
            w.write(buf)
            expected += bytes(buf)
        w.write(b"")
        w.write(memoryview(b"tail"))
        expected += b"tail"
    assert w.ref.nbytes == len(expected) and store.get(w.ref) == expected
    exact = [os.urandom(256 << 10) for _ in range(3)]  # parts that are whole bytes objects
    with store.open_writer("x") as w2:
        for part in exact:
            w2.write(part)
    assert store.get(w2.ref) == b"".join(exact)
    with pytest.raises(ValueError, match="closed"):
        w2.write(b"more")


# -- storage options in the environment (diloco_async/storage/options.py) -------------------------------------

from diloco_async.storage.options import STORAGE_OPTIONS_ENV, storage_options_from_env  # noqa: E402


def test_storage_options_from_env():
    assert STORAGE_OPTIONS_ENV == "DILOCO_STORAGE_OPTIONS"  # the name child processes are started with
    assert storage_options_from_env({}) == {} and storage_options_from_env({STORAGE_OPTIONS_ENV: ""}) == {}
    options = {"client_kwargs": {"endpoint_url": "http://127.0.0.1:9"}, "anon": False}
    assert storage_options_from_env({STORAGE_OPTIONS_ENV: json.dumps(options)}) == options
    with pytest.raises(ValueError, match=f"^{STORAGE_OPTIONS_ENV} is not valid JSON") as err:
        storage_options_from_env({STORAGE_OPTIONS_ENV: '{"key": "secret-value"'})
    assert "secret-value" not in str(err.value)
    with pytest.raises(ValueError, match=f"^{STORAGE_OPTIONS_ENV} must be a JSON object, got list"):
        storage_options_from_env({STORAGE_OPTIONS_ENV: "[1, 2]"})


def test_storage_options_from_env_reads_the_process_environment(monkeypatch):
    monkeypatch.setenv(STORAGE_OPTIONS_ENV, '{"anon": true}')
    assert storage_options_from_env() == {"anon": True}
    monkeypatch.delenv(STORAGE_OPTIONS_ENV)
    assert storage_options_from_env() == {}


# -- key layout (diloco_async/storage/keys.py) -----------------------------------------------------------------


def test_keys_layout_and_parsers_round_trip():
    assert keys.contribution_key("r", 2, 7, "L1", "n0") == "r/contrib/p002/r00000007/L1-n0.safetensors"
    assert keys.contribution_key("r", 2, 7, "L1", "n0").startswith(keys.contribution_round_prefix("r", 2, 7) + "/")
    assert keys.version_key("r", 1, 12) == "r/globals/p001/v00000012.safetensors"
    assert keys.version_key("r", 1, 12).startswith(keys.fragment_versions_prefix("r", 1) + "/")
    assert keys.parse_version_key("r", keys.version_key("r", 1, 12)) == (1, 12)
    assert keys.parse_contribution_key("r", keys.contribution_key("r", 2, 7, "L1", "n0")) == (2, 7)
    for other in ("r/globals/p001/x.bin", "r2/globals/p001/v00000012.safetensors", keys.plan_key("r"),
                  keys.contribution_key("r", 2, 7, "L1", "n0")):
        assert keys.parse_version_key("r", other) is None
    assert keys.parse_contribution_key("r", keys.version_key("r", 1, 12)) is None
    assert keys.checkpoint_state_key("r", 3) == "r/checkpoints/00000003/state.safetensors"
    assert keys.checkpoint_manifest_key("r", 3) == "r/checkpoints/00000003/manifest.json"
    assert keys.ddp_checkpoint_prefix("r") == "r/ddp/checkpoints"
    prefix = keys.learner_prefix("r", "L1")
    assert keys.state_seq_of(prefix, keys.state_manifest_key(prefix, 42)) == 42
    assert keys.state_seq_of(prefix + "/", keys.state_file_key(prefix, 42)) == 42
    for other in (keys.state_folder(prefix, 42), f"{prefix}/x/state.safetensors", keys.checkpoint_state_key("r", 42)):
        assert keys.state_seq_of(prefix, other) is None
    assert keys.split_state_key(keys.state_manifest_key(prefix, 42)) == (prefix, 42)
    assert keys.split_state_key(keys.state_folder(prefix, 42) + "/") == (prefix, 42)
    for bad in ("00000042", f"{prefix}/x/manifest.json", keys.state_file_key(prefix, 42)):
        with pytest.raises(ValueError, match="names no checkpoint"):
            keys.split_state_key(bad)
    url = keys.checkpoint_url("s3://bucket/root", "r", 5)
    assert url == "s3://bucket/root/r/checkpoints/00000005"
    assert keys.split_checkpoint_url(url) == ("s3://bucket/root", "r", 5)


# -- local reads straight into the result (issue 17, item 4) ------------------------------------------


def _big(nbytes: int, seed: int = 0) -> bytes:
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)) \
        .numpy().tobytes()


def test_local_large_get_reads_into_bytes_and_verifies(tmp_path):
    """A large local object is read into the ``bytes`` returned, in chunks, and its sha256 is of
    exactly those bytes: a flipped byte on disk or a file of the wrong size is refused."""
    from diloco_async.storage import reader

    store = ObjectStore(f"file://{tmp_path}/s", part_nbytes=256 * 1024)
    data = _big(3 * reader.INTO_CHUNK_NBYTES + 12345)
    ref = store.put("big", data)
    got = store.get(ref)
    assert type(got) is bytes and got == data
    path = tmp_path / "s" / "big"
    os.chmod(path, 0o644)
    with open(path, "r+b") as fh:  # rot one byte at rest, in the last chunk
        fh.seek(len(data) - 7)
        fh.write(bytes([data[-7] ^ 0x01]))
    with pytest.raises(IntegrityError, match="sha256"):
        store.get(ref)
    with open(path, "ab") as fh:
        fh.write(b"!")
    with pytest.raises(IntegrityError) as err:
        store.get(ref)
    assert err.value.reason == "size_mismatch"


def test_local_read_left_hanging_cannot_change_what_get_returned(tmp_path, monkeypatch):
    """A chunk read that times out and lands later (a hung disk) writes into a buffer the store
    has let go of: the bytes already returned, and verified, stay what was verified."""
    from diloco_async.storage import backends, reader

    store = ObjectStore(f"file://{tmp_path}/s", part_nbytes=256 * 1024,
                        policy=RetryPolicy(timeout_s=0.3, retries=2, backoff_s=0.01))
    data = _big(8 * 256 * 1024 + 3, seed=1)
    ref = store.put("big", data)
    gate, landed = threading.Event(), threading.Event()
    calls = []
    real = backends._LocalStream.readinto

    def readinto(self, view):
        calls.append(len(view))
        if len(calls) == 3:  # the third chunk hangs past the timeout, then writes junk and returns
            gate.wait(5)
            view[:] = b"\xff" * len(view)
            landed.set()
            return len(view)
        return real(self, view)

    monkeypatch.setattr(backends._LocalStream, "readinto", readinto)
    got = store.get(ref)
    assert store.counters["timeouts"] == 1 and got == data
    gate.set()
    assert landed.wait(5)
    assert got == data and calls[0] == min(256 * 1024, reader.INTO_CHUNK_NBYTES)  # chunks of part_nbytes


def test_gc_collects_compact_versions_as_their_versions(store):
    """Compressed-download payloads (``compact/p/v...``, diloco_async/codec/versions.py) go with the
    versions: the ones below a fragment's floor are deleted, the others kept."""
    _run_layout(store)
    for p in (0, 1):
        for v in range(1, 6):
            store.put(keys.compact_key("run", p, v, "int4", "delta"), b"d" * v)
    report = collect_garbage(store, "run", keep_checkpoints=2)
    left = set(store.list("run"))
    for p in (0, 1):
        for v in range(1, 6):
            assert (keys.compact_key("run", p, v, "int4", "delta") in left) == (v >= 3), (p, v)
    assert report.deleted["compact"] == 4 and report.deleted["globals"] == 4
