"""Parts of the synchronizer package on their own: bounded logs, the uptime ledger, the lifecycle."""

from __future__ import annotations

import random
import tracemalloc

import pytest

from diloco_async.metrics.goodput import MergeGaps, uptime
from diloco_async.sync import logs as logs_module
from diloco_async.sync.lifecycle import Lifecycle, Phase
from diloco_async.sync.logs import BoundedMap, JsonLinesLog


def point(i: int) -> dict:
    return {"key": f"learner/learner-{i % 4}/train_loss", "value": 1.0 / (i + 1), "step": i, "timestamp_ms": 10**12 + i}


def test_metric_log_memory_stays_flat_over_many_points(tmp_path):
    log = JsonLinesLog(tail=500, spill_dir=tmp_path)
    # only what the log's own code allocated: pytest-xdist's I/O thread in this process allocates
    # too (tens of kB at random moments), which is not the log's memory
    mine = [tracemalloc.Filter(True, logs_module.__file__, all_frames=True)]
    tracemalloc.start(8)
    try:
        for i in range(5_000):
            log.append(point(i))
        after_5k = sum(s.size for s in tracemalloc.take_snapshot().filter_traces(mine).statistics("filename"))
        for i in range(5_000, 20_000):
            log.append(point(i))
        after_20k = sum(s.size for s in tracemalloc.take_snapshot().filter_traces(mine).statistics("filename"))
    finally:
        tracemalloc.stop()
    assert len(log) == 20_000 and log.in_memory == 500
    assert after_5k > 500 * 50  # the 500 lines in memory are counted
    assert after_20k < after_5k * 1.1 + 4 * 1024, (after_5k, after_20k)
    # the newest points come from memory, the oldest from the spill file, numbered as appended
    assert log.read(19_990, 5) == [point(i) for i in range(19_990, 19_995)]
    assert log.read(5, 5) is None
    log.flush()
    assert log.read_spilled(5, 3, upto=len(log)) == [point(5), point(6), point(7)]
    assert log.read_spilled(19_998, 10, upto=len(log)) == [point(19_998), point(19_999)]
    log.seal()
    log.append(point(20_000))  # after the seal: in memory only
    with open(log.source, "rb") as fh:  # what the final upload reads
        assert sum(1 for _ in fh) == 20_000
    log.close()
    assert list(log)[-1] == point(20_000)  # the tail stays readable after close
    assert list(tmp_path.iterdir()) == []  # nothing left on disk
    with pytest.raises(ValueError):
        log.read_spilled(0, 1, upto=1)


def test_spilled_read_stops_at_the_flushed_count(tmp_path):
    log = JsonLinesLog(tail=2, spill_dir=tmp_path)
    for i in range(10):
        log.append(point(i))
    log.flush()
    upto = len(log)
    for i in range(10, 15):  # appended after the flush: not part of this answer
        log.append(point(i))
    assert log.read_spilled(8, 100, upto=upto) == [point(8), point(9)]
    log.close()


def test_bounded_map_keeps_the_newest_entries():
    m: BoundedMap[tuple[str, int, int], str] = BoundedMap(cap=100)
    for n in range(10_000):
        m[("a", 0, n)] = f"key-{n}"
    assert len(m) == 100
    assert m.get(("a", 0, 9_999)) == "key-9999" and ("a", 0, 9_899) not in m
    with pytest.raises(ValueError):
        BoundedMap(cap=0)


@pytest.mark.parametrize("seed", range(5))
def test_merge_gaps_uptime_equals_uptime_over_every_merge(seed):
    rng = random.Random(seed)
    start, t, times = 100.0, 100.0, []
    for _ in range(2_000):
        t += rng.choice([rng.uniform(0, 2), rng.uniform(0, 2), rng.uniform(3, 40)])
        times.append(t)
    gaps = MergeGaps(start, min_gap_s=5.0)
    for x in times:
        gaps.record(x)
    assert len(gaps.long_gaps) < len(times) / 2
    for end, max_gap in [(t, 5.0), (t + 30, 7.5), (t + 1, 60.0)]:
        assert gaps.uptime(end, max_gap) == uptime(times, start, end, max_gap)  # bit for bit
    assert MergeGaps(start, 5.0).uptime(start + 20, 5.0) == uptime([], start, start + 20, 5.0)
    with pytest.raises(ValueError):
        gaps.uptime(t, 4.0)


def test_lifecycle_moves_only_along_allowed_transitions():
    life = Lifecycle()
    assert life.running and not life.stopped
    with pytest.raises(RuntimeError, match="running -> finished"):
        life.move(Phase.FINISHED)
    life.move(Phase.DRAINING)
    assert not life.running and not life.stopped
    with pytest.raises(RuntimeError):
        life.move(Phase.DRAINING)
    for phase in (Phase.STOPPING, Phase.FINAL_CHECKPOINT, Phase.WRITING_SUMMARY, Phase.FINISHING, Phase.FINISHED):
        life.move(phase)
        assert life.stopped
    with pytest.raises(RuntimeError):
        life.move(Phase.RUNNING)


def test_unparseable_requests_log_one_line_without_a_traceback(caplog):
    import logging

    from aiohttp.http_exceptions import BadStatusLine

    from diloco_async.sync.gate import quiet_protocol_errors

    server_log = logging.getLogger(f"aiohttp.server.test-{id(caplog)}")
    quiet_protocol_errors(server_log)
    with caplog.at_level(logging.INFO):
        for _ in range(5):
            try:
                raise BadStatusLine(b"GET /ws?learner_id=a b HTTP/1.1")
            except BadStatusLine:
                server_log.exception("Error handling request from %s", "127.0.0.1")
        try:
            raise RuntimeError("a real bug")
        except RuntimeError:
            server_log.exception("Error handling request from %s", "127.0.0.1")
    lines = [r for r in caplog.records if "protocol_error" in r.getMessage()]
    assert len(lines) == 1 and lines[0].exc_info is None  # rate-limited, no traceback
    assert not any(r.exc_info and isinstance(r.exc_info[1], BadStatusLine) for r in caplog.records)
    assert any(r.exc_info and isinstance(r.exc_info[1], RuntimeError) for r in caplog.records)  # bugs still show
