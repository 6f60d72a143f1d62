"""The token store's bars (issue 45 item 1): tokenization throughput with two workers against one,
and peak memory of tokenization for a small and a ten times larger corpus.

* Throughput: a synthetic JSONL corpus (:mod:`benchmarks.synth_corpus`, ``--bpe-mb``, 12 shards)
  tokenized from cold (a fresh token cache: the corpus digest, both passes over every shard, the
  assembly of the training and held-out files) with a byte-level BPE of 4096 tokens (a
  tokenizer.json trained once on a sample first, so no run trains), by 1 and by 2 workers (one
  thread each), interleaved (1, 2, 1, 2 ..., ``--repeats`` pairs). Figure: source bytes per second
  of 2 workers over 1, the mean of the pairs' ratios. Bar: >= 1.7.
* Memory: the peak RSS of the build's whole process tree (the build and its workers, sampled every
  20 ms with psutil) for a ``--small-mb`` corpus in 8 shards and a ``--large-mb`` corpus in 20
  (64 and 256 MB shards by default: a worker's memory does not depend on the shard either), 2
  workers, the bytes tokenizer (a BPE over 5 GB takes hours on two cores). Bar: the large over the
  small within 10% (<= 1.10 and >= 0.90).

Every build runs in a fresh child process (``--child``); corpora are generated into a temporary
folder under ``--dir`` and deleted after. Usage:
python -m benchmarks.data_bars [--quick] [--bpe-mb 96] [--repeats 2] [--small-mb 512] [--large-mb 5120] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from benchmarks.args import description, positive_int
from benchmarks.bars import Bar, print_bars
from benchmarks.synth_corpus import write_corpus

__all__ = ["main", "throughput_bar", "memory_bars"]

THROUGHPUT_GOAL = 1.7
RSS_TOLERANCE = 0.10
_ROOT = Path(__file__).resolve().parents[1]


def _child(spec: dict) -> None:
    """Build the corpus's token files from cold with the settings of ``spec``; print the seconds."""
    from diloco_async.config.data import DataConfig
    from diloco_async.data.tokens import open_corpus

    cfg = DataConfig(source="urls", urls=[spec["urls"]], token_cache_dir=spec["cache"], tokenizer=spec["tokenizer"],
                     tokenize_workers=spec["workers"], tokenize_pool_min_bytes=0)
    start = time.perf_counter()
    corpus = open_corpus(cfg, context=64)
    print(json.dumps({"seconds": time.perf_counter() - start, "train_tokens": len(corpus.train)}), flush=True)


def _build(urls: str, cache: Path, tokenizer: str, workers: int) -> dict:
    """Run one cold build in a child process; its seconds and the peak RSS of its process tree (bytes)."""
    spec = {"urls": urls, "cache": str(cache), "tokenizer": tokenizer, "workers": workers}
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "RAYON_NUM_THREADS": "1"}  # a worker is one core
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.data_bars", "--child", json.dumps(spec)], cwd=_ROOT,
                            stdout=subprocess.PIPE, text=True, env=env)
    root, peak = psutil.Process(proc.pid), 0
    while proc.poll() is None:
        try:
            tree = [root, *root.children(recursive=True)]
            peak = max(peak, sum(p.memory_info().rss for p in tree if p.is_running()))
        except psutil.Error:
            pass  # a worker exited between the listing and the reading
        time.sleep(0.02)
    out = proc.stdout.read() if proc.stdout else ""
    if proc.returncode != 0:
        raise RuntimeError(f"build with {workers} worker(s) of {urls} failed with status {proc.returncode}")
    shutil.rmtree(cache, ignore_errors=True)
    return {**json.loads(out.strip().splitlines()[-1]), "peak_rss": peak}


def _bpe_tokenizer(corpus: Path, out: Path) -> str:
    """A 4096-token byte-level BPE trained on the first 8 MB of the corpus's first shard, saved as a tokenizer.json."""
    from diloco_async.data.tokenizer import train_bpe

    first = sorted(corpus.glob("*.jsonl"))[0]
    with open(first, "rb") as fh:
        sample = b"\n".join(json.loads(line)["text"].encode() for line in fh.read(8 << 20).splitlines()[:-1])
    path = out / "tokenizer.json"
    path.write_text(train_bpe(sample, 4096).to_str())
    return str(path)


