"""A synthetic JSONL corpus of a given size for the data benchmarks (``make bench-data``).

Pseudo-English documents (words of a small vocabulary, lines and sentences of random length, a few
accented words so the text is not pure ASCII), one ``{"id": ..., "text": ...}`` record per line,
cut into shards of ``shard_bytes``. Every record starts with its shard and document number, so no
two shards share content (the token store would otherwise reuse one shard's tokens for another).
Deterministic for a seed; written at disk speed from a pool of pre-built documents.

Usage: python -m benchmarks.synth_corpus OUT_DIR --total-mb 512 --shard-mb 64 [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

from benchmarks.args import description, positive_int

__all__ = ["write_corpus"]

_WORDS = ("the king queen lord lady sword crown love death night day speak hear thou thee thy good noble fair "
          "heaven earth father mother son daughter honour grace war peace blood heart café naïve über").split()


def _pool(rng: random.Random, n_docs: int) -> list[str]:
    """``n_docs`` JSON-escaped document bodies of about 0.3 to 3 KB."""
    docs = []
    for _ in range(n_docs):
        lines = []
        for _ in range(rng.randint(3, 30)):
            words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 14))]
            lines.append(" ".join(words).capitalize() + rng.choice(".,;!?"))
        docs.append(json.dumps("\n".join(lines))[1:-1])
    return docs


def write_corpus(out: Path, total_bytes: int, shard_bytes: int, seed: int = 0) -> list[Path]:
    """Write shards ``out/part-00000.jsonl`` ... of about ``shard_bytes`` each until ``total_bytes``.

    Returns:
        the shard paths, in order.
    """
    rng = random.Random(seed)
    pool = _pool(rng, 2048)
    out.mkdir(parents=True, exist_ok=True)
    paths, written, shard = [], 0, 0
    while written < total_bytes:
        path = out / f"part-{shard:05d}.jsonl"
        size, n, lines = 0, 0, []
        limit = min(shard_bytes, total_bytes - written)
        with open(path, "w", encoding="utf-8") as fh:
            while size < limit:
                line = f'{{"id": "{shard}-{n}", "text": "shard {shard} doc {n}: {pool[rng.randrange(len(pool))]}"}}\n'
                lines.append(line)
                size += len(line.encode("utf-8"))
                n += 1
                if len(lines) >= 4096:
                    fh.writelines(lines)
                    lines = []
            fh.writelines(lines)
        paths.append(path)
        written += size
        shard += 1
    return paths


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.synth_corpus", description=description(__doc__))
    ap.add_argument("out", type=Path)
    ap.add_argument("--total-mb", type=positive_int, default=512)
    ap.add_argument("--shard-mb", type=positive_int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    paths = write_corpus(args.out, args.total_mb << 20, args.shard_mb << 20, args.seed)
    print(f"{len(paths)} shards, {sum(p.stat().st_size for p in paths)} bytes in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
