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
* A learner's memory (issue 45 item 4): on each of those two token stores, a real run of
  ``configs/default.toml`` (one synchronizer, one learner process, leased slices of 16 inner steps,
  ``--learner-s`` seconds) and the peak RSS of the learner's process tree, sampled every 100 ms. The
  learner maps the training tokens and reads only the pages of the slices it leases (and the
  held-out windows), so its memory must not follow the corpus. Bar: the large over the small within
  10%, both sides; its tokens trained are shown.

Every build runs in a fresh child process (``--child``); corpora are generated into a temporary
folder under ``--dir`` and deleted after. Usage:
python -m benchmarks.data_bars [--quick] [--bpe-mb 96] [--repeats 2] [--small-mb 512] [--large-mb 5120]
    [--learner-s 60] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from benchmarks.args import description, non_negative_float, positive_int
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


def _build(urls: str, cache: Path, tokenizer: str, workers: int, keep: bool = False) -> dict:
    """Run one cold build in a child process; its seconds and the peak RSS of its process tree (bytes).
    The token cache is deleted after unless ``keep``."""
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
    if not keep:
        shutil.rmtree(cache, ignore_errors=True)
    return {**json.loads(out.strip().splitlines()[-1]), "peak_rss": peak}


def _tree_rss(root: psutil.Process) -> int:
    """The RSS of ``root`` and its descendants now (bytes; 0 once it is gone)."""
    try:
        tree = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0
    total = 0
    for p in tree:
        with contextlib.suppress(psutil.Error):
            total += p.memory_info().rss
    return total


def learner_peak_rss(urls: str, cache: Path, work: Path, seconds: float) -> dict:
    """A real run on the token store ``cache`` (built from ``urls``) with leased slices: one
    synchronizer and one learner for ``seconds``; the learner's peak RSS (bytes, its process tree
    sampled every 100 ms) and the tokens the run trained (the slice ledger's).

    Raises:
        RuntimeError: the learner trained nothing (its log's tail in the message).
    """
    from diloco_async.config.resolved import with_fields
    from diloco_async.config.schema import load_config
    from diloco_async.run import RunProcesses

    base = load_config(_ROOT / "configs/default.toml", [])
    step_tokens = base.learners.grad_accum_steps * base.learners.batch_size_of(0) * base.model.context
    cfg = with_fields(base, {  # slices of 16 inner steps
        "data.source": "urls", "data.urls": [urls], "data.token_cache_dir": str(cache), "data.slices": True,
        "data.slice_tokens": 16 * step_tokens, "learners.checkpoint_every_s": 0.0, "learners.count": 1,
        "synchronizer.min_quorum": 1, "budget.wall_s": float(seconds), "budget.tokens": 10**12,
        "run.store": f"file://{work}/store", "run.workdir": f"{work}/runs"})
    run = RunProcesses(cfg)
    peak = 0
    try:
        run.start_synchronizer()
        learner = psutil.Process(run.start_learner(0).proc.pid)
        deadline = time.monotonic() + seconds + 180
        while run.sync is not None and run.sync.poll() is None and time.monotonic() < deadline:
            peak = max(peak, _tree_rss(learner))
            time.sleep(0.1)
    finally:
        run.stop_all()
    summary = run.final_summary()
    trained = summary.get("tokens_trained", 0)
    if not trained:
        tail = "".join(log.read_text(errors="replace")[-2000:] for log in sorted((run.workdir / "logs").glob("*.log")))
        raise RuntimeError(f"the learner trained no slice on {urls}; logs in {run.workdir / 'logs'}:\n{tail}")
    shutil.rmtree(work, ignore_errors=True)
    return {"peak_rss": peak, "tokens_trained": trained}


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