def throughput_bar(work: Path, corpus_mb: int, repeats: int) -> list[Bar]:
    corpus = work / "bpe-corpus"
    paths = write_corpus(corpus, corpus_mb << 20, max(1, corpus_mb // 12) << 20, seed=1)
    size = sum(p.stat().st_size for p in paths)
    tok = _bpe_tokenizer(corpus, work)
    rates: dict[int, list[float]] = {1: [], 2: []}
    for rep in range(repeats):
        for workers in (1, 2):
            r = _build(f"file://{corpus}/*.jsonl", work / f"cache-{rep}-{workers}", tok, workers)
            rates[workers].append(size / r["seconds"])
            print(f"[{rep}] {workers} worker(s): {size / 2**20:.0f} MiB in {r['seconds']:.1f} s = "
                  f"{rates[workers][-1] / 2**20:.2f} MiB/s, peak RSS {r['peak_rss'] / 2**20:.0f} MiB", flush=True)
    shutil.rmtree(corpus, ignore_errors=True)
    ratios = [b / a for a, b in zip(rates[1], rates[2], strict=True)]
    mean = sum(ratios) / len(ratios)
    pairs = ", ".join(f"{r:.2f}" for r in ratios)
    detail = f"BPE 4096, {len(paths)} JSONL shards, {size / 2**20:.0f} MiB; pairs {pairs}"
    return [Bar("tokenization throughput, 2 workers / 1 worker", mean, THROUGHPUT_GOAL, "min", detail),
            Bar("tokenization MiB/s, 1 worker (BPE 4096)", sum(rates[1]) / repeats / 2**20, 0, "min", shown=True)]


def memory_bars(work: Path, small_mb: int, large_mb: int) -> list[Bar]:
    peaks = {}
    for total_mb, shard_mb in ((small_mb, max(1, small_mb // 8)), (large_mb, max(1, large_mb // 20))):
        corpus = work / f"rss-{total_mb}"
        t0 = time.perf_counter()
        paths = write_corpus(corpus, total_mb << 20, shard_mb << 20, seed=2)
        size = sum(p.stat().st_size for p in paths)
        print(f"generated {size / 2**20:.0f} MiB in {len(paths)} shards in {time.perf_counter() - t0:.0f} s",
              flush=True)
        r = _build(f"file://{corpus}/*.jsonl", work / f"cache-rss-{total_mb}", "bytes", 2)
        shutil.rmtree(corpus, ignore_errors=True)
        peaks[total_mb] = r["peak_rss"]
        print(f"{size / 2**20:.0f} MiB: built in {r['seconds']:.1f} s, peak RSS {r['peak_rss'] / 2**20:.0f} MiB "
              f"(build and workers)", flush=True)
    ratio = peaks[large_mb] / peaks[small_mb]
    detail = (f"{peaks[small_mb] / 2**20:.0f} MiB for {small_mb} MiB, {peaks[large_mb] / 2**20:.0f} MiB for {large_mb} "
              "MiB; bytes tokenizer, 2 workers")
    figure = f"peak RSS of tokenization, {large_mb} / {small_mb} MiB corpus"
    return [Bar(figure, ratio, 1 + RSS_TOLERANCE, "max", detail),
            Bar(f"{figure} (lower side)", ratio, 1 - RSS_TOLERANCE, "min")]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.data_bars", description=description(__doc__))
    ap.add_argument("--quick", action="store_true", help="small corpora: checks the benchmark runs, not the goals")
    ap.add_argument("--bpe-mb", type=positive_int, default=96)
    ap.add_argument("--repeats", type=positive_int, default=2)
    ap.add_argument("--small-mb", type=positive_int, default=512)
    ap.add_argument("--large-mb", type=positive_int, default=5120)
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    ap.add_argument("--only", choices=["throughput", "memory"])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        _child(json.loads(args.child))
        return 0
    if args.quick:
        args.bpe_mb, args.repeats, args.small_mb, args.large_mb = 8, 1, 16, 64
    bars: list[Bar] = []
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench-data-") as tmp:
        if args.only in (None, "throughput"):
            bars += throughput_bar(Path(tmp), args.bpe_mb, args.repeats)
        if args.only in (None, "memory"):
            bars += memory_bars(Path(tmp), args.small_mb, args.large_mb)
    return print_bars(bars, title="token store bars (make bench-data)")


if __name__ == "__main__":
    sys.exit(main())
