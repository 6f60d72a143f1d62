"""The background held-out evaluator reads the newest published versions from a real file store,
never a half-written object, and evaluates exactly the model they make."""

from __future__ import annotations

import torch

from diloco_async.config.schema import load_config
from diloco_async.data.tokens import HeldoutSplit
from diloco_async.metrics.evaluation import heldout_loss
from diloco_async.metrics.heldout_monitor import HeldoutMonitor, load_versions, newest_versions
from diloco_async.models import build_run_model, plan_of, trainable_parameters
from diloco_async.storage import keys
from diloco_async.storage.store import ObjectStore
from diloco_async.sync.work import put_version
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


def test_newest_versions_and_load_evaluate_the_published_model(tmp_path):
    cfg, model, plan, store, split = _setup(tmp_path)
    _publish(store, plan, model, 0, 0, 1.0)
    assert newest_versions(store, RUN, FRAGMENTS) is None  # fragment 1 has nothing published yet
    _publish(store, plan, model, 1, 0, 1.0)
    _publish(store, plan, model, 0, 1, 0.5)
    expected = dict(_publish(store, plan, model, 0, 2, 0.25))
    expected.update(_publish(store, plan, model, 1, 1, 0.75))
    # a writer caught mid-write: its temporary file lies next to the keys and must never be read
    folder = tmp_path / "store" / keys.fragment_versions_prefix(RUN, 0)
    (folder / ".tmp-0123abcd").write_bytes(b"half an object")
    assert newest_versions(store, RUN, FRAGMENTS) == {0: 2, 1: 1}

    fresh = build_run_model(cfg)
    monitor = HeldoutMonitor(fresh, split, store, RUN, every_s=60.0)
    point = monitor.evaluate_newest()
    assert point is not None and point.step == 3 and point.versions == (2, 1)
    reference = build_run_model(cfg)
    with torch.no_grad():
        for name, tensor in expected.items():
            trainable_parameters(reference)[name].copy_(tensor)
    assert point.loss_nats == heldout_loss(reference, split.batches)
    assert point.bits_per_byte == split.bits_per_byte(point.loss_nats)
    assert monitor.evaluate_newest() is None  # nothing newer: no second point at the same step


def test_a_version_that_does_not_decode_leaves_the_model_unchanged(tmp_path):
    cfg, model, plan, store, split = _setup(tmp_path)
    _publish(store, plan, model, 0, 0, 1.0)
    _publish(store, plan, model, 1, 0, 1.0)
    store.put(keys.version_key(RUN, 1, 1), b"not a safetensors file")
    _publish(store, plan, model, 0, 1, 3.0)
    target = build_run_model(cfg)
    before = {n: p.detach().clone() for n, p in target.named_parameters()}
    try:
        load_versions(target, store, RUN, plan, {0: 1, 1: 1})
    except ValueError:
        pass
    else:
        raise AssertionError("an undecodable version was loaded")
    assert all(torch.equal(before[n], p) for n, p in target.named_parameters())


def test_the_sampler_runs_on_the_evaluated_model_and_its_failure_keeps_the_loss(tmp_path):
    cfg, model, plan, store, split = _setup(tmp_path)
    _publish(store, plan, model, 0, 0, 1.0)
    published = dict(_publish(store, plan, model, 1, 0, 0.5))
    published.update(_publish(store, plan, model, 0, 1, 0.75))  # step 1: past the initial model's step 0
    holds = []

    def sampler(m):  # the model it is handed holds the published versions
        params = trainable_parameters(m)
        holds.append(all(torch.equal(params[n], t) for n, t in published.items()))
        return [f"sample {len(holds)}", "second"]

    monitor = HeldoutMonitor(build_run_model(cfg), split, store, RUN, every_s=0.01, sampler=sampler)
    monitor.start()
    try:  # 60 s is the failure mode only: one pass takes milliseconds
        drained = wait_until(monitor.drain_samples, 60, "the monitor's first samples", interval_s=0.01)
    finally:
        monitor.stop()
    assert holds == [True]  # one new model, evaluated and sampled once
    assert drained == [(1, ("sample 1", "second"))]
    assert monitor.drain_samples() == []  # handed over once
    assert [p["key"] for p in monitor.drain()] == ["eval/loss", "eval/bits_per_byte", "eval/duration_s"]

    def broken(m):
        raise RuntimeError("generation failed")

    _publish(store, plan, model, 0, 2, 0.25)
    failing = HeldoutMonitor(build_run_model(cfg), split, store, RUN, every_s=60.0, sampler=broken)
    point = failing.evaluate_newest()
    assert point is not None and point.step == 2 and point.samples == ()
    assert failing.sample_errors == 1 and failing.errors == 0
