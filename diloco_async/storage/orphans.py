"""Leftovers of writers that died mid-upload: found by age, removed by garbage collection (defect 12).

A writer killed between starting an upload and publishing it leaves something no key names and
no listing of objects shows:

* ``file://``: a temporary file ``.tmp-<uuid>`` next to the key it was meant for (its age: time
  since its last write, the file's mtime);
* ``s3://``: an incomplete multipart upload, whose parts are billed until it is aborted (its
  age: time since its newest part was uploaded, or since it was initiated if it has none, on the
  store's clock; parts are listed only for uploads initiated longer ago than the threshold);
* ``gs://``: a resumable upload session; GCS cannot list them and drops them itself a week
  after they start, so nothing is done here;
* ``memory://``: nothing (an upload lives in the writer's memory).

Only leftovers older than a threshold are touched: a live upload is younger (a local temp file
is written continuously; a multipart upload lasts as long as its parts take to send), so the
threshold must exceed the longest upload a run makes.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from diloco_async.storage.backends import TEMP_PREFIX

if TYPE_CHECKING:
    from diloco_async.storage.store import ObjectStore

__all__ = ["Orphan", "find_orphans", "drop_orphan"]

log = logging.getLogger("diloco.storage.gc")


@dataclass(frozen=True)
class Orphan:
    """One leftover upload.

    Attributes:
        kind: ``temp_file`` or ``multipart_upload``.
        path: the temporary file's absolute path, or the ``bucket/key`` the upload was for.
        age_s: seconds since its last write (temp file) or its start (multipart upload).
        nbytes: bytes it holds (0 where the store does not say without more requests).
        upload_id: the S3 upload id (multipart uploads only).
    """

    kind: str
    path: str
    age_s: float
    nbytes: int = 0
    upload_id: str | None = None


def find_orphans(store: ObjectStore, prefix: str, older_than_s: float,
                 clock: Callable[[], float] = time.time) -> list[Orphan]:
    """Leftover uploads under ``prefix`` (relative to the store root) older than ``older_than_s``.

    Args:
        clock: wall-clock seconds since the epoch (compared with mtimes and S3 initiation times).

    Raises:
        ValueError: ``older_than_s`` is negative.
    """
    if older_than_s < 0:
        raise ValueError(f"older_than_s must be >= 0, got {older_than_s}")
    access = store.access
    base = access.path(prefix) if prefix.strip("/") else access.root
    if store.protocol == "file":
        found = _temp_files(base, clock())
    elif store.protocol == "s3":
        found = access.call(f"list uploads {access.where(prefix)}", _multipart_uploads, store.fs, base,
                            older_than_s, clock())
    else:
        found = []
    return [o for o in found if o.age_s >= older_than_s]


def drop_orphan(store: ObjectStore, orphan: Orphan) -> None:
    """Remove one leftover: delete the temp file, or abort the multipart upload. A leftover
    that is already gone is not an error."""
    if orphan.kind == "temp_file":
        try:
            os.unlink(orphan.path)
        except FileNotFoundError:
            pass
    elif orphan.kind == "multipart_upload":
        store.access.call(f"abort upload {orphan.path}", _abort_upload, store.fs, orphan.path, orphan.upload_id)
    else:
        raise ValueError(f"unknown orphan kind {orphan.kind!r}")


def _temp_files(base: str, now_s: float) -> list[Orphan]:
    out = []
    for folder, _dirs, files in os.walk(base):
        for name in files:
            if not name.startswith(TEMP_PREFIX):
                continue
            path = os.path.join(folder, name)
            try:
                st = os.stat(path)
            except FileNotFoundError:  # published or aborted meanwhile
                continue
            out.append(Orphan("temp_file", path, max(now_s - st.st_mtime, 0.0), st.st_size))
    return out


def _multipart_uploads(fs, base: str, older_than_s: float, now_s: float) -> list[Orphan]:
    bucket, key_prefix, _ = fs.split_path(base)
    key_prefix = f"{key_prefix.rstrip('/')}/" if key_prefix else ""
    out: list[Orphan] = []
    for up in _pages(fs, "list_multipart_uploads", "Uploads", ("KeyMarker", "UploadIdMarker"),
                     Bucket=bucket, Prefix=key_prefix):
        last_s = up["Initiated"].timestamp()
        if now_s - last_s < older_than_s:
            continue  # started recently: live
        parts = _pages(fs, "list_parts", "Parts", ("PartNumberMarker",), Bucket=bucket, Key=up["Key"],
                       UploadId=up["UploadId"])
        last_s = max([last_s, *(p["LastModified"].timestamp() for p in parts)])
        out.append(Orphan("multipart_upload", f"{bucket}/{up['Key']}", max(now_s - last_s, 0.0),
                          sum(int(p["Size"]) for p in parts), up["UploadId"]))
    return out


def _pages(fs, method: str, field: str, markers: tuple[str, ...], **kw) -> list[dict]:
    """Every item of a paginated S3 listing (``Next<marker>`` fields carry on)."""
    items: list[dict] = []
    while True:
        page = fs.call_s3(method, **kw)
        items += page.get(field, [])
        if not page.get("IsTruncated"):
            return items
        kw.update({m: page[f"Next{m}"] for m in markers})


def _abort_upload(fs, path: str, upload_id: str | None) -> None:
    bucket, key, _ = fs.split_path(path)
    try:
        fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id)
    except FileNotFoundError:
        pass  # completed or aborted meanwhile
