"""Fault injection through the real store (diloco_async/storage/faults.py): transient errors are retried,
hung calls time out (C08), an error mid-upload publishes nothing (C11), a torn checkpoint is
skipped (C10), stale listings never hide or spoil an exact key, corrupt reads are caught."""

from __future__ import annotations

import hashlib
import logging
import random
import threading
import uuid

import pytest
import torch

from diloco_async.storage import keys
from diloco_async.storage.checkpoint import latest_checkpoint, load_checkpoint, write_checkpoint
from diloco_async.storage.faults import FaultPlan, FaultyStore, SimulatedCrash
from diloco_async.storage.gc import collect_garbage
from diloco_async.storage.retry import Backoff, RetryPolicy, call_with_retry, run_with_timeout
from diloco_async.storage.store import IntegrityError, ObjectStore

from polling import wait_until
from storage_servers import make_bucket

KiB, MiB = 1 << 10, 1 << 20
PART = 256 * KiB
#: a call a test hangs blocks this long at most, then fails as a dead connection (ConnectionError):
#: a timeout that does not cut it makes the test fail on the error, not on a count of seconds
HANG_S = 30.0
#: the per-call timeout of a test that hangs some calls and lets real ones through: the real ones
#: (a memory or local-file call of a few hundred KiB) must never run into it, even on a loaded machine
CUT_S = 1.0


def blob(nbytes: int, seed: int = 0) -> bytes:
    return hashlib.shake_256(f"fault-{seed}".encode()).digest(nbytes)


def local_store(kind: str, tmp_path, **retry) -> ObjectStore:
    policy = RetryPolicy(**{"timeout_s": 5.0, "retries": 3, "backoff_s": 0.01, **retry})
    if kind == "memory":
        return ObjectStore(f"memory://faults-{uuid.uuid4().hex}", policy=policy, part_nbytes=PART)
    return ObjectStore(f"file://{tmp_path}/store", policy=policy, part_nbytes=PART)


@pytest.fixture(params=["memory", "file"])
def kind(request) -> str:
    return request.param


@pytest.fixture
def released():
    """Plans whose hung calls are woken at teardown, so no test leaves a thread blocked."""
    plans: list[FaultPlan] = []
    yield plans.append
    for plan in plans:
        plan.release()


# -- transient errors ------------------------------------------------------------------------------


def test_transient_errors_are_retried(kind, tmp_path):
    store = local_store(kind, tmp_path)
    faulty = FaultyStore(store)
    for op in ["put", "read", "exists", "find", "delete"]:
        faulty.faults.fail(op, times=2)
    ref = faulty.put("a/b", b"payload")
    assert faulty.get(ref) == b"payload"
    assert faulty.exists("a/b") and faulty.list("a") == ["a/b"]
    faulty.delete("a/b")
    assert faulty.faults.injected["transient"] == 10
    assert store.counters["retries"] == 10


def test_transient_errors_in_parts_are_retried(kind, tmp_path):
    faulty = FaultyStore(local_store(kind, tmp_path))
    faulty.faults.fail("send", times=2)
    faulty.faults.fail("commit", times=1)
    data = blob(3 * PART + 1)
    with faulty.open_writer("big") as w:
        w.write(data)
    assert faulty.get(w.ref) == data


def test_an_upload_that_cannot_resend_a_part_restarts_after_the_policys_backoff(tmp_path, monkeypatch):
    """Where a failed part cannot be sent again (GCS resumable uploads), the whole upload starts
    over from the source, after the store's backoff like any other retry (pauses recorded here)."""
    from diloco_async.storage import writer

    pauses: list[float] = []
    monkeypatch.setattr(writer, "time", type("Clock", (), {"sleep": staticmethod(pauses.append)}))
    faulty = FaultyStore(local_store("memory", tmp_path, retries=2, backoff_s=0.04))
    faulty._backend.resend_parts = False  # as on GCS
    faulty.faults.fail("send", times=2)
    src = tmp_path / "src.bin"
    src.write_bytes(data := blob(2 * PART + 1))
    ref = faulty.put_from_file("restarted", src)
    assert faulty.get(ref) == data
    assert faulty.counters["upload_restarts"] == 2 and faulty.counters["retries"] == 0
    assert len(pauses) == 2 and 0.02 <= pauses[0] <= 0.04 and 0.04 <= pauses[1] <= 0.08, pauses


