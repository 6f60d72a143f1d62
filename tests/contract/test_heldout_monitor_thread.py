"""The background held-out evaluator's thread against a real file store: each new version evaluated
once, torch's thread count restored (the evaluator's reads are tests/unit/test_heldout_monitor.py's)."""

from __future__ import annotations

import torch

from diloco_async.config import load_config
from diloco_async.heldout_monitor import HeldoutMonitor
from diloco_async.models import build_run_model, plan_of, trainable_parameters
from diloco_async.sync.work import put_version
from diloco_async.tokens import HeldoutSplit
from storage import keys
from storage.store import ObjectStore
from tests.polling import wait_until

RUN = "run-eval"
FRAGMENTS = 2


def _setup(tmp_path):
    cfg = load_config(None, ["model.n_layer=1", "model.d_model=32", "model.n_head=2", "model.context=16"])
    torch.manual_seed(0)
    model = build_run_model(cfg)
    plan = plan_of(model, FRAGMENTS)
    store = ObjectStore(f"file://{tmp_path}/store")
    store.put_json(keys.plan_key(RUN), {"run_id": RUN, "plan": plan.to_json()})  # as the synchronizer writes it
    gen = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(3):
        x = torch.randint(0, 256, (4, 17), generator=gen)
        batches.append((x[:, :-1], x[:, 1:]))
    split = HeldoutSplit(batches, tokens=10_000, nbytes=12_000)
    return cfg, model, plan, store, split


def _publish(store, plan, model, p, v, scale):
    """Publish fragment ``p`` of ``model`` scaled by ``scale`` as version ``v``; returns the tensors."""
    params = trainable_parameters(model)
    tensors = {n: params[n].detach() * scale for n in plan.names(p)}
    put_version(store, RUN, p, v, tensors)
    return tensors


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
