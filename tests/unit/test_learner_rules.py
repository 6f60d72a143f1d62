"""Goldens of the learner's outer rules (outer gradient, adopt, counters) and of the one inner step.

Values are binary fractions, so every expected tensor is exact in float32.
"""

from __future__ import annotations

import pytest
import torch

from diloco_async.config.schema import load_config
from diloco_async.inner.workload import Workload, inner_step, warmup_lr
from diloco_async.learner.rules import Progress, adopt, outer_gradient, progress_after_adopt
from diloco_async.models.transformer import ByteGPT


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def test_outer_gradient_is_base_minus_params():
    base = {"w": t(1.5, 1.0), "b": t(0.25)}
    params = {"w": t(1.25, 0.5), "b": t(0.75)}
    delta = outer_gradient(base, params)
    assert set(delta) == {"w", "b"}
    assert torch.equal(delta["w"], t(0.25, 0.5)) and torch.equal(delta["b"], t(-0.5))
    assert torch.equal(params["w"], t(1.25, 0.5))  # inputs untouched


def test_outer_gradient_design_golden_row():
    # DESIGN §4 golden table, anchoring row: Θ^base = [1.5, 1], θ = [1.2, 0.9] → local Δ = [0.3, 0.1]
    delta = outer_gradient({"x": t(1.5, 1.0)}, {"x": t(1.2, 0.9)})
    assert torch.allclose(delta["x"], t(0.3, 0.1), atol=1e-6)


def test_outer_gradient_covers_the_names_of_params_only():
    delta = outer_gradient({"a": t(1.0), "other": t(2.0)}, {"a": t(0.5)})
    assert list(delta) == ["a"]
    with pytest.raises(KeyError):
        outer_gradient({"a": t(1.0)}, {"missing": t(0.0)})


def test_adopt_overwrite_takes_the_new_version():
    params, new = {"w": t(1.0, 2.0)}, {"w": t(3.0, 4.0)}
    out = adopt("overwrite", params, new)
    assert torch.equal(out["w"], t(3.0, 4.0)) and torch.equal(params["w"], t(1.0, 2.0))


def test_adopt_mix_weights_the_new_version_by_alpha():
    params, new = {"w": t(1.0, 2.0)}, {"w": t(3.0, 6.0)}
    out = adopt("mix", params, new, mix_alpha=0.25)
    assert torch.equal(out["w"], t(1.5, 3.0))  # 0.75·θ + 0.25·Θ^new
    assert torch.equal(adopt("mix", params, new, mix_alpha=1.0)["w"], t(3.0, 6.0))
    assert torch.equal(params["w"], t(1.0, 2.0))


def test_adopt_rebase_keeps_progress_since_the_snapshot_or_the_base():
    params, new = {"w": t(1.5, 2.0)}, {"w": t(3.0, 4.0)}
    snapshot, base = {"w": t(1.0, 2.5)}, {"w": t(0.5, 0.5)}
    # θ + (Θ^new − snapshot) = [1.5 + 2.0, 2.0 + 1.5]
    assert torch.equal(adopt("rebase", params, new, base=base, snapshot=snapshot)["w"], t(3.5, 3.5))
    # no contribution in flight: θ + (Θ^new − Θ^base) = [1.5 + 2.5, 2.0 + 3.5]
    assert torch.equal(adopt("rebase", params, new, base=base)["w"], t(4.0, 5.5))
    assert torch.equal(params["w"], t(1.5, 2.0)) and torch.equal(snapshot["w"], t(1.0, 2.5))


def test_adopt_rejects_bad_arguments():
    with pytest.raises(ValueError, match="rebase"):
        adopt("rebase", {"w": t(1.0)}, {"w": t(2.0)})
    with pytest.raises(ValueError, match="unknown adopt rule"):
        adopt("average", {"w": t(1.0)}, {"w": t(2.0)})


def test_adopt_on_parameters_is_not_tracked_by_autograd():
    p = torch.nn.Parameter(t(1.0, 2.0))
    for rule in ("mix", "rebase"):
        out = adopt(rule, {"w": p}, {"w": t(3.0, 4.0)}, base={"w": t(0.0, 0.0)})
        assert not out["w"].requires_grad


