"""`make bench-leases`: a learner's tokens/s when it trains leased slices (``data.slices``, DESIGN
§5.2) against the same run on its fixed shard, both measured in this process's session.

Each pair runs the recipe with one learner twice, ``shards`` (the fixed shard, random windows) and
``leases`` (slices of ``--slice-steps`` inner steps leased from the synchronizer, the next one
asked for while the current one trains), in alternating order (shards first in even pairs, leases
first in odd ones), so a drift of the machine's load falls on both sides. Both sides run without
learner inner-state checkpoints (leases refuse them). Tokens/s of each run come from the learner's
timeline (:func:`benchmarks.hf_learner.in_run_tokens_per_s`: everything between two steps, a wait
for a lease included, counts against the learner).

Bar: leases / shards tokens/s >= 0.98, on the mean of the pairs' ratios, printed with its 95%
t-interval. Exit status 1 on a miss.

Usage: python -m benchmarks.lease_tokens [--config configs/default.toml] [--run-s 60] [--pairs 3]
       [--slice-steps 16] [--set section.field=value ...]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from benchmarks.args import description, non_negative_int, positive_float, positive_int
from benchmarks.paired_runs import paired_tokens_per_s
from diloco_async.config.resolved import with_fields
from diloco_async.config.schema import Config, load_config

GOAL = 0.98


def lease_modes(cfg: Config, slice_steps: int) -> dict[str, Config]:
    """The two sides: ``cfg`` on its fixed shards and with leased slices of ``slice_steps`` inner
    steps of learner 0 each; neither saves learner inner states."""
    lc = cfg.learners
    step_tokens = lc.grad_accum_steps * lc.batch_size_of(0) * cfg.model.context
    plain = with_fields(cfg, {"learners.checkpoint_every_s": 0.0})
    return {"shards": plain,
            "leases": with_fields(plain, {"data.slices": True, "data.slice_tokens": slice_steps * step_tokens})}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.lease_tokens", description=description(__doc__))
    ap.add_argument("--config", default="configs/default.toml")
    ap.add_argument("--run-s", type=positive_float, default=60.0, help="wall seconds of each run (budget.wall_s)")
    ap.add_argument("--warmup-steps", type=non_negative_int, default=5)
    ap.add_argument("--pairs", type=positive_int, default=3, help="interleaved (shards, leases) pairs, for an interval")
    ap.add_argument("--slice-steps", type=positive_int, default=16, help="inner steps of one learner per slice")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                    help="a recipe setting for both sides (repeatable)")
    args = ap.parse_args(argv)
    try:  # a bad --set or recipe is the command line's error, before anything starts
        modes = lease_modes(load_config(args.config, args.overrides), args.slice_steps)
    except (OSError, ValueError) as err:
        ap.error(str(err))
    with tempfile.TemporaryDirectory() as tmp:
        return paired_tokens_per_s(modes, {"shards": "fixed shard", "leases": "leased slices"}, tmp=Path(tmp),
                                   pairs=args.pairs, run_s=args.run_s, warmup_steps=args.warmup_steps, goal=GOAL,
                                   title="make bench-leases: bars")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
