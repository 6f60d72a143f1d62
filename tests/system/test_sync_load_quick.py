"""The load generator of ``benchmarks/sync_load.py`` in its quick mode (issue 17): it speaks the
real protocol to a real synchronizer process (heartbeats and announcements over the WebSocket,
as the real learner sends them), and every message it sends is answered.

Speed is the benchmark's business: this test checks only that the load is real (joins,
WebSockets, heartbeats, announcements merged) and counted (nothing dropped, both latencies
measured), never how fast it was answered.
"""

from __future__ import annotations

from benchmarks.sync_load import LoadSpec, report, run_load


def test_quick_load_is_real_and_nothing_is_dropped():
    res = run_load(LoadSpec(learners=32, heartbeat_s=0.25, announce_s=2.0, seconds=4.0, warmup_s=3.0))
    assert res.errors == []
    assert res.sent == res.answered and res.ws_lost == 0 and res.dropped == 0
    assert res.sent["join"] == 32 and res.sent["heartbeat"] >= 32 * 4
    # heartbeats and announcements over the WebSocket, as the real learner sends them
    assert res.sent_by_transport == {"ws": res.sent["heartbeat"] + res.sent["announce"]}
    assert res.acks.get("accepted", 0) >= 4  # real objects fetched, verified ...
    # ... and merged: the WebSockets heard of rounds and of the versions they published
    assert res.pushed_by_type.get("round_open", 0) >= 32 and res.pushed_by_type.get("version", 0) >= 32
    assert res.heartbeat_s and res.announce_s and res.health_s
    fig = report(res)
    assert fig["dropped"] == 0 and fig["heartbeat_p99_ms"] >= fig["heartbeat_p50_ms"] > 0
