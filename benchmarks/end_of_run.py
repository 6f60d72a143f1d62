"""The end of a run (issue 44, item 1): is the final model worse than the run's best periodic eval?
``make bench-end``.

Runs a recipe (default ``configs/default.toml``, ``make run``'s) once per seed (``run.seed``), one
after the other, through :class:`~diloco_async.run.RunProcesses` (the processes ``make run``
starts, without Prefect and MLflow), with the held-out monitor of ``make run`` beside it
(:class:`~diloco_async.metrics.heldout_monitor.HeldoutMonitor`, every ``tracking.eval_every_s``).
Per seed: the best periodic eval (the lowest ``eval/loss`` point the monitor logged), the final
model's held-out loss (the final checkpoint's, as ``make run`` evaluates it) and the gap final -
best, nats/token. The bar: the upper end of the 95% t-interval of the gap over the seeds <= 0.01.

Runs are free-running (the wall clock decides which learner lands in which round), not replayed.

With ``--trace N`` (diagnosis) the garbage collection of versions is turned off
(``synchronizer.keep_checkpoints = 0``; nothing else of the run changes) and, after the run, the
model after each of the last N merges is rebuilt from the published versions and evaluated; each
merge is printed with its time against the drain's start, quorum, contributions' inner steps,
tokens and staleness, and the norm of the outer step it published (:mod:`benchmarks.end_trace`).

usage: python -m benchmarks.end_of_run [--config PATH] [--seeds 0,1,2,3,4] [--trace N]
       [--set section.field=value ...] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from benchmarks.args import description, non_negative_int
from benchmarks.bars import Bar, print_bars
from benchmarks.end_trace import trace_last_merges
from benchmarks.stats import mean_interval
from diloco_async.config.resolved import with_fields
from diloco_async.config.schema import Config, load_config
from diloco_async.metrics.evaluation import heldout_loss, heldout_split, model_from_checkpoint
from diloco_async.metrics.heldout_monitor import HeldoutMonitor
from diloco_async.models import build_run_model
from diloco_async.run import RunProcesses
from diloco_async.storage import keys
from diloco_async.storage.checkpoint import latest_checkpoint

__all__ = ["run_seed", "gap_bars", "main", "GAP_GOAL_NATS"]

GAP_GOAL_NATS = 0.01
"""Upper end of the 95% interval of (final loss - best periodic eval), nats/token (issue 44)."""


def _drive(rp: RunProcesses, timeout_s: float) -> None:
    t0 = time.monotonic()
    rp.start_synchronizer()
    for i in range(rp.cfg.learners.count):
        rp.start_learner(i)
    while rp.sync.poll() is None and time.monotonic() - t0 < timeout_s:
        rp.supervise()
        time.sleep(0.5)
    rp.finished_cleanly = rp.sync.poll() == 0
    if not rp.finished_cleanly:
        raise RuntimeError(f"synchronizer did not finish cleanly (exit {rp.sync.poll()}); log {rp.sync.log_path}")


def run_seed(cfg: Config, trace: int = 0, timeout_s: float = 3600.0) -> dict:
    """One run of ``cfg`` with the held-out monitor beside it; its periodic evals, final loss and
    gap (nats/token), and with ``trace`` > 0 the last ``trace`` merges (:func:`trace_last_merges`).

    Raises:
        RuntimeError: the synchronizer did not finish cleanly, or left no checkpoint.
    """
    rp = RunProcesses(cfg)
    split = heldout_split(cfg)
    monitor = HeldoutMonitor(build_run_model(cfg), split, rp.store, rp.run_id, cfg.tracking.eval_every_s)
    t0 = time.monotonic()
    try:
        monitor.start()
        _drive(rp, timeout_s)
    finally:
        monitor.stop()
        rp.stop_all()
    points = [p for p in monitor.drain() if p["key"] == "eval/loss"]
    ckpt = latest_checkpoint(rp.store, rp.run_id)
    if ckpt is None:
        raise RuntimeError(f"run {rp.run_id}: no verified checkpoint at the end")
    final = heldout_loss(model_from_checkpoint(cfg, ckpt), split.batches)
    summary = rp.store.get_json(keys.summary_key(rp.run_id, str(rp.epoch)))
    best = min(points, key=lambda p: p["value"]) if points else None
    out = {"seed": cfg.run.seed, "run_id": rp.run_id, "wall_s": time.monotonic() - t0,
           "merges": summary["merges"], "stop_reason": summary.get("stop_reason"),
           "periodic": [(p["step"], p["value"]) for p in points], "final_loss": final,
           "best_loss": best["value"] if best else None, "best_step": best["step"] if best else None,
           "gap": final - best["value"] if best else None}
    if trace > 0:
        out["trace"] = trace_last_merges(cfg, rp, ckpt, split, trace)
    return out


def gap_bars(runs: list[dict], goal: float = GAP_GOAL_NATS) -> list[Bar]:
    """The bar on the upper end of the gap's 95% t-interval, and the mean gap shown beside it."""
    gaps = [r["gap"] for r in runs]
    if not gaps or any(g is None for g in gaps):
        return [Bar("final - best periodic eval, upper 95% (nats/token)", None, goal, "max", "a run had no eval")]
    mean, half = mean_interval(gaps)
    shown = ", ".join(f"{g:+.4f}" for g in gaps)
    return [Bar("final - best periodic eval, upper 95% (nats/token)", mean + half, goal, "max",
                f"{len(gaps)} seeds, free-running (not replayed)"),
            Bar("final - best periodic eval, mean (nats/token)", mean, goal, "max",
                f"+- {half:.4f} (95% t); per seed {shown}", shown=True)]


def _print_run(r: dict) -> None:
    print(f"seed {r['seed']}: run {r['run_id']}, {r['merges']} merges, stop {r['stop_reason']!r}, "
          f"best periodic {r['best_loss']:.4f} at merge {r['best_step']}, final {r['final_loss']:.4f} "
          f"(gap {r['gap']:+.4f}), {len(r['periodic'])} periodic evals, {r['wall_s']:.0f} s", flush=True)
    for row in r.get("trace", []):
        print("  " + json.dumps(row), flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.end_of_run", description=description(__doc__))
    ap.add_argument("--config", default="configs/default.toml")
    ap.add_argument("--seeds", default="0,1,2,3,4", help="comma-separated run.seed values, run one after the other")
    ap.add_argument("--trace", type=non_negative_int, default=0,
                    help="evaluate the model after each of the last N merges (turns version GC off)")
    ap.add_argument("--set", action="append", default=[], help="section.field=value")
    ap.add_argument("--out", default=".local/bench/end_of_run.json")
    args = ap.parse_args(argv)
    try:
        seeds = [int(x) for x in args.seeds.split(",")]
    except ValueError:
        ap.error(f"--seeds {args.seeds!r}: comma-separated integers")
    cfg = load_config(args.config, args.set)  # bad config is refused here, before anything starts
    torch.set_num_threads(1)  # evaluations beside the run's processes: spinning threads only slow both
    if args.trace:
        cfg = with_fields(cfg, {"synchronizer.keep_checkpoints": 0})
    runs = []
    for seed in seeds:
        runs.append(run_seed(with_fields(cfg, {"run.seed": seed}), trace=args.trace))
        _print_run(runs[-1])
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"config": args.config, "set": args.set, "runs": runs}, indent=1))
    return print_bars(gap_bars(runs), title="end of run (issue 44)")


if __name__ == "__main__":
    sys.exit(main())