def test_retries_stop_at_the_policy_and_publish_nothing(kind, tmp_path):
    faulty = FaultyStore(local_store(kind, tmp_path, retries=2))
    faulty.faults.fail("put", times=3)
    with pytest.raises(ConnectionError):
        faulty.put("k", b"x")
    assert faulty.faults.calls["put"] == 3
    assert not faulty.exists("k")


@pytest.mark.parametrize("error", [FileNotFoundError("gone"), FileExistsError("taken"), PermissionError("no"),
                                   ValueError("bad argument")])
def test_permanent_errors_are_not_retried(error, tmp_path):
    faulty = FaultyStore(local_store("memory", tmp_path))
    faulty.faults.fail("read", error=error)
    with pytest.raises(type(error)):
        faulty.get_unverified("k")
    assert faulty.faults.calls["read"] == 1 and faulty.counters["retries"] == 0


def test_corrupt_read_is_detected_and_not_retried(kind, tmp_path):
    faulty = FaultyStore(local_store(kind, tmp_path))
    small, large = faulty.put("s", b"abc"), faulty.put("l", blob(2 * PART + 3))
    for ref in (small, large):
        faulty.faults.corrupt()
        with pytest.raises(IntegrityError, match="sha256"):
            faulty.get(ref)
    assert faulty.counters["retries"] == 0
    assert faulty.get(large) == blob(2 * PART + 3)  # the object itself is fine


def test_answer_lost_after_the_write_landed(kind, tmp_path):
    """The PUT (or the multipart completion) reached the store but its answer did not: the retry
    meets the object it wrote itself and accepts it, because the bytes are identical."""
    faulty = FaultyStore(local_store(kind, tmp_path))
    faulty.faults.lose_reply("put")
    ref = faulty.put("k", b"once")
    assert faulty.get(ref) == b"once"
    faulty.faults.lose_reply("commit")
    with faulty.open_writer("big") as w:
        w.write(blob(2 * PART + 1))
    assert faulty.get(w.ref) == blob(2 * PART + 1)
    with pytest.raises(FileExistsError):  # someone else's bytes are still refused
        faulty.put("k", b"other")


def test_seeded_schedule_is_reproducible_and_survived(tmp_path):
    def run(seed: int) -> tuple:
        faulty = FaultyStore(local_store("memory", tmp_path, retries=8), seed=seed,
                             p_transient=0.25, p_slow=0.1, slow_s=0.001)
        refs = [faulty.put(f"k/{i}", blob(100 + i, i)) for i in range(20)]
        assert [faulty.get(r) for r in refs] == [blob(100 + i, i) for i in range(20)]
        return dict(faulty.faults.injected), faulty.counters["retries"]

    first = run(7)
    assert first[0]["transient"] > 0 and first[0]["slow"] > 0
    assert run(7) == first


# -- hangs and slow calls (C08) ----------------------------------------------------------------------


def test_hung_put_times_out_within_bound(kind, tmp_path, released):
    """The per-call timeout cuts a hung put: a TimeoutError naming the bound, counted once (a
    hang that nothing cut would end after HANG_S as a ConnectionError)."""
    faulty = FaultyStore(local_store(kind, tmp_path, timeout_s=CUT_S, retries=0))
    released(faulty.faults)
    faulty.faults.hang("put", hold_s=HANG_S)
    with pytest.raises(TimeoutError, match=f"no answer within {CUT_S:.3g} s"):
        faulty.put("k", b"x")
    assert faulty.counters["timeouts"] == 1 and faulty.faults.injected["hang"] == 1
    assert not faulty.exists("k")