def memory_bars(work: Path, small_mb: int, large_mb: int, learner_s: float = 0.0) -> list[Bar]:
    peaks, learners = {}, {}
    for total_mb, shard_mb in ((small_mb, max(1, small_mb // 8)), (large_mb, max(1, large_mb // 20))):
        corpus = work / f"rss-{total_mb}"
        t0 = time.perf_counter()
        paths = write_corpus(corpus, total_mb << 20, shard_mb << 20, seed=2)
        size = sum(p.stat().st_size for p in paths)
        print(f"generated {size / 2**20:.0f} MiB in {len(paths)} shards in {time.perf_counter() - t0:.0f} s",
              flush=True)
        urls, cache = f"file://{corpus}/*.jsonl", work / f"cache-rss-{total_mb}"
        r = _build(urls, cache, "bytes", 2, keep=learner_s > 0)
        peaks[total_mb] = r["peak_rss"]
        print(f"{size / 2**20:.0f} MiB: built in {r['seconds']:.1f} s, peak RSS {r['peak_rss'] / 2**20:.0f} MiB "
              f"(build and workers)", flush=True)
        if learner_s > 0:
            learners[total_mb] = learner_peak_rss(urls, cache, work / f"run-{total_mb}", learner_s)
            print(f"{size / 2**20:.0f} MiB: a learner on leased slices for {learner_s:.0f} s: peak RSS "
                  f"{learners[total_mb]['peak_rss'] / 2**20:.0f} MiB, {learners[total_mb]['tokens_trained']} tokens "
                  "trained", flush=True)
        shutil.rmtree(corpus, ignore_errors=True)
        shutil.rmtree(cache, ignore_errors=True)
    ratio = peaks[large_mb] / peaks[small_mb]
    detail = (f"{peaks[small_mb] / 2**20:.0f} MiB for {small_mb} MiB, {peaks[large_mb] / 2**20:.0f} MiB for {large_mb} "
              "MiB; bytes tokenizer, 2 workers")
    figure = f"peak RSS of tokenization, {large_mb} / {small_mb} MiB corpus"
    bars = [Bar(figure, ratio, 1 + RSS_TOLERANCE, "max", detail),
            Bar(f"{figure} (lower side)", ratio, 1 - RSS_TOLERANCE, "min")]
    if learners:
        small, large = learners[small_mb], learners[large_mb]
        figure = f"peak RSS of a learner on leased slices, {large_mb} / {small_mb} MiB corpus"
        detail = (f"{small['peak_rss'] / 2**20:.0f} MiB ({small['tokens_trained']} tokens trained) for {small_mb} "
                  f"MiB, {large['peak_rss'] / 2**20:.0f} MiB ({large['tokens_trained']}) for {large_mb} MiB; "
                  f"{learner_s:.0f} s")
        ratio = large["peak_rss"] / small["peak_rss"]
        bars += [Bar(figure, ratio, 1 + RSS_TOLERANCE, "max", detail),
                 Bar(f"{figure} (lower side)", ratio, 1 - RSS_TOLERANCE, "min")]
    return bars


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.data_bars", description=description(__doc__))
    ap.add_argument("--quick", action="store_true", help="small corpora: checks the benchmark runs, not the goals")
    ap.add_argument("--bpe-mb", type=positive_int, default=96)
    ap.add_argument("--repeats", type=positive_int, default=2)
    ap.add_argument("--small-mb", type=positive_int, default=512)
    ap.add_argument("--large-mb", type=positive_int, default=5120)
    ap.add_argument("--learner-s", type=non_negative_float, default=60.0,
                    help="seconds of the learner run on each memory corpus (0: no learner row)")
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    ap.add_argument("--only", choices=["throughput", "memory"])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        _child(json.loads(args.child))
        return 0
    if args.quick:
        args.bpe_mb, args.repeats, args.small_mb, args.large_mb, args.learner_s = 8, 1, 16, 64, 15.0
    bars: list[Bar] = []
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench-data-") as tmp:
        if args.only in (None, "throughput"):
            bars += throughput_bar(Path(tmp), args.bpe_mb, args.repeats)
        if args.only in (None, "memory"):
            bars += memory_bars(Path(tmp), args.small_mb, args.large_mb, args.learner_s)
    return print_bars(bars, title="token store bars (make bench-data)")


if __name__ == "__main__":
    sys.exit(main())
