"""One backend per URL protocol: single requests, no retries, no timeouts (the store adds those;
the filesystems underneath are built not to retry either, :mod:`diloco_async.storage.filesystems`).

A backend works on full paths (``bucket/key``, ``/abs/path``) and offers:

* ``put(path, data)``: one exclusive-create request (``FileExistsError`` if the key exists);
* ``begin(path) -> Upload``: a multi-part upload that publishes nothing until ``commit`` and
  that ``abort`` drops: S3 multipart upload, GCS resumable upload, a local temporary file;
* ``open_stream(path, start, end) -> Stream``: sequential reads of ``[start, end)`` in chunks
  (S3: one streaming GET; local files: one open file, which also reads into a caller's buffer,
  ``reads_into``; elsewhere one ranged read per chunk);
* ``read``, ``size``, ``exists``, ``delete``, ``find``.

``Upload.send(number, offset, data, last)`` sends part ``number`` (1-based) that starts at byte
``offset``; ``last`` marks the final part. Where ``resend_parts`` is true, sending the same part
again after an error is safe (S3 part numbers, local ``pwrite``); GCS resumable uploads cannot
be re-sent blindly, so the store restarts the whole upload instead.
"""

from __future__ import annotations

import os
import threading
import uuid
from typing import Any, Protocol

import fsspec
from fsspec.asyn import sync

from diloco_async.storage.filesystems import new_filesystem

__all__ = ["Backend", "Upload", "Stream", "IntoStream", "make_backend", "new_filesystem", "PROTOCOLS", "PART_QUANTUM",
           "TEMP_PREFIX"]

PROTOCOLS = ("file", "memory", "s3", "gs")
#: GCS resumable uploads take non-final parts in multiples of 256 KiB
PART_QUANTUM = 256 * 1024
#: names of unpublished local files; never a valid key, skipped by listings
TEMP_PREFIX = ".tmp-"


class Upload(Protocol):
    def send(self, number: int, offset: int, data: bytes, last: bool) -> None: ...
    def commit(self) -> None: ...
    def abort(self) -> None: ...


class Stream(Protocol):
    def read(self, nbytes: int) -> bytes: ...  # up to nbytes; b"" at the end
    def close(self) -> None: ...


class IntoStream(Stream, Protocol):  # a stream that also reads into a caller's buffer (``reads_into``)
    def readinto(self, view: memoryview) -> int: ...  # up to len(view) bytes; 0 at the end


class Backend:
    """fsspec-based reads, listings and deletes shared by all protocols."""

    #: ``put`` of large bytes goes through ``begin`` (parts) rather than one request
    multipart = True
    #: parts may be in flight at once
    parallel_parts = True
    #: a part may be sent again after an error
    resend_parts = True
    #: non-final parts are multiples of this many bytes
    part_quantum = 1
    #: ``open_stream`` returns an :class:`IntoStream` (reads land in the caller's buffer, no copy)
    reads_into = False
    writes_at_offsets = False  #: an upload writes at any offset (pwrite): a part may go as pieces, unjoined

    def __init__(self, fs: fsspec.AbstractFileSystem) -> None:
        self.fs = fs

    def put(self, path: str, data: bytes) -> None:
        raise NotImplementedError

    def begin(self, path: str) -> Upload:
        raise NotImplementedError

    def read(self, path: str, start: int | None, end: int | None) -> bytes:
        return self.fs.cat_file(path, start=start, end=end)

    def open_stream(self, path: str, start: int, end: int) -> Stream:
        return _RangeStream(self, path, start, end)

    def size(self, path: str) -> int:
        self.fs.invalidate_cache(path)
        return int(self.fs.size(path))

    def exists(self, path: str) -> bool:
        self.fs.invalidate_cache(path)
        return bool(self.fs.exists(path))

    def delete(self, path: str) -> None:
        try:
            self.fs.rm_file(path)
        except FileNotFoundError:
            pass
        self.fs.invalidate_cache(path)

    def find(self, path: str) -> dict[str, int]:
        """``{full path: nbytes}`` of the objects under ``path`` (recursive)."""
        self.fs.invalidate_cache(path)
        try:
            found = self.fs.find(path, detail=True)
        except FileNotFoundError:
            return {}
        return {p: int(info.get("size") or 0) for p, info in found.items() if info.get("type", "file") == "file"}


class _RangeStream:
    """One ranged read per chunk, up to ``end`` (the size the caller expects)."""

    def __init__(self, backend: Backend, path: str, start: int, end: int) -> None:
        self.backend, self.path, self.pos, self.end = backend, path, start, end

    def read(self, nbytes: int) -> bytes:
        if self.pos >= self.end:
            return b""
        data = self.backend.read(self.path, self.pos, min(self.pos + nbytes, self.end))
        self.pos += len(data)
        return data

    def close(self) -> None:
        pass


# -- local files --------------------------------------------------------------------------------


