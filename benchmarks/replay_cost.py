"""`make bench-replay`: what a replayed run (``run.schedule = "replay"``, issue 44 item 2) costs in
wall time against a free run of the same recipe, and whether two replays of one seed published the
same versions while a CPU hog ran beside the second.

For each seed: the recipe free-running, then replayed, then replayed again beside a CPU hog
(``python -c "while True: pass"``), each a synchronizer and its learners as processes over a
file:// store. Wall seconds of a run: from the synchronizer's start to the last process's exit. The
versions of a run: each merge log record's (fragment, version, sha256, learners merged).

Bars: replays of one seed that published the same versions, as a share of the seeds (goal 1.0), and,
shown for context (no goal), replay / free wall seconds, the mean over seeds with its 95% t-interval.
Exit status 1 on a miss.

Usage: python -m benchmarks.replay_cost [--seeds 3] [--tokens 6144] [--set section.field=value ...]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.args import description, positive_int
from benchmarks.bars import Bar, print_bars
from benchmarks.stats import mean_interval
from diloco_async.config.resolved import with_fields
from diloco_async.config.schema import Config, apply_overrides
from diloco_async.run import RunProcesses
from diloco_async.storage.store import ObjectStore

RUN_ID = "replaycost"


def recipe(root: Path, seed: int, schedule: str, tokens: int, overrides: list[str]) -> Config:
    """A tiny model, 2 learners of seeded speeds exp(N(0, 0.5)) and 20% step jitter, 2 fragments, K = 1."""
    fields = {
        "run.store": f"file://{root}/store", "run.workdir": f"{root}/runs", "run.seed": seed,
        "run.schedule": schedule, "model.n_layer": 1, "model.d_model": 16, "model.n_head": 2, "model.context": 16,
        "learners.count": 2, "learners.batch_size": 2, "learners.checkpoint_every_s": 0.0,
        "synchronizer.num_fragments": 2, "synchronizer.sync_every": 4, "synchronizer.min_quorum": 1,
        "synchronizer.heartbeat_timeout_s": 10.0, "synchronizer.checkpoint_every_s": 100000.0,
        "replay.speed_spread": 0.5, "faults.step_jitter": 0.2, "budget.tokens": tokens}
    cfg = with_fields(Config(), fields)
    return Config.model_validate(apply_overrides(cfg.model_dump(mode="json"), overrides)) if overrides else cfg


def timed_run(cfg: Config) -> tuple[float, list[tuple]]:
    """Run ``cfg`` to its end; returns its wall seconds and its merge log's (fragment, version, sha256, merged)."""
    run = RunProcesses(cfg, run_id=RUN_ID)
    t0 = time.monotonic()
    try:
        run.start_synchronizer()
        for i in range(cfg.learners.count):
            run.start_learner(i)
        for shard in run.shard_syncs:
            if shard.wait(timeout=1800) != 0:
                raise RuntimeError(f"the synchronizer failed: {shard.log_path}")
        run.finished_cleanly = True
        for handle in run.learners.values():
            handle.wait(timeout=120)
        wall_s = time.monotonic() - t0
    finally:
        run.stop_all()
    store = ObjectStore(cfg.run.store)
    logs = [k for k in store.list(f"{RUN_ID}/epochs") if k.endswith("/merges.jsonl")]
    text = "".join(store.get_unverified(k).decode() for k in logs)
    records = [json.loads(line) for line in text.splitlines() if line.strip()]
    return wall_s, [(r["fragment"], r["version"], r.get("sha256"), [c["learner"] for c in r["contributions"]])
                    for r in records]


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.replay_cost", description=description(__doc__))
    ap.add_argument("--seeds", type=positive_int, default=3, help="seeds 0..N-1, three runs each")
    ap.add_argument("--tokens", type=positive_int, default=6144, help="budget.tokens of every run")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                    help="a recipe setting for every run (repeatable)")
    args = ap.parse_args(argv)
    try:  # a bad --set is the command line's error, before anything starts
        recipe(Path("/nonexistent"), 0, "replay", args.tokens, args.overrides)
    except ValueError as err:
        ap.error(str(err))
    ratios, same = [], 0
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(args.seeds):
            free_s, free = timed_run(recipe(Path(tmp) / f"free-{seed}", seed, "free", args.tokens, args.overrides))
            replay_s, first = timed_run(recipe(Path(tmp) / f"replay-{seed}", seed, "replay", args.tokens,
                                               args.overrides))
            hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
            try:
                hog_s, second = timed_run(recipe(Path(tmp) / f"hog-{seed}", seed, "replay", args.tokens,
                                                 args.overrides))
            finally:
                hog.kill()
                hog.wait(timeout=30)
            same += int(bool(first) and first == second)
            ratios.append(replay_s / free_s)
            print(f"[seed {seed}] free {free_s:6.1f} s ({len(free)} merges), replay {replay_s:6.1f} s "
                  f"({len(first)} merges), replay beside a CPU hog {hog_s:6.1f} s: same versions "
                  f"{first == second}", flush=True)
    ratio, half = mean_interval(ratios)
    shown = ", ".join(f"{r:.2f}" for r in ratios)
    return print_bars([
        Bar("replays of one seed publishing the same versions (one beside a CPU hog), share of seeds",
            same / args.seeds, 1.0, detail=f"{same} of {args.seeds}"),
        Bar("wall seconds, replay / free run of the same recipe", ratio, 0.0, shown=True,
            detail=f"mean of {args.seeds} seeds +- {half:.2f} (95%): {shown}"),
    ], title="make bench-replay: bars")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
