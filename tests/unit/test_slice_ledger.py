"""The slice ledger (diloco_async/policy/slices.py; DESIGN §5.2): every transition, epochs, the
JSON round trip, bad input, and what holds for any order of leases, merges, releases and losses."""

from __future__ import annotations

import json
import random

import pytest

from diloco_async.config.schema import load_config
from diloco_async.learner.slices import PREFETCH_SLICES
from diloco_async.policy.slices import (
    LEASED,
    NEVER_REACHED,
    RETURNED,
    SLICES_BESIDE_FINISHED,
    TRAINED,
    SliceLedger,
    check_corpus_slices,
    slice_count,
    slices_needed,
)


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        self.t += 1.0
        return self.t


def test_slice_count_and_bad_sizes() -> None:
    assert slice_count(1001, 100) == 10  # the last token is only a target
    assert slice_count(1000, 100) == 9
    with pytest.raises(ValueError, match="data.slice_tokens=0"):
        slice_count(1000, 0)
    with pytest.raises(ValueError, match="data.slice_tokens=5000 is larger than the 1000 training tokens"):
        slice_count(1000, 5000)
    with pytest.raises(ValueError, match="n_slices=0"):
        SliceLedger(0, 10)
    with pytest.raises(ValueError, match="data.slice_tokens=0"):
        SliceLedger(3, 0)
    with pytest.raises(ValueError, match="a lease of -1 slices"):
        SliceLedger(3, 10).lease("a", -1, 0.0)
    with pytest.raises(ValueError, match="slice 3 outside"):
        SliceLedger(3, 10).tokens_of(3)


def test_a_corpus_the_learners_could_hold_whole_is_refused() -> None:
    """3 learners of 8 x 32 tokens a step, H = 8: each holds the 2 slices of 1,024 tokens it trains
    over H steps until every fragment's contribution named them, and the one in hand and the next:
    12 slices. With 11 every slice could be held with none left to step on (the run stalled without
    a word, a new-user helper found), so it is refused before anything starts."""
    cfg = load_config(None, ["data.slices=true", "learners.checkpoint_every_s=0", "learners.count=3",
                             "learners.batch_size=8", "model.context=32", "synchronizer.sync_every=8",
                             "data.slice_tokens=1024"])
    assert SLICES_BESIDE_FINISHED == PREFETCH_SLICES + 1  # the one in hand and those the learner leases ahead
    assert slices_needed(cfg) == 3 * (2 + 2)
    assert check_corpus_slices(cfg, 12 * 1024 + 1) == 12
    with pytest.raises(ValueError, match=r"data.slice_tokens=1024: the 12,288 training tokens make 11 slices, "
                                         r"fewer than the 12 that 3 learners can hold at once"):
        check_corpus_slices(cfg, 12 * 1024)
    with pytest.raises(ValueError, match="data.slice_tokens=1024 is larger than the 1000 training tokens"):
        check_corpus_slices(cfg, 1000)


def test_leases_fresh_slices_in_stream_order_then_none() -> None:
    led, clock = SliceLedger(5, 64), Clock()
    assert led.lease("a", 2, clock()) == [0, 1]
    assert led.lease("b", 0, clock()) == []
    assert led.lease("b", 2, clock()) == [2, 3]
    assert led.tokens_of(3) == (192, 64)
    assert led.held_by("a") == [0, 1] and led.held_by("b") == [2, 3]
    assert led.leases[0].at_s == 101.0 and led.leases[2].at_s == 103.0
    assert led.states()["never_reached"] == [4] and led.states()["leased"] == [0, 1, 2, 3]
    assert led.lease("c", 3, clock()) == [4]  # nothing trained: no new epoch, nothing more
    assert led.lease("c", 1, clock()) == [] and led.epoch == 0


def test_merge_trains_held_slices_only_and_once() -> None:
    led = SliceLedger(4, 10)
    led.lease("a", 2, 0.0)
    led.lease("b", 1, 0.0)
    assert led.merged("a", [0]) == [0]
    assert led.merged("a", [0, 1]) == [1]  # slice 0 stays trained under the same lease
    assert led.merged("a", [2]) == []  # b's: never trained by a's merge
    assert led.merged("a", [3]) == []  # nobody's
    assert led.counts["merged_not_held"] == 2 and led.counts["trained"] == 2
    assert led.states()["trained"] == [0, 1] and led.states()["leased"] == [2]
    assert led.held_by("a") == [0, 1]  # still held: a's contributions of other fragments may name them
    assert led.not_held("a", [0, 1, 2, 3]) == [2, 3]


