"""Heartbeat replies are shared by the learners in the same state (issue 17) and still say, to each
learner, exactly the open rounds it has not announced to and the current versions."""

from __future__ import annotations

import uuid

from diloco_async.config.schema import load_config
from diloco_async.protocol.messages import Announcement, Heartbeat, JoinRequest
from diloco_async.storage import keys
from diloco_async.storage.store import ObjectStore
from diloco_async.sync import Synchronizer
from diloco_async.sync.version_infos import REPLIES_CAP


def test_replies_are_shared_and_each_learner_hears_its_own_open_rounds():
    cfg = load_config(None, ["model.n_layer=1", "model.d_model=16", "model.n_head=2", "model.context=8",
                             "synchronizer.num_fragments=2", "synchronizer.min_quorum=2", "budget.wall_s=600"])
    sync = Synchronizer(cfg, ObjectStore(f"memory://replies-{uuid.uuid4().hex}"), "run1")
    try:
        sync.publish_initial()  # version 0 of every fragment, as a run starts
        ids = ["a", "b", "c"]
        for lid in ids:
            sync._on_join(JoinRequest(learner_id=lid, uptime_s=1.0))

        def beat(lid: str):
            return sync._on_heartbeat(Heartbeat(learner_id=lid, step=1, tokens_total=8, uptime_s=2.0))

        first = [beat(lid) for lid in ids]
        assert first[0] is first[1] is first[2] and first[0].open_rounds == []  # one model for all
        sync.table.open_round(sync.book[0], 1, sync.ctx.clock())
        ref = f"{keys.contribution_round_prefix('run1', 0, 1)}/a/x"
        ann = Announcement(learner_id="a", fragment=0, round_n=1, base_version=0, c_steps=1, c_tokens=8,
                           compute_s=0.1, key=ref, nbytes=10, sha256="0" * 64, codec="fp32", update_id="u1")
        sync.table.rounds[(0, 1)].state.announce("a", ann.key, sync.ctx.clock())
        a, b, c = (beat(lid) for lid in ids)
        assert a.open_rounds == [] and a is not b  # a announced: round 1 of fragment 0 is not news to it
        assert b is c and [(r.fragment, r.round_n, r.version) for r in b.open_rounds] == [(0, 1, 0)]
        assert [v.version for v in b.versions] == [f.version for f in sync.book]
        sync.book[1].version += 1  # a new version (its ref too): a new reply, with it
        sync.book[1].refs[sync.book[1].version] = sync.book[1].refs[0]
        b2 = beat("b")
        assert b2 is not b and [v.version for v in b2.versions] == [0, 1]
        assert len(sync._replies._replies) <= REPLIES_CAP
    finally:
        sync.close()
