"""The learner registry's incremental bookkeeping (issue 17) against the full passes it replaced.

A random sequence of joins, rejoins (new incarnations), heartbeats, clock moves, liveness checks
and a checkpoint restore drives the registry; after every step its liveness verdicts, live
learners (and the cached ids and "every live learner reported" of them), tokens processed and
provisioned seconds must equal what one pass over every learner
(the code before issue 17) gives on the same state.
"""

from __future__ import annotations

import random

import pytest

from diloco_async.protocol.messages import Heartbeat, JoinRequest
from diloco_async.sync.learners import LearnerRegistry

TIMEOUT_S = 5.0


def full_pass_lost(reg: LearnerRegistry, now_s: float, expected_live: dict[str, bool]) -> set[str]:
    """The learners one pass over all finds silent for more than TIMEOUT_S (marking them in
    ``expected_live``): the liveness check before issue 17."""
    lost = set()
    for lid, info in reg.learners.items():
        if expected_live[lid] and now_s - info.last_seen_s > TIMEOUT_S:
            expected_live[lid] = False
            lost.add(lid)
    return lost


@pytest.mark.parametrize("seed", range(6))
def test_incremental_registry_matches_full_passes(seed):
    rng = random.Random(seed)
    reg = LearnerRegistry()
    ids = [f"l{i}" for i in range(40)]
    incarnation = dict.fromkeys(ids, 0)
    tokens = dict.fromkeys(ids, 0)
    expected_live: dict[str, bool] = {}
    now = 1000.0
    mark_s = None
    for _ in range(3000):
        op = rng.random()
        lid = rng.choice(ids)
        if op < 0.08:  # join: a new slot, the same incarnation again, or a restart
            if lid in reg and rng.random() < 0.5:
                incarnation[lid] += 1
                tokens[lid] = 0
            reg.join(JoinRequest(learner_id=lid, incarnation=incarnation[lid], uptime_s=0.5), now, None)
            expected_live[lid] = True
        elif op < 0.70 and lid in reg and reg.learners[lid].incarnation == incarnation[lid]:
            tokens[lid] += rng.randrange(0, 50)
            reg.heartbeat(Heartbeat(learner_id=lid, incarnation=incarnation[lid], step=1, tokens_total=tokens[lid]),
                          now)
            expected_live[lid] = True
        elif op < 0.85:
            now += rng.choice([0.01, 0.3, 1.0, 2.5, TIMEOUT_S, 7.0])
        elif op < 0.97:
            lost = {i.learner_id for i in reg.mark_lost(now, TIMEOUT_S)}
            assert lost == full_pass_lost(reg, now, expected_live)
        elif op < 0.99:
            mark_s = now
            reg.mark_provisioned(now)
        else:  # a checkpoint and a restore from it: every learner not live until it heartbeats
            ledgers, learners = reg.to_manifest(now)
            reg.restore(ledgers, learners, now)
            expected_live = dict.fromkeys(expected_live, False)
            mark_s = None
        assert [i.learner_id for i in reg.live()] == [lid for lid, i in reg.learners.items() if expected_live[lid]]
        live_full_pass = [i for i in reg.learners.values() if i.live]
        assert reg.live_ids() == tuple(i.learner_id for i in live_full_pass)  # the cached views
        assert reg.all_live_reported() == all(i.reported for i in live_full_pass)
        assert all(i.live == expected_live[lid] for lid, i in reg.learners.items())
        assert reg.tokens_processed() == sum(led.tokens_processed for led in reg.ledgers.values())
    reg.flush_provisioned()
    if mark_s is not None:
        for lid, info in reg.learners.items():
            assert reg.ledgers[lid].provisioned_s == mark_s - info.started_s


def test_liveness_looks_only_at_learners_whose_timeout_may_have_passed():
    reg = LearnerRegistry()
    for i in range(1000):
        reg.join(JoinRequest(learner_id=f"l{i}"), 1000.0 + i * 0.001, None)
    for i in range(1000):  # everyone heard from again, later
        reg.heartbeat(Heartbeat(learner_id=f"l{i}", step=1), 1003.0)
    # nobody is due: the check is one comparison with the heap's top
    assert reg.mark_lost(1005.5, TIMEOUT_S) == []
    assert len(reg._heard) == 1000  # one entry per live learner, however many heartbeats
    # the join entries have come due, been looked at once and pushed back at the newest time
    assert reg.mark_lost(1007.5, TIMEOUT_S) == []
    assert len(reg._heard) == 1000 and min(k for k, _, _ in reg._heard) == 1003.0
    assert len(reg.mark_lost(1008.01, TIMEOUT_S)) == 1000 and reg.live() == ()
