"""The token store: every source shard (one file of the corpus) tokenized on its own, by a pool of
worker processes, into fixed-width token records with a manifest (docs/data-and-models.md "The token
store", DESIGN §3.1).

Layout under ``data.token_store`` (an fsspec URL or a local folder; default
``{token_cache_dir}/store``)::

    shards/{key}.bin    the token ids of one part of one source shard, little-endian, fixed width
                        (uint8/uint16/uint32 by vocabulary: token i is bytes [i*w, (i+1)*w))
    shards/{key}.json   its manifest: source URL and sha256, tokenizer digest, byte range of the
                        shard's text, token count and the sha256 of the .bin (written last)

A part's ``key`` is its content: the source's sha256, the tokenizer's digest and the byte range
(``all``, or ``head``/``tail`` of the split at ``N``), so a second corpus or run that holds the
same file reuses its tokens. A worker writes the .bin under a temporary name, moves it into place,
then the manifest; a .bin without a manifest does not count.

Two passes, both per shard and parallel: :func:`measure_shard` (the source's digest and the bytes
of its document text, which place the held-out cut) and :func:`tokenize_shard` (streams the
documents, encodes about ``chunk_bytes`` at a time cut at newlines, writes the records). Memory is
bounded by the chunk and the longest single document, never by the shard or the corpus.
:func:`read_part` streams a part back and refuses one whose bytes do not match its manifest.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import fsspec
import numpy as np
from fsspec.utils import infer_compression

from diloco_async.data.sources import SourceFile, iter_text, read_documents
from diloco_async.data.tokenizer import Tokenizer, token_dtype

__all__ = ["ShardText", "TokenPart", "ShardJob", "measure_shard", "tokenize_shard", "read_part",
           "init_worker", "STORE_VERSION"]

log = logging.getLogger("diloco.store")

STORE_VERSION = 1
_READ_BYTES = 4 << 20


@dataclass(frozen=True)
class ShardText:
    """What the first pass learns of one source shard.

    Attributes:
        url: the source file's fsspec URL.
        digest: sha256 (hex) of its stored bytes and of the settings that read them (format, text field).
        text_bytes: bytes of its document text (documents joined with ``\\n``).
        docs: documents in it (a text file is one document, even when empty).
    """

    url: str
    digest: str
    text_bytes: int
    docs: int


@dataclass(frozen=True)
class TokenPart:
    """One token file of the store and its manifest (the JSON file holds these fields).

    Attributes:
        key: the file name stem under ``shards/``.
        source_url, source_digest: the source shard it comes from.
        tokenizer_digest: the tokenizer's digest; dtype: numpy dtype string of a record.
        byte_start, byte_end: the range of the shard's document text it covers.
        tokens: records in the .bin; token_digest: sha256 (hex) of the .bin.
    """

    key: str
    source_url: str
    source_digest: str
    tokenizer_digest: str
    dtype: str
    byte_start: int
    byte_end: int
    tokens: int
    token_digest: str
    version: int = STORE_VERSION


@dataclass(frozen=True)
class ShardJob:
    """The second pass's work on one shard: tokenize ``source`` with ``tokenizer`` into ``store``,
    as one part, or as two cut at byte ``split_at`` of its text (0 < split_at < text_bytes)."""

    source: SourceFile
    text_field: str
    shard: ShardText
    store: str
    tokenizer: Tokenizer
    split_at: int | None = None
    chunk_bytes: int = 1 << 20


def init_worker() -> None:
    """Initializer of a tokenizing worker process: one core each (the pool is the parallelism), so a
    Hugging Face tokenizer must not start its own thread pool."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    os.environ["RAYON_NUM_THREADS"] = "1"


def _source_digest(f: SourceFile, text_field: str) -> str:
    h = hashlib.sha256(b"diloco-source-v1\n")
    h.update(json.dumps({"format": f.format, "text_field": text_field if f.format != "text" else None}).encode())
    with fsspec.open(f.url, "rb") as fh:
        while chunk := fh.read(_READ_BYTES):
            h.update(chunk)
    return h.hexdigest()


def measure_shard(f: SourceFile, text_field: str) -> ShardText:
    """First pass over one source shard: its digest, document count and text bytes.

    Raises:
        ValueError: a JSONL line that is not JSON, a field or Parquet column that is absent or not
            text (the message names the file and the line or row), or a Parquet file that does not parse.
    """
    digest = _source_digest(f, text_field)
    if f.format == "text":
        plain = infer_compression(f.url) is None
        return ShardText(f.url, digest, f.size_bytes if plain else sum(map(len, iter_text(f, text_field))), 1)
    docs = nbytes = 0
    try:
        for doc in read_documents(f, text_field):
            docs += 1
            nbytes += len(doc)
    except Exception as err:  # noqa: BLE001 - pyarrow/decompressors raise their own types; name the file
        if isinstance(err, ValueError) and f.url in str(err):
            raise
        raise ValueError(f"not a readable {f.format} file ({type(err).__name__}: {err}): {f.url}") from None
    return ShardText(f.url, digest, nbytes + max(docs - 1, 0), docs)


def _part_key(shard: ShardText, tok: Tokenizer, part: str) -> str:
    return f"{shard.digest[:24]}-{tok.digest[:12]}-{part}"