@pytest.mark.parametrize("rule", ["overwrite", "mix", "rebase"])
def test_adopt_matches_the_in_place_update_bit_for_bit(rule):
    """The rules give exactly what the learner's former in-place updates gave."""
    g = torch.Generator().manual_seed(5)
    params = {n: torch.nn.Parameter(torch.randn(17, 3, generator=g)) for n in ("a", "b")}
    new = {n: torch.randn(17, 3, generator=g) for n in params}
    snap = {n: torch.randn(17, 3, generator=g) for n in params}
    out = adopt(rule, params, new, mix_alpha=0.3, snapshot=snap)
    with torch.no_grad():
        for n, val in new.items():
            if rule == "overwrite":
                params[n].copy_(val)
            elif rule == "mix":
                params[n].mul_(1 - 0.3).add_(val, alpha=0.3)
            else:
                params[n].add_(val - snap[n])
    for n in params:
        assert torch.equal(out[n], params[n].detach())


def test_progress_after_adopt():
    now, in_flight = Progress(14, 896, 3.5), Progress(10, 640, 2.5)
    assert progress_after_adopt("overwrite", now, in_flight) == Progress(0, 0, 0.0)
    assert progress_after_adopt("mix", now) == Progress(0, 0, 0.0)
    assert progress_after_adopt("rebase", now, in_flight) == Progress(4, 256, 1.0)
    assert progress_after_adopt("rebase", now) == now
    assert Progress(4, 256, 1.0).plus(64, 0.5) == Progress(5, 320, 1.5)


def test_warmup_lr():
    assert warmup_lr(0.5, 0, 4) == 0.125
    assert warmup_lr(0.5, 1, 4) == 0.25
    assert warmup_lr(0.5, 3, 4) == 0.5
    assert warmup_lr(0.5, 10, 4) == 0.5
    assert warmup_lr(0.5, 0, 0) == 0.5  # no warm-up


def _tiny():
    cfg = load_config(None, ["model.n_layer=1", "model.d_model=16", "model.n_head=2", "model.context=8"])
    torch.manual_seed(0)
    model = ByteGPT(cfg.model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)


def test_inner_step_is_forward_backward_hook_clip_step():
    batch = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(1))
    x, y = batch[:, :-1], batch[:, 1:]
    model_a, opt_a = _tiny()
    model_b, opt_b = _tiny()
    calls = []
    loss = inner_step(model_a, opt_a, x, y, lr=0.002, grad_clip=0.5,
                      after_backward=lambda: calls.append(next(model_a.parameters()).grad is not None))
    # the same step written out
    for group in opt_b.param_groups:
        group["lr"] = 0.002
    loss_b = model_b.loss(x, y)
    opt_b.zero_grad(set_to_none=True)
    loss_b.backward()
    torch.nn.utils.clip_grad_norm_(model_b.parameters(), 0.5)
    opt_b.step()
    assert calls == [True]  # the hook runs once, with the gradients computed
    assert torch.equal(loss, loss_b.detach()) and not loss.requires_grad
    assert opt_a.param_groups[0]["lr"] == 0.002
    for pa, pb in zip(model_a.parameters(), model_b.parameters(), strict=True):
        assert torch.equal(pa, pb)


def test_workload_from_config_steps_its_shard():
    cfg = load_config(None, ["model.n_layer=1", "model.d_model=16", "model.n_head=2", "model.context=8",
                             "learners.batch_size=2", "learners.lr=0.01", "learners.warmup_steps=2"])
    w = Workload.from_config(cfg, index=1, incarnation=0)
    assert w.tokens_per_step == 16 and set(w.params) == {n for n, _ in w.model.named_parameters()}
    with pytest.raises(RuntimeError):
        w.step(0)
    w.shard = torch.arange(200, dtype=torch.uint8)
    before = {n: p.detach().clone() for n, p in w.params.items()}
    loss = w.step(0)
    assert isinstance(loss, float) and loss > 0
    assert w.optimizer.param_groups[0]["lr"] == 0.005  # warm-up: (0 + 1) / 2 of learners.lr
    assert any(not torch.equal(before[n], p) for n, p in w.params.items())


