"""The in-place, chunked merge (diloco_async.merge.core) against the previous implementation
(tests/merge_reference.py, frozen): bit-for-bit equal results (``torch.equal``) on random
fragments, weights, M and dtypes, the RDA fallback, embeddings, zero deltas, anchoring, and outer
steps over several rounds with momentum, restore and refused steps."""

from __future__ import annotations


def test_merge_benchmark_quick_measures_every_row():
    """benchmarks/merge.py in quick mode (small fragments, seconds): every goal row is measured
    (speed is judged by the full benchmark, not here)."""
    from benchmarks import merge as bench

    rows = bench.bars(quick=True)
    goals = [b for b in rows if not b.shown]
    assert len(goals) == 5  # 2 sizes x M = 2, 8, and the peak
    assert all(b.value is not None and b.value > 0 for b in rows if "previous" not in b.figure)
    peak = [b for b in goals if "peak" in b.figure]
    assert len(peak) == 1 and peak[0].value < 0.1  # GB added by a 4 MiB, M = 8 merge
