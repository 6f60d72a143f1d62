"""Storage for runs left going for days (issue 14, item 6; defect 12).

* credentials rotated under a running store: moto's server enforcing IAM auth (its documented
  ``/moto-api/reset-auth`` switch); the rotated-out key is refused, the store renews its
  filesystem from the environment and goes on;
* part sizes chosen from the object size and the backend's part limit;
* a completed object shorter than what was sent is never returned, so never announced;
* uploads left by a SIGKILLed writer (local temp file, S3 multipart upload) collected by gc after
  the age threshold, a live upload younger than it left alone.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid

import pytest

from storage.credentials import is_expired_credentials
from storage.faults import FaultyStore
from storage.gc import collect_garbage
from storage.options import STORAGE_OPTIONS_ENV
from storage.orphans import find_orphans
from storage.parts import GCS_LIMITS, S3_LIMITS, PartLimits, part_nbytes_for, streaming_part_nbytes
from storage.store import IntegrityError, ObjectStore

from storage_servers import make_bucket

MiB, GiB = 1 << 20, 1 << 30


def blob(nbytes: int, seed: int = 0) -> bytes:
    return hashlib.shake_256(f"longhaul-{seed}".encode()).digest(nbytes)


# -- part sizes (pure) -----------------------------------------------------------------------------


def test_part_size_follows_object_size_and_s3_limits():
    assert part_nbytes_for(100 * MiB, 16 * MiB, S3_LIMITS) == 16 * MiB  # preference fits
    assert part_nbytes_for(1 * MiB, 1 * MiB, S3_LIMITS) == 5 * MiB  # raised to the S3 minimum
    # 1 TiB at 16 MiB would be 65,536 parts: raised so that 10,000 suffice
    big = 1 << 40
    part = part_nbytes_for(big, 16 * MiB, S3_LIMITS)
    assert 16 * MiB < part <= big // 10_000 + 1 and -(-big // part) <= 10_000
    # the largest object S3 takes: 10,000 parts of 5 GiB
    assert part_nbytes_for(10_000 * 5 * GiB, 16 * MiB, S3_LIMITS) == 5 * GiB
    with pytest.raises(ValueError, match="larger than the backend allows"):
        part_nbytes_for(10_000 * 5 * GiB + 1, 16 * MiB, S3_LIMITS)
    gcs = part_nbytes_for(6 * (1 << 40) // 2, 16 * MiB, GCS_LIMITS)
    assert gcs == 16 * MiB  # no part count on GCS
    with pytest.raises(ValueError, match="larger than the backend allows"):
        part_nbytes_for(6 << 40, 16 * MiB, GCS_LIMITS)
    odd = PartLimits(max_parts=3, quantum_nbytes=256 * 1024)
    assert part_nbytes_for(10 * MiB, 1 * MiB, odd) == 3 * MiB + 512 * 1024  # ceil(10/3 MiB) to 256 KiB


def test_streaming_parts_grow_so_a_stream_of_unknown_size_fits():
    sizes = [streaming_part_nbytes(n, 16 * MiB, S3_LIMITS) for n in range(1, 10_001)]
    assert sizes[0] == 16 * MiB and sizes[999] == 16 * MiB and sizes[1000] == 32 * MiB
    assert max(sizes) == 5 * GiB and sizes == sorted(sizes)
    assert sum(sizes) >= 10 * (1 << 40)  # over 10 TiB within 10,000 parts
    with pytest.raises(ValueError, match="10000 parts"):
        streaming_part_nbytes(10_001, 16 * MiB, S3_LIMITS)
    assert streaming_part_nbytes(50_000, 1 * MiB, GCS_LIMITS) == 1 * MiB
    with pytest.raises(ValueError):
        PartLimits(min_part_nbytes=10, max_part_nbytes=5)


def _s3_store(s3_endpoint, **kw) -> ObjectStore:
    bucket = make_bucket("s3", s3_endpoint.storage_options)
    policy = {"part_nbytes": 5 * MiB, "timeout_s": 30.0, "retries": 2, "backoff_s": 0.05, **kw}
    return ObjectStore(f"s3://{bucket}/run", s3_endpoint.storage_options, **policy)


def _etag_parts(store: ObjectStore, key: str) -> int:
    bucket, _, rest = store.root.partition("/")
    etag = store.fs.call_s3("head_object", Bucket=bucket, Key=f"{rest}/{key}")["ETag"].strip('"')
    return int(etag.rsplit("-", 1)[1])


def test_s3_part_size_chosen_from_object_size_within_part_limit(s3_endpoint):
    """An S3-compatible store allowing 4 parts: 30 MiB goes out as 4 parts of 7.5 MiB (not 6 of
    5 MiB), as the completed object's multipart ETag ("...-4") says; a stream of unknown size grows
    its parts and fits too; an object over the limit is refused before anything starts."""
    limits = PartLimits(max_parts=4, min_part_nbytes=5 * MiB, max_part_nbytes=5 * GiB)
    store = _s3_store(s3_endpoint, part_limits=limits)
    faulty = FaultyStore(store)
    data = blob(30 * MiB)
    ref = faulty.put("known", data)
    assert faulty.faults.calls["send"] == 4 and _etag_parts(store, "known") == 4
    assert store.get(ref) == data
    with store.open_writer("streamed") as w:  # size unknown: parts of 5 and 10 MiB, then the last 15
        for i in range(0, len(data), 3 * MiB):
            w.write(data[i:i + 3 * MiB])
    assert _etag_parts(store, "streamed") == 3 and store.get(w.ref) == data
    small = ObjectStore(store.url, s3_endpoint.storage_options, part_nbytes=5 * MiB,
                        part_limits=PartLimits(max_parts=2, min_part_nbytes=5 * MiB, max_part_nbytes=5 * MiB))
    with pytest.raises(ValueError, match="larger than the backend allows"):
        small.put("too-big", data)
    bucket = store.root.split("/")[0]
    assert store.fs.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads", []) == []


# -- size of the completed object ------------------------------------------------------------------


def test_s3_short_multipart_object_is_deleted_and_never_returned(s3_endpoint):
    """The final part loses its tail on the way: the completed object is 1 byte short. The write
    raises IntegrityError (size_mismatch) instead of returning a ref, and the object is removed."""
    store = _s3_store(s3_endpoint)
    faulty = FaultyStore(store)
    faulty.faults.truncate(1)
    with pytest.raises(IntegrityError, match="size_mismatch") as err:
        faulty.put("short", blob(11 * MiB))
    assert err.value.reason == "size_mismatch" and store.counters["size_mismatch"] == 1
    assert not store.exists("short")


def test_learner_never_announces_a_short_object(tmp_path):
    """The learner's upload path (diloco_async/learner/uploads.py) against a real HTTP endpoint:
    a truncated contribution is reported failed and no announcement is sent; a whole one is."""
    from aiohttp import web

    from diloco_async.client import SyncClient
    from diloco_async.learner.state import Shared, UploadJob
    from diloco_async.learner.uploads import Uploads

    announced: list[dict] = []

    async def announce(request):
        announced.append(await request.json())
        return web.json_response({"status": "accepted", "reason": "ok"})

    async def scenario() -> list:
        app = web.Application()
        app.router.add_post("/announce", announce)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        store = FaultyStore(ObjectStore(f"file://{tmp_path}/store"))
        shared = Shared()
        shared.join_response = type("Join", (), {"run_id": "run"})()
        uploads = Uploads("A", 0, store, shared)
        import torch

        job = lambda: UploadJob(0, 1, 0, 10, 100, 1.0, {"w": torch.ones(64)})  # noqa: E731
        async with SyncClient(f"http://127.0.0.1:{port}", "t") as client:
            store.faults.truncate(5)
            await uploads._upload_and_announce(client, job())
            await uploads._upload_and_announce(client, job())
        await runner.cleanup()
        return [shared.outcomes.get_nowait() for _ in range(2)]

    outcomes = asyncio.run(scenario())
    assert [o[2] for o in outcomes] == ["failed", "accepted"]
    assert len(announced) == 1


# -- credentials rotated under a running store -----------------------------------------------------


def _moto_auth(url: str, count: str) -> None:
    """moto's documented switch: enforce IAM auth after ``count`` more requests ("inf": never)."""
    req = urllib.request.Request(f"{url}/moto-api/reset-auth", data=count.encode(), method="POST",
                                 headers={"Content-Type": "text/plain"})
    urllib.request.urlopen(req, timeout=10).read()


