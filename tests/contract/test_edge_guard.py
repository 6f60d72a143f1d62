"""The update guard and schedule safety against a live synchronizer (issue 14, items 3-4): one
learner's in-bounds but impossible or hostile input cannot poison, stall or end the run.

Defects of issue 14 covered here: 3 (a finite outer gradient of norm 1e30 was merged and
published), 4 (an int8 header's block_size made the synchronizer allocate ~1 GB), 5 (an enormous
``tokens_total`` ended a token-budget run), 6 (an enormous ``c_tokens``: one contribution could
dominate or fail the merge, and a failed merge lost the round), 7 (one heartbeat with step 10^12
moved the schedule out of reach; a step time of 1e6 s held every round in its grace window).
"""

from __future__ import annotations

import resource
import uuid

import pytest
import safetensors.torch
import torch
from test_edge import STEP, announcement, fragment_delta, join_and_step, post, status, wait_open, wait_version
from test_sync_status_board import actor_passes
from test_synchronizer import LEARNERS, published, running, small_config

from diloco_async.codec import wire
from diloco_async.policy.fragments import FragmentPlan
from diloco_async.storage import keys
from diloco_async.sync.state import Verified

from polling import await_until

pytestmark = pytest.mark.timeout(120)


def announce_bytes(store, lid, data: bytes, codec="fp32", fragment=0, round_n=1, **fields) -> dict:
    ref = store.put(keys.contribution_key("run1", fragment, round_n, lid, uuid.uuid4().hex[:8]), data)
    body = {"learner_id": lid, "fragment": fragment, "round_n": round_n, "base_version": 0, "c_steps": 4,
            "c_tokens": 1000, "compute_s": 1.0, "key": ref.key, "nbytes": ref.nbytes, "sha256": ref.sha256,
            "codec": codec, "update_id": uuid.uuid4().hex[:8]}
    return {**body, **fields}


async def accepted(client, body) -> None:
    code, ack = await post(client, "/announce", body)
    assert code == 200 and ack["status"] == "accepted", ack


async def honest_two(client, store, plan, fragment=0, round_n=1):
    for lid in ("a", "c"):
        await accepted(client, announcement(store, plan, lid, fragment, round_n))


# -- defect 3 ---------------------------------------------------------------------------------

async def test_outer_gradient_of_norm_1e30_is_rejected_as_norm_outlier():
    async with running(small_config()) as (_sync, client, store):
        plan = await join_and_step(client)
        await wait_open(client, 0, 1)
        huge = {n: t * 1e30 for n, t in fragment_delta(plan, 0, 2).items()}  # finite in fp32
        await accepted(client, announce_bytes(store, "b", wire.encode_to_bytes(huge, "fp32", {})))
        await honest_two(client, store, plan)
        st = await wait_version(client, 0, 1)
        assert st["rejected_by_reason"] == {"norm_outlier": 1}
        assert st["contributions_merged"] == 2
        got = published(store, plan, 1)
        assert max(float(t.abs().max()) for t in got.values()) < 10.0


async def test_clip_mode_merges_the_outlier_scaled_to_its_bound():
    async with running(small_config(**{"guard.norm_action": "clip"})) as (_sync, client, store):
        plan = await join_and_step(client)
        await wait_open(client, 0, 1)
        huge = {n: t * 1e30 for n, t in fragment_delta(plan, 0, 2).items()}
        await accepted(client, announce_bytes(store, "b", wire.encode_to_bytes(huge, "fp32", {})))
        await honest_two(client, store, plan)
        st = await wait_version(client, 0, 1)
        assert st["contributions_clipped"] == 1 and st["contributions_merged"] == 3
        assert st["rejected_by_reason"] == {}
        got = published(store, plan, 1)
        assert max(float(t.abs().max()) for t in got.values()) < 10.0


# -- defect 4 ---------------------------------------------------------------------------------

@pytest.mark.parametrize("codec", ["int8", "int4", "int2"])
async def test_codec_header_block_size_checked_before_any_allocation(codec):
    async with running(small_config()) as (_sync, client, store):
        plan = await join_and_step(client)
        await wait_open(client, 0, 1)
        delta = fragment_delta(plan, 0, 2)
        one_block = max(t.numel() for t in delta.values())  # one scale per tensor, whatever block size is claimed
        hostile = safetensors.torch.save(wire.encode(delta, codec, block_size=one_block),
                                         metadata={"codec": codec, "block_size": str(2**26)})
        assert len(hostile) < 20_000
        rss_before_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        await accepted(client, announce_bytes(store, "b", hostile, codec))
        await honest_two(client, store, plan)
        st = await wait_version(client, 0, 1)
        assert st["rejected_by_reason"] == {"codec_header": 1}
        assert st["contributions_merged"] == 2
        # decoding it would have allocated 2**26 floats (256 MiB) per tensor
        assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before_kib < 128 * 1024


