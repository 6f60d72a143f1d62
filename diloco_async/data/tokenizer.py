"""Tokenizers of ``data.tokenizer``: bytes, a Hugging Face ``tokenizer.json``, or a byte-level BPE
trained once on the training split and cached by content hash.

Every tokenizer here turns corpus bytes into a 1-D numpy array of token ids and has a
``vocab_size`` and a ``digest`` (sha256 of its definition: the key of the token files built with
it). A trained BPE lives in ``{token_cache_dir}/tokenizers/`` under a name derived from the corpus
digest, the vocabulary size and the training settings: the first process to need it trains it
under a file lock and publishes it with an atomic rename; every other process (learners, the
evaluator) and every later run loads that file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
from filelock import FileLock

from diloco_async.config.data import parse_tokenizer_spec

__all__ = ["Tokenizer", "load_tokenizer", "train_bpe", "check_vocab", "token_dtype", "transformers_tokenizer",
           "BPE_SETTINGS", "END_OF_TEXT"]

log = logging.getLogger("diloco.tokenizer")

END_OF_TEXT = "<|endoftext|>"
#: Everything besides the corpus and the vocabulary size that decides a trained BPE (part of its cache key).
BPE_SETTINGS = {"model": "bpe", "pre_tokenizer": "byte_level", "add_prefix_space": False, "min_frequency": 2,
                "special_tokens": [END_OF_TEXT], "initial_alphabet": "byte_level", "chunk": "lines<=1MiB"}
_CHUNK_CHARS = 1 << 20


def token_dtype(vocab_size: int) -> np.dtype:
    """Smallest unsigned dtype that holds every id below ``vocab_size`` (uint8, uint16 or uint32)."""
    for dt in (np.uint8, np.uint16, np.uint32):
        if vocab_size <= np.iinfo(dt).max + 1:
            return np.dtype(dt)
    raise ValueError(f"vocabulary of {vocab_size} tokens does not fit in uint32")


def check_vocab(tokenizer_vocab: int, model_vocab: int, *, model_field: str = "model.vocab_size",
                tokenizer: str = "") -> None:
    """Refuse a tokenizer whose ids do not all index the model's embedding.

    Args:
        tokenizer_vocab: ids the tokenizer produces lie in ``[0, tokenizer_vocab)``.
        model_vocab: rows of the model's token embedding.
        model_field: where ``model_vocab`` comes from, for the message (e.g. an HF config's vocab_size).
        tokenizer: the ``data.tokenizer`` value, for the message.

    Raises:
        ValueError: ``tokenizer_vocab > model_vocab``, naming both values.
    """
    if tokenizer_vocab > model_vocab:
        what = f"data.tokenizer={tokenizer!r} has" if tokenizer else "the tokenizer has"
        raise ValueError(f"{what} {tokenizer_vocab} tokens but {model_field}={model_vocab}: the model's "
                         f"vocabulary must be at least the tokenizer's (set {model_field} >= {tokenizer_vocab})")


def _lines(text: str, max_chars: int = _CHUNK_CHARS) -> Iterator[str]:
    """``text`` cut after newlines into pieces of at most about ``max_chars`` (a line longer than that is cut)."""
    start = 0
    while start < len(text):
        end = min(len(text), start + max_chars)
        if end < len(text):
            nl = text.rfind("\n", start, end)
            end = nl + 1 if nl > start else end
        yield text[start:end]
        start = end


@dataclass
class Tokenizer:
    """A tokenizer of corpus bytes.

    Attributes:
        spec: the ``data.tokenizer`` value it came from.
        vocab_size: ids lie in ``[0, vocab_size)``.
        digest: sha256 (hex) of its definition (``"bytes"``, or the tokenizer.json text).
        hf: the ``tokenizers.Tokenizer``, None for bytes.
        json_path: path or URL of its tokenizer.json (the cached file for a trained BPE), None for bytes.
    """

    spec: str
    vocab_size: int
    digest: str
    hf: Any = None
    json_path: str | None = None

    def encode(self, data: bytes) -> np.ndarray:
        """Token ids of ``data`` (UTF-8 text; invalid bytes become U+FFFD for a Hugging Face
        tokenizer), 1-D of :func:`token_dtype`."""
        dtype = token_dtype(self.vocab_size)
        if self.hf is None:
            return np.frombuffer(data, dtype=np.uint8).copy()
        text = data.decode("utf-8", errors="replace")
        invalid = len(data) - len(data.decode("utf-8", errors="ignore").encode("utf-8"))
        if invalid:
            log.warning("%s: %d bytes are not valid UTF-8 and were replaced by U+FFFD", self.spec, invalid)
        pieces = list(_lines(text))
        out = [np.asarray(e.ids, dtype=dtype) for e in self.hf.encode_batch(pieces, add_special_tokens=False)]
        return np.concatenate(out) if out else np.zeros(0, dtype=dtype)


def transformers_tokenizer(tok: Tokenizer) -> Any | None:
    """``tok`` as a ``transformers.PreTrainedTokenizerFast`` (what ``save_pretrained`` writes and
    ``AutoTokenizer.from_pretrained`` reads back: the same ids as :meth:`Tokenizer.encode`), or
    None for the bytes tokenizer (ids are the bytes; nothing to save)."""
    if tok.hf is None:
        return None
    from transformers import PreTrainedTokenizerFast

    specials = {"eos_token": END_OF_TEXT} if tok.hf.token_to_id(END_OF_TEXT) is not None else {}
    return PreTrainedTokenizerFast(tokenizer_object=tok.hf, **specials)


def _from_json_text(spec: str, text: str, json_path: str) -> Tokenizer:
    from tokenizers import Tokenizer as HFTokenizer

    try:
        hf = HFTokenizer.from_str(text)
    except Exception as err:  # noqa: BLE001 - tokenizers raises its own Exception type
        raise ValueError(f"data.tokenizer={spec!r}: {json_path} is not a tokenizers tokenizer.json ({err})") from None
    return Tokenizer(spec, hf.get_vocab_size(with_added_tokens=True),
                     hashlib.sha256(hf.to_str().encode()).hexdigest(), hf, json_path)


def train_bpe(train_text: bytes, vocab_size: int) -> Any:
    """A byte-level BPE (``tokenizers``) with at most ``vocab_size`` tokens trained on ``train_text``
    with :data:`BPE_SETTINGS` (deterministic for the same input)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=BPE_SETTINGS["min_frequency"],
                                  special_tokens=[END_OF_TEXT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    pieces = list(_lines(train_text.decode("utf-8", errors="replace")))
    tok.train_from_iterator(pieces, trainer=trainer, length=len(pieces))
    return tok


def _bpe_path(cache_dir: str | Path, vocab_size: int, corpus_digest: str, eval_fraction: float,
              sample_bytes: int) -> Path:
    import tokenizers

    key = json.dumps({"corpus": corpus_digest, "vocab_size": vocab_size, "eval_fraction": eval_fraction,
                      "settings": BPE_SETTINGS, "tokenizers": tokenizers.__version__, "sample_bytes": sample_bytes},
                     sort_keys=True)
    return Path(cache_dir) / "tokenizers" / f"bpe-{vocab_size}-{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"


def _cached_bpe(spec: str, vocab_size: int, cache_dir: str | Path, corpus_digest: str, eval_fraction: float,
                train_text: Callable[[], bytes], sample_bytes: int) -> Tokenizer:
    path = _bpe_path(cache_dir, vocab_size, corpus_digest, eval_fraction, sample_bytes)
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock"):
        if not path.exists():
            hf = train_bpe(train_text(), vocab_size)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
            with os.fdopen(fd, "w") as fh:
                fh.write(hf.to_str())
            os.chmod(tmp, 0o644)  # mkstemp makes it private; the cache is shared
            os.replace(tmp, path)  # publish, then the next process only reads
            log.info("trained %s on a sample of the training split (%d tokens): %s", spec, hf.get_vocab_size(), path)
    return _from_json_text(spec, path.read_text(), str(path))


def load_tokenizer(spec: str, *, cache_dir: str | Path, corpus_digest: str, eval_fraction: float,
                   train_text: Callable[[], bytes], sample_bytes: int = 128 << 20) -> Tokenizer:
    """The tokenizer named by ``spec`` (a ``data.tokenizer`` value).

    Args:
        spec: ``bytes``, ``bpe:<vocab size>`` or a path/fsspec URL of a tokenizer.json.
        cache_dir: where trained BPE tokenizers are cached.
        corpus_digest, eval_fraction: identify the training split (part of a BPE's cache key).
        train_text: returns the text to train a BPE on (the training split, or a sample of it of at
            most about ``sample_bytes``); called only to train a BPE not yet cached.
        sample_bytes: the bound on that sample (``data.bpe_sample_bytes``; part of a BPE's cache key).

    Raises:
        ValueError: an unknown spec, or a file that is not a tokenizer.json.
        FileNotFoundError: the tokenizer.json does not exist.
    """
    kind, arg = parse_tokenizer_spec(spec)
    if kind == "bytes":
        return Tokenizer(spec, 256, hashlib.sha256(b"bytes").hexdigest())
    if kind == "bpe":
        assert isinstance(arg, int)
        return _cached_bpe(spec, arg, cache_dir, corpus_digest, eval_fraction, train_text, sample_bytes)
    assert isinstance(arg, str)
    try:
        with fsspec.open(arg, "r", encoding="utf-8") as fh:
            text = fh.read()
    except FileNotFoundError:
        raise FileNotFoundError(f"data.tokenizer={spec!r}: no such file") from None
    return _from_json_text(spec, text, arg)