class LocalBackend(Backend):
    """Temp file in the target folder, fsync, then ``os.link`` to the final name (fails if the
    name exists, atomically): a reader sees the whole object or nothing."""

    multipart = False
    reads_into = writes_at_offsets = True

    def open_stream(self, path: str, start: int, end: int) -> IntoStream:
        return _LocalStream(path, start, end)

    def put(self, path: str, data: bytes) -> None:
        upload = self.begin(path)
        try:
            upload.send(1, 0, data, True)
            upload.commit()
        finally:
            upload.abort()

    def begin(self, path: str) -> Upload:
        return _LocalUpload(path)


class _LocalStream:
    """Sequential reads of ``[start, end)`` of one local file through one unbuffered handle."""

    def __init__(self, path: str, start: int, end: int) -> None:
        self.fh = open(path, "rb", buffering=0)  # noqa: SIM115 - closed by close()
        self.fh.seek(start)
        self.left = max(end - start, 0)

    def read(self, nbytes: int) -> bytes:
        data = self.fh.read(min(nbytes, self.left)) if self.left else b""
        self.left -= len(data)
        return data

    def readinto(self, view: memoryview) -> int:
        view, got = view[: self.left], 0
        while got < len(view) and (n := self.fh.readinto(view[got:])):  # a raw read may return less
            got += n
        self.left -= got
        return got

    def close(self) -> None:
        self.fh.close()


class _LocalUpload:
    def __init__(self, path: str) -> None:
        self.path = path
        folder = os.path.dirname(path)
        os.makedirs(folder, exist_ok=True)
        self.tmp = os.path.join(folder, f"{TEMP_PREFIX}{uuid.uuid4().hex}")
        self.fd: int | None = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        self._busy = 0
        self._lock = threading.Lock()
        self.committed = False

    def send(self, number: int, offset: int, data: bytes, last: bool) -> None:
        with self._lock:
            if self.fd is None:
                raise OSError(f"upload of {self.path} was aborted")
            fd, self._busy = self.fd, self._busy + 1
        try:
            view = memoryview(data)
            while view:
                n = os.pwrite(fd, view, offset)
                view, offset = view[n:], offset + n
        finally:
            with self._lock:
                self._busy -= 1

    def commit(self) -> None:
        if self.fd is None:  # committed (or aborted) already: the name is taken or was never ours
            raise FileExistsError(f"object exists: file://{self.path}") if self.committed else \
                OSError(f"upload of {self.path} was aborted")
        os.fsync(self.fd)
        try:
            os.link(self.tmp, self.path)
        except FileExistsError:
            raise FileExistsError(f"object exists: file://{self.path}") from None
        self.committed = True
        _fsync_dir(os.path.dirname(self.path))
        self.abort()  # the temp name goes; the published name stays

    def abort(self) -> None:
        with self._lock:
            fd, self.fd = self.fd, None
            busy = self._busy
        if fd is not None and not busy:  # a write still hung in the kernel keeps its fd
            os.close(fd)
        try:
            os.unlink(self.tmp)
        except FileNotFoundError:
            pass


def _fsync_dir(folder: str) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# -- memory (tests) -------------------------------------------------------------------------------

_MEMORY_LOCK = threading.Lock()


class MemoryBackend(Backend):
    """fsspec's process-wide in-memory filesystem; exclusive create under one lock."""

    multipart = False
    parallel_parts = False

    def put(self, path: str, data: bytes) -> None:
        with _MEMORY_LOCK:
            if self.fs.exists(path):
                raise FileExistsError(f"object exists: memory://{path}")
            self.fs.pipe_file(path, bytes(data))

    def begin(self, path: str) -> Upload:
        return _MemoryUpload(self, path)


class _MemoryUpload:
    def __init__(self, backend: MemoryBackend, path: str) -> None:
        self.backend, self.path = backend, path
        self.parts: dict[int, bytes] = {}

    def send(self, number: int, offset: int, data: bytes, last: bool) -> None:
        self.parts[number] = bytes(data)

    def commit(self) -> None:
        self.backend.put(self.path, b"".join(self.parts[n] for n in sorted(self.parts)))
        self.parts.clear()

    def abort(self) -> None:
        self.parts.clear()


# -- S3 ---------------------------------------------------------------------------------------------


class S3Backend(Backend):
    """s3fs; exclusive create with ``If-None-Match: *`` on PUT and on multipart completion."""

    def put(self, path: str, data: bytes) -> None:
        bucket, key, _ = self.fs.split_path(path)
        self.fs.call_s3("put_object", Bucket=bucket, Key=key, Body=data, IfNoneMatch="*")
        self.fs.invalidate_cache(path)

    def begin(self, path: str) -> Upload:
        return _S3Upload(self, path)

    def read(self, path: str, start: int | None, end: int | None) -> bytes:
        if start is not None or end is not None:
            return self.fs.cat_file(path, start=start, end=end)
        stream = _S3Stream(self.fs, path, 0)  # one GET (s3fs's cat_file adds a HEAD first)
        try:
            return stream.read(-1)
        finally:
            stream.close()

    def open_stream(self, path: str, start: int, end: int) -> Stream:
        return _S3Stream(self.fs, path, start)