class _PartWriter:
    """Writes token records to ``shards/{key}.bin`` under a temporary name, hashing them."""

    def __init__(self, fs: fsspec.AbstractFileSystem, root: str, key: str, dtype: np.dtype) -> None:
        self.fs, self.key, self.dtype = fs, key, dtype
        self.path = f"{root}/shards/{key}.bin"
        self.tmp = f"{self.path}.tmp-{uuid.uuid4().hex[:12]}"
        self.fh = fs.open(self.tmp, "wb")
        self.h = hashlib.sha256()
        self.tokens = 0

    def write(self, ids: np.ndarray) -> None:
        data = np.ascontiguousarray(ids, dtype=self.dtype.newbyteorder("<")).tobytes()
        self.fh.write(data)
        self.h.update(data)
        self.tokens += len(ids)

    def publish(self, job: ShardJob, start: int, end: int) -> TokenPart:
        """Move the records into place, then write the manifest (the part counts from then on)."""
        self.fh.close()
        self.fs.mv(self.tmp, self.path)
        part = TokenPart(self.key, job.source.url, job.shard.digest, job.tokenizer.digest, self.dtype.str,
                         start, end, self.tokens, self.h.hexdigest())
        manifest = self.path[:-len(".bin")] + ".json"
        tmp = f"{manifest}.tmp-{uuid.uuid4().hex[:12]}"
        with self.fs.open(tmp, "w") as fh:
            fh.write(json.dumps(asdict(part), indent=1))
        self.fs.mv(tmp, manifest)
        return part


def _load_part(fs: fsspec.AbstractFileSystem, root: str, key: str) -> TokenPart | None:
    path = f"{root}/shards/{key}.json"
    if not fs.exists(path):
        return None
    with fs.open(path, "r") as fh:
        meta = json.load(fh)
    return TokenPart(**meta) if meta.get("version") == STORE_VERSION else None


def _flush_end(buf: bytearray, chunk_bytes: int) -> int:
    """How much of ``buf`` to encode now: up to its last newline once it holds ``chunk_bytes``
    (a tokenizer never sees a line cut in two); a buffer four chunks long without a newline is
    cut at a UTF-8 character start. 0: wait for more."""
    if len(buf) < chunk_bytes:
        return 0
    end = buf.rfind(b"\n") + 1
    if end > 0:
        return end
    if len(buf) < 4 * chunk_bytes:
        return 0
    end = len(buf) - 1
    while end > 0 and (buf[end] & 0xC0) == 0x80:
        end -= 1
    return end


def tokenize_shard(job: ShardJob) -> list[TokenPart]:
    """Second pass over one source shard: its parts in the store (reused when their manifests are
    already there). Runs in a worker process or inline.

    Returns:
        one part (``all``), or two (``head`` then ``tail``) when ``job.split_at`` is set.

    Raises:
        ValueError: as :func:`measure_shard`, or the source changed since the first pass (its text
            is not ``shard.text_bytes`` long; the message names the file).
    """
    fs, root = fsspec.core.url_to_fs(job.store)
    names = ["all"] if job.split_at is None else [f"head{job.split_at}", f"tail{job.split_at}"]
    keys = [_part_key(job.shard, job.tokenizer, n) for n in names]
    found = [_load_part(fs, root, k) for k in keys]
    if all(found):
        return found  # type: ignore[return-value]
    fs.makedirs(f"{root}/shards", exist_ok=True)
    dtype = token_dtype(job.tokenizer.vocab_size)
    writers = [_PartWriter(fs, root, k, dtype) for k in keys]
    cut = job.split_at
    buf, offset, parts = bytearray(), 0, []
    for block in iter_text(job.source, job.text_field, job.chunk_bytes):
        buf += block
        if cut is not None and offset + len(buf) > cut:  # the head ends inside this buffer
            writers[0].write(job.tokenizer.encode(bytes(buf[:cut - offset])))
            parts.append(writers.pop(0).publish(job, 0, cut))
            del buf[:cut - offset]
            offset, cut = job.split_at, None
        while end := _flush_end(buf, job.chunk_bytes):
            writers[0].write(job.tokenizer.encode(bytes(buf[:end])))
            del buf[:end]
            offset += end
    if buf:
        writers[0].write(job.tokenizer.encode(bytes(buf)))
        offset += len(buf)
    if offset != job.shard.text_bytes or cut is not None:
        raise ValueError(f"{job.source.url} changed while it was tokenized: {offset} bytes of text, "
                         f"{job.shard.text_bytes} when it was measured")
    parts.append(writers[0].publish(job, job.split_at or 0, offset))
    log.info("tokenized (%s) %s", ", ".join(f"{p.key} {p.tokens} tokens" for p in parts), job.source.url)
    return parts


def read_part(store: str, part: TokenPart, read_bytes: int = _READ_BYTES) -> Iterator[bytes]:
    """The records of ``part`` from ``store``, in blocks, checked against its manifest as they stream:
    the last block is yielded only after the size and sha256 matched.

    Raises:
        ValueError: the .bin is not the manifest's size or digest (a tampered or damaged store); the
            message names the file, both digests and what to do. Nothing built from it counts.
    """
    fs, root = fsspec.core.url_to_fs(store)
    path = f"{root}/shards/{part.key}.bin"
    expected = part.tokens * np.dtype(part.dtype).itemsize
    size = fs.size(path) if fs.exists(path) else None
    if size != expected:
        raise ValueError(f"token store {store}: {path} holds {size} bytes, its manifest says {part.tokens} tokens "
                         f"({expected} bytes); delete {part.key}.bin and .json to rebuild it")
    h = hashlib.sha256()
    pending = b""
    with fs.open(path, "rb") as fh:
        while block := fh.read(read_bytes):
            if pending:
                yield pending
            h.update(block)
            pending = block
    if h.hexdigest() != part.token_digest:
        log.error("token store %s: %s has sha256 %s, its manifest %s", store, path, h.hexdigest(), part.token_digest)
        raise ValueError(f"token store {store}: {path} has sha256 {h.hexdigest()} but its manifest says "
                         f"{part.token_digest}; delete {part.key}.bin and .json to rebuild it")
    if pending:
        yield pending
