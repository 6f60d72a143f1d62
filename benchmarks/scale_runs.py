"""``make bench-scale-runs`` (issue 40, part c): ``make run``'s recipe end to end with real
learners, on two synchronizer shards against one.

Per seed (``run.seed``), the recipe runs with ``synchronizer.shards = 1`` and then ``= 2``, each
through :class:`~diloco_async.run.RunProcesses` (the processes ``make run`` starts, without Prefect
and MLflow): real learner processes, real synchronizer processes, the same token budget. Per run:
the final model's held-out loss (its final checkpoint, or with two shards the run checkpoint naming
both, as ``make run`` evaluates it), compute and token goodput and merges from the run's summary
(aggregated over the shards). The fragments, the math and the budget are the same; what differs is
which process merges which fragment, and timing.

Bars (paired by seed, 95% t-intervals): the final loss of S = 2 over S = 1 within 2% either way,
and compute goodput S = 2 minus S = 1 within 0.05 either way; merges and token goodput shown.
Free-running runs (the wall clock decides which learner lands in which round), so a seed does not
replay the same run twice: the intervals carry that noise.

usage: python -m benchmarks.scale_runs [--config PATH] [--seeds 0,1,2] [--set section.field=value ...]
"""

from __future__ import annotations

import argparse
import sys
import time

from benchmarks.args import description
from benchmarks.bars import Bar, print_bars
from benchmarks.stats import mean_interval
from diloco_async.config.resolved import with_fields
from diloco_async.config.schema import Config, load_config
from diloco_async.metrics.evaluation import heldout_loss, heldout_split, model_from_checkpoint
from diloco_async.run import RunProcesses

__all__ = ["run_once", "main", "LOSS_GOAL", "GOODPUT_GOAL"]

LOSS_GOAL = 0.02
"""|final loss S = 2 / S = 1 − 1|, mean over seeds plus its 95% half-width, at most this."""
GOODPUT_GOAL = 0.05
"""|compute goodput S = 2 − S = 1|, mean over seeds plus its 95% half-width, at most this."""


def run_once(cfg: Config, timeout_s: float = 1800.0) -> dict:
    """One run of ``cfg`` to its end: final held-out loss (nats/token), goodputs, merges, wall s.

    Raises:
        RuntimeError: a synchronizer did not finish cleanly within ``timeout_s``, or the run left no
            final checkpoint.
    """
    rp = RunProcesses(cfg)
    t0 = time.monotonic()
    try:
        rp.start_synchronizer()
        for i in range(cfg.learners.count):
            rp.start_learner(i)
        while rp.synchronizer_running() and time.monotonic() - t0 < timeout_s:
            rp.supervise()  # a learner or a shard that died is restarted, as make run does
            time.sleep(0.5)
        codes = [h.poll() for h in rp.shard_syncs or [rp.sync]]
        rp.finished_cleanly = all(c == 0 for c in codes)
        if not rp.finished_cleanly:
            raise RuntimeError(f"run {rp.run_id}: synchronizer exit codes {codes} (None: still running after "
                               f"{timeout_s:.0f} s); logs under {rp.workdir / 'logs'}")
        summary = rp.final_summary()
        ckpt = rp.final_checkpoint()
        if ckpt is None:
            raise RuntimeError(f"run {rp.run_id}: no verified checkpoint at the end")
        final = heldout_loss(model_from_checkpoint(cfg, ckpt), heldout_split(cfg).batches)
    finally:
        rp.stop_all()
    return {"shards": cfg.synchronizer.shards, "seed": cfg.run.seed, "run_id": rp.run_id, "final_loss": final,
            "compute_goodput": summary["compute_goodput"], "token_goodput": summary["token_goodput"],
            "merges": summary["merges"], "wall_s": time.monotonic() - t0}


def bars(runs: list[dict]) -> list[Bar]:
    """The bars over runs paired by seed (one S = 1 and one S = 2 run per seed)."""
    by = {(r["seed"], r["shards"]): r for r in runs}
    seeds = sorted({r["seed"] for r in runs if (r["seed"], 1) in by and (r["seed"], 2) in by})
    if not seeds:
        return [Bar("final loss S = 2 / S = 1 - 1, |mean| + 95%", None, LOSS_GOAL, "max", "no pair of runs")]
    out = []
    for label, f, goal in (("final loss S = 2 / S = 1 - 1", lambda a, b: b["final_loss"] / a["final_loss"] - 1,
                            LOSS_GOAL),
                           ("compute goodput S = 2 - S = 1", lambda a, b: b["compute_goodput"] - a["compute_goodput"],
                            GOODPUT_GOAL)):
        diffs = [f(by[(s, 1)], by[(s, 2)]) for s in seeds]
        mean, half = mean_interval(diffs)
        shown = ", ".join(f"{d:+.4f}" for d in diffs)
        out.append(Bar(f"{label}, |mean| + 95%", abs(mean) + half, goal, "max",
                       f"mean {mean:+.4f} +- {half:.4f} over {len(seeds)} seeds ({shown})"))
    for key in ("final_loss", "compute_goodput", "token_goodput", "merges"):
        for shards in (1, 2):
            mean, half = mean_interval([float(by[(s, shards)][key]) for s in seeds])
            out.append(Bar(f"S = {shards}: {key.replace('_', ' ')}", mean, 0.0, detail=f"+- {half:.4f}", shown=True))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.scale_runs", description=description(__doc__))
    ap.add_argument("--config", default="configs/default.toml")
    ap.add_argument("--seeds", default="0,1,2", help="comma-separated run.seed values")
    ap.add_argument("--set", action="append", default=[], help="section.field=value")
    args = ap.parse_args(argv)
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
        base = load_config(args.config, args.set)
    except ValueError as err:
        print(f"bench-scale-runs: {err}", file=sys.stderr)
        return 2
    runs = []
    for seed in seeds:
        for shards in (1, 2):
            r = run_once(with_fields(base, {"run.seed": seed, "synchronizer.shards": shards}))
            print(f"seed {seed}, S = {shards}: final loss {r['final_loss']:.4f}, compute goodput "
                  f"{r['compute_goodput']:.3f}, token goodput {r['token_goodput']:.3f}, {r['merges']} merges, "
                  f"{r['wall_s']:.0f} s (run {r['run_id']})", flush=True)
            runs.append(r)
    return print_bars(bars(runs), title="synchronizer shards end to end (issue 40)")


if __name__ == "__main__":
    sys.exit(main())
