"""Storage for runs left going for days, against moto's S3 server (issue 14, item 6; defect 12):
credentials rotated under a running store are renewed from the environment; part sizes follow the
object size and the part limit; a short multipart object is deleted and never returned; a learner
never announces a short object."""

from __future__ import annotations

import asyncio
import hashlib
import json
import urllib.request
import uuid

import pytest

from diloco_async.storage.faults import FaultyStore
from diloco_async.storage.parts import PartLimits
from diloco_async.storage.retry import RetryPolicy
from diloco_async.storage.store import IntegrityError, ObjectStore

from storage_servers import make_bucket

MiB, GiB = 1 << 20, 1 << 30


def blob(nbytes: int, seed: int = 0) -> bytes:
    return hashlib.shake_256(f"longhaul-{seed}".encode()).digest(nbytes)


def _s3_store(s3_endpoint, **kw) -> ObjectStore:
    bucket = make_bucket("s3", s3_endpoint.storage_options)
    policy = RetryPolicy(timeout_s=30.0, retries=2, backoff_s=0.05)
    return ObjectStore(f"s3://{bucket}/run", s3_endpoint.storage_options, policy=policy, part_nbytes=5 * MiB, **kw)


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

    from diloco_async.learner.state import Shared, UploadJob
    from diloco_async.learner.uploads import Uploads
    from diloco_async.protocol.client import SyncClient

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
        store = ObjectStore(f"s3://{bucket}/run", s3_endpoint.storage_options, part_nbytes=5 * MiB,
                            policy=RetryPolicy(timeout_s=30.0, retries=0))
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

        fresh = ObjectStore(store.url, s3_endpoint.storage_options, part_nbytes=5 * MiB, policy=RetryPolicy(retries=0))
        fresh.put("later", b"3")
        assert fresh.counters["credentials_refreshed"] == 0

        # credentials given in the storage options: the store asks refresh_options for new ones
        def options(key: dict) -> dict:
            return {**s3_endpoint.storage_options, "key": key["AccessKeyId"], "secret": key["SecretAccessKey"]}

        handed_out = [key_c]
        explicit = ObjectStore(store.url, options(key_c), policy=RetryPolicy(retries=0),
                               refresh_options=lambda: options(handed_out[-1]))
        explicit.put("explicit-before", b"4")
        handed_out.append(admin.create_access_key(UserName=user)["AccessKey"])
        rotate(key_c, handed_out[-1])
        explicit.put("explicit-after", b"5")
        assert explicit.counters["credentials_refreshed"] == 1
    finally:
        _moto_auth(s3_endpoint.url, "inf")
