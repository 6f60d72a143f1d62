"""Leases at the synchronizer (diloco_async/sync/slices.py, config/slices.py; DESIGN §5.2): the
refusals before anything starts, lease requests, announcements checked against the leases (not
held: refused; too many tokens: clamped), lost and restarted learners, the last accounting at a
stop, and the ledger through a checkpoint document."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from diloco_async.config.schema import Config, config_hash, load_config
from diloco_async.learner.slices import SliceFeed
from diloco_async.policy.rounds import RoundState
from diloco_async.protocol.messages import Announcement, JoinRequest, LeaseRequest
from diloco_async.sync.learners import LearnerRegistry
from diloco_async.sync.reporting import Reporter
from diloco_async.sync.slices import SliceDesk
from diloco_async.sync.state import Contribution, Round

LEASES = ["data.slices=true", "learners.checkpoint_every_s=0"]


def _cfg(*more: str) -> Config:
    return load_config(None, [*LEASES, *more])


def test_leases_off_by_default_and_out_of_the_config_hash() -> None:
    plain = load_config(None, [])
    assert plain.data.slices is False
    assert config_hash(plain) == config_hash(load_config(None, ["data.slice_tokens=4096"]))  # off: not hashed
    assert config_hash(plain) != config_hash(_cfg())


def test_refused_before_anything_starts_naming_the_value() -> None:
    cfg = _cfg()
    per_step = cfg.learners.batch_size * cfg.model.context
    refusal = rf"data.slice_tokens={per_step - 1}: smaller than one batch .*{per_step} tokens"
    with pytest.raises(ValueError, match=refusal):
        _cfg(f"data.slice_tokens={per_step - 1}")
    _cfg(f"data.slice_tokens={per_step}")  # exactly one batch: fine
    with pytest.raises(ValueError, match=r"data.slice_tokens: Input should be greater than or equal to 1 \(got 0\)"):
        _cfg("data.slice_tokens=0")
    with pytest.raises(ValueError, match="synchronizer.shards=2: the slice ledger has one owner"):
        _cfg("synchronizer.shards=2", "synchronizer.num_fragments=2")
    with pytest.raises(ValueError, match="learners.checkpoint_every_s=30: a restarted learner"):
        load_config(None, ["data.slices=true"])


def _desk(n_slices: int = 6):
    clock = SimpleNamespace(t=10.0)
    report = Reporter(0.0, "run", clock=lambda: clock.t)
    cfg = _cfg()
    desk = SliceDesk.build(cfg, lambda: clock.t, report, train_tokens=n_slices * cfg.data.slice_tokens + 1)
    reg = LearnerRegistry()
    for lid in ("a", "b"):
        reg.join(JoinRequest(learner_id=lid), 0.0, None)
    return desk, reg, report, clock


def _ann(lid: str, slices: list[int], c_tokens: int, p: int = 0) -> Announcement:
    return Announcement(learner_id=lid, fragment=p, round_n=1, base_version=0, c_steps=1, c_tokens=c_tokens,
                        compute_s=1.0, key=f"k/{lid}", nbytes=1, sha256="0" * 64, codec="fp32", update_id=f"u{lid}{p}",
                        slices=slices)


def _table(*contribs: Announcement) -> dict:
    """The open rounds: one holding ``contribs`` (none when there are none)."""
    rnd = Round(RoundState(0, 1, 0.0, 1))
    for ann in contribs:
        rnd.contributions[ann.learner_id] = Contribution(ann)
    return {(0, 1): rnd} if contribs else {}


def test_lease_requests_release_and_revoke() -> None:
    desk, reg, _report, _clock = _desk()
    n = desk.ledger.slice_tokens
    got = desk.on_lease(LeaseRequest(learner_id="a", want=2), reg, running=True)
    assert got.slices == [(0, 0, n), (1, n, n)] and got.revoked == [] and got.epoch == 0
    stranger = desk.on_lease(LeaseRequest(learner_id="zed", want=2, held=[0]), reg, running=True)
    assert stranger.slices == [] and stranger.revoked == [0]  # not a learner of this run
    stale = desk.on_lease(LeaseRequest(learner_id="a", incarnation=1, want=2, held=[0]), reg, running=True)
    assert stale.slices == [] and stale.revoked == [0]  # not this incarnation: it must join first
    after_stop = desk.on_lease(LeaseRequest(learner_id="b", want=2), reg, running=False)
    assert after_stop.slices == []
    back = desk.on_lease(LeaseRequest(learner_id="a", want=0, release=[1], held=[0, 1, 5]), reg, running=True)
    assert back.revoked == [1, 5]  # 1 is being returned, 5 was never a's
    desk.sweep(_table(), stopped=False, registry=reg)
    assert desk.figures()["slices_requeued"] == 1


def test_announcements_not_held_refused_and_tokens_clamped() -> None:
    desk, reg, report, _clock = _desk()
    n = desk.ledger.slice_tokens
    desk.on_lease(LeaseRequest(learner_id="a", want=2), reg, running=True)
    desk.on_lease(LeaseRequest(learner_id="b", want=1), reg, running=True)
    ann, why = desk.check_announcement(_ann("a", [0, 2], 10))
    assert why == "slices [2] are not leased to a"
    ann, why = desk.check_announcement(_ann("a", [0, 1], 2 * n))
    assert why is None and ann.c_tokens == 2 * n  # within its slices: untouched
    ann, why = desk.check_announcement(_ann("a", [0], 3 * n))
    assert why is None and ann.c_tokens == n and report.clamped_by_reason["c_tokens_over_slices"] == 1
    ann, why = desk.check_announcement(_ann("b", [], 50))
    assert why is None and ann.c_tokens == 0  # names no slice: no tokens to weigh
    desk.merged("a", [0])
    assert desk.figures()["slices_trained"] == 1 and desk.figures()["tokens_trained"] == n


def test_lost_learner_leases_return_after_its_contributions_settle() -> None:
    desk, reg, _report, clock = _desk()
    desk.on_lease(LeaseRequest(learner_id="a", want=2), reg, running=True)
    desk.on_lease(LeaseRequest(learner_id="b", want=1), reg, running=True)
    named = _ann("a", [0], 10)
    desk.check_announcement(named)
    assert len(reg.mark_lost(1e9, 1.0)) == 2  # a and b silent: lost
    clock.t = desk.lapse_s - 1.0  # not silent for heartbeat_timeout_s yet (a learner restored from a checkpoint)
    desk.sweep(_table(named), stopped=False, registry=reg)
    assert desk.figures()["slices_requeued"] == 0 and desk.figures()["slices_leased_now"] == 3
    clock.t = desk.lapse_s + 1.0
    desk.sweep(_table(named), stopped=False, registry=reg)
    f = desk.figures()
    assert f["slices_requeued"] == 2 and f["slices_leased_now"] == 1  # 0 waits for a's contribution in flight
    desk.sweep(_table(), stopped=False, registry=reg)  # that contribution was thrown away
    f = desk.figures()
    assert f["slices_requeued"] == 3 and f["slices_thrown_away"] == 1 and f["slices_leased_now"] == 0


def test_a_restarted_learner_gives_back_its_old_leases() -> None:
    desk, reg, _report, _clock = _desk()
    desk.on_lease(LeaseRequest(learner_id="a", want=2), reg, running=True)
    reg.join(JoinRequest(learner_id="a", incarnation=1), 1.0, None)
    got = desk.on_lease(LeaseRequest(learner_id="a", incarnation=1, want=1), reg, running=True)
    desk.sweep(_table(), stopped=False, registry=reg)
    assert got.slices[0][0] == 2 and desk.ledger.held_by("a") == [2]
    assert desk.figures()["slices_requeued"] == 2


def test_stop_ends_every_lease_once_no_round_is_left() -> None:
    desk, reg, _report, _clock = _desk()
    desk.on_lease(LeaseRequest(learner_id="a", want=2), reg, running=True)
    desk.merged("a", [0])
    named = _ann("a", [1], 10)
    desk.sweep(_table(named), stopped=True, registry=reg)  # a round still drains: nothing ends yet
    assert desk.figures()["slices_leased_now"] == 2
    desk.sweep(_table(), stopped=True, registry=reg)
    f = desk.figures()
    figures = (f["slices_leased_now"], f["slices_trained"], f["slices_requeued"], f["slices_never_reached"])
    assert figures == (0, 1, 1, 4)
    states = desk.ledger.states()
    assert states == {"never_reached": [2, 3, 4, 5], "leased": [], "trained": [0], "returned": [1]}


def test_ledger_through_a_checkpoint_document_and_versions_after_it() -> None:
    desk, reg, _report, _clock = _desk()
    desk.on_lease(LeaseRequest(learner_id="a", want=3), reg, running=True)
    desk.merged("a", [0])
    doc = json.loads(json.dumps(desk.to_json()))
    fresh, _, _, _ = _desk()
    fresh.restore(doc, trained_since=[1])  # slice 1 merged into a version published after the checkpoint
    assert fresh.ledger.states()["trained"] == [0, 1] and fresh.ledger.held_by("a") == [0, 1, 2]
    assert fresh.incarnations == {"a": 0}
    other, _, _, _ = _desk(n_slices=7)
    with pytest.raises(ValueError, match="6 slices of 65536 tokens, this run 7 of 65536"):
        other.restore(doc)


def test_the_learner_feed_names_hands_back_and_prefetches() -> None:
    feed = SliceFeed(fragments=2)
    assert feed.take(10) is None and feed.starved == 1
    body = feed.request_body("a", 0)
    assert body == {"learner_id": "a", "incarnation": 0, "want": 2, "release": [], "held": []}
    assert feed.answered({"slices": [[3, 300, 20], [7, 700, 20]], "revoked": [], "epoch": 0}) == 2
    assert feed.request_body("a", 0) is None  # one in hand (to be), one ahead
    assert feed.take(10) == (3, 300) and feed.take(10) == (3, 310)
    feed.trained(3, 10)
    assert feed.request_body("a", 0)["want"] == 1  # slice 3 is used up: the next is asked for while 7 trains
    assert feed.take(10) == (7, 700)
    feed.trained(7, 10)
    assert feed.named(0, 1) == [3, 7] and feed.named(1, 1) == [3, 7]
    feed.settled(0, 1)
    feed.adopted(0, progress_kept=False)
    assert feed.named(0, 2) == [] and feed.to_release == []  # fragment 1's next contribution still names 3
    feed.settled(0, 2)
    feed.adopted(1, progress_kept=False)
    assert feed.to_release == []  # fragment 1's contribution naming 3 is not answered yet
    feed.settled(1, 1)
    assert feed.to_release == [3]  # finished and named by nothing any more: handed back
    feed.answered({"slices": [], "revoked": [7], "epoch": 1})
    assert feed.take(10) is None and feed.epoch == 1  # 7 is no longer ours


def test_the_merge_log_names_only_the_slices_a_merge_trained() -> None:
    """A contribution merged at direction factor 0 moved nothing: its slices stay untrained in the
    ledger (another learner may lease and train them), so the merge log must not name them as trained."""
    desk, reg, _report, _clock = _desk()
    desk.on_lease(LeaseRequest(learner_id="a", want=1), reg, running=True)
    weighted, unweighted = Contribution(_ann("a", [0], 10)), Contribution(_ann("b", [3], 10))
    assert weighted.merge_record(0.5)["slices"] == [0] and weighted.merge_record(0.5)["direction_factor"] == 0.5
    rec = unweighted.merge_record(0.0)
    assert "slices" not in rec and rec["slices_untrained"] == [3] and rec["direction_factor"] == 0.0
    assert {"slices", "slices_untrained"}.isdisjoint(Contribution(_ann("a", [], 0)).merge_record())  # named none


def test_the_merge_log_names_the_epoch_each_slice_was_leased_in() -> None:
    """Across an epoch's end a learner may still hold a slice of the last epoch (trained there): the
    merge log says which epoch each named slice belongs to, so that a slice trained once per epoch is
    not read as trained twice."""
    desk, reg, _report, _clock = _desk(n_slices=2)
    desk.on_lease(LeaseRequest(learner_id="a", want=2), reg, running=True)
    desk.merged("a", [0, 1])
    desk.ledger.release("a", [0])
    desk.ledger.sweep([])
    assert desk.on_lease(LeaseRequest(learner_id="b", want=1), reg, running=True).epoch == 1  # b leases 0 again
    assert desk.lease_epochs([0, 1]) == [1, 0]  # 0: b's lease of epoch 1; 1: a's of epoch 0
    assert Contribution(_ann("a", [1], 10)).merge_record(1.0, None, [0])["slice_epochs"] == [0]
    assert "slice_epochs" not in Contribution(_ann("a", [1], 10)).merge_record(1.0)
    off = SliceDesk(None, lambda: 0.0, _report)
    assert off.lease_epochs([0]) is None


def test_a_contribution_waiting_for_its_next_round_keeps_its_slices_leased() -> None:
    """A late contribution waiting for the round that opens next (DESIGN §3.5) may still be merged:
    the lease of a slice it names does not end while it waits, whatever happened to its learner."""
    desk, reg, _report, clock = _desk()
    desk.on_lease(LeaseRequest(learner_id="a", want=1), reg, running=True)
    waiting = _ann("a", [0], 10)
    desk.check_announcement(waiting)
    reg.mark_lost(1e9, 1.0)
    clock.t = desk.lapse_s + 1.0
    desk.sweep(_table(), stopped=False, registry=reg, waiting=[Contribution(waiting)])
    assert desk.figures()["slices_requeued"] == 0 and desk.figures()["slices_leased_now"] == 1
    desk.sweep(_table(), stopped=False, registry=reg)  # it was merged or abandoned meanwhile
    assert desk.figures()["slices_requeued"] == 1