def test_release_waits_for_contributions_in_flight_then_returns() -> None:
    led = SliceLedger(4, 10)
    led.lease("a", 3, 0.0)
    led.named("a", [1])
    led.merged("a", [0])
    assert led.release("a", [0, 1, 2, 3]) == [0, 1, 2]  # 3 is not a's
    assert led.not_held("a", [0, 1, 2]) == [0, 1, 2]  # releasing: no longer announced by a
    assert led.sweep(in_flight=[1]) == [0, 2]  # slice 1 is named by a contribution still in a round
    assert 0 not in led.leases and led.state[0] == TRAINED  # trained: the lease just ended
    assert led.state[2] == RETURNED and led.state[1] == LEASED
    assert led.merged("a", [1]) == [1]  # that contribution merged after all: trained, never returned
    assert led.sweep(in_flight=[]) == [1] and led.state[1] == TRAINED
    assert led.counts["returned"] == 1 and led.counts["thrown_away"] == 0  # 2 was never named
    assert led.lease("b", 2, 0.0) == [2, 3]  # the returned one first


def test_thrown_away_slice_returns_named_and_counted() -> None:
    led = SliceLedger(3, 10)
    led.lease("a", 1, 0.0)
    led.named("a", [0])  # announced, then late / rejected / zero weight: never merged
    assert led.learner_lost("a") == [0]
    assert led.releasing() and led.sweep([]) == [0]
    f = led.figures()
    figures = (f["slices_thrown_away"], f["tokens_thrown_away"], f["slices_requeued"], f["tokens_requeued"])
    assert figures == (1, 10, 1, 10)
    assert not led.releasing()
    assert led.lease("b", 1, 0.0) == [0] and led.leases[0].learner == "b" and not led.leases[0].named


def test_lost_learner_returns_everything_it_holds() -> None:
    led = SliceLedger(6, 10)
    led.lease("a", 3, 0.0)
    led.lease("b", 2, 0.0)
    led.merged("a", [0])
    assert led.learner_lost("a") == [0, 1, 2]
    led.sweep([])
    assert led.states() == {"never_reached": [5], "leased": [3, 4], "trained": [0], "returned": [1, 2]}
    assert led.learner_lost("nobody") == []


def test_pool_exhausted_starts_the_next_epoch() -> None:
    led = SliceLedger(3, 10)
    led.lease("a", 3, 0.0)
    led.merged("a", [0, 1])
    led.release("a", [0, 1])
    led.sweep([])
    assert led.lease("b", 1, 0.0) == [0]  # pool empty, slices trained: epoch 1, from the start
    assert led.epoch == 1 and led.counts["epochs_refilled"] == 1
    assert led.state[1] == NEVER_REACHED and led.state[2] == LEASED  # a still holds 2 (epoch 0)
    led.merged("a", [2])  # trained in epoch 0
    assert led.state[2] == LEASED  # this epoch has not trained it yet
    led.release("a", [2])
    assert led.sweep([]) == [2]
    assert led.lease("c", 3, 0.0) == [2, 1]  # 2 joins epoch 1's pool (first: it was put back)
    assert led.counts["trained_twice"] == 0


def test_a_slice_thrown_away_after_its_epoch_ended_is_trained_in_that_epoch() -> None:
    """Epoch 0 ends (the pool is empty) while a holds slice 2 untrained; a is lost after naming it.
    Epoch 0 owes slice 2: it is leased again under epoch 0, before anything else, and trained there;
    only then does it join epoch 1's pool. Each epoch trains each of its slices exactly once."""
    led = SliceLedger(3, 10)
    led.lease("a", 3, 0.0)
    led.merged("a", [0, 1])
    led.release("a", [0, 1])
    led.sweep([])
    assert led.lease("b", 1, 0.0) == [0] and led.epoch == 1
    led.named("a", [2])
    led.learner_lost("a")
    led.sweep([])
    assert led.owed == [(2, 0)] and led.figures()["slices_owed"] == 1 and led.counts["thrown_away"] == 1
    assert led.lease("b", 1, 0.0) == [2] and led.leases[2].epoch == 0 and led.owed == []  # epoch 0's, first
    assert led.merged("b", [2]) == [2] and led.state[2] == RETURNED  # epoch 1 has not trained it
    assert led.lease("c", 3, 0.0) == [1]  # 2 is still b's
    led.release("b", [2])
    led.sweep([])
    assert led.lease("c", 1, 0.0) == [2] and led.leases[2].epoch == 1
    assert led.counts["trained"] == 3 and led.counts["trained_twice"] == 0
    doc = json.loads(json.dumps(led.to_json()))
    led.named("c", [2])
    led.learner_lost("c")  # thrown away in epoch 1, now the current one: not owed, returned
    led.sweep([])
    assert led.owed == [] and led.state[2] == RETURNED
    assert SliceLedger.from_json({**doc, "owed": [[1, 0]]}).owed == [(1, 0)]


def test_mark_trained_from_versions_after_a_checkpoint() -> None:
    led = SliceLedger(4, 10)
    led.lease("a", 2, 0.0)
    assert led.mark_trained([1, 3, 9]) == [1, 3]
    assert led.leases[1].trained and led.state[3] == TRAINED
    led.learner_lost("a")
    led.sweep([])
    assert led.states()["trained"] == [1, 3] and led.states()["returned"] == [0]
    assert led.lease("b", 2, 0.0) == [0, 2] and led.epoch == 0  # neither trained slice comes back this epoch
    assert led.lease("b", 2, 0.0) == [1, 3] and led.epoch == 1  # they do in the next


