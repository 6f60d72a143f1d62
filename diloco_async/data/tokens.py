"""Token files: the corpus tokenized once, cached, and memory-mapped by every process.

:func:`open_corpus` lists the configured corpus's source shards (:mod:`diloco_async.data.sources`),
has each tokenized on its own into the token store by a pool of workers
(:mod:`diloco_async.data.store`, :mod:`diloco_async.data.build`) and joins the parts into a training
file and a held-out tail (``data.eval_fraction`` of the text's bytes, moved back to a UTF-8
character boundary: the same bytes whatever the tokenizer, the worker count and the learner count):
``{token_cache_dir}/tokens/{corpus digest}-{tokenizer digest}-{eval_fraction}-v2/`` (``train.bin``,
``heldout.bin``, ``meta.json`` last), under a file lock and through a temporary folder renamed into
place. Every later call, in any process, maps those files read-only (``numpy.memmap``): the pages
are the OS page cache's, shared by every learner on the machine, never copied.

:class:`Corpus` cuts the training tokens into one contiguous shard per learner, samples windows
from a shard, and gives the fixed held-out windows and the counts that turn nats per token into
bits per byte (:func:`bits_per_byte`).
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from filelock import FileLock

from diloco_async.config.data import DataConfig, parse_tokenizer_spec
from diloco_async.data.build import TOKENS_VERSION, StoreBuild
from diloco_async.data.sources import corpus_digest, resolve_sources
from diloco_async.data.tokenizer import Tokenizer, check_vocab, load_tokenizer

__all__ = ["Corpus", "HeldoutSplit", "open_corpus", "bits_per_byte", "split_point"]

log = logging.getLogger("diloco.tokens")

def bits_per_byte(nats_per_token: float, tokens: int, nbytes: int) -> float:
    """Bits per byte of text from a mean loss in nats per token over a split of ``tokens`` tokens
    covering ``nbytes`` bytes: ``nats_per_token * tokens / (nbytes * ln 2)``. For the bytes
    tokenizer (tokens == nbytes) it is nats per byte / ln 2.

    Raises:
        ValueError: ``tokens`` or ``nbytes`` not positive.
    """
    if tokens <= 0 or nbytes <= 0:
        raise ValueError(f"bits per byte needs positive counts, got {tokens} tokens over {nbytes} bytes")
    return nats_per_token * tokens / (nbytes * math.log(2))


def split_point(data: bytes, eval_fraction: float) -> int:
    """Where the held-out tail starts: ``len(data) - int(len(data) * eval_fraction)``, moved back
    to the start of a UTF-8 character (so no tokenizer sees half a character on either side)."""
    cut = len(data) - int(len(data) * eval_fraction)
    while 0 < cut < len(data) and (data[cut] & 0xC0) == 0x80:
        cut -= 1
    return cut


@dataclass(frozen=True)
class HeldoutSplit:
    """The fixed held-out windows and the size of the held-out split they come from.

    Attributes:
        batches: (inputs, targets) int64 [B, T] each, the same for every caller.
        tokens, nbytes: tokens and bytes of the whole held-out split.
    """

    batches: list[tuple[torch.Tensor, torch.Tensor]]
    tokens: int
    nbytes: int

    def bits_per_byte(self, nats_per_token: float) -> float:
        """:func:`bits_per_byte` over this split."""
        return bits_per_byte(nats_per_token, self.tokens, self.nbytes)


@dataclass
class Corpus:
    """Training shards and held-out split of a tokenized corpus.

    Args:
        train, heldout: 1-D token ids (read-only memory maps of the token files, or any array).
        context: window length T in tokens.
        vocab_size: ids lie in ``[0, vocab_size)``.
        heldout_bytes: bytes of text the held-out tokens cover.
        tokenizer: the tokenizer the ids come from.
        manifest_url: the corpus manifest in the token store (every source shard's URL, sha256, text
            bytes and token parts; ``corpora/{name}.json``, written last), or "" when unknown.

    Raises:
        ValueError: too few tokens for four training windows or one held-out window.
    """

    train: np.ndarray
    heldout: np.ndarray
    context: int
    vocab_size: int
    heldout_bytes: int
    tokenizer: Tokenizer | None = None
    manifest_url: str = ""

    def __post_init__(self) -> None:
        if len(self.train) < 4 * (self.context + 1) or len(self.heldout) < self.context + 1:
            raise ValueError(
                f"corpus of {len(self.train)} training and {len(self.heldout)} held-out tokens is too small "
                f"for context {self.context} (check data.urls and data.eval_fraction)"
            )

    def shard(self, index: int, count: int) -> np.ndarray:
        """Contiguous training shard ``index`` of ``count`` (a view, 1-D).

        Raises:
            ValueError: ``index`` out of range, or a shard shorter than two windows.
        """
        if not 0 <= index < count:
            raise ValueError(f"shard index {index} out of range for {count} shards")
        size = len(self.train) // count
        if size < 2 * (self.context + 1):
            raise ValueError(f"{len(self.train)} training tokens make shards of {size} tokens for learners.count="
                             f"{count}: too few for windows of {self.context + 1} tokens")
        return self.train[index * size: (index + 1) * size if index < count - 1 else len(self.train)]

    @staticmethod
    def sample(shard: np.ndarray | torch.Tensor, batch_size: int, context: int, gen: torch.Generator
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Random windows of a shard: inputs and next-token targets, int64 [B, T] each."""
        starts = torch.randint(0, len(shard) - context - 1, (batch_size,), generator=gen)
        idx = starts[:, None] + torch.arange(context + 1)[None, :]
        win = torch.from_numpy(np.asarray(shard)[idx.numpy()].astype(np.int64))
        return win[:, :-1], win[:, 1:]

    @staticmethod
    def windows(stream: np.ndarray, first: int, batch_size: int, context: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``batch_size`` consecutive windows of ``stream`` from token ``first`` (window j's inputs are
        tokens ``first + j * context`` onwards): inputs and next-token targets, int64 [B, T] each.
        The last target is token ``first + batch_size * context``.

        Raises:
            ValueError: the windows run past the end of ``stream`` (naming ``first``).
        """
        end = first + batch_size * context + 1
        if first < 0 or end > len(stream):
            raise ValueError(f"windows from token {first} ({batch_size} x {context}) run past the {len(stream)} tokens")
        flat = torch.from_numpy(np.asarray(stream[first:end]).astype(np.int64))
        return flat[:-1].view(batch_size, context), flat[1:].view(batch_size, context)

    def eval_batches(self, batch_size: int, n_batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Fixed, evenly spaced held-out windows: the same for every caller."""
        n = batch_size * n_batches
        span = len(self.heldout) - self.context - 1
        starts = torch.linspace(0, span, n).long()
        idx = starts[:, None] + torch.arange(self.context + 1)[None, :]
        win = torch.from_numpy(np.asarray(self.heldout)[idx.numpy()].astype(np.int64))
        return [(win[i:i + batch_size, :-1], win[i:i + batch_size, 1:]) for i in range(0, n, batch_size)]

    def heldout_split(self, batch_size: int, n_batches: int) -> HeldoutSplit:
        """:meth:`eval_batches` with the held-out split's token and byte counts."""
        return HeldoutSplit(self.eval_batches(batch_size, n_batches), len(self.heldout), self.heldout_bytes)


def _map(folder: Path) -> tuple[dict, np.ndarray, np.ndarray]:
    meta = json.loads((folder / "meta.json").read_text())
    arrays = [np.memmap(folder / f"{name}.bin", dtype=np.dtype(meta["dtype"]), mode="r",
                        shape=(meta[f"{name}_tokens"],)) if meta[f"{name}_tokens"] else np.zeros(0, meta["dtype"])
              for name in ("train", "heldout")]
    return meta, arrays[0], arrays[1]


def open_corpus(cfg: DataConfig, context: int, model_vocab: int | None = None) -> Corpus:
    """The configured corpus, tokenized and cached (see the module docstring), mapped read-only.

    Args:
        cfg: the ``[data]`` section.
        context: window length T in tokens.
        model_vocab: rows of the model's token embedding; when given, a larger tokenizer is refused
            (:func:`~diloco_async.data.tokenizer.check_vocab`) before any BPE is trained.

    Raises:
        FileNotFoundError: a data URL matches no file, or the tokenizer.json does not exist.
        ValueError: a URL matches only empty files, a JSONL field or Parquet column is absent, the
            tokenizer spec is unknown or larger than ``model_vocab``, or the corpus is too small.
    """
    kind, arg = parse_tokenizer_spec(cfg.tokenizer)
    if model_vocab is not None and kind != "file":  # known from the spec: refuse before reading or training
        check_vocab(256 if kind == "bytes" else int(arg or 0), model_vocab, tokenizer=cfg.tokenizer)
    files = resolve_sources(cfg)
    digest = corpus_digest(files, cfg)
    with StoreBuild(cfg, files) as build:  # starts workers only if something needs tokenizing
        tok = load_tokenizer(cfg.tokenizer, cache_dir=cfg.token_cache_dir, corpus_digest=digest,
                             eval_fraction=cfg.eval_fraction, train_text=build.training_sample,
                             sample_bytes=cfg.bpe_sample_bytes)
        if model_vocab is not None:
            check_vocab(tok.vocab_size, model_vocab, tokenizer=cfg.tokenizer)
        folder = (Path(cfg.token_cache_dir) / "tokens"
                  / f"{digest[:20]}-{tok.digest[:20]}-{cfg.eval_fraction:g}-v{TOKENS_VERSION}")
        if not (folder / "meta.json").exists():
            folder.parent.mkdir(parents=True, exist_ok=True)
            with FileLock(str(folder) + ".lock"):
                if not (folder / "meta.json").exists():
                    build.assemble(folder, tok, digest)
    meta, train, heldout = _map(folder)
    store = str(meta.get("store") or "")
    manifest = f"{store.rstrip('/')}/corpora/{folder.name}.json" if store else ""
    return Corpus(train, heldout, context, tok.vocab_size, meta["heldout_bytes"], tok, manifest)
