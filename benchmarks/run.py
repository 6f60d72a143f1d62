"""`make bench`: the speed and memory goals of issue 17, each a ratio against a baseline measured in
this run, then one bars table (figure, value, goal, ok/MISS) and exit status 1 on a miss.

Sections, in order (each module also runs alone as ``python -m benchmarks.<module>``):

* ``merge`` (benchmarks/merge.py): anchoring + RDA + outer step on 16 MiB and 256 MiB fragments,
  M = 2, 8, 16, against memcpy; peak memory of the 256 MiB, M = 16 merge;
* ``codec_store`` (benchmarks/codec_store.py): int4/int8/bf16 encode+decode against the fp32
  codec's round trip; ``file://`` put+get against raw file I/O;
* ``s3`` (benchmarks/storage.py): ObjectStore against raw s3fs on one moto server;
* ``sync_load`` (benchmarks/sync_load.py): 256 and 1,000 simulated learners on one synchronizer;
* ``memory`` (benchmarks/memory.py): RSS of real learner and synchronizer processes against the
  model's fp32 size;
* ``memory_big`` (benchmarks/memory.py --big): a 100M-parameter run with 2 learners completes (skipped
  with ``--quick``);
* ``learner`` (benchmarks/memory_tokens.py): learner tokens/s with sync on against a plain loop.

Usage: python -m benchmarks.run [--quick] [--only merge,codec_store,...]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

from benchmarks.args import description
from benchmarks.bars import Bar, print_bars

__all__ = ["SECTIONS", "main"]


def _merge(quick: bool) -> list[Bar]:
    from benchmarks import merge

    return merge.bars(quick=quick)


def _codec_store(quick: bool) -> list[Bar]:
    from benchmarks import codec_store

    return codec_store.bars(quick=quick)


def _s3(quick: bool) -> list[Bar]:
    from benchmarks.storage import bench_storage

    mib = 32 if quick else 256
    out = bench_storage(mib=mib, repeat=1 if quick else 3)
    return [Bar(f"S3 (moto) {mib} MiB {op}: ObjectStore / raw s3fs", out[f"{op} ratio"], 0.9, "min")
            for op in ("put", "get")]


def _sync_load(quick: bool) -> list[Bar]:
    from benchmarks import sync_load

    return sync_load.bars(quick=quick)


def _memory(quick: bool) -> list[Bar]:
    from benchmarks import memory

    return memory.bars(quick=quick)


def _memory_big(quick: bool) -> list[Bar]:
    from benchmarks import memory

    return [] if quick else memory.bars(sizes=(), big=True)


def _learner(quick: bool) -> list[Bar]:
    from benchmarks import memory_tokens

    return [memory_tokens.tokens_bar(quick=quick)]


SECTIONS: dict[str, Callable[[bool], list[Bar]]] = {
    "merge": _merge, "codec_store": _codec_store, "s3": _s3, "sync_load": _sync_load, "memory": _memory,
    "memory_big": _memory_big, "learner": _learner,
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.run", description=description(__doc__))
    ap.add_argument("--quick", action="store_true", help="small sizes and short runs (seconds per section)")
    ap.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated sections of {list(SECTIONS)}")
    args = ap.parse_args(argv)
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in SECTIONS]
    if unknown:
        ap.error(f"unknown section(s) {unknown}; choose from {list(SECTIONS)}")
    rows: list[Bar] = []
    for name in names:
        t0 = time.monotonic()
        print(f"\n== {name}", flush=True)
        try:
            rows += SECTIONS[name](args.quick)
        except Exception as err:  # one broken section must not hide the others' figures
            print(f"{name}: failed: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
            rows.append(Bar(f"{name}: section ran", None, 1.0, detail=f"{type(err).__name__}: {err}"))
        print(f"== {name}: {time.monotonic() - t0:.0f} s", flush=True)
    return print_bars(rows, title="make bench: bars")


if __name__ == "__main__":
    raise SystemExit(main())