# -- defect 5 ---------------------------------------------------------------------------------

async def test_enormous_in_bounds_tokens_total_cannot_end_a_token_budget_run():
    async with running(small_config(**{"budget.tokens": 10**9})) as (sync, client, _store):
        await join_and_step(client)
        for _ in range(3):  # repeated: each heartbeat is credited at most what the pace limit allows
            code, _answer = await post(client, "/heartbeat", {"learner_id": "a", "step": STEP + 1,
                                                              "tokens_total": 2**50})
            assert code == 200
        await actor_passes(sync.board, 5)  # the budget is checked at every pass
        st = await status(client)
        assert st["phase"] == "running" and st["stop_reason"] is None
        assert 0 < st["tokens_processed"] < 10**7
        assert st["clamped_by_reason"]["implausible_tokens"] == 3
    assert sync.final_summary is not None and sync.final_summary["stop_reason"] == "test over"


# -- defect 6 ---------------------------------------------------------------------------------

@pytest.mark.parametrize(("fields", "reason"), [({"c_tokens": 2**50}, "implausible_tokens"),
                                                ({"c_steps": 10**9, "c_tokens": 10**9}, "implausible_steps")])
async def test_impossible_counters_rejected_the_others_merge(fields, reason):
    async with running(small_config()) as (_sync, client, store):
        plan = await join_and_step(client)
        await wait_open(client, 0, 1)
        code, ack = await post(client, "/announce", announcement(store, plan, "b", **fields))
        assert code == 200 and ack["status"] == "rejected" and ack["reason"].startswith(reason), ack
        await honest_two(client, store, plan)
        st = await wait_version(client, 0, 1)
        assert st["rejected_by_reason"] == {reason: 1}
        assert st["contributions_merged"] == 2 and st["rounds_abandoned"] == 0


async def test_a_contribution_that_fails_the_merge_is_dropped_the_others_merge(monkeypatch):
    from diloco_async.sync import work

    real = work.token_weight

    def weight(c_tokens, c_steps):  # the merge of any round holding b's contribution raises
        if c_tokens == 999:
            raise OverflowError("injected")
        return real(c_tokens, c_steps)
    monkeypatch.setattr(work, "token_weight", weight)
    async with running(small_config()) as (_sync, client, store):
        plan = await join_and_step(client)
        await wait_open(client, 0, 1)
        await accepted(client, announcement(store, plan, "b", c_tokens=999))
        await honest_two(client, store, plan)
        st = await wait_version(client, 0, 1)
        assert st["rejected_by_reason"] == {"merge_failed": 1}
        assert st["contributions_merged"] == 2 and st["rounds_abandoned"] == 0
        assert st["learners"]["b"]["contributions"] == {"rejected": 1}


# -- defect 7 ---------------------------------------------------------------------------------

async def heartbeat_all(client, step, **fields):
    for lid in LEARNERS:
        code, _ = await post(client, "/heartbeat", {"learner_id": lid, "step": step, **fields})
        assert code == 200


async def contribute_to_open_rounds(client, store, plan) -> set[tuple[int, int]]:
    """Every learner contributes to every open round; returns those rounds."""
    rounds = {(r["fragment"], r["round"]) for r in (await status(client))["rounds"]}
    for p, n in rounds:
        for lid in LEARNERS:
            await post(client, "/announce", announcement(store, plan, lid, p, n))
    return rounds


async def test_a_step_of_10_to_the_12_does_not_move_the_schedule_out_of_reach():
    async with running(small_config(**{"synchronizer.min_quorum": 1})) as (sync, client, store):
        for lid in LEARNERS:
            code, answer = await post(client, "/join", {"learner_id": lid})
            assert code == 200
        plan = FragmentPlan.from_json(answer["plan"])
        await heartbeat_all(client, 1)
        code, _answer = await post(client, "/heartbeat", {"learner_id": "a", "step": 10**12})
        assert code == 200
        await actor_passes(sync.board, 3)  # the actor took the lie (it answered it); its schedule runs on it
        await heartbeat_all(client, 1)  # "a" is honest again
        seen = await contribute_to_open_rounds(client, store, plan)
        last = max(n for _p, n in seen) if seen else 0

        async def new_round():  # the honest learners advance; a round after the lie's must open
            nonlocal step
            step += 2
            await heartbeat_all(client, step)
            st = await status(client)
            return [r for r in st["rounds"] if r["round"] > last] or None
        step = 1
        await await_until(new_round, 30, "a round to open for the honest learners")
        assert (await status(client))["learners"]["a"]["step"] < 10**6


