"""Storage for runs left going for days, without a server (issue 14, item 6; defect 12): part sizes
follow the object size and S3's limits, a stream of unknown size fits, expired-credential errors are
recognised and renew the filesystem once per expiry. Against moto: tests/contract/test_storage_longhaul_s3.py;
after a SIGKILLed writer: tests/system/test_storage_longhaul_gc.py."""

from __future__ import annotations

import pytest

from diloco_async.storage.credentials import is_expired_credentials
from diloco_async.storage.faults import FaultyStore
from diloco_async.storage.parts import GCS_LIMITS, S3_LIMITS, PartLimits, part_nbytes_for, streaming_part_nbytes
from diloco_async.storage.retry import RetryPolicy
from diloco_async.storage.store import ObjectStore

MiB, GiB = 1 << 20, 1 << 30


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
    store = FaultyStore(ObjectStore(f"file://{tmp_path}/s", policy=RetryPolicy(retries=0)))
    old_fs = store.fs
    store.faults.fail("put", error=expired)
    store.put("k", b"x")
    assert store.counters["credentials_refreshed"] == 1 and store.counters["retries"] == 0
    assert store.fs is not old_fs  # a new filesystem, not the cached one
    store.faults.fail("put", times=2, error=expired)
    with pytest.raises(PermissionError):
        store.put("k2", b"y")
    assert store.counters["credentials_refreshed"] == 2 and not store.exists("k2")
