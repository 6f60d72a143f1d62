"""The pure figure of the fuzz run (diloco_async.chaos.fuzz_run): the heartbeat p99 of a window."""

from __future__ import annotations

import math

from diloco_async.chaos.fuzz_run import _p99_ms


def test_p99_is_the_higher_rank_within_the_window():
    # (t, latency s): latencies 1..200 ms at t = 0..199; the window [50, 150) holds 51..150 ms
    latencies = [(float(t), (t + 1) / 1000) for t in range(200)]
    assert _p99_ms(latencies, 50.0, 150.0) == 150.0  # 100 values: index ceil(0.99 * 99) = 99, the largest
    assert _p99_ms(latencies, 0.0, 200.0) == 199.0  # 200 values: index ceil(0.99 * 199) = 198
    assert _p99_ms(latencies, 0.0, 1.0) == 1.0
    assert math.isnan(_p99_ms(latencies, 300.0, 400.0))
