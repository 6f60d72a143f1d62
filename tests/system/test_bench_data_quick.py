"""The learner part of ``benchmarks/data_bars.py`` (issue 45 item 4, ``make bench-data``) on real
processes: a synchronizer and a learner train leased slices of a token store built by the benchmark,
and the learner's peak RSS and the run's trained tokens come back.

How much memory is the benchmark's business: this test checks only that the run is real (slices
trained, a learner process measured), never the figure.
"""

from __future__ import annotations

from benchmarks.data_bars import _build, learner_peak_rss
from benchmarks.synth_corpus import write_corpus


def test_a_learner_trains_leased_slices_of_the_benchmarks_token_store(tmp_path):
    write_corpus(tmp_path / "corpus", 4 << 20, 1 << 20, seed=3)
    urls, cache = f"file://{tmp_path}/corpus/*.jsonl", tmp_path / "cache"
    _build(urls, cache, "bytes", 1, keep=True)
    out = learner_peak_rss(urls, cache, tmp_path / "run", seconds=8.0)
    assert out["tokens_trained"] > 0 and out["tokens_trained"] % (16 * 16 * 64) == 0, out  # whole slices
    assert out["peak_rss"] > 50 << 20, out  # a learner process with torch loaded was sampled