def _use_key(monkeypatch, key: dict) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key["AccessKeyId"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", key["SecretAccessKey"])


def test_rotated_credentials_renew_the_filesystem(s3_endpoint, monkeypatch):
    """A long-running store whose access key is rotated out keeps working: moto refuses the old
    key (InvalidAccessKeyId), the store builds a new filesystem from the environment and tries
    again, counting ``credentials_refreshed``; an upload in flight across a rotation completes;
    a store made afterwards is not handed the stale client from fsspec's instance cache."""
    import boto3

    iam = boto3.client("iam", endpoint_url=s3_endpoint.url, region_name="us-east-1")
    user = f"learner-{uuid.uuid4().hex[:8]}"
    iam.create_user(UserName=user)
    iam.put_user_policy(UserName=user, PolicyName="all", PolicyDocument=json.dumps(
        {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}))
    key_a, key_b = (iam.create_access_key(UserName=user)["AccessKey"] for _ in range(2))
    bucket = make_bucket("s3", s3_endpoint.storage_options)
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    _use_key(monkeypatch, key_a)
    _moto_auth(s3_endpoint.url, "0")
    try:
        store = ObjectStore(f"s3://{bucket}/run", s3_endpoint.storage_options, part_nbytes=5 * MiB, retries=0,
                            timeout_s=30.0)
        store.put("before", b"1")  # key A (a client cached from before may be renewed once here)
        base = store.counters["credentials_refreshed"]

        def rotate(old: dict, new: dict):  # the operator's side: retire the old key, hand out the new
            admin = boto3.client("iam", endpoint_url=s3_endpoint.url, region_name="us-east-1",
                                 aws_access_key_id=new["AccessKeyId"], aws_secret_access_key=new["SecretAccessKey"])
            admin.delete_access_key(UserName=user, AccessKeyId=old["AccessKeyId"])
            _use_key(monkeypatch, new)
            return admin

        admin = rotate(key_a, key_b)
        ref = store.put("after", b"2")
        assert store.counters["credentials_refreshed"] == base + 1
        assert store.get(ref) == b"2"

        data = blob(12 * MiB)
        with store.open_writer("in-flight", len(data)) as w:
            w.write(data[: 6 * MiB])  # part 1 goes out with key B
            key_c = admin.create_access_key(UserName=user)["AccessKey"]
            admin = rotate(key_b, key_c)
            w.write(data[6 * MiB:])
        assert store.counters["credentials_refreshed"] == base + 2
        assert store.get(w.ref) == data

        fresh = ObjectStore(store.url, s3_endpoint.storage_options, part_nbytes=5 * MiB, retries=0)
        fresh.put("later", b"3")
        assert fresh.counters["credentials_refreshed"] == 0

        # credentials given in the storage options: the store asks refresh_options for new ones
        def options(key: dict) -> dict:
            return {**s3_endpoint.storage_options, "key": key["AccessKeyId"], "secret": key["SecretAccessKey"]}

        handed_out = [key_c]
        explicit = ObjectStore(store.url, options(key_c), retries=0, refresh_options=lambda: options(handed_out[-1]))
        explicit.put("explicit-before", b"4")
        handed_out.append(admin.create_access_key(UserName=user)["AccessKey"])
        rotate(key_c, handed_out[-1])
        explicit.put("explicit-after", b"5")
        assert explicit.counters["credentials_refreshed"] == 1
    finally:
        _moto_auth(s3_endpoint.url, "inf")


def test_expired_credential_errors_are_recognised():
    from botocore.exceptions import ClientError
    from gcsfs.retry import HttpError
    from s3fs.errors import translate_boto_error

    def s3_error(code: str) -> BaseException:
        return translate_boto_error(ClientError({"Error": {"Code": code, "Message": "m"}}, "PutObject"))

    for code in ("ExpiredToken", "RequestExpired", "InvalidAccessKeyId", "InvalidToken"):
        assert is_expired_credentials(s3_error(code)), code
    for code in ("AccessDenied", "NoSuchKey", "SlowDown"):
        assert not is_expired_credentials(s3_error(code)), code
    assert is_expired_credentials(HttpError({"code": 401, "message": "Invalid Credentials"}))
    assert not is_expired_credentials(HttpError({"code": 403, "message": "Forbidden"}))
    assert not is_expired_credentials(PermissionError("denied"))


def test_expired_token_from_the_fault_layer_renews_once_per_expiry(tmp_path):
    """ExpiredToken raised under the store (as s3fs raises it): renewed and retried, not counted
    as a retry; a second expiry right after the renewal is raised (no loop)."""
    from botocore.exceptions import ClientError
    from s3fs.errors import translate_boto_error

    expired = translate_boto_error(ClientError({"Error": {"Code": "ExpiredToken", "Message": "expired"}}, "Put"))
    store = FaultyStore(ObjectStore(f"file://{tmp_path}/s", retries=0))
    old_fs = store.fs
    store.faults.fail("put", error=expired)
    store.put("k", b"x")
    assert store.counters["credentials_refreshed"] == 1 and store.counters["retries"] == 0
    assert store.fs is not old_fs  # a new filesystem, not the cached one
    store.faults.fail("put", times=2, error=expired)
    with pytest.raises(PermissionError):
        store.put("k2", b"y")
    assert store.counters["credentials_refreshed"] == 2 and not store.exists("k2")


# -- leftovers of killed writers -------------------------------------------------------------------

_KILLED_WRITER = """
import sys, time
from storage.options import storage_options_from_env
from storage.store import ObjectStore
store = ObjectStore(sys.argv[1], storage_options_from_env(), part_nbytes=5 << 20, max_concurrency=1)
w = store.open_writer("run/contrib/p0/r1/A-dead")
w.write(bytes(11 << 20))  # two parts sent (one at a time: both landed), the upload never finished
print("uploading", flush=True)
time.sleep(600)
"""


def _leftovers(store: ObjectStore) -> list[str]:
    return sorted(o.kind for o in find_orphans(store, "run", 0.0))


@pytest.mark.parametrize("kind", ["file", "s3"])
def test_gc_collects_uploads_of_a_killed_writer_after_the_threshold(kind, tmp_path, request):
    """Defect 12: a writer SIGKILLed mid-upload leaves a temp file (file://) or an incomplete
    multipart upload (S3). gc leaves it while younger than orphan_age_s, removes it after, and
    never touches a live upload younger than the threshold, which then publishes normally."""
    env = dict(os.environ)
    if kind == "s3":
        server = request.getfixturevalue("s3_endpoint")
        url = f"s3://{make_bucket('s3', server.storage_options)}/root"
        options = server.storage_options
    else:
        url, options = f"file://{tmp_path}/store", {}
    env[STORAGE_OPTIONS_ENV] = json.dumps(options)
    # one part at a time: write() returns once its parts landed (moto reports a fixed 2010 initiation
    # time, so an upload's age there comes from its parts' upload times)
    store = ObjectStore(url, options, part_nbytes=5 * MiB, max_concurrency=1)
    child = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, url], env=env, stdout=subprocess.PIPE,
                             text=True)
    try:
        assert child.stdout.readline().strip() == "uploading"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    expected = "temp_file" if kind == "file" else "multipart_upload"
    assert _leftovers(store) == [expected]
    threshold_s = 3.0
    young = collect_garbage(store, "run", orphan_age_s=threshold_s)
    assert young.objects == 0 and _leftovers(store) == [expected]
    time.sleep(threshold_s + 0.5)
    live = store.open_writer("run/contrib/p0/r1/B-live")
    live.write(blob(11 * MiB))  # begun just now: younger than the threshold
    report = collect_garbage(store, "run", orphan_age_s=threshold_s)
    assert report.deleted == {expected: 1} and report.checkpoint is None
    assert _leftovers(store) == [expected]  # the live one only
    ref = live.close()
    assert store.get(ref) == blob(11 * MiB) and _leftovers(store) == []
    assert store.list("run") == ["run/contrib/p0/r1/B-live"]
