"""The object digest (diloco_async/storage/digest.py, issue 17 item 4): equal to its written-out definition
(tests/digest_reference.py) at every size and however the bytes are fed; objects over 4 MiB
written before it (whole-object sha256 in their ref) still read, and only when the bytes are
theirs; the read buffer's huge-page hint."""

from __future__ import annotations

import hashlib
import os
import random
import sys
import threading

import pytest

from diloco_async.storage import digest, reader
from diloco_async.storage.digest import PIECE_NBYTES, PieceHasher, object_digest
from diloco_async.storage.faults import FaultyStore
from diloco_async.storage.store import IntegrityError, ObjectRef, ObjectStore
from tests.digest_reference import reference_digest

MiB = 1 << 20


def blob(nbytes: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(nbytes)


@pytest.mark.parametrize("nbytes", [0, 1, PIECE_NBYTES - 1, PIECE_NBYTES, PIECE_NBYTES + 1,
                                    3 * PIECE_NBYTES, 3 * PIECE_NBYTES + 12345])
def test_digest_is_its_definition(nbytes):
    data = blob(nbytes, seed=nbytes)
    assert object_digest(data) == reference_digest(data)
    if nbytes <= PIECE_NBYTES:  # small objects keep the plain sha256 they always had
        assert object_digest(data) == hashlib.sha256(data).hexdigest()
    else:
        assert object_digest(data) != hashlib.sha256(data).hexdigest()


def test_any_chunking_gives_the_same_digest():
    data = blob(2 * PIECE_NBYTES + 777, seed=1)
    rng = random.Random(2)
    for _ in range(5):
        hasher, pos = PieceHasher(), 0
        while pos < len(data):
            n = rng.choice([1, 63, 4096, PIECE_NBYTES - 5, PIECE_NBYTES, PIECE_NBYTES + 3, 3 * MiB])
            hasher.update(memoryview(data)[pos:pos + n])
            pos += n
        assert hasher.nbytes == len(data)
        assert hasher.hexdigest() == reference_digest(data)


def test_set_hash_threads_swaps_the_pool_and_refuses_zero():
    data = blob(3 * PIECE_NBYTES + 1, seed=9)
    try:
        for threads in (1, 3, None):
            digest.set_hash_threads(threads)
            assert digest.hash_threads() == (threads or digest.hash_threads())
            assert (digest._shared_pool() is None) == (digest.hash_threads() == 1)
            narrow = PieceHasher(lanes=1)
            narrow.update(data)
            narrow.widen()
            assert narrow.hexdigest() == object_digest(data) == reference_digest(data)
        with pytest.raises(ValueError, match=">= 1"):
            digest.set_hash_threads(0)
    finally:
        digest.set_hash_threads(None)


def test_a_changed_byte_or_order_changes_the_digest():
    data = bytearray(blob(3 * PIECE_NBYTES, seed=4))
    before = object_digest(bytes(data))
    data[2 * PIECE_NBYTES + 5] ^= 0x10
    assert object_digest(bytes(data)) != before
    a, b, c = (bytes(data[i:i + PIECE_NBYTES]) for i in range(0, len(data), PIECE_NBYTES))
    assert object_digest(a + b + c) != object_digest(b + a + c)


@pytest.mark.parametrize("value", ["0", "-2", "two", "1.5"])
def test_bad_hash_threads_setting_is_refused(monkeypatch, value):
    monkeypatch.setenv(digest.HASH_THREADS_ENV, value)
    with pytest.raises(ValueError, match="DILOCO_HASH_THREADS"):
        digest.hash_threads()


@pytest.fixture(params=["file", "memory"])
def store(request, tmp_path):
    if request.param == "file":
        return ObjectStore(f"file://{tmp_path}/s")
    return ObjectStore(f"memory://digest-{os.getpid()}-{tmp_path.name}")


def test_an_object_written_before_piece_digests_still_reads(store, tmp_path):
    data = blob(2 * PIECE_NBYTES + 100, seed=5)
    ref = store.put("old/state", data)
    assert ref.sha256 == reference_digest(data)
    legacy = ObjectRef(ref.key, ref.nbytes, hashlib.sha256(data).hexdigest())  # as an older version wrote it
    assert store.get(legacy) == data
    chunks: list[bytes] = []
    store.stream(legacy, chunks.append)
    assert b"".join(chunks) == data
    store.get_to_file(legacy, tmp_path / "copy")
    assert (tmp_path / "copy").read_bytes() == data
    store.verify(legacy)
    assert store.counters["legacy_digests"] == 4


def test_a_legacy_ref_to_other_bytes_is_refused(store):
    data = blob(2 * PIECE_NBYTES + 100, seed=6)
    ref = store.put("old/state", data)
    other = bytearray(data)
    other[-1] ^= 0xFF
    for wrong in (hashlib.sha256(bytes(other)).hexdigest(), object_digest(bytes(other))):
        with pytest.raises(IntegrityError, match="sha256"):
            store.get(ObjectRef(ref.key, ref.nbytes, wrong))
    assert store.counters.get("legacy_digests", 0) == 0


def test_a_corrupt_legacy_object_is_refused(tmp_path):
    store = ObjectStore(f"file://{tmp_path}/s")
    data = blob(2 * PIECE_NBYTES + 100, seed=7)
    ref = store.put("old/state", data)
    path = tmp_path / "s" / "old" / "state"
    os.chmod(path, 0o644)
    with open(path, "r+b") as fh:  # rot one byte at rest
        fh.seek(PIECE_NBYTES + 3)
        fh.write(bytes([data[PIECE_NBYTES + 3] ^ 0x01]))
    legacy = ObjectRef(ref.key, ref.nbytes, hashlib.sha256(data).hexdigest())
    for read in (store.get, store.verify, lambda r: store.stream(r, lambda chunk: None)):
        with pytest.raises(IntegrityError, match="sha256"):
            read(legacy)
    assert store.counters.get("legacy_digests", 0) == 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise through libc: Linux")
def test_large_read_buffers_ask_for_huge_pages(monkeypatch):
    assert reader._MADVISE is not None
    calls = []
    monkeypatch.setattr(reader, "_MADVISE", lambda addr, n, advice: calls.append((addr, n, advice)) or 0)
    small, large = reader._Target(reader.HUGE_PAGES_FROM_NBYTES - 1), reader._Target(8 * MiB)
    assert len(calls) == 1
    addr, n, advice = calls[0]
    assert advice == reader.mmap.MADV_HUGEPAGE and addr % reader.mmap.PAGESIZE == 0
    assert 8 * MiB - 2 * reader.mmap.PAGESIZE <= n <= 8 * MiB
    large.view[:] = b"\x01" * (8 * MiB)
    assert large.take() == b"\x01" * (8 * MiB) and len(small.take()) == reader.HUGE_PAGES_FROM_NBYTES - 1


@pytest.mark.parametrize("protocol", ["file", "memory"])
def test_a_legacy_ref_never_passes_bytes_that_differ_from_the_second_read(tmp_path, protocol):
    """The first read returns one flipped byte, the re-read the true bytes: the whole sha256 of
    the re-read matches the legacy ref, but what the caller holds is not those bytes."""
    url = f"file://{tmp_path}/s" if protocol == "file" else f"memory://digest-flip-{tmp_path.name}"
    store = FaultyStore(ObjectStore(url))
    data = blob(2 * PIECE_NBYTES + 100, seed=8)
    ref = store.put("old/state", data)
    legacy = ObjectRef(ref.key, ref.nbytes, hashlib.sha256(data).hexdigest())
    store.faults.corrupt()
    with pytest.raises(IntegrityError, match="sha256"):
        store.get(legacy)
    assert store.faults.injected["corrupt"] == 1 and store.counters.get("legacy_digests", 0) == 0
    assert store.get(legacy) == data  # nothing injected: accepted


def test_update_waits_while_the_backlog_is_full(monkeypatch):
    """A writer faster than hashing holds at most BACKLOG_PIECES per thread of its buffers."""
    release = threading.Event()
    real = digest._piece_digest
    monkeypatch.setattr(digest, "_piece_digest", lambda view: (release.wait(30), real(view))[1])
    data = blob(12 * PIECE_NBYTES, seed=10)
    hasher = PieceHasher(lanes=1)
    feeder = threading.Thread(target=hasher.update, args=(data,))
    feeder.start()
    try:
        feeder.join(0.5)
        assert feeder.is_alive()  # blocked: the pool is held and the backlog is full
        held = len(hasher._waiting) + hasher._running
        assert held == hasher._backlog == digest.BACKLOG_PIECES * digest.hash_threads()
    finally:
        release.set()
    feeder.join(30)
    assert not feeder.is_alive() and hasher.hexdigest() == reference_digest(data)


def test_a_stream_whose_pool_was_shut_down_still_finishes():
    """At interpreter exit the pool refuses new work; a stream in another thread must not hang."""
    data = blob(6 * PIECE_NBYTES + 5, seed=11)
    try:
        hasher = PieceHasher()
        digest.set_hash_threads(2)  # shuts down the pool the hasher holds
        hasher.update(data)
        assert hasher.hexdigest() == reference_digest(data)
    finally:
        digest.set_hash_threads(None)