@pytest.mark.parametrize("codec", ["fp32", "bf16", "int8", "int4", "int2"])
def test_outer_gradient_encoded_tensor_by_tensor_is_the_same_payload(codec):
    """A learner that answers several rounds at one step encodes each Δ as it takes it, one
    tensor at a time: the synchronizer decodes exactly what the whole-fragment path sends."""
    from diloco_async.codec import wire
    from diloco_async.learner.rules import encoded_outer_gradient

    gen = torch.Generator().manual_seed(3)
    base = {"b.w": torch.randn(33, 70, generator=gen), "a.bias": torch.randn(129, generator=gen),
            "c.scalar": torch.randn((), generator=gen)}
    theta = {n: t + 0.01 * torch.randn(t.shape, generator=gen) for n, t in base.items()}
    specs = {n: tuple(t.shape) for n, t in base.items()}
    meta = {"fragment": "1", "round": "4"}
    whole = wire.decode_from_bytes(wire.encode_to_bytes(outer_gradient(base, theta), codec, meta), codec, specs)
    each = wire.decode_from_bytes(wire.encoded_to_bytes(encoded_outer_gradient(base, theta, codec), codec, meta),
                                  codec, specs)
    assert whole[1] == each[1]
    assert set(whole[0]) == set(each[0]) == set(base)
    for n in base:
        assert torch.equal(whole[0][n], each[0][n]), n


def _inner_loop(option: str):
    """A one-process learner's training loop on a 1-layer model in 2 fragments, base versions 0,
    with ``option`` (``section.field=value``) set: (workload, plan, base copies, shared state, loop)."""
    from diloco_async.learner.state import Shared
    from diloco_async.learner.training import InnerLoop, StartPoint
    from diloco_async.metrics.timeline import Recorder
    from diloco_async.models import plan_of

    cfg = load_config(None, ["model.n_layer=1", "model.d_model=16", "model.n_head=2", "model.context=8",
                             "learners.batch_size=2", "synchronizer.num_fragments=2", option])
    w = Workload.from_config(cfg, index=0, incarnation=0)
    plan = plan_of(w.model, 2)
    base = {p: {n: w.params[n].detach().clone() + 0.5 for n in plan.names(p)} for p in range(2)}
    shared = Shared()
    shared.base.update({0: 0, 1: 0})
    loop = InnerLoop(cfg, shared, w, plan, Recorder(None), learner_id="learner-0", start=StartPoint(base))
    return w, plan, base, shared, loop


def test_contribution_taken_while_an_upload_waits_is_encoded_at_once(tmp_path):
    """The training thread queues the fp32 Δ when the upload queue is empty (the comms thread
    encodes it off the training thread), and encodes it itself when an upload already waits:
    a late learner answering several rounds at one step queues no pile of fp32 outer gradients."""
    from diloco_async.codec import wire

    w, plan, base, shared, loop = _inner_loop("learners.codec=int4")
    loop._contribute(0, 1)
    loop._contribute(1, 1)
    first, second = shared.upload_queue.get_nowait(), shared.upload_queue.get_nowait()
    assert first.encoded is None and set(first.delta) == set(plan.names(0))
    assert second.delta == {} and second.encoded is not None
    specs = {n: tuple(w.params[n].shape) for n in plan.names(1)}
    got, _ = wire.decode_from_bytes(wire.encoded_to_bytes(second.encoded, "int4"), "int4", specs)
    theta = {n: w.params[n].detach() for n in plan.names(1)}
    want, _ = wire.decode_from_bytes(wire.encode_to_bytes(outer_gradient(base[1], theta), "int4"), "int4", specs)
    assert all(torch.equal(got[n], want[n]) for n in specs)


