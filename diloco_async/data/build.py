"""Building a corpus's token files from the token store (:mod:`diloco_async.data.store`).

The corpus's text is every source shard's documents, shards in reading order, joined with ``\\n``
(the bytes :func:`~diloco_async.data.sources.corpus_bytes` would hold, never held here). The
held-out split is its tail: ``data.eval_fraction`` of those bytes, the cut moved back to a UTF-8
character start (:func:`~diloco_async.data.tokens.split_point`'s rule). Its place comes from the first
pass alone (each shard's text length); the one shard the cut falls inside is tokenized as two parts,
every other shard as one, so the held-out bytes are the same for every tokenizer and worker count.

:class:`StoreBuild` owns the worker pool of one build: the first pass, a bounded sample of the
training split for a BPE (``data.bpe_sample_bytes``), the second pass, and :meth:`StoreBuild.assemble`,
which streams the parts (checking each against its manifest) into the local ``train.bin`` and
``heldout.bin`` that every process maps, then writes ``meta.json`` and the corpus manifest
``corpora/{name}.json`` in the store, last.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import shutil
import tempfile
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Executor, Future, ProcessPoolExecutor
from dataclasses import asdict, dataclass
from functools import cached_property, partial
from pathlib import Path
from typing import Any

import fsspec

from diloco_async.config.data import DataConfig
from diloco_async.data.sources import SourceFile, iter_text
from diloco_async.data.store import (
    ShardJob,
    ShardText,
    TokenPart,
    init_worker,
    measure_shard,
    read_part,
    tokenize_shard,
)
from diloco_async.data.tokenizer import Tokenizer, token_dtype

__all__ = ["StoreBuild", "Layout", "store_url", "TOKENS_VERSION"]

log = logging.getLogger("diloco.tokens")

TOKENS_VERSION = 2


def store_url(cfg: DataConfig) -> str:
    """``data.token_store``, or ``{token_cache_dir}/store`` when it is empty."""
    return cfg.token_store or str(Path(cfg.token_cache_dir).resolve() / "store")


@dataclass(frozen=True)
class Layout:
    """Where the held-out cut falls in the corpus's text.

    Attributes:
        spans: per shard, its [start, end) in the corpus's text, or None for a shard without documents.
        separators: the positions of the ``\\n`` between consecutive shards.
        total: bytes of the corpus's text; cut: where held-out starts (a UTF-8 character start).
        split: (shard, byte of its text) when the cut falls strictly inside a shard, else None.
    """

    spans: list[tuple[int, int] | None]
    separators: list[int]
    total: int
    cut: int
    split: tuple[int, int] | None

    @staticmethod
    def plan(shards: list[ShardText], eval_fraction: float) -> tuple[list[tuple[int, int] | None], list[int], int, int]:
        """(spans, separators, total, nominal cut) of shards joined with one ``\\n`` byte."""
        spans: list[tuple[int, int] | None] = []
        seps: list[int] = []
        pos, seen = 0, False
        for s in shards:
            if not s.docs:
                spans.append(None)
                continue
            if seen:
                seps.append(pos)
                pos += 1
            spans.append((pos, pos + s.text_bytes))
            pos, seen = pos + s.text_bytes, True
        return spans, seps, pos, pos - int(pos * eval_fraction)


def _read_prefix(f: SourceFile, text_field: str, nbytes: int) -> bytes:
    """The first ``nbytes`` bytes of a file's document text (streamed, stops there)."""
    out = bytearray()
    for block in iter_text(f, text_field):
        out += block
        if len(out) >= nbytes:
            break
    return bytes(out[:nbytes])


def _window(f: SourceFile, text_field: str, start: int, stop: int) -> bytes:
    """Bytes ``[start, stop)`` of a file's document text, streamed: only the window is kept."""
    out, pos = bytearray(), 0
    for block in iter_text(f, text_field):
        if pos + len(block) > start:
            out += block[max(0, start - pos):max(0, stop - pos)]
        pos += len(block)
        if pos >= stop:
            break
    return bytes(out)


class _Inline(Executor):
    def submit(self, fn: Callable, /, *args: Any, **kwargs: Any) -> Future:
        future: Future = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except Exception as err:  # noqa: BLE001 - handed to the caller through the future, as a pool does
            future.set_exception(err)
        return future


def _bounded_map(pool: Executor, fn: Callable, items: Iterable, in_flight: int) -> list:
    """``[fn(x) for x in items]`` on ``pool``, in order, with at most ``in_flight`` jobs submitted
    at once (a job carries the tokenizer: thousands of shards must not queue thousands of copies)."""
    out, pending = [], deque()
    for item in items:
        pending.append(pool.submit(fn, item))
        if len(pending) >= in_flight:
            out.append(pending.popleft().result())
    out.extend(f.result() for f in pending)
    return out


