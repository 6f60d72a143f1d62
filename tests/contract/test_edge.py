"""Validation at the edge (issue 14, item 1): hostile and out-of-range requests get 4xx with a
reason naming the field, never 500; the actor survives an exception while handling one message;
JSON out is standard JSON; and after all of it honest learners still merge a round.

Defects of issue 14 covered here: 1 (a 400-digit step killed the actor), 5 (an enormous
``tokens_total`` broke ``/status`` and ended the run), 6 (an enormous ``c_tokens`` made the merge
raise and the round's contributions were lost uncounted), 8 (deep JSON, long integers, non-ASCII
``Authorization`` gave 500; NaN and Infinity accepted and echoed).
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid

import pytest
import torch
from test_sync_status_board import actor_passes
from test_synchronizer import AUTH, LEARNERS, running, small_config

from diloco_async.codec import wire
from diloco_async.policy.fragments import FragmentPlan
from diloco_async.storage import keys

from polling import await_until, newer_status

pytestmark = pytest.mark.timeout(120)

STEP = 6  # opens round 1 of both fragments (offsets 0 and 2, H = 4)


def strict_json(text: str):
    """Standard JSON only: NaN, Infinity and -Infinity raise."""
    def no_constants(name):
        raise AssertionError(f"non-standard JSON constant {name} in a response")
    return json.loads(text, parse_constant=no_constants)


async def status(client) -> dict:
    """/status (parsed strictly) from a snapshot newer than the call."""
    async def get() -> dict:
        r = await asyncio.wait_for(client.get("/status"), 30)
        assert r.status == 200
        return strict_json(await r.text())

    return await newer_status(get)


async def post(client, path, body, headers=AUTH):
    """POST a JSON body (a dict) or raw bytes; returns (status, parsed answer or text)."""
    kw = {"json": body} if isinstance(body, dict) else {"data": body}
    r = await asyncio.wait_for(client.post(path, headers=headers, **kw), 30)
    text = await r.text()
    try:
        return r.status, json.loads(text)
    except ValueError:
        return r.status, text


async def join_and_step(client, step=STEP) -> FragmentPlan:
    for lid in LEARNERS:
        code, answer = await post(client, "/join", {"learner_id": lid})
        assert code == 200
    for lid in LEARNERS:
        assert (await post(client, "/heartbeat", {"learner_id": lid, "step": step}))[0] == 200
    return FragmentPlan.from_json(answer["plan"])


async def wait_open(client, fragment, round_n):
    async def opened():
        st = await status(client)
        return any((r["fragment"], r["round"]) == (fragment, round_n) for r in st["rounds"])
    await await_until(opened, 30, f"round ({fragment}, {round_n}) to open")


def announcement(store, plan, lid, fragment=0, round_n=1, **fields) -> dict:
    delta = fragment_delta(plan, fragment, LEARNERS.index(lid) + 1)
    ref = store.put(keys.contribution_key("run1", fragment, round_n, lid, uuid.uuid4().hex[:8]),
                    wire.encode_to_bytes(delta, "fp32", {}))
    body = {"learner_id": lid, "fragment": fragment, "round_n": round_n, "base_version": 0, "c_steps": 4,
            "c_tokens": 1000, "compute_s": 1.0, "key": ref.key, "nbytes": ref.nbytes, "sha256": ref.sha256,
            "codec": "fp32", "update_id": uuid.uuid4().hex[:8]}
    return {**body, **fields}


def fragment_delta(plan, fragment, seed) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {s.name: torch.randn(s.shape, generator=g) * 0.01 for s in plan.fragments[fragment]}


async def wait_version(client, fragment, version, timeout_s=30.0) -> dict:
    async def reached():
        st = await status(client)
        return st if st["versions"][str(fragment)] >= version else None
    return await await_until(reached, timeout_s, f"fragment {fragment} to reach version {version}")


async def honest_round(client, store, plan, fragment=0, round_n=1, version=1) -> dict:
    """Every learner contributes to (fragment, round_n); returns the status once it merged."""
    await wait_open(client, fragment, round_n)
    for lid in LEARNERS:
        code, ack = await post(client, "/announce", announcement(store, plan, lid, fragment, round_n))
        assert code == 200 and ack["status"] == "accepted", ack
    return await wait_version(client, fragment, version)


def names_field(answer, field: str) -> bool:
    return isinstance(answer, dict) and field in answer.get("error", "")


# -- defect 1 ---------------------------------------------------------------------------------

async def test_huge_step_rejected_and_actor_survives_a_handler_error(caplog):
    caplog.set_level(logging.WARNING)
    async with running(small_config()) as (sync, client, store):
        plan = await join_and_step(client)
        for lid in ("a", "b"):  # two of them: the global step (K = 2) would be the huge one
            code, answer = await post(client, "/heartbeat", {"learner_id": lid, "step": 10**400})
            assert code == 400 and names_field(answer, "step"), answer
        assert (await status(client))["phase"] == "running"

        # an exception inside the actor while handling one message: that request fails, the run goes on
        real = sync.registry.heartbeat

        def broken(hb, now_s):
            if hb.learner_id == "b":
                raise OverflowError("injected")
            return real(hb, now_s)
        sync.registry.heartbeat = broken
        code, answer = await post(client, "/heartbeat", {"learner_id": "b", "step": STEP})
        assert code == 500 and "handler_error" in answer["error"]
        assert "learner=b" in caplog.text
        sync.registry.heartbeat = real

        # and one raised by the clock-driven part of the actor
        real_schedule = sync.table.schedule
        calls = []

        def schedule_once_broken(now):
            calls.append(now)
            if len(calls) == 1:
                raise OverflowError("injected")
            return real_schedule(now)
        sync.table.schedule = schedule_once_broken

        async def went_on():
            return len(calls) > 1
        await await_until(went_on, 30, "the actor to go on")
        st = await status(client)
        assert st["rejected_by_reason"]["bad_request"] == 2
        assert st["rejected_by_reason"]["handler_error"] == 1
        assert st["actor_errors"] == 1
        st = await honest_round(client, store, plan)
        assert st["contributions_merged"] == 3


# -- defect 5 ---------------------------------------------------------------------------------

@pytest.mark.parametrize("tokens_total", [10**30, 2**62, 2**63])
async def test_enormous_tokens_total_rejected(tokens_total):
    async with running(small_config(**{"budget.tokens": 10**9})) as (sync, client, _store):
        await join_and_step(client)
        code, answer = await post(client, "/heartbeat", {"learner_id": "a", "step": STEP + 1,
                                                         "tokens_total": tokens_total})
        assert code == 400 and names_field(answer, "tokens_total"), answer
        await actor_passes(sync.board, 5)  # the budget is checked at every pass
        st = await status(client)
        assert st["phase"] == "running" and st["stop_reason"] is None
        assert st["tokens_processed"] == 0
    assert sync.final_summary is not None and sync.final_summary["stop_reason"] == "test over"


# -- defect 6 ---------------------------------------------------------------------------------

async def test_enormous_c_tokens_rejected_the_others_merge():
    # b never contributes: the round closes on a and c's quorum after the grace window (0.5 s here)
    async with running(small_config(**{"synchronizer.grace_initial_s": 0.5})) as (_sync, client, store):
        plan = await join_and_step(client)
        await wait_open(client, 0, 1)
        for field, value in (("c_tokens", 10**200), ("c_steps", 10**200), ("c_tokens", 2**63)):
            code, answer = await post(client, "/announce", announcement(store, plan, "b", **{field: value}))
            assert code == 400 and names_field(answer, field), answer
        for lid in ("a", "c"):
            code, ack = await post(client, "/announce", announcement(store, plan, lid))
            assert ack["status"] == "accepted"
        st = await wait_version(client, 0, 1)
        assert st["contributions_merged"] == 2 and st["rounds_abandoned"] == 0


async def test_failed_merge_counts_its_contributions_and_the_run_goes_on(monkeypatch):
    from diloco_async.sync import work

    real = work.merge_and_step

    def broken(*args, **kw):
        raise OverflowError("injected merge failure")
    monkeypatch.setattr(work, "merge_and_step", broken)
    async with running(small_config()) as (_sync, client, store):
        plan = await join_and_step(client)
        await wait_open(client, 0, 1)
        for lid in LEARNERS:
            await post(client, "/announce", announcement(store, plan, lid))

        async def abandoned():
            st = await status(client)
            return st if st["rounds_abandoned"] == 1 else None
        st = await await_until(abandoned, 30, "the round to be abandoned")
        assert st["rejected_by_reason"] == {"merge_failed": 3}
        assert st["contributions_rejected"] == 3
        assert all(st["learners"][lid]["contributions"] == {"rejected": 1} for lid in LEARNERS)
        monkeypatch.setattr(work, "merge_and_step", real)
        st = await honest_round(client, store, plan, fragment=1, round_n=1, version=1)
        assert st["contributions_merged"] == 3


# -- defect 8 ---------------------------------------------------------------------------------

HOSTILE = [
    ("deep nesting", "/heartbeat", b"[" * 100_000 + b"]" * 100_000, AUTH),
    ("deep object", "/join", b'{"learner_id":' * 50_000 + b"1" + b"}" * 50_000, AUTH),
    ("5000-digit integer", "/heartbeat", b'{"learner_id":"a","step":' + b"9" * 5000 + b"}", AUTH),
    ("NaN", "/heartbeat", b'{"learner_id":"a","step":1,"train_loss":NaN}', AUTH),
    ("Infinity", "/heartbeat", b'{"learner_id":"a","step":1,"tokens_per_s":Infinity}', AUTH),
    ("-Infinity", "/join", b'{"learner_id":"a","uptime_s":-Infinity}', AUTH),
    ("a list", "/join", b"[1, 2]", AUTH),
    ("a string", "/join", b'"a"', AUTH),
    ("null", "/announce", b"null", AUTH),
    ("not UTF-8", "/join", b'{"learner_id":"\xff\xfe"}', AUTH),
    ("not JSON", "/heartbeat", b"learner_id=a&step=1", AUTH),
    ("empty", "/announce", b"", AUTH),
]


async def test_hostile_bodies_get_400_and_the_run_still_merges():
    async with running(small_config()) as (sync, client, store):
        for what, path, body, headers in HOSTILE:
            code, answer = await post(client, path, body, headers)
            assert code == 400, (what, code, answer)
            assert isinstance(answer, dict) and answer["error"].startswith("bad_request"), (what, answer)
        for header in ("Bearer t\u00e9st", "Bearer \u2603", "\u00ff" * 10):
            code, _ = await post(client, "/join", {"learner_id": "a"}, {"Authorization": header})
            assert code == 401, header
        r = await client.post("/join", json={"learner_id": "a"},
                              headers={"Authorization": b"Bearer \xff\xfe".decode("latin-1")})
        assert r.status == 401
        for query in ("since=-1", "since=x", "since=" + "9" * 5000, "since=1e3", f"since={2**80}"):
            r = await client.get(f"/metrics?{query}", headers=AUTH)
            assert r.status == 400, query
        async def counted():  # /status is a snapshot the actor publishes: it may lag a request or two
            st = await status(client)
            return st if st["rejected_by_reason"].get("bad_request") == len(HOSTILE) + 5 else None

        st = await await_until(counted, 30, "every hostile body counted in /status")
        assert st["rejected_by_reason"]["bad_request"] == len(HOSTILE) + 5
        assert st["bad_requests"]["json_too_deep"] == 2
        sync.report.metric("test/not_a_number", float("nan"))  # a metric that could be non-finite
        r = await client.get("/metrics", headers=AUTH)
        points = strict_json(await r.text())["metrics"]
        assert [p["value"] for p in points if p["key"] == "test/not_a_number"] == [None]
        plan = await join_and_step(client)
        st = await honest_round(client, store, plan)
        assert st["contributions_merged"] == 3


# -- out-of-range fields ----------------------------------------------------------------------

OUT_OF_RANGE = [
    ("/join", "learner_id", "x" * 65),
    ("/join", "learner_id", "a b"),
    ("/join", "learner_id", "\u00e9"),
    ("/join", "incarnation", -1),
    ("/join", "incarnation", 2**64),
    ("/join", "uptime_s", 1e300),
    ("/heartbeat", "step", -1),
    ("/heartbeat", "step", 2**53 + 1),
    ("/heartbeat", "step_time_s", 1e12),
    ("/heartbeat", "tokens_total", -5),
    ("/heartbeat", "train_loss", 1e300),
    ("/heartbeat", "tokens_per_s", 1e300),
    ("/heartbeat", "bytes_down", 2**63),
    ("/heartbeat", "bytes_up", 10**40),
    ("/heartbeat", "uptime_s", 1e300),
    ("/heartbeat", "base_versions", {str(i): 0 for i in range(5000)}),
    ("/heartbeat", "base_versions", {"0": 2**60}),
    ("/heartbeat", "base_versions", {str(2**60): 0}),
    ("/announce", "fragment", 2**40),
    ("/announce", "round_n", 2**60),
    ("/announce", "base_version", 10**30),
    ("/announce", "compute_s", 1e300),
    ("/announce", "key", "run1/" + "k" * 5000),
    ("/announce", "nbytes", 2**63),
    ("/announce", "update_id", "a/b"),
    ("/announce", "update_id", "u" * 65),
]


async def test_out_of_range_fields_get_400_naming_the_field():
    valid = {"/join": {"learner_id": "a"}, "/heartbeat": {"learner_id": "a", "step": 1},
             "/announce": {"learner_id": "a", "fragment": 0, "round_n": 1, "base_version": 0, "c_steps": 4,
                           "c_tokens": 1000, "compute_s": 1.0, "key": "run1/x", "nbytes": 10,
                           "sha256": "0" * 64, "codec": "fp32", "update_id": "u1"}}
    async with running(small_config()) as (_sync, client, _store):
        for path, field, value in OUT_OF_RANGE:
            code, answer = await post(client, path, {**valid[path], field: value})
            assert code == 400 and names_field(answer, field), (path, field, value, answer)
        async def counted():  # /status is a snapshot the actor publishes: it may lag a request or two
            st = await status(client)
            return st if st["rejected_by_reason"].get("bad_request") == len(OUT_OF_RANGE) else None

        st = await await_until(counted, 30, "every bad request counted in /status")
        assert st["rejected_by_reason"] == {"bad_request": len(OUT_OF_RANGE)}
        assert st["bad_requests"]["field:step"] == 2
        assert st["learners"] == {}
