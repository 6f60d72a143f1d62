"""`make bench-sync-memory`: the synchronizer's memory over a long real run (issue 11).

Starts a real run of the default recipe (4 learners, the synchronizer and learners as processes,
through :class:`diloco_async.flows.train.TrainingRun`, as ``make run`` does, without MLflow), pulls the metric
stream as the flow does, and samples the synchronizer process's RSS (psutil) every ``--interval`` seconds
for ``--minutes``. Then it stops the run and prints the RSS at the reference minute (5, or a
quarter of the run when shorter), at the end, their ratio, and one bar:

* end RSS / reference RSS <= 1.10 (memory stays flat: logs and sets are bounded).

Exit status 1 when the bar is missed, 0 otherwise.

Usage: python -m benchmarks.sync_memory [--minutes 20] [--interval 5] [--config configs/default.toml]
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

import psutil

from benchmarks.args import description, positive_float
from diloco_async.config.resolved import with_fields
from diloco_async.config.schema import load_config
from diloco_async.flows.train import TrainingRun

GOAL_RATIO = 1.10


def _mib(nbytes: float) -> float:
    return nbytes / 2**20


def rss_bytes(pid: int) -> int:
    """Resident set size of process ``pid`` in bytes."""
    return psutil.Process(pid).memory_info().rss


def sample_run(run: TrainingRun, minutes: float, interval_s: float) -> list[tuple[float, int]]:
    """(seconds since the synchronizer started, RSS bytes) every ``interval_s`` for ``minutes``,
    restarting dead learners and pulling the metric stream meanwhile, as the train flow does."""
    run.start_synchronizer()
    for i in range(run.cfg.learners.count):
        run.start_learner(i)
    samples: list[tuple[float, int]] = []
    t0 = time.monotonic()
    next_sample = t0
    points = 0
    while (now := time.monotonic()) - t0 < minutes * 60:
        if run.sync.poll() is not None:
            raise RuntimeError(f"the synchronizer exited early ({run.sync.poll()}); log: {run.sync.log_path}")
        run.supervise()
        points += len(run.pull_metrics())
        if now >= next_sample:
            samples.append((now - t0, rss_bytes(run.sync.pid)))
            next_sample += interval_s
            if len(samples) % max(1, int(60 / interval_s)) == 0:
                print(f"  {samples[-1][0] / 60:5.1f} min  RSS {_mib(samples[-1][1]):7.1f} MiB  "
                      f"({points} metric points pulled)", flush=True)
        time.sleep(min(1.0, max(0.0, next_sample - time.monotonic())))
    return samples


def rss_at(samples: list[tuple[float, int]], minute: float) -> int:
    """The RSS of the first sample at or after ``minute``."""
    return next(rss for t, rss in samples if t >= minute * 60)


def bars(samples: list[tuple[float, int]], minutes: float) -> tuple[float, list[tuple[str, float | None, str]]]:
    """(reference minute, rows as (figure, value, goal)); a goal of "" marks a figure shown only."""
    ref_minute = min(5.0, minutes / 4)
    ref, end = rss_at(samples, ref_minute), samples[-1][1]
    ratio = end / ref
    return ref_minute, [
        (f"synchronizer RSS at minute {ref_minute:g} (MiB)", _mib(ref), ""),
        (f"synchronizer RSS at the end, minute {samples[-1][0] / 60:.1f} (MiB)", _mib(end), ""),
        ("end RSS / reference RSS", ratio, f"<= {GOAL_RATIO:g}"),
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.sync_memory", description=description(__doc__))
    ap.add_argument("--minutes", type=positive_float, default=20.0, help="length of the sampled run (default 20)")
    ap.add_argument("--interval", type=positive_float, default=5.0, help="seconds between RSS samples (default 5)")
    ap.add_argument("--config", default="configs/default.toml")
    args = ap.parse_args(argv)
    cfg = with_fields(load_config(args.config), {"budget.wall_s": args.minutes * 60 + 120.0,
                                                 "budget.tokens": 1_000_000_000_000})
    run = TrainingRun(cfg)
    print(f"run {run.run_id}: {cfg.learners.count} learners, sampling the synchronizer's RSS every "
          f"{args.interval:g} s for {args.minutes:g} min (logs in {run.workdir / 'logs'})", flush=True)
    try:
        samples = sample_run(run, args.minutes, args.interval)
        os.kill(run.sync.pid, signal.SIGTERM)  # a clean stop: learners told, final checkpoint and summary
        run.finished_cleanly = run.sync.wait(timeout=180) == 0
    finally:
        run.stop_all()
    _, rows = bars(samples, args.minutes)
    ok = True
    print(f"\n{'figure':58s} {'value':>9s}   {'goal':9s}")
    for name, value, goal in rows:
        passed = not goal or value <= GOAL_RATIO
        ok &= passed
        print(f"{name:58s} {value:9.3f}   {goal:9s} {('ok' if passed else 'MISS') if goal else ''}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