def test_json_round_trip_and_bad_documents() -> None:
    led = SliceLedger(7, 32)
    led.lease("a", 3, 5.0)
    led.lease("b", 2, 6.0)
    led.named("a", [1])
    led.merged("a", [0])
    led.learner_lost("a")
    led.sweep([2])
    doc = json.loads(json.dumps(led.to_json()))
    back = SliceLedger.from_json(doc)
    assert back.to_json() == led.to_json()
    assert back.states() == led.states() and back.figures() == led.figures()
    assert back.lease("c", 3, 7.0) == led.lease("c", 3, 7.0)
    bad = dict(doc, n_slices=8)
    with pytest.raises(ValueError, match="7 states for 8 slices"):
        SliceLedger.from_json(bad)
    bad = dict(doc, leases={"99": ["a", 0.0, 0, False, False, False]})
    with pytest.raises(ValueError, match="slice 99 outside"):
        SliceLedger.from_json(bad)


@pytest.mark.parametrize("seed", range(8))
def test_any_order_trains_no_slice_twice_and_loses_none(seed: int) -> None:
    """Random leases, namings, merges (of contributions in flight), releases and losses by four
    learners: whatever the order, within an epoch a slice is trained at most once, is held by at
    most one learner, and at the end (every lease ended, nothing in flight) each slice is exactly
    one of trained, returned or never reached, and each slice of an earlier epoch was trained in it
    or is still owed by it."""
    rng = random.Random(seed)
    led = SliceLedger(40, 16)
    in_flight: list[tuple[str, list[int]]] = []
    trained_by_epoch: dict[tuple[int, int], int] = {}
    for _ in range(600):
        who = rng.choice("abcd")
        op = rng.random()
        if op < 0.3:
            led.lease(who, rng.randint(0, 3), 0.0)
        elif op < 0.55 and led.held_by(who):
            named = rng.sample(led.held_by(who), k=min(2, len(led.held_by(who))))
            assert not led.not_held(who, named)
            led.named(who, named)
            in_flight.append((who, named))
        elif op < 0.75 and in_flight:
            lid, named = in_flight.pop(rng.randrange(len(in_flight)))
            if rng.random() < 0.6:  # merged; else thrown away
                for s in led.merged(lid, named):
                    trained_by_epoch[(s, led.leases[s].epoch)] = trained_by_epoch.get((s, led.leases[s].epoch), 0) + 1
        elif op < 0.85:
            led.release(who, rng.sample(range(40), k=5))
        elif op < 0.9:
            led.learner_lost(who)
        led.sweep(s for _, named in in_flight for s in named)
        holders = [lease.learner for lease in led.leases.values()]
        assert len(holders) == len(led.leases)  # one holder per slice by construction; and:
        assert all(led.state[s] in (LEASED, TRAINED) for s, lease in led.leases.items() if lease.epoch == led.epoch)
    assert max(trained_by_epoch.values(), default=0) == 1
    # a contribution in flight merges only slices its learner still holds (none went to another meanwhile)
    assert led.counts["trained_twice"] == 0 and led.counts["merged_not_held"] == 0
    in_flight.clear()
    for who in "abcd":
        led.learner_lost(who)
    led.sweep([])
    assert not led.leases
    states = led.states()
    assert sorted(states["trained"] + states["returned"] + states["never_reached"]) == list(range(40))
    assert states["leased"] == []
    assert led.epoch >= 1
    for e in range(led.epoch):
        trained, owed = {s for s, ee in trained_by_epoch if ee == e}, [s for s, ee in led.owed if ee == e]
        assert sorted([*trained, *owed]) == list(range(40)), f"epoch {e}: a slice neither trained nor owed"


def test_version_header_names_each_learners_slices() -> None:
    from diloco_async.policy.slices import header_slices, slice_header

    value = slice_header({"learner-0": [3, 4], "learner-1": [], "learner-2": [9]})
    assert value == "learner-0:3,4;learner-2:9"
    assert header_slices(value) == {"learner-0": [3, 4], "learner-2": [9]}
    assert header_slices(None) == {} and header_slices("") == {} and slice_header({}) == ""
    with pytest.raises(ValueError):
        header_slices("learner-0:3,x")


def test_a_leased_step_reads_consecutive_windows_of_the_stream() -> None:
    import numpy as np

    from diloco_async.data.tokens import Corpus

    stream = np.arange(100, dtype=np.uint16)
    x, y = Corpus.windows(stream, 10, batch_size=3, context=4)
    assert x.tolist() == [[10, 11, 12, 13], [14, 15, 16, 17], [18, 19, 20, 21]]
    assert y.tolist() == [[11, 12, 13, 14], [15, 16, 17, 18], [19, 20, 21, 22]]
    assert Corpus.windows(stream, 87, 3, 4)[1][-1, -1] == 99
    with pytest.raises(ValueError, match="windows from token 88"):
        Corpus.windows(stream, 88, 3, 4)
