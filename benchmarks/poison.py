"""A poisoned learner among three honest ones (issue 14, item 3): ``make bench-poison``.

Runs a recipe (default ``configs/default.toml``, ``make run``'s) once with three honest learners
(the baseline, measured in the same invocation: four learner slots, the fourth left empty, so
each honest learner trains on the same quarter of the corpus as in the poisoned runs) and once
per poison mode with a fourth learner that sends poisoned outer gradients
(``faults.poison``: ``scale`` = x1e6, ``sign_flip``, ``constant``). Both runs stop at the same
global step (``budget.max_steps``), so the honest learners do the same work. Reports per run:
the final held-out loss (nats/byte) of the last checkpoint, the largest absolute value of any
published version, whether every published value is finite, and the rejections by reason; then
one bar per figure and exit 1 on a miss.

With several ``--seeds`` the baseline and every mode run once per seed (``run.seed``); the loss
bar is on the mean of the per-seed ratios, printed with a 95% t-interval over the seeds.

usage: python -m benchmarks.poison [--config PATH] [--modes scale,sign_flip,constant]
       [--max-steps N] [--seeds 0,1] [--set section.field=value ...]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import safetensors.torch

from benchmarks.args import description
from benchmarks.stats import mean_interval
from diloco_async.chaos.measure import initial_model
from diloco_async.config.resolved import with_fields
from diloco_async.config.schema import Config, load_config
from diloco_async.metrics.evaluation import heldout_batches, heldout_loss, model_from_checkpoint
from diloco_async.run import RunProcesses
from diloco_async.storage import keys
from diloco_async.storage.checkpoint import latest_checkpoint

__all__ = ["run_once", "published_extremes", "main"]

LOSS_RATIO_GOAL = 1.02  # poisoned loss / baseline loss
MAX_ABS_GOAL = 100.0  # no published value above this (the honest model's largest is ~1-10)


def published_extremes(store, run_id: str) -> tuple[float, bool]:
    """(largest |value| in any published version, whether every value is finite)."""
    largest, finite = 0.0, True
    for key in store.list(keys.versions_prefix(run_id)):
        for t in safetensors.torch.load(store.get_unverified(key)).values():
            finite = finite and bool(t.isfinite().all())
            largest = max(largest, float(t.float().nan_to_num(posinf=math.inf).abs().max()))
    return largest, finite


def run_once(cfg: Config, timeout_s: float = 1800.0, started: int | None = None) -> dict:
    """One run of ``cfg``, until its budget stops it; its figures. Only the first ``started``
    learner slots are started (default: every slot), so a baseline can leave the poisoner's slot
    empty while every honest learner keeps its data shard."""
    rp = RunProcesses(cfg)
    t0 = time.monotonic()
    try:
        rp.start_synchronizer()
        for i in range(cfg.learners.count if started is None else started):
            rp.start_learner(i)
        while rp.sync.poll() is None and time.monotonic() - t0 < timeout_s:
            rp.supervise()
            time.sleep(0.5)
        rp.finished_cleanly = rp.sync.poll() == 0
    finally:
        rp.stop_all()
    summary = rp.store.get_json(keys.summary_key(rp.run_id, str(rp.epoch)))
    ckpt = latest_checkpoint(rp.store, rp.run_id)
    batches = heldout_batches(cfg)
    loss = heldout_loss(model_from_checkpoint(cfg, ckpt), batches)
    largest, finite = published_extremes(rp.store, rp.run_id)
    return {"run_id": rp.run_id, "seed": cfg.run.seed, "poison": list(cfg.faults.poison), "loss": loss,
            "initial_loss": heldout_loss(initial_model(cfg), batches), "max_abs_published": largest,
            "all_finite": finite, "wall_s": time.monotonic() - t0, "merges": summary["merges"],
            "global_step": summary["global_step"], "rejected_by_reason": summary["rejected_by_reason"],
            "contributions_merged": summary["contributions_merged"],
            "contributions_downweighted": summary.get("contributions_downweighted", 0),
            "learners": {lid: d["contributions"] for lid, d in summary["learners"].items()}}


def _bars(bases: list[dict], runs: dict[str, list[dict]]) -> list[tuple[str, float, str, float, bool]]:
    """One loss bar (mean per-seed ratio) and one published-extremes bar per mode."""
    rows = []
    for mode, per_seed in runs.items():
        ratios = [r["loss"] / b["loss"] for r, b in zip(per_seed, bases, strict=True)]
        mean, half = mean_interval(ratios)
        print(f"{mode}: loss ratios per seed {[round(x, 4) for x in ratios]}, mean {mean:.4f} +- {half:.4f} (95%)")
        rows.append((f"{mode}: held-out loss / baseline's", mean, "<=", LOSS_RATIO_GOAL, mean <= LOSS_RATIO_GOAL))
        largest = max(r["max_abs_published"] for r in per_seed)
        finite = all(r["all_finite"] for r in per_seed)
        rows.append((f"{mode}: largest published |value|", largest, "<=", MAX_ABS_GOAL,
                     finite and largest <= MAX_ABS_GOAL))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.poison", description=description(__doc__))
    ap.add_argument("--config", default="configs/default.toml")
    ap.add_argument("--modes", default="scale,sign_flip,constant")
    ap.add_argument("--max-steps", type=int, default=1200, help="budget.max_steps of every run")
    ap.add_argument("--seeds", default="0", help="comma-separated run.seed values; every run once per seed")
    ap.add_argument("--set", action="append", default=[], help="section.field=value")
    ap.add_argument("--out", default=".local/bench/poison.json")
    args = ap.parse_args(argv)
    common = with_fields(load_config(args.config, args.set),  # the one parse of the recipe and --set
                         {"budget.tokens": 1_000_000_000_000, "budget.max_steps": args.max_steps,
                          "budget.wall_s": 3600.0, "learners.count": 4})
    seeds = [int(x) for x in args.seeds.split(",")]
    modes = args.modes.split(",")
    bases, runs = [], {mode: [] for mode in modes}
    for seed in seeds:
        seeded = with_fields(common, {"run.seed": seed})
        # the baseline: the same four slots (the same data shards), the poisoner's left empty
        bases.append(run_once(seeded, started=3))
        print(json.dumps({"seed": seed, "baseline": bases[-1]}), flush=True)
        for mode in modes:
            runs[mode].append(run_once(with_fields(seeded, {"faults.poison": ["none", "none", "none", mode]})))
            print(json.dumps({"seed": seed, mode: runs[mode][-1]}), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"seeds": seeds, "baseline": bases, **runs}, indent=2))
    rows = _bars(bases, runs)
    for name, value, op, goal, ok in rows:
        print(f"{name:44s} {value:10.4f}   {op} {goal:<6g}  {'ok' if ok else 'MISS'}")
    return 0 if all(ok for *_, ok in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