def test_a_late_contribution_keeps_its_progress_and_a_folded_one_answers_its_new_round(tmp_path):
    """``rebase``: a version adopted at the boundary where the contribution in flight was answered
    ``late`` keeps all the progress (the outcome is read first); one folded into round 2 (DESIGN §3.5)
    stays in flight for round 2, which then counts as answered (no second contribution to it)."""
    from diloco_async.learner.rules import Progress
    from diloco_async.protocol.messages import VersionInfo

    w, plan, _base, shared, loop = _inner_loop("learners.adopt=rebase")
    version = VersionInfo(fragment=0, version=1, key="k", nbytes=1, sha256="0" * 64)

    def boundary_with(outcomes, progress_after_contribution):
        loop.progress[0] = Progress(4, 400, 2.0)
        loop._contribute(0, 1)
        loop.progress[0] = progress_after_contribution
        for o in outcomes:
            shared.outcomes.put(o)
        shared.adopt_queue.put((version, {n: w.params[n].detach().clone() for n in plan.names(0)}))
        return loop._adopt_arrivals()  # the boundary's first step: outcomes heard, then versions adopted

    assert boundary_with([(0, 1, "late")], Progress(6, 600, 3.0)) == [0]
    assert loop.progress[0] == Progress(6, 600, 3.0)  # nothing of it merged: all of it goes with the next one
    shared.base[0], loop.answered = 0, set()
    with shared.lock:
        shared.open_rounds[(0, 2)] = (0, 0.0)
    loop.progress[0] = Progress(4, 400, 2.0)
    loop._contribute(0, 1)
    shared.upload_queue.queue.clear()
    for o in [(0, 1, "accepted"), (0, 2, "folded")]:
        shared.outcomes.put(o)
    loop._read_outcomes()
    assert loop.in_flight[0].round_n == 2 and (0, 2) in loop.answered
    loop.in_flight.clear()  # even once its version is adopted, round 2 is not answered again
    loop._answer_rounds()
    assert shared.upload_queue.empty()
    # round 1's version adopted before the answer to its late contribution is heard: round 2 waits for it
    loop.answered, loop.progress[0] = set(), Progress(4, 400, 2.0)
    loop._contribute(0, 1)
    shared.upload_queue.queue.clear()
    shared.adopt_queue.put((VersionInfo(fragment=0, version=2, key="k", nbytes=1, sha256="0" * 64),
                            {n: w.params[n].detach().clone() for n in plan.names(0)}))
    loop.progress[0] = Progress(6, 600, 3.0)
    assert loop._adopt_arrivals() == [0] and 0 not in loop.in_flight
    with shared.lock:
        shared.open_rounds[(0, 2)] = (2, 0.0)
    loop._answer_rounds()
    assert shared.upload_queue.empty() and 0 in loop.unheard  # no second contribution to the round it may join
    shared.outcomes.put((0, 1, "late"))  # not folded after all: round 2 is answered at the next boundary
    loop._adopt_arrivals()
    loop._answer_rounds()
    assert [(j.fragment, j.round_n) for j in shared.upload_queue.queue] == [(0, 2)]


def test_heartbeat_reports_a_long_block_while_it_lasts(tmp_path):
    """A round that keeps the training thread waiting for 10 s must show as blocked in the
    heartbeats sent during it, not only in the first one after it: the synchronizer counts at
    most the seconds since the previous heartbeat (sync/learners.py), so a wait reported only at
    its end would be counted as a quarter of a second."""
    import time

    from diloco_async.learner.comms import Comms
    from diloco_async.learner.state import LearnerSlot, Shared, SyncEndpoint
    from diloco_async.storage.store import ObjectStore

    shared = Shared()
    comms = Comms(LearnerSlot("a", 0), SyncEndpoint("http://127.0.0.1:9", "token", give_up_after_s=10.0),
                  ObjectStore(f"file://{tmp_path}/s"), shared, time.monotonic())
    assert comms.heartbeat_body()["blocked_s"] == 0.0
    shared.stats.blocked_s, shared.stats.blocked_since_s = 2.0, time.time() - 10.0  # a block began 10 s ago
    assert comms.heartbeat_body()["blocked_s"] == pytest.approx(12.0, abs=0.5)
    shared.stats.blocked_s, shared.stats.blocked_since_s = 12.0, None  # it ended
    assert comms.heartbeat_body()["blocked_s"] == 12.0


