"""The scripted learners of ``benchmarks/scale.py`` (issue 40, ``make bench-scale``) on real
synchronizer processes: with one shard and with two, contributions are fetched, verified and
merged by every shard, and every announcement is answered.

How fast is the benchmark's business: this test checks only that the load is real and reaches
every shard, never the rate.
"""

from __future__ import annotations

import pytest

from benchmarks.scale import ScaleSpec, run_scale


@pytest.mark.parametrize("shards", [1, 2])
def test_the_scale_load_is_merged_by_every_shard(shards):
    out = run_scale(ScaleSpec(shards=shards, seconds=4.0, warmup_s=3.0, n_layer=1, d_model=64))
    assert len(out["merged_by_shard"]) == shards and all(n >= 4 for n in out["merged_by_shard"]), out
    assert out["merged_bytes_per_s"] > 0 and set(out["acks"]) <= {"accepted", "late"}, out
    assert out["acks"].get("accepted", 0) >= 4 * shards, out