async def test_a_step_time_of_1e6_s_does_not_hold_the_round_in_grace():
    """Defect 7: 1e6 s, the largest step time the edge lets through, is clamped."""
    cfg = small_config(**{"synchronizer.min_quorum": 1})
    async with running(cfg) as (_sync, client, store):
        plan = await join_and_step(client)
        for lid in ("a", "c"):
            await post(client, "/heartbeat", {"learner_id": lid, "step": STEP, "step_time_s": 0.05})
        code, body = await post(client, "/heartbeat", {"learner_id": "b", "step": STEP, "step_time_s": 1e6})
        assert code == 200, body
        await wait_open(client, 0, 1)
        await honest_two(client, store, plan)  # b never announces: the grace window decides
        st = await wait_version(client, 0, 1)  # 30 s, held for 1e6 s were the step time not clamped
        assert st["contributions_merged"] == 2


async def test_a_step_time_of_1e9_s_is_refused_at_the_edge():
    """Defect 7 as filed (1e9 s): refused with 400 naming step_time_s; the learner's next honest
    heartbeat is taken."""
    async with running(small_config()) as (_sync, client, _store):
        await join_and_step(client)
        code, body = await post(client, "/heartbeat", {"learner_id": "b", "step": STEP, "step_time_s": 1e9})
        assert code == 400 and "step_time_s" in str(body), body
        code, body = await post(client, "/heartbeat", {"learner_id": "b", "step": STEP, "step_time_s": 0.05})
        assert code == 200, body


# -- stuck rounds, counts at stop ---------------------------------------------------------------

async def reject_b_then_merge_round_2(client, store) -> dict:
    """Quorum 3 of 3: a's update and b's NaN one to fragment 0's round 1, which can then never make
    it; once round 2 opens (within 10 s), all three merge there. Returns the status at that opening."""
    plan = await join_and_step(client)
    await wait_open(client, 0, 1)
    await accepted(client, announcement(store, plan, "a"))
    nan = {n: torch.full_like(t, float("nan")) for n, t in fragment_delta(plan, 0, 2).items()}
    await accepted(client, announce_bytes(store, "b", wire.encode_to_bytes(nan, "fp32", {})))
    await wait_open(client, 0, 2)
    opened = await status(client)
    for lid in LEARNERS:
        await accepted(client, announcement(store, plan, lid, 0, 2))
    st = await wait_version(client, 0, 1)
    assert st["contributions_merged"] == 3
    return opened


async def test_a_round_that_cannot_reach_quorum_is_abandoned_and_reopened():
    cfg = small_config(**{"synchronizer.min_quorum": 3, "guard.round_timeout_s": 1.0})
    async with running(cfg) as (_sync, client, store):
        await reject_b_then_merge_round_2(client, store)

        async def timed_out():  # fragment 1's round 1, unanswered, after round_timeout_s
            st = await status(client)
            return st if st["rounds_abandoned_by_reason"].get("round_timeout", 0) >= 1 else None
        st = await await_until(timed_out, 30, "fragment 1's round 1 to time out")
        assert st["rounds_abandoned_by_reason"]["quorum_unreachable"] == 1


async def test_a_rejected_update_that_puts_the_quorum_out_of_reach_reopens_the_round_at_once():
    """Three live learners, quorum 3: once b's update is rejected, round 1 can never make it (b cannot
    announce again). It is abandoned and reopened at once, not after heartbeat_timeout_s (60 s here)
    or round_timeout_s (300 s), so one rejected update does not hold its fragment back."""
    async with running(small_config(**{"synchronizer.min_quorum": 3})) as (_sync, client, store):
        opened = await reject_b_then_merge_round_2(client, store)
    assert opened["rounds_abandoned_by_reason"] == {"quorum_unreachable": 1}
    assert opened["rejected_by_reason"] == {"non_finite": 1}


async def test_rounds_abandoned_and_verifications_dropped_at_stop_are_counted():
    async with running(small_config()) as (sync, client, _store):
        await join_and_step(client)
        await wait_open(client, 0, 1)
        await wait_open(client, 1, 1)
        await sync.inbox.put(Verified(0, 99, "a", None, "digest: late", 10))  # its round is gone

        async def dropped() -> bool:
            return (await status(client))["verifications_dropped"] == 1

        await await_until(dropped, 30, "the late verification to be dropped")
    assert sync.final_summary["rounds_abandoned_by_reason"] == {"at_stop": 2}
    assert sync.final_summary["rounds_abandoned"] == 2
    assert sync.final_summary["verifications_dropped"] == 1
