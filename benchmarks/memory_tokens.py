"""Learner tokens/s with sync on against a plain training loop at ~48M parameters (issue 17).

The model is :data:`benchmarks.sizes.SIZES` ``[50]`` (a ByteGPT of 49M parameters), batch
``--batch`` windows of 64 tokens, one thread. Method of :mod:`benchmarks.hf_learner`: each repeat
measures the plain loop (same model, AdamW, batches and threads, in this process), then one
learner inside a real run (a synchronizer and the learner as processes over a ``file://`` store,
4 fragments, inner-state checkpoints every 30 s, as the default recipe) from its timeline's step
records, then the plain loop again; the ratio is in-run / mean of the two plain measurements.
Bar: mean ratio over the repeats >= 0.95 (printed with its 95% t-interval).

Usage: python -m benchmarks.memory_tokens [--quick] [--repeats 2] [--run-s 100] [--plain-s 25]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from benchmarks.args import description, positive_float, positive_int
from benchmarks.bars import Bar, print_bars
from benchmarks.hf_learner import in_run_tokens_per_s, plain_loop_tokens_per_s
from benchmarks.sizes import SIZES
from benchmarks.stats import mean_interval
from diloco_async.config.resolved import with_fields
from diloco_async.config.schema import Config

__all__ = ["tokens_bar", "main"]

GOAL = 0.95


def tokens_bar(quick: bool = False, repeats: int = 2, run_s: float = 100.0, plain_s: float = 25.0,
               batch: int = 4, warmup_steps: int = 3) -> Bar:
    """Measure and return the tokens/s bar (``quick``: a 1M-parameter model, one short repeat)."""
    size = 1 if quick else 50
    cfg = with_fields(Config(), {**SIZES[size], "learners.batch_size": batch, "learners.threads": 1,
                                 "learners.checkpoint_every_s": 30.0, "synchronizer.num_fragments": 4})
    if quick:
        repeats, run_s, plain_s = 1, 25.0, 5.0
    ratios = []
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(repeats):
            before, _ = plain_loop_tokens_per_s(cfg, plain_s, warmup_steps)
            inside, n = in_run_tokens_per_s(cfg, Path(tmp) / f"r{rep}", run_s, warmup_steps)
            after, _ = plain_loop_tokens_per_s(cfg, plain_s, warmup_steps)
            ratios.append(inside / ((before + after) / 2))
            print(f"[{rep}] plain {before:8.1f} / {after:8.1f} tokens/s, learner in a run {inside:8.1f} tokens/s "
                  f"over {n} steps: ratio {ratios[-1]:.3f}", flush=True)
    mean, half = mean_interval(ratios)
    print(f"learner in a run / plain loop at {size}M: {mean:.3f} +- {half:.3f} (95%, {len(ratios)} repeats)",
          flush=True)
    return Bar(f"learner tokens/s with sync on / plain loop, {size}M", mean, GOAL, "min",
               f"mean of {len(ratios)} repeats +- {half:.3f}; batch {batch}x64, 1 thread")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.memory_tokens", description=description(__doc__))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=positive_int, default=2)
    ap.add_argument("--run-s", type=positive_float, default=100.0)
    ap.add_argument("--plain-s", type=positive_float, default=25.0)
    ap.add_argument("--batch", type=positive_int, default=4)
    args = ap.parse_args(argv)
    bar = tokens_bar(args.quick, args.repeats, args.run_s, args.plain_s, args.batch)
    return print_bars([bar], title="learner tokens/s bar")


if __name__ == "__main__":
    sys.exit(main())
