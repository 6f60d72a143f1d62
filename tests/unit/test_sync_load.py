"""The pure parts of ``benchmarks/sync_load.py``'s load generator: how many generator processes a
load takes, and its percentiles. The load itself, against a real synchronizer process, is
tests/system/test_sync_load_quick.py's."""

from __future__ import annotations

import pytest

from benchmarks.sync_load import percentile_ms
from benchmarks.sync_load_learners import generators_for


def test_a_generator_drives_at_most_250_learners_and_there_are_at_least_two():
    assert [generators_for(n) for n in (1, 32, 256, 500, 501, 1000, 1001)] == [2, 2, 2, 2, 3, 4, 5]


def test_percentiles_are_nearest_rank():
    values = [i / 1000 for i in range(1, 101)]  # 1..100 ms
    assert percentile_ms(values, 0.99) == 99.0 and percentile_ms(values, 0.5) == 50.0
    assert percentile_ms([], 0.99) is None
    # the ceil(q n)-th smallest: of 5 the 3rd (q n = 2.5), of 51 the 51st (q n = 50.49)
    assert percentile_ms([i / 1000 for i in range(1, 6)], 0.5) == 3.0
    assert percentile_ms([i / 1000 for i in range(1, 52)], 0.99) == 51.0


def test_the_load_bars_are_means_of_the_runs_p99s_and_drops_add_up():
    from benchmarks.sync_load import _load_bars
    from benchmarks.sync_load_learners import LoadResult, LoadSpec

    spec = LoadSpec(1000, 1.0, 10.0, seconds=30.0)

    def run(hb_ms: float, ann_ms: float, sent: int, answered: int) -> LoadResult:
        # 100 latencies: 98 at 1 ms and two at the run's tail (the p99 of 100 values is the 99th)
        return LoadResult(spec, heartbeat_s=[0.001] * 98 + [hb_ms / 1000] * 2,
                          announce_s=[0.001] * 98 + [ann_ms / 1000] * 2,
                          sent={"heartbeat": sent}, answered={"heartbeat": answered})

    ann, hb, dropped = _load_bars([run(60.0, 40.0, 10, 10), run(70.0, 20.0, 10, 9), run(50.0, 30.0, 5, 5)], 50.0)
    assert hb.value == pytest.approx(60.0) and not hb.ok and "mean of 3 runs" in hb.detail
    assert ann.value == pytest.approx(30.0) and ann.ok
    assert dropped.value == 1 and not dropped.ok and "25 sent over 3 run(s)" in dropped.detail
    none = _load_bars([run(10.0, 10.0, 1, 1), LoadResult(spec, heartbeat_s=[0.001])], 50.0)[0]
    assert none.value is None and not none.ok  # a run without announcements: not measured, a miss
