"""How exactly the chaos harness's speed factors hold on a shared host (issue 47), with no
synchronizer, store or network: the control beside `make bench-het`'s per-learner shares.

Starts one process per speed factor, all at once. Each runs the same torch inner loop (a small
matmul chain on one thread, as a learner's step on this host) through the harness's own
:class:`~diloco_async.learner.faults.SlowedWorkload` (a step sleeps
:func:`~diloco_async.inner.workload.emulated_delay_s` of its measured time, ``--jitter`` as the
scenarios, lower priority once ready) for ``--run-s`` seconds, and counts its steps. Per speed
factor it prints, over ``--repeats`` repetitions, the steps done over ``speed`` x the full-speed
processes' mean (1.0: the emulation delivers its nominal share; below: it under-delivers), and the
seconds of compute per step over the full-speed processes' (how much longer a slowed process's
compute takes when it runs). Every row is shown, none is a goal: it is the measurement that says
what the nominal compute share of a slowed learner is worth on this host.

Usage: python -m benchmarks.speed_emulation [--speeds 1,0.5,0.1,1,1] [--run-s 30] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import random
import sys
import time

from benchmarks.args import description
from benchmarks.bars import Bar, print_bars
from benchmarks.stats import mean_over_runs

__all__ = ["main", "run_fleet"]


class _MatmulWorkload:
    """A stand-in for a learner's inner step: 20 chained 256 x 256 float32 matmuls on one thread;
    ``compute_s`` sums the seconds its steps took (the emulation's sleep comes after, outside)."""

    def __init__(self) -> None:
        import torch

        torch.set_num_threads(1)
        self.torch = torch
        self.a, self.b = torch.randn(256, 256), torch.randn(256, 256)
        self.compute_s = 0.0

    def step(self, step: int, run_tokens: float = 0.0) -> float:
        t0 = time.perf_counter()
        for _ in range(20):
            self.a = self.torch.tanh(self.a @ self.b)
        self.compute_s += time.perf_counter() - t0
        return float(self.a[0, 0])

    def load_data(self, cfg, index: int) -> int:
        return 0


def _one(speed: float, jitter: float, seed: int, start_at: float, run_s: float, out: mp.Queue) -> None:
    from diloco_async.learner.faults import SlowedWorkload

    work = _MatmulWorkload()
    slowed = SlowedWorkload(work, speed, jitter, random.Random(seed), nice=10)  # type: ignore[arg-type]
    slowed.load_data(None, 0)
    while time.time() < start_at:
        time.sleep(0.01)
    work.compute_s, steps, end = 0.0, 0, time.perf_counter() + run_s
    while time.perf_counter() < end:
        slowed.step(steps)
        steps += 1
    out.put({"speed": speed, "steps": steps, "compute_s_per_step": work.compute_s / max(1, steps)})


def run_fleet(speeds: list[float], run_s: float, jitter: float = 0.05, seed: int = 0) -> list[dict]:
    """One repetition: a process per speed factor, started together; their step counts."""
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    start_at = time.time() + 5.0  # every process imported torch before any starts counting
    procs = [ctx.Process(target=_one, args=(s, jitter, seed * 100 + i, start_at, run_s, out))
             for i, s in enumerate(speeds)]
    for p in procs:
        p.start()
    results = [out.get(timeout=run_s + 120) for _ in procs]
    for p in procs:
        p.join()
    return results


def _bars(reps: list[list[dict]], speeds: list[float]) -> list[Bar]:
    bars = []
    for speed in sorted(set(speeds) - {1.0}):
        share, compute = [], []
        for rows in reps:
            full = [r for r in rows if r["speed"] == 1.0]
            full_steps = sum(r["steps"] for r in full) / len(full)
            full_compute = sum(r["compute_s_per_step"] for r in full) / len(full)
            mine = [r for r in rows if r["speed"] == speed]
            share.append(sum(r["steps"] for r in mine) / len(mine) / (speed * full_steps))
            compute.append(sum(r["compute_s_per_step"] for r in mine) / len(mine) / full_compute)
        for name, values in (("steps / (speed x full-speed steps)", share),
                             ("compute s per step / full-speed's", compute)):
            value, detail = mean_over_runs(values)
            bars.append(Bar(f"{speed:g}x: {name}", value, 0.0, detail=detail, shown=True))
    return bars


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.speed_emulation", description=description(__doc__))
    parser.add_argument("--speeds", default="1,0.5,0.1,1,1", help="speed factors, one process each (default: "
                        "configs/chaos/heterogeneous.toml's five slots' compute speeds)")
    parser.add_argument("--run-s", type=float, default=30.0, help="seconds each repetition counts steps")
    parser.add_argument("--repeats", type=int, default=3, help="repetitions (intervals are over them)")
    parser.add_argument("--jitter", type=float, default=0.05, help="faults.step_jitter of every process")
    args = parser.parse_args(argv)
    speeds = [float(s) for s in args.speeds.split(",")]
    if 1.0 not in speeds or any(not 0 < s <= 1 for s in speeds) or args.repeats < 1 or args.run_s <= 0:
        print("error: --speeds needs a 1 and values in (0, 1]; --repeats >= 1; --run-s > 0", file=sys.stderr)
        return 2
    reps = [run_fleet(speeds, args.run_s, args.jitter, seed) for seed in range(args.repeats)]
    for seed, rows in enumerate(reps):
        print(json.dumps({"repeat": seed, "processes": rows}))
    return print_bars(_bars(reps, speeds), out=sys.stdout, title="speed factors on this host (no synchronizer)")


if __name__ == "__main__":
    sys.exit(main())