def test_hung_part_upload_times_out_then_retries(kind, tmp_path, released):
    """C08: the second part's upload blocks forever; the call times out within the bound and
    the part is sent again; the object is whole."""
    faulty = FaultyStore(local_store(kind, tmp_path, timeout_s=CUT_S, retries=2))
    released(faulty.faults)
    faulty.faults.slow("send", 0.0)  # part 1 goes through ...
    faulty.faults.hang("send", hold_s=HANG_S)  # ... part 2 hangs (a dead connection after HANG_S)
    data = blob(4 * PART + 10)
    with faulty.open_writer("frag") as w:
        w.write(data[:PART + 1])  # part 1 is sent (and hangs), part 2 waits in the buffer
        w.write(data[PART + 1:])
    # the timeout, not the end of the hang, freed the part: one timeout, one retry
    assert faulty.counters["timeouts"] == 1 and faulty.counters["retries"] == 1
    assert faulty.get(w.ref) == data


def test_hung_upload_that_never_recovers_is_aborted(kind, tmp_path, released):
    faulty = FaultyStore(local_store(kind, tmp_path, timeout_s=CUT_S, retries=1, backoff_s=0.01))
    released(faulty.faults)
    faulty.faults.hang("send", times=10, hold_s=HANG_S)
    with pytest.raises(TimeoutError, match="no answer within"):
        faulty.put_from_file("frag", _file(tmp_path, blob(3 * PART)))
    assert faulty.counters["timeouts"] >= 2 and faulty.counters["retries"] >= 1  # cut, tried again, cut
    assert faulty.counters["aborted_uploads"] == 1
    assert not faulty.exists("frag") and faulty.list("") == []


def test_hung_s3_part_upload_is_aborted_and_cleaned_up(s3_endpoint, released):
    """C08 on S3: after the timeout the multipart upload is aborted; no parts linger."""
    bucket = make_bucket("s3", s3_endpoint.storage_options)
    # 2 s: part 1 and the abort must each fit in the timeout on a loaded machine (with 0.5 s a slow
    # part 1 timed out, then the abort call did too, and the upload stayed: a flaky test, not C08)
    store = ObjectStore(f"s3://{bucket}/run", s3_endpoint.storage_options, part_nbytes=5 * MiB,
                        policy=RetryPolicy(timeout_s=2.0, retries=0))
    faulty = FaultyStore(store)
    released(faulty.faults)
    faulty.faults.slow("send", 0.0)  # part 1 passes
    faulty.faults.hang("send")  # part 2 hangs
    with pytest.raises(TimeoutError):
        faulty.put("frag", blob(11 * MiB))
    assert not store.exists("frag")
    assert store.fs.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads", []) == []


def test_streamed_read_resumes_where_it_stopped(kind, tmp_path, released):
    """A chunk read hangs, then the reopened stream fails once: the read times out, reopens at
    the byte where it stopped, and the object still verifies."""
    faulty = FaultyStore(local_store(kind, tmp_path, timeout_s=CUT_S, retries=2))
    released(faulty.faults)
    data = blob(5 * PART + 3)
    ref = faulty.put("big", data)
    faulty.faults.slow("read", 0.0, times=2)  # two chunks arrive ...
    faulty.faults.hang("read", hold_s=HANG_S)  # ... the third hangs
    faulty.faults.fail("read")  # ... and the first read after reopening fails
    assert faulty.get(ref) == data
    assert faulty.counters["timeouts"] == 1 and faulty.counters["retries"] == 2
    assert faulty.faults.calls["open"] == 3
    faulty.faults.corrupt()
    with pytest.raises(IntegrityError):
        faulty.get_to_file(ref, tmp_path / "out.bin")
    assert not (tmp_path / "out.bin").exists()


