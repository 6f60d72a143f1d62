"""Error feedback for compressed uploads (``learners.error_feedback``; DESIGN §6 "Error feedback").

The residual math (codec/feedback.py), the learner's holder and when it keeps a residual
(learner/feedback.py), the upload path with a real file store (learner/uploads.py), the residual
through a spooled inner state and back (learner/training.py, learner/process.py), and the config's
refusals (config/feedback.py, config/parallelism.py).
"""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
import torch

from diloco_async.codec import wire
from diloco_async.codec.feedback import compensate, residual_bound
from diloco_async.config.schema import Config, config_hash, load_config
from diloco_async.learner.feedback import ErrorFeedback
from diloco_async.learner.state import Shared, UploadJob

SHAPES = {"w": (8, 64), "b": (64,)}


def _rounds(k: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """k outer gradients with a steady drift under int2's threshold beside a few large values:
    each 64-element block has one element of 1.0, and every other element is small (0.05 to 0.3),
    so int2 (levels {-1, 0, +1}·absmax) rounds it to 0 every round without feedback."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(k):
        d = {}
        for name, shape in SHAPES.items():
            t = 0.05 + 0.25 * torch.rand(shape, generator=g)
            t.view(-1, 64)[:, 0] = 1.0
            d[name] = t
        out.append(d)
    return out


def _run(rounds: list[dict[str, torch.Tensor]], codec: str, feedback: bool) -> tuple[dict, dict, dict]:
    """(Σ decoded uploads, Σ true Δ, last residual) over ``rounds``."""
    sent_sum = {n: torch.zeros(s) for n, s in SHAPES.items()}
    true_sum = {n: torch.zeros(s) for n, s in SHAPES.items()}
    residual = None
    for delta in rounds:
        for n, t in delta.items():
            true_sum[n] += t
        work = {n: t.clone() for n, t in delta.items()}
        if feedback:
            encoded, residual = compensate(work, residual, codec)
        else:
            encoded = wire.encode(work, codec)
        sent = wire.decode(encoded, codec, SHAPES)
        for n in SHAPES:
            sent_sum[n] += sent[n]
    return sent_sum, true_sum, residual or {}


def _gap(a: dict, b: dict) -> float:
    return max(float((a[n] - b[n]).abs().max()) for n in a)


def test_int2_with_feedback_tracks_the_true_sum_within_one_codec_step_and_drifts_without():
    """Over 40 rounds of int2, the decoded uploads' sum lags the true Δ's sum by at most one codec
    step (the block's scale, here at most the largest |c|, about 1.3) with error feedback; without
    it the small elements (rounded to 0 every round) drift by 40 × their size, far past one step."""
    rounds = _rounds(40)
    sent, true, residual = _run(rounds, "int2", feedback=True)
    step = max(float(t.abs().max()) for d in rounds for t in d.values()) + residual_bound(residual)
    assert _gap(sent, true) <= step
    assert _gap(sent, true) == pytest.approx(residual_bound(residual), rel=1e-4)  # Σ sent = Σ Δ − e_k
    sent_plain, _, _ = _run(rounds, "int2", feedback=False)
    assert _gap(sent_plain, true) > 5 * step  # 40 rounds of 0.05 to 0.3 each, never sent


@pytest.mark.parametrize("codec", ["bf16", "int8", "int4", "int2"])
def test_the_decoded_sum_plus_the_residual_is_the_true_sum_for_every_lossy_codec(codec):
    """Σ decode(encode(Δ_i + e_{i-1})) + e_k = Σ Δ_i (telescoping), to fp32 rounding, for each
    lossy codec; the residual left is within one step of that codec."""
    rounds = _rounds(12, seed=3)
    sent, true, residual = _run(rounds, codec, feedback=True)
    for n in SHAPES:
        torch.testing.assert_close(sent[n] + residual[n], true[n], rtol=0, atol=1e-4)
    largest = max(float(t.abs().max()) for d in rounds for t in d.values())
    step = {"bf16": largest / 128, "int8": largest / 127, "int4": largest / 7, "int2": largest}[codec]
    assert residual_bound(residual) <= step


def test_a_codec_change_keeps_the_residual():
    """A link-bound learner steps int8 → int2 → int4: the residual is fp32 in Δ's own domain, so
    the decoded sum plus the last residual is still the true sum."""
    rounds = _rounds(9, seed=5)
    residual, sent_sum = None, {n: torch.zeros(s) for n, s in SHAPES.items()}
    for i, delta in enumerate(rounds):
        codec = ("int8", "int2", "int4")[i % 3]
        encoded, residual = compensate({n: t.clone() for n, t in delta.items()}, residual, codec)
        for n, t in wire.decode(encoded, codec, SHAPES).items():
            sent_sum[n] += t
    for n in SHAPES:
        torch.testing.assert_close(sent_sum[n] + residual[n], sum(d[n] for d in rounds), rtol=0, atol=1e-4)


def test_compensate_names_a_residual_of_the_wrong_shape():
    with pytest.raises(ValueError, match=r"residual of 'b' has shape \(3,\), the outer gradient \(64,\)"):
        compensate({"b": torch.ones(64)}, {"b": torch.zeros(3)}, "int2")


def test_the_holder_keeps_a_residual_only_for_an_upload_that_was_taken():
    """put_made makes the new residual current; a refused or late contribution gives the one before
    back; one that a newer upload of the fragment already built on is kept."""
    fb = ErrorFeedback("a")
    _, r1 = fb.encode(0, {"b": torch.full((64,), 0.3).index_fill_(0, torch.tensor([0]), 1.0)}, "int2")
    before = fb.put_made(0, r1)
    assert before is None
    fb.settle(0, r1, before, "accepted")
    assert fb.tensors()["residual/0/b"] is r1["b"]
    _, r2 = fb.encode(0, {"b": torch.full((64,), 0.2)}, "int2")
    before2 = fb.put_made(0, r2)
    fb.settle(0, r2, before2, "late")
    assert fb.tensors()["residual/0/b"] is r1["b"] and fb.reverted == 1
    _, r3 = fb.encode(0, {"b": torch.full((64,), 0.2)}, "int2")
    before3 = fb.put_made(0, r3)
    _, r4 = fb.encode(0, {"b": torch.full((64,), 0.1)}, "int2")
    fb.put_made(0, r4)
    fb.settle(0, r3, before3, "rejected")  # r4 built on r3 already
    assert fb.tensors()["residual/0/b"] is r4["b"] and fb.kept == 1


class _Client:
    def __init__(self, statuses: list[str]) -> None:
        self.statuses, self.bodies = statuses, []

    async def announce(self, body: dict) -> dict:
        self.bodies.append(body)
        return {"status": self.statuses.pop(0), "reason": "test"}


def _uploads(tmp_path, statuses: list[str]):
    from diloco_async.learner.uploads import Uploads
    from diloco_async.protocol.messages import JoinResponse
    from diloco_async.storage.store import ObjectStore

    shared = Shared()
    shared.feedback = ErrorFeedback("a")
    shared.join_response = JoinResponse.model_construct(run_id="r1")
    store = ObjectStore(f"file://{tmp_path}/s")
    up = Uploads("a", 0, store, shared)
    up.configure(store, "int2", 30.0)
    return up, shared, store, _Client(statuses)


def _get(store, body: dict) -> bytes:
    from diloco_async.storage.store import ObjectRef

    return store.get(ObjectRef(body["key"], body["nbytes"], body["sha256"]))


def _job(delta: dict[str, torch.Tensor], n: int) -> UploadJob:
    return UploadJob(0, n, 0, 1, 1, 0.0, {k: v.clone() for k, v in delta.items()})


def test_uploads_send_delta_plus_residual_and_keep_it_only_when_put_and_taken(tmp_path):
    """Through Uploads with a real file store: the bytes put are decode(encode(Δ + e)); an accepted
    upload leaves e' = Δ + e − sent; a late one leaves e as it was; a put that fails leaves it too."""
    up, shared, store, client = _uploads(tmp_path, ["accepted", "late", "accepted"])
    delta = _rounds(1)[0]
    specs = {n: tuple(t.shape) for n, t in delta.items()}
    asyncio.run(up._upload_and_announce(client, _job(delta, 1)))
    first, _ = wire.decode_from_bytes(_get(store, client.bodies[0]), "int2", specs)
    residual = {k.split("/")[-1]: t for k, t in shared.feedback.tensors().items()}
    for n in specs:
        torch.testing.assert_close(residual[n], delta[n] - first[n])
    asyncio.run(up._upload_and_announce(client, _job(delta, 2)))  # late: sent Δ + e, e kept
    second, _ = wire.decode_from_bytes(_get(store, client.bodies[1]), "int2", specs)
    want = wire.decode(wire.encode({n: delta[n] + residual[n] for n in specs}, "int2"), "int2", specs)
    assert all(torch.equal(second[n], want[n]) for n in specs)
    assert all(t is residual[k.split("/")[-1]] for k, t in shared.feedback.tensors().items())

    def broken_put(key, data):
        raise OSError("disk gone")

    up.store.put = broken_put
    asyncio.run(up._upload_and_announce(client, _job(delta, 3)))
    assert shared.outcomes.get_nowait()[2] == "accepted" and shared.outcomes.get_nowait()[2] == "late"
    assert shared.outcomes.get_nowait() == (0, 3, "failed")
    assert all(t is residual[k.split("/")[-1]] for k, t in shared.feedback.tensors().items())


def test_the_residual_restored_from_a_spooled_inner_state_gives_the_same_next_upload(tmp_path, caplog):
    """The training thread spools the residuals with the inner state, the comms thread writes it to
    the store, and a new incarnation restores them: its next upload of the same Δ is exactly
    the one the first incarnation would have made (the same encoded tensors). An incarnation with
    no saved state starts from zero residuals and says so in the log."""
    from diloco_async.inner.workload import Workload
    from diloco_async.learner.process import Learner
    from diloco_async.learner.state import LearnerSlot, SpooledState, SyncEndpoint
    from diloco_async.learner.training import InnerLoop, StartPoint
    from diloco_async.metrics.timeline import Recorder
    from diloco_async.models import plan_of
    from diloco_async.storage.checkpoint import latest_state, write_state_file
    from diloco_async.storage.store import ObjectStore

    cfg = load_config(None, ["model.n_layer=1", "model.d_model=16", "model.n_head=2", "model.context=8",
                             "learners.batch_size=2", "synchronizer.num_fragments=2", "learners.codec=int2",
                             "learners.error_feedback=true", "learners.checkpoint_every_s=0.001"])
    w = Workload.from_config(cfg, index=0, incarnation=0)
    plan = plan_of(w.model, 2)
    base = {p: {n: w.params[n].detach().clone() + 0.5 for n in plan.names(p)} for p in range(2)}
    shared = Shared()
    shared.feedback = fb = ErrorFeedback("a")
    shared.base.update({0: 0, 1: 0})
    delta = {n: torch.randn(w.params[n].shape, generator=torch.Generator().manual_seed(1)) for n in plan.names(0)}
    _, residual = fb.encode(0, {n: t.clone() for n, t in delta.items()}, "int2")
    fb.put_made(0, residual)
    loop = InnerLoop(cfg, shared, w, plan, Recorder(None), learner_id="a", start=StartPoint(base))
    loop.last_state_s = time.monotonic() - 1.0
    loop._maybe_save_inner_state()
    loop.spooler.join()
    spooled = shared.upload_queue.get(timeout=30)
    assert isinstance(spooled, SpooledState)
    store = ObjectStore(f"file://{tmp_path}/s")
    write_state_file(store, "learners/a", 1, spooled.path, {"inner": spooled.meta})
    expected, _ = fb.encode(0, {n: t.clone() for n, t in delta.items()}, "int2")

    saved = latest_state(store, "learners/a")
    again = Learner(LearnerSlot("a", 0, incarnation=1), SyncEndpoint("http://127.0.0.1:9", "t"), store)
    again._restore_residuals(saved.tensors, saved.seq)
    assert not any(k.startswith("residual/") for k in saved.tensors)  # taken out of the inner state
    got, _ = again.shared.feedback.encode(0, {n: t.clone() for n, t in delta.items()}, "int2")
    assert set(got) == set(expected) and all(torch.equal(got[k], expected[k]) for k in expected)  # same payload

    fresh = Learner(LearnerSlot("a", 0, incarnation=2), SyncEndpoint("http://127.0.0.1:9", "t"), store)
    with caplog.at_level(logging.WARNING, logger="diloco.learner"):
        fresh._restore_residuals(None, None)
    assert fresh.shared.feedback.tensors() == {}
    assert "a (incarnation 2) has no error-feedback residual to restore (no saved inner state)" in caplog.text


def test_error_feedback_with_only_the_fp32_codec_is_refused_naming_the_values():
    """fp32 drops nothing: error feedback would be a silent no-op, so the recipe is refused (not
    warned about) before anything starts; with a lossy step-down in link_codecs it has work to do."""
    with pytest.raises(ValueError, match=r"learners.error_feedback = true with learners.codec = 'fp32' and "
                                         r"learners.link_codecs = \[\]: the fp32 codec drops nothing"):
        load_config(None, ["learners.codec=fp32", "learners.error_feedback=true"])
    assert load_config(None, ["learners.codec=fp32", "learners.link_codecs=['int4']",
                              "learners.error_feedback=true"]).learners.error_feedback


def test_error_feedback_with_a_sharded_learner_group_is_refused():
    with pytest.raises(ValueError, match=r"learners.error_feedback=true: the residual of a sharded group"):
        load_config(None, ["learners.codec=int2", "learners.error_feedback=true", "learners.parallelism=fsdp",
                           "learners.nproc_per_learner=2", "learners.checkpoint_every_s=0"])


def test_error_feedback_off_hashes_as_before_it_existed_and_on_changes_the_hash():
    from diloco_async.config.schema import _training_dict

    off = Config()
    assert off.public_dict()["learners"]["error_feedback"] is False
    assert "error_feedback" not in _training_dict(off.public_dict())["learners"]
    on = load_config(None, ["learners.codec=int2", "learners.error_feedback=true"])
    plain = load_config(None, ["learners.codec=int2"])
    assert config_hash(on) != config_hash(plain)
