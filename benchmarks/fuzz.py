"""`make bench-fuzz`: the API fuzz against a live synchronizer process (issue 14).

Runs :func:`diloco_async.chaos.fuzz_run.run_api_fuzz` with ``--requests`` (default 10,000) seeded
valid, boundary and hostile requests on every route, from ``--concurrency`` clients, while three
honest scripted learners and a poisoner contribute. Prints the statuses by request kind, then one
bar per figure:

* requests sent >= ``--requests``; responses 5xx == 0; requests not answered == 0;
* the synchronizer alive and ``/health`` answering; every fragment merged again <= 30 s after;
* synchronizer RSS growth from the end of the warm-up (the first tenth) to the end < 10 %;
* published versions read back: none with a non-finite value, largest |value| <= 100;
* no request whose body names a learner other than its token's holder answered 2xx;
* no traceback in the synchronizer's log;
* ``--slow-clients`` connections that stall mid-headers or mid-body, opened when the fuzz starts,
  all closed by the server within ``--slow-limit`` seconds;
* shown: the honest learners' heartbeat p99 latency before the fuzz and during it.

Exit status 1 when a bar is missed, 0 otherwise.

Usage: python -m benchmarks.fuzz [--requests 10000] [--seed 14] [--concurrency 8] [--slow-clients 24]
       [--slow-limit 90] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.args import description
from diloco_async.chaos.fuzz_run import FuzzResult, run_api_fuzz


def print_kinds(result: FuzzResult) -> None:
    """Statuses by route and mutation (the first two parts of a request's kind)."""
    merged: dict[str, dict[int, int]] = {}
    for kind, statuses in result.by_kind.items():
        key = "/".join(kind.split("/")[:2])
        for status, n in statuses.items():
            merged.setdefault(key, {}).setdefault(status, 0)
            merged[key][status] += n
    print(f"\n{'request kind':34s} statuses")
    for key in sorted(merged):
        print(f"{key:34s} " + "  ".join(f"{s}:{n}" for s, n in sorted(merged[key].items())))


def print_bars(rows: list[tuple[str, float, str, bool]]) -> bool:
    """The bars table; True when every bar is met."""
    print(f"\n{'figure':58s} {'value':>12s}   {'goal':9s}")
    for name, value, goal, ok in rows:
        print(f"{name:58s} {value:12.4g}   {goal:9s} {'ok' if ok else 'MISS'}")
    return all(ok for *_, ok in rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.fuzz", description=description(__doc__))
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--seed", type=int, default=14)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--time-limit", type=float, default=900.0, help="seconds the fuzz may send for")
    ap.add_argument("--slow-clients", type=int, default=24, help="stalled connections held open during the fuzz")
    ap.add_argument("--slow-limit", type=float, default=90.0,
                    help="seconds the server has to close the stalled connections")
    ap.add_argument("--workdir", default=None, help="store and logs (default: a temporary folder, removed)")
    args = ap.parse_args(argv)
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="bench-fuzz-"))
    t0 = time.monotonic()
    try:
        result = run_api_fuzz(args.requests, args.seed, workdir, args.concurrency, args.time_limit,
                              slow_clients=args.slow_clients, slow_limit_s=args.slow_limit)
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    print(f"{result.requests} requests in {result.elapsed_s:.1f} s of fuzz ({time.monotonic() - t0:.0f} s in all); "
          f"statuses {dict(sorted(result.by_status.items()))}")
    print_kinds(result)
    for line in result.examples_5xx + result.examples_no_answer:
        print("  ", line)
    print(f"\nhonest announcements: {dict(result.honest_acks)}; poisoner: {dict(result.poison_acks)}; "
          f"merges during the fuzz: {result.merges_during}; RSS {result.rss_warm_bytes / 2**20:.1f} -> "
          f"{result.rss_end_bytes / 2**20:.1f} MiB; versions read back: {result.published_read}")
    print(f"synchronizer rejections by reason: {result.rejected_by_reason}")
    return 0 if print_bars(result.bars(args.requests)) else 1


if __name__ == "__main__":
    sys.exit(main())