def test_slow_calls(kind, tmp_path):
    faulty = FaultyStore(local_store(kind, tmp_path, timeout_s=CUT_S, retries=1))
    faulty.faults.slow("put", 0.05)
    ref = faulty.put("k", b"x")  # slow but in time
    faulty.faults.slow("read", HANG_S)  # slower than the timeout: the retry answers
    assert faulty.get(ref) == b"x"
    assert faulty.counters["timeouts"] == 1 and faulty.faults.injected["slow"] == 2


def test_deadline_bounds_all_retries(tmp_path, released):
    """The deadline, not the 50 retries, ends a call whose every attempt hangs. Each attempt takes
    its whole timeout (0.2 s, or what is left of the 0.8 s deadline) and each pause at least half
    its backoff (0.025, 0.05, 0.1 s), so at most 4 attempts fit in the deadline; a loaded machine
    only makes them fewer. Without the deadline all 51 would run."""
    faulty = FaultyStore(local_store("memory", tmp_path, timeout_s=0.2, retries=50, backoff_s=0.05,
                                     deadline_s=0.8))
    released(faulty.faults)
    faulty.faults.hang("read", times=100, hold_s=HANG_S)
    with pytest.raises(TimeoutError, match="no answer within"):
        faulty.get_unverified("k")
    assert 1 <= faulty.counters["timeouts"] <= 4, faulty.counters
    assert faulty.counters["retries"] == faulty.counters["timeouts"] - 1  # every retry was cut, then none was left


# -- torn writes and exceptions mid-upload (C11, C10) --------------------------------------------------


