"""The background held-out evaluator's thread against a real file store: each new version evaluated
once, torch's thread count restored (the evaluator's reads are tests/unit/test_heldout_monitor.py's)."""

from __future__ import annotations

import torch
from test_heldout_monitor import FRAGMENTS, RUN, _publish, _setup  # noqa: F401, F811 (shared with unit/test_heldout_monitor.py; fixtures among them)

from diloco_async.metrics.heldout_monitor import HeldoutMonitor
from diloco_async.models import build_run_model
from tests.polling import wait_until


def test_the_thread_evaluates_each_new_version_once_and_restores_torch_threads(tmp_path):
    cfg, model, plan, store, split = _setup(tmp_path)
    for p in range(FRAGMENTS):
        _publish(store, plan, model, p, 0, 1.0)
    threads = torch.get_num_threads()
    monitor = HeldoutMonitor(build_run_model(cfg), split, store, RUN, every_s=0.05)
    monitor.start()
    try:
        got: list[dict] = []
        for v in (1, 2, 3):
            _publish(store, plan, model, 0, v, 1.0 - 0.2 * v)
            wait_until(lambda v=v: got.extend(monitor.drain()) or any(m["step"] == v for m in got), 60,
                       f"the point of version {v}")
    finally:
        monitor.stop()
    got.extend(monitor.drain())
    losses = [m for m in got if m["key"] == "eval/loss"]
    assert [m["step"] for m in losses] == [1, 2, 3]  # the start model (step 0) is the caller's to log
    assert len({m["value"] for m in losses}) == 3
    assert {m["key"] for m in got} == {"eval/loss", "eval/bits_per_byte", "eval/duration_s"}
    assert monitor.errors == 0
    assert torch.get_num_threads() == threads