def test_an_announcement_is_retried_with_the_projects_one_backoff(tmp_path, monkeypatch):
    """A failed announcement is sent again (same body, same update id) after the pauses of
    :func:`synchronizer_backoff` (diloco_async.storage.retry.Backoff from 0.1 s doubling to 5 s, jittered to
    half or more of each delay), until it is acknowledged; the pauses are recorded, not slept."""
    import asyncio
    import random

    import aiohttp

    from diloco_async.learner import uploads
    from diloco_async.learner.state import Shared, UploadJob
    from diloco_async.storage.retry import Backoff
    from diloco_async.storage.store import ObjectStore

    class Client:
        def __init__(self) -> None:
            self.bodies: list[dict] = []

        async def announce(self, body: dict) -> dict:
            self.bodies.append(body)
            if len(self.bodies) <= 7:
                raise aiohttp.ClientConnectionError("synchronizer down")
            return {"status": "accepted", "reason": ""}

    class Paused:
        def __init__(self) -> None:
            self.pauses: list[float] = []

        async def sleep(self, pause_s: float) -> None:
            self.pauses.append(pause_s)

    up = uploads.Uploads("a", 0, ObjectStore(f"file://{tmp_path}/s"), Shared())
    paused = Paused()
    monkeypatch.setattr(uploads, "asyncio", paused)
    monkeypatch.setattr(uploads, "synchronizer_backoff", lambda: Backoff(0.1, 5.0, rng=random.Random(1)))
    client, body = Client(), {"update_id": "u1"}
    job = UploadJob(fragment=0, round_n=1, base_version=0, c_steps=1, c_tokens=1, compute_s=0.0, delta={})
    assert asyncio.run(up._announce(client, job, body)).status == "accepted"
    assert client.bodies == [body] * 8
    same = Backoff(0.1, 5.0, rng=random.Random(1))
    assert paused.pauses == [same.next_pause_s() for _ in range(7)]
    assert paused.pauses != [0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 5.0]  # jittered, not in step with other learners


def test_backoff_doubles_to_its_cap_jittered_and_starts_over_on_reset():
    import random

    from diloco_async.storage.retry import Backoff

    backoff = Backoff(0.1, 5.0, rng=random.Random(0))
    pauses = [backoff.next_pause_s() for _ in range(8)]
    for pause_s, delay_s in zip(pauses, [0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0], strict=True):
        assert 0.5 * delay_s <= pause_s <= delay_s
    assert len(set(pauses)) == len(pauses)  # jittered: no two learners (or tries) in step
    backoff.reset()
    assert 0.05 <= backoff.next_pause_s() <= 0.1
    with pytest.raises(ValueError, match="backoff delays must be >= 0"):
        Backoff(-1.0, 5.0)


def test_an_ack_naming_another_round_tells_the_training_thread_it_was_folded(tmp_path):
    """An announcement acknowledged for a later round (DESIGN §3.5), ``accepted`` or, for a retry
    whose first answer was lost, ``duplicate``, reaches the training thread as its own outcome then
    ``folded`` into that round; one answered for its own round, or late, as that outcome alone."""
    from diloco_async.learner import uploads
    from diloco_async.learner.state import Shared, UploadJob
    from diloco_async.storage.store import ObjectStore

    up = uploads.Uploads("a", 0, ObjectStore(f"file://{tmp_path}/s"), Shared())
    job = UploadJob(fragment=0, round_n=1, base_version=0, c_steps=1, c_tokens=1, compute_s=0.0, delta={})
    for status, joined in [("accepted", 2), ("duplicate", 2), ("accepted", 1), ("late", None), ("duplicate", None)]:
        up._report(job, status, joined)
    told = []
    while not up.shared.outcomes.empty():
        told.append(up.shared.outcomes.get_nowait())
    assert told == [(0, 1, "accepted"), (0, 2, "folded"), (0, 1, "duplicate"), (0, 2, "folded"),
                    (0, 1, "accepted"), (0, 1, "late"), (0, 1, "duplicate")]