def test_exception_mid_upload_publishes_nothing_then_retry_matches(kind, tmp_path):
    """C11: the serializer raises after ~60 %; nothing at the key, no temp visible; the retry
    publishes the whole fragment and its digest is the one a signal would carry."""
    store = local_store(kind, tmp_path)
    data = blob(8 * PART)

    def chunks():
        for i in range(0, len(data), PART // 2):
            if i >= 0.6 * len(data):
                raise RuntimeError("serializer failed")
            yield data[i:i + PART // 2]

    with pytest.raises(RuntimeError):
        with store.open_writer("contrib/frag") as w:
            for chunk in chunks():
                w.write(chunk)
    assert w.ref is None and not store.exists("contrib/frag") and store.list("") == []
    if kind == "file":
        assert list((tmp_path / "store").rglob(".tmp-*")) == []
    ref = store.put("contrib/frag", data)
    assert ref.sha256 == hashlib.sha256(data).hexdigest()
    assert store.get(ref) == data


@pytest.mark.parametrize("how", ["put", "stream"])
def test_short_object_is_deleted_and_never_returned(kind, tmp_path, how):
    """The store ends up holding fewer bytes than were sent (the single PUT, or the final part of
    a streamed upload, loses its tail): the write raises IntegrityError (size_mismatch) instead
    of returning a ref a learner would announce, and the short object is removed."""
    store = local_store(kind, tmp_path)
    faulty = FaultyStore(store)
    data = blob(3 * PART + 7)
    faulty.faults.truncate(3)
    with pytest.raises(IntegrityError, match="size_mismatch") as err:
        if how == "put":
            faulty.put("contrib/frag", data)
        else:
            with faulty.open_writer("contrib/frag") as w:
                for i in range(0, len(data), PART // 2):
                    w.write(data[i:i + PART // 2])
    assert err.value.reason == "size_mismatch" and store.counters["size_mismatch"] == 1
    assert faulty.faults.injected["truncate"] == 1
    assert not store.exists("contrib/frag") and store.list("") == []
    assert store.get(faulty.put("contrib/frag", data)) == data  # the key is free for a retry


def test_torn_write_is_not_retried_and_leaves_no_object(kind, tmp_path):
    store = local_store(kind, tmp_path)
    faulty = FaultyStore(store)
    faulty.faults.tear(after_nbytes=PART + 100)
    with pytest.raises(SimulatedCrash):
        faulty.put_from_file("frag", _file(tmp_path, blob(3 * PART)))
    assert store.counters["retries"] == 0
    assert not store.exists("frag") and store.list("") == []


def _tensors(value: float) -> dict[str, torch.Tensor]:
    return {"p000/param/w": torch.full((64, 64), value), "p000/momentum/w": torch.zeros(64, 64)}


@pytest.mark.parametrize("torn", ["state", "manifest"])
def test_torn_checkpoint_is_skipped_and_never_collected(kind, tmp_path, torn, caplog):
    """C10: checkpoint 3 dies mid-write (state torn, or state whole and manifest torn). Resume
    takes checkpoint 2, logs why when there is something to skip, and GC keeps 2 and the partial 3."""
    store = local_store(kind, tmp_path)
    for seq in (1, 2):
        write_checkpoint(store, "run", seq, _tensors(float(seq)),
                         {"versions": {"0": seq}, "next_round": {"0": seq + 1}})
    faulty = FaultyStore(store)
    faulty.faults.tear(after_nbytes=1000, skip=0 if torn == "state" else 1)
    with pytest.raises(SimulatedCrash):
        write_checkpoint(faulty, "run", 3, _tensors(3.0), {"versions": {"0": 3}, "next_round": {"0": 4}})
    with caplog.at_level(logging.WARNING, logger="diloco.checkpoint"):
        ck = latest_checkpoint(store, "run")
    assert ck.seq == 2 and torch.equal(ck.tensors["p000/param/w"], torch.full((64, 64), 2.0))
    if torn == "manifest":
        assert "skipping incomplete checkpoint 3" in caplog.text
    report = collect_garbage(store, "run", keep_checkpoints=1)
    assert report.checkpoint == 2 and report.deleted_checkpoints == [1]
    assert latest_checkpoint(store, "run").seq == 2


# -- stale listings --------------------------------------------------------------------------------


def test_stale_listing_never_hides_or_spoils_an_exact_key(kind, tmp_path):
    store = local_store(kind, tmp_path)
    faulty = FaultyStore(store)
    write_checkpoint(faulty, "run", 1, _tensors(1.0), {"versions": {"0": 1}})
    faulty.freeze_listings()
    ref = faulty.put(keys.version_key("run", 0, 2), b"v2")
    write_checkpoint(faulty, "run", 2, _tensors(2.0), {"versions": {"0": 2}})
    assert faulty.list(keys.versions_prefix("run")) == []  # the listing lags ...
    assert faulty.exists(ref.key) and faulty.get(ref) == b"v2"  # ... exact keys do not
    assert load_checkpoint(faulty, "run", 2).manifest["versions"] == {"0": 2}
    assert latest_checkpoint(faulty, "run").seq == 1  # an older but valid one, never a wrong one
    assert faulty.faults.injected["stale_list"] >= 2
    faulty.thaw_listings()
    assert latest_checkpoint(faulty, "run").seq == 2


def test_hang_is_released_as_a_dead_connection(tmp_path):
    plan = FaultPlan()
    faulty = FaultyStore(local_store("memory", tmp_path, timeout_s=None, retries=0), plan)
    plan.hang("exists")
    out: list = []
    t = threading.Thread(target=lambda: out.append(_raises(lambda: faulty.exists("k"))))
    t.start()
    wait_until(lambda: plan.calls["exists"] == 1, 30, "the call to reach the hang", interval_s=0.01)
    assert t.is_alive() and not out  # it hangs there (no hold_s: until released)
    plan.release()
    t.join(30)
    assert not t.is_alive() and out and isinstance(out[0], ConnectionError)


def _raises(fn):
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - returned for the assertion
        return err
    return None


def _file(tmp_path, data: bytes):
    path = tmp_path / f"src-{uuid.uuid4().hex}.bin"
    path.write_bytes(data)
    return path


# -- the retry policy on a fake clock (diloco_async/storage/retry.py) -------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 0.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now_s

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now_s += seconds


def failing(errors: list[BaseException]):
    calls = []

    def fn(x):
        calls.append(x)
        if errors:
            raise errors.pop(0)
        return x * 2

    return fn, calls


def test_retry_policy_rejects_bad_settings():
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        RetryPolicy(timeout_s=0)
    with pytest.raises(ValueError, match="invalid retry policy: retries=-1"):
        RetryPolicy(retries=-1)
    with pytest.raises(ValueError, match="deadline_s=0"):
        RetryPolicy(deadline_s=0)
    assert ObjectStore("memory://policy").policy == RetryPolicy()
    policy = RetryPolicy(timeout_s=None, retries=0)
    assert ObjectStore("memory://policy", policy=policy).policy is policy


def test_backoff_doubles_with_jitter_up_to_the_cap_and_resets():
    backoff = Backoff(1.0, 4.0, rng=random.Random(0))
    pauses = [backoff.next_pause_s() for _ in range(5)]
    for pause, delay in zip(pauses, [1.0, 2.0, 4.0, 4.0, 4.0], strict=True):
        assert 0.5 * delay <= pause <= delay
    backoff.reset()
    assert 0.5 <= backoff.next_pause_s() <= 1.0


def test_call_with_retry_retries_transient_errors_then_gives_up():
    clock, counted = FakeClock(), []
    policy = RetryPolicy(timeout_s=None, retries=2, backoff_s=1.0, deadline_s=100.0)
    fn, calls = failing([ConnectionError("reset"), TimeoutError("slow")])
    assert call_with_retry(policy, "op", fn, 21, count=counted.append, clock=clock, sleep=clock.sleep) == 42
    assert calls == [21, 21, 21] and counted == ["retries", "timeouts", "retries"]
    assert 0.5 <= clock.slept[0] <= 1.0 and 1.0 <= clock.slept[1] <= 2.0
    fn, calls = failing([ConnectionError("1"), ConnectionError("2"), ConnectionError("3")])
    with pytest.raises(ConnectionError, match="3"):
        call_with_retry(policy, "op", fn, 1, clock=clock, sleep=clock.sleep)
    assert len(calls) == 3


def test_call_with_retry_never_retries_permanent_errors_nor_past_the_deadline():
    clock = FakeClock()
    policy = RetryPolicy(timeout_s=None, retries=5, backoff_s=1.0, deadline_s=2.5)
    for err in (FileExistsError("k"), FileNotFoundError("k"), IntegrityError("k"), PermissionError("k")):
        fn, calls = failing([err])
        with pytest.raises(type(err)):
            call_with_retry(policy, "op", fn, 1, clock=clock, sleep=clock.sleep)
        assert len(calls) == 1
    fn, calls = failing([ConnectionError("down")] * 10)
    with pytest.raises(ConnectionError):
        call_with_retry(policy, "op", fn, 1, clock=clock, sleep=clock.sleep)
    assert 2 <= len(calls) <= 3 and sum(clock.slept) < 2.5  # pauses 0.5-1, then 1-2: the third would pass 2.5 s
    fn, calls = failing([ConnectionError("once")])
    with pytest.raises(ConnectionError):
        call_with_retry(policy, "op", fn, 1, retry=False, clock=clock, sleep=clock.sleep)
    assert len(calls) == 1


def test_run_with_timeout_raises_timeout_error_and_leaves_the_call_running():
    gate = threading.Event()
    with pytest.raises(TimeoutError, match="hung op: no answer within 0.05 s"):
        run_with_timeout(gate.wait, (5.0,), 0.05, "hung op")
    gate.set()
    assert run_with_timeout(lambda a, b: a + b, (1, 2), 1.0, "add") == 3
    assert run_with_timeout(lambda: "direct", (), None, "untimed") == "direct"
