"""Peak bytes per second over 1 s windows (diloco_async/sync/traffic.py), with an injected clock,
and the figures in the synchronizer's summary."""

from __future__ import annotations

import pytest

from diloco_async.sync.reporting import Reporter
from diloco_async.sync.traffic import PeakRate, TrafficPeaks


class Clock:
    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_peak_is_the_busiest_window_not_the_busiest_second_of_any_alignment():
    clock = Clock()
    rate = PeakRate(clock)
    assert rate.peak_bytes_per_s == 0.0
    for t, nbytes in ((100.1, 300), (100.9, 400),  # window 0: 700
                      (101.0, 500),  # window 1 starts exactly at 1 s: 500
                      (102.5, 200), (102.6, 250), (102.99, 100),  # window 2: 550
                      (105.2, 650)):  # window 5 after idle windows: 650
        clock.t = t
        rate.add(nbytes)
    assert rate.peak_bytes_per_s == 700.0  # 400 + 500 across 100.9..101.0 straddles a boundary: not one window


def test_window_width_scales_the_rate_and_bad_input():
    clock = Clock(0.0)
    rate = PeakRate(clock, window_s=0.5)
    clock.t = 0.1
    rate.add(100)
    rate.add(-50)  # ignored
    clock.t = 0.6
    rate.add(10)
    assert rate.peak_bytes_per_s == 200.0  # 100 bytes in a 0.5 s window
    with pytest.raises(ValueError, match="window_s"):
        PeakRate(clock, window_s=0.0)


def test_in_out_and_total_share_windows():
    clock = Clock(0.0)
    peaks = TrafficPeaks(clock)
    clock.t = 0.2
    peaks.add_in(1000)
    peaks.add_out(300)
    clock.t = 1.5
    peaks.add_out(900)
    assert peaks.figures() == {"peak_bytes_in_per_s": 1000.0, "peak_bytes_out_per_s": 900.0,
                               "peak_bytes_per_s": 1300.0}


def test_reporter_counts_bytes_and_their_peaks(tmp_path):
    clock = Clock(5.0)
    rep = Reporter(5.0, "t", tmp_path, clock=clock)
    try:
        rep.add_bytes_in(4096)
        clock.t = 5.5
        rep.add_bytes_in(1024)
        clock.t = 7.0
        rep.add_bytes_out(2048)
        assert rep.counters["bytes_in"] == 5120 and rep.counters["bytes_out"] == 2048
        assert rep.traffic.figures() == {"peak_bytes_in_per_s": 5120.0, "peak_bytes_out_per_s": 2048.0,
                                         "peak_bytes_per_s": 5120.0}
    finally:
        rep.close()


def test_net_points_of_every_learner_only_every_period_else_those_merged(tmp_path):
    """At each merge the per-learner ``net/learner/...`` points are the merged learners' only,
    except the first merge and once every NET_ALL_LEARNERS_S, which write every learner's."""
    from diloco_async.metrics.goodput import LearnerLedger
    from diloco_async.sync.learners import LearnerRegistry
    from diloco_async.sync.reporting import NET_ALL_LEARNERS_S

    reg = LearnerRegistry()
    for i in range(5):
        reg.wire.up(f"l{i}", 0, 1000 * (i + 1))
        reg.ledgers[f"l{i}"] = LearnerLedger()
        reg.ledgers[f"l{i}"].tokens_processed = 100
    rep = Reporter(0.0, "n", tmp_path)

    def learners_written(merged, now_s):
        before = len(list(rep.metrics))
        rep.net(reg, merged, now_s)
        keys = [r["key"] for r in list(rep.metrics)[before:]]
        return sorted({k.split("/")[2] for k in keys if k.startswith("net/learner/")})

    try:
        assert learners_written(["l1"], 10.0) == ["l0", "l1", "l2", "l3", "l4"]  # the first: all
        assert learners_written(["l1", "l3"], 10.0 + NET_ALL_LEARNERS_S / 2) == ["l1", "l3"]
        assert learners_written(["l2"], 10.0 + NET_ALL_LEARNERS_S) == ["l0", "l1", "l2", "l3", "l4"]
        assert learners_written([], 11.0 + NET_ALL_LEARNERS_S) == []
        assert learners_written(None, 12.0 + NET_ALL_LEARNERS_S) == ["l0", "l1", "l2", "l3", "l4"]
    finally:
        rep.close()