class _S3Stream:
    """One GET from ``start`` to the end of the object, read in chunks on s3fs's event loop."""

    def __init__(self, fs: Any, path: str, start: int) -> None:
        self.fs = fs
        bucket, key, _ = fs.split_path(path)
        kw = {"Range": f"bytes={start}-"} if start else {}
        self.body = fs.call_s3("get_object", Bucket=bucket, Key=key, **kw)["Body"]

    def read(self, nbytes: int) -> bytes:
        return sync(self.fs.loop, self._read, nbytes)

    async def _read(self, nbytes: int) -> bytes:
        if nbytes < 0:
            return await self.body.read()
        pieces, got = [], 0
        while got < nbytes:
            piece = await self.body.read(nbytes - got)
            if not piece:
                break
            pieces.append(piece)
            got += len(piece)
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)

    def close(self) -> None:
        self.body.close()


class _S3Upload:
    def __init__(self, backend: Backend, path: str) -> None:
        self.backend, self.path = backend, path  # backend.fs may be renewed (fresh credentials) mid-upload
        self.bucket, self.key, _ = backend.fs.split_path(path)
        out = self.fs.call_s3("create_multipart_upload", Bucket=self.bucket, Key=self.key)
        self.upload_id: str | None = out["UploadId"]
        self.etags: dict[int, str] = {}

    @property
    def fs(self) -> Any:
        return self.backend.fs

    def send(self, number: int, offset: int, data: bytes, last: bool) -> None:
        out = self.fs.call_s3("upload_part", Bucket=self.bucket, Key=self.key, UploadId=self.upload_id,
                              PartNumber=number, Body=data)
        self.etags[number] = out["ETag"]

    def commit(self) -> None:
        parts = [{"PartNumber": n, "ETag": self.etags[n]} for n in sorted(self.etags)]
        self.fs.call_s3("complete_multipart_upload", Bucket=self.bucket, Key=self.key, UploadId=self.upload_id,
                        MultipartUpload={"Parts": parts}, IfNoneMatch="*")
        self.upload_id = None
        self.fs.invalidate_cache(self.path)

    def abort(self) -> None:
        if self.upload_id is None:
            return
        try:
            self.fs.call_s3("abort_multipart_upload", Bucket=self.bucket, Key=self.key, UploadId=self.upload_id)
        except FileNotFoundError:
            pass  # already completed or aborted
        self.upload_id = None


# -- GCS --------------------------------------------------------------------------------------------


class GcsBackend(Backend):
    """gcsfs; exclusive create with ``ifGenerationMatch=0`` (simple and resumable uploads)."""

    parallel_parts = False
    resend_parts = False
    part_quantum = PART_QUANTUM

    def put(self, path: str, data: bytes) -> None:
        self.fs.pipe_file(path, data, mode="create")  # simple upload, ifGenerationMatch=0

    def begin(self, path: str) -> Upload:
        return _GcsUpload(self.fs, path)


class _GcsUpload:
    """A resumable upload: the session URL takes parts in order; the one marked ``last``
    finalizes the object. ``ifGenerationMatch=0`` is given at initiation, which GCS checks when
    the object is finalized."""

    def __init__(self, fs: Any, path: str) -> None:
        from gcsfs.core import initiate_upload

        self.fs, self.path = fs, path
        bucket, key, _ = fs.split_path(path)
        self.location: str | None = sync(fs.loop, initiate_upload, fs, bucket, key, mode="create")

    def send(self, number: int, offset: int, data: bytes, last: bool) -> None:
        if self.location is None:
            raise OSError(f"upload of {self.path} was aborted")
        end = offset + len(data) - 1
        if last:
            # Belt and braces: some emulators drop the initiation precondition on finalize
            # (fake-gcs-server before fsouza/fake-gcs-server#2260); GCS itself enforces it.
            if self.fs.exists(path := self.path):
                raise FileExistsError(f"object exists: gs://{path}")
            total = str(offset + len(data))
        else:
            assert len(data) % PART_QUANTUM == 0, "non-final GCS parts are multiples of 256 KiB"
            total = "*"
        headers = {"Content-Range": f"bytes {offset}-{end}/{total}", "Content-Length": str(len(data)),
                   "Content-Type": "application/octet-stream"}
        out_headers, _ = self.fs.call("POST", self.location, headers=headers, data=data)
        if not last:
            got = out_headers.get("Range", "")
            if not got.endswith(f"-{end}"):
                raise OSError(f"gs://{self.path}: part {number} not fully taken (server has {got!r}, sent up to {end})")

    def commit(self) -> None:
        self.location = None  # the last part finalized the object
        self.fs.invalidate_cache(self.path)

    def abort(self) -> None:
        if self.location is None:
            return
        location, self.location = self.location, None
        try:
            self.fs.call("DELETE", location.replace("&ifGenerationMatch=0", ""))
        except FileNotFoundError:
            pass


_BACKENDS = {"file": LocalBackend, "memory": MemoryBackend, "s3": S3Backend, "gs": GcsBackend}


def make_backend(protocol: str, storage_options: dict[str, Any]) -> Backend:
    """The backend for ``protocol`` on a :func:`~diloco_async.storage.filesystems.new_filesystem` (one attempt
    per request: the store retries)."""
    return _BACKENDS[protocol](new_filesystem(protocol, storage_options))