class StoreBuild:
    """One build of a corpus's token files: a pool of ``data.tokenize_workers`` processes, started
    only if something needs tokenizing; inline instead for one worker, for a corpus smaller than
    ``data.tokenize_pool_min_bytes``, or when a source or the store is a ``memory://`` URL (which
    other processes cannot see). Use as a context manager.

    Args:
        cfg: the ``[data]`` section; files: the corpus's source shards in reading order.
    """

    def __init__(self, cfg: DataConfig, files: list[SourceFile]) -> None:
        self.cfg, self.files, self.store = cfg, files, store_url(cfg)
        urls = [f.url for f in files] + [self.store]
        local_only = any(u.startswith("memory://") for u in urls)
        small = sum(f.size_bytes for f in files) < cfg.tokenize_pool_min_bytes
        self.workers = 1 if local_only or small else min(cfg.tokenize_workers, len(files))
        self._pool: Executor | None = None

    def __enter__(self) -> StoreBuild:
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)

    @property
    def pool(self) -> Executor:
        if self._pool is None:
            self._pool = _Inline() if self.workers == 1 else ProcessPoolExecutor(
                self.workers, mp_context=multiprocessing.get_context("spawn"), initializer=init_worker)
            log.info("token store %s: %d worker(s) for %d source shards", self.store, self.workers, len(self.files))
        return self._pool

    @cached_property
    def shards(self) -> list[ShardText]:
        """First pass: every shard measured (in parallel)."""
        return _bounded_map(self.pool, partial(measure_shard, text_field=self.cfg.text_field), self.files,
                            2 * self.workers)

    @cached_property
    def layout(self) -> Layout:
        """The held-out cut, moved back to a character start by reading the one shard it falls in."""
        spans, seps, total, cut = Layout.plan(self.shards, self.cfg.eval_fraction)
        for i, span in enumerate(spans):
            if span and span[0] < cut < span[1]:
                local = cut - span[0]
                start = max(0, local - 4)  # a UTF-8 character is at most 4 bytes
                window = _window(self.files[i], self.cfg.text_field, start, local + 1)
                while local > start and (window[local - start] & 0xC0) == 0x80:
                    local -= 1
                return Layout(spans, seps, total, span[0] + local, (i, local) if local else None)
        return Layout(spans, seps, total, cut, None)

    def training_sample(self) -> bytes:
        """Text to train a BPE on: the training split when it fits in ``data.bpe_sample_bytes``
        (then exactly ``corpus_bytes(...)[:cut]``), else the same share of every shard's training
        text from its start, in whole lines."""
        cut, budget = self.layout.cut, self.cfg.bpe_sample_bytes
        seps = set(self.layout.separators)
        out = bytearray()
        for i, span in enumerate(self.layout.spans):
            if span is None:
                continue
            if span[0] - 1 in seps and span[0] - 1 < cut:
                out += b"\n"
            if span[0] >= cut:
                break
            take = min(span[1], cut) - span[0]
            quota = take if cut <= budget else int(take * budget / cut)
            piece = _read_prefix(self.files[i], self.cfg.text_field, quota)
            out += piece if quota == take else piece[:piece.rfind(b"\n") + 1]
        log.info("BPE sample: %d bytes of a %d-byte training split", len(out), cut)
        return bytes(out)

    def tokenize(self, tok: Tokenizer) -> list[list[TokenPart]]:
        """Second pass: every shard's parts in the store (in parallel; existing parts are reused)."""
        split = self.layout.split
        jobs = (ShardJob(f, self.cfg.text_field, s, self.store, tok, split[1] if split and split[0] == i else None)
                for i, (f, s) in enumerate(zip(self.files, self.shards, strict=True)))
        return _bounded_map(self.pool, tokenize_shard, jobs, 2 * self.workers)

    def assemble(self, folder: Path, tok: Tokenizer, corpus_digest: str) -> dict:
        """Write ``train.bin``, ``heldout.bin`` and ``meta.json`` into ``folder`` (through a temporary
        sibling renamed into place), then the corpus manifest in the store; returns the meta.

        Raises:
            ValueError: a part does not match its manifest (:func:`~diloco_async.data.store.read_part`).
        """
        parts, lay = self.tokenize(tok), self.layout
        sep = tok.encode(b"\n").astype(token_dtype(tok.vocab_size).newbyteorder("<")).tobytes()
        tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=folder.name + ".tmp"))
        try:
            itemsize = token_dtype(tok.vocab_size).itemsize
            with open(tmp / "train.bin", "wb") as train, open(tmp / "heldout.bin", "wb") as heldout:
                seps = set(lay.separators)
                for i, span in enumerate(lay.spans):
                    if span is None:
                        continue
                    if span[0] - 1 in seps:
                        (train if span[0] <= lay.cut else heldout).write(sep)
                    for k, part in enumerate(parts[i]):
                        into_train = (k == 0) if len(parts[i]) == 2 else span[1] <= lay.cut
                        out = train if into_train else heldout
                        for block in read_part(self.store, part):
                            out.write(block)
                counts = {"train": train.tell() // itemsize, "heldout": heldout.tell() // itemsize}
            meta = {"version": TOKENS_VERSION, "corpus_digest": corpus_digest, "tokenizer": tok.spec,
                    "tokenizer_digest": tok.digest, "vocab_size": tok.vocab_size,
                    "dtype": token_dtype(tok.vocab_size).str, "eval_fraction": self.cfg.eval_fraction,
                    "train_tokens": counts["train"], "heldout_tokens": counts["heldout"], "train_bytes": lay.cut,
                    "heldout_bytes": lay.total - lay.cut, "store": self.store, "workers": self.workers}
            (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
            os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is shared
            os.rename(tmp, folder)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        self._write_manifest(folder.name, meta, parts)
        log.info("tokenized %d bytes in %d shards with %s into %d + %d tokens: %s", lay.total, len(self.files),
                 tok.spec, counts["train"], counts["heldout"], folder)
        return meta

    def _write_manifest(self, name: str, meta: dict, parts: list[list[TokenPart]]) -> None:
        """``corpora/{name}.json``: the corpus's meta and, per source shard, its URL, sha256, text bytes
        and parts (token counts and digests); written after everything it names."""
        fs, root = fsspec.core.url_to_fs(self.store)
        fs.makedirs(f"{root}/corpora", exist_ok=True)
        doc = {**meta, "shards": [{**asdict(s), "parts": [asdict(p) for p in ps]}
                                  for s, ps in zip(self.shards, parts, strict=True)]}
        with fs.open(f"{root}/corpora/{name}.json", "w") as fh:
            fh.write(json.dumps(doc, indent=1))
