"""Interleaved pairs of in-run learner tokens/s (`make bench-tls`, `make bench-leases`): a baseline
recipe and a variant measured alternately (A B, B A, ...) so that a drift of the machine's load
falls on both, then the variant / baseline ratio with its 95% interval as a bars row.
"""

from __future__ import annotations

import time
from pathlib import Path

from benchmarks.bars import Bar, print_bars
from benchmarks.hf_learner import in_run_tokens_per_s
from benchmarks.stats import mean_interval
from diloco_async.config.schema import Config

__all__ = ["paired_tokens_per_s"]


def paired_tokens_per_s(modes: dict[str, Config], labels: dict[str, str], *, tmp: Path, pairs: int, run_s: float,
                        warmup_steps: int, goal: float, title: str) -> int:
    """Measure ``pairs`` interleaved pairs of the two recipes of ``modes`` (the first key the
    baseline, the second the variant), each a run of ``run_s`` seconds in its own folder under
    ``tmp`` (:func:`benchmarks.hf_learner.in_run_tokens_per_s`, tokens/s after ``warmup_steps``);
    print each figure, then the bars: both means (shown) and variant / baseline >= ``goal``.
    ``labels``: mode -> its name in the bars. Returns the bars' exit status (1 on a miss)."""
    base, variant = list(modes)
    t0 = time.monotonic()
    ratios, by_mode = [], {base: [], variant: []}
    for pair in range(pairs):
        order = [base, variant] if pair % 2 == 0 else [variant, base]
        got = {}
        for mode in order:
            got[mode], steps = in_run_tokens_per_s(modes[mode], tmp / f"{mode}-{pair}", run_s, warmup_steps)
            print(f"[{pair}] {mode:6s} {got[mode]:9.1f} tokens/s over {steps} steps", flush=True)
            by_mode[mode].append(got[mode])
        ratios.append(got[variant] / got[base])
    ratio, half = mean_interval(ratios)
    shown = ", ".join(f"{r:.3f}" for r in ratios)
    print(f"({time.monotonic() - t0:.0f} s)")
    return print_bars([
        Bar(f"learner tokens/s, {labels[base]} (mean)", sum(by_mode[base]) / pairs, 0.0, shown=True),
        Bar(f"learner tokens/s, {labels[variant]} (mean)", sum(by_mode[variant]) / pairs, 0.0, shown=True),
        Bar(f"learner tokens/s, {labels[variant]} / {labels[base]}", ratio, goal,
            detail=f"mean of {pairs} interleaved pairs +- {half:.3f} (95%): {shown}"),
    ], title=title)
