"""The synchronizer of a replayed run (``run.schedule = "replay"``, issue 44 item 2; DESIGN §3.2)
behind its real HTTP server, driven by three scripted learners whose step boundaries reach it in an
order the wall clock decides (a seeded random pause before each request, another seed per run).

Each learner sends every boundary as a heartbeat carrying the contributions it uploaded since the
last one (outer gradients drawn from (learner, fragment, round), put in the store), and answers the
rounds the synchronizer names open to it. Whatever the arrival order, the runs publish the same
versions: the merge logs (fragment, version, sha256, learners merged) and the version objects'
bytes are equal. The quorum is one and the learners' virtual speeds differ, so rounds close on the
grace window with some learners left out: the schedule is asynchronous, and still the same.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random

import torch
from test_synchronizer import AUTH, running, small_config

from diloco_async.codec import wire
from diloco_async.policy.fragments import FragmentPlan
from diloco_async.storage import keys

LEARNERS = ["a", "b", "c"]
TOKENS_PER_STEP = 32


def replay_config():
    return small_config(**{"run.schedule": "replay", "synchronizer.min_quorum": 1,
                           "synchronizer.grace_initial_s": 2.0, "synchronizer.drain_s": 5.0,
                           "replay.speed_spread": 0.6, "faults.step_jitter": 0.3,
                           "budget.tokens": len(LEARNERS) * 40 * TOKENS_PER_STEP, "budget.wall_s": 100000})


def outer_gradient(plan: FragmentPlan, lid: str, p: int, n: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(f"{lid}/{p}/{n}".encode()).digest()[:4], "big"))
    return {s.name: torch.randn(s.shape, generator=g) * 0.01 for s in plan.fragments[p]}


async def scripted_learner(client, store, plan: FragmentPlan, lid: str, arrivals: random.Random) -> int:
    """Boundaries until told to stop; returns the contributions it made."""
    step, owed, made, since = 0, [], 0, {p: 0 for p in range(plan.num_fragments)}
    while True:
        await asyncio.sleep(arrivals.random() * 0.004)  # the wall clock's part: another order in each run
        body = {"learner_id": lid, "step": step, "tokens_total": step * TOKENS_PER_STEP,
                "replay_announcements": owed}
        r = await client.post("/heartbeat", json=body, headers=AUTH)
        assert r.status == 200, await r.text()
        answer = await r.json()
        assert len(answer["acks"]) == len(owed)
        if answer["stop"]:
            return made
        owed = []
        for rnd in answer["open_rounds"]:
            p, n, version = rnd["fragment"], rnd["round_n"], rnd["version"]
            if since[p] < 1:
                continue
            data = wire.encode_to_bytes(outer_gradient(plan, lid, p, n), "fp32", {})
            ref = await asyncio.to_thread(store.put, keys.contribution_key("run1", p, n, lid, f"p{p}r{n}"), data)
            owed.append({"learner_id": lid, "fragment": p, "round_n": n, "base_version": version,
                         "c_steps": since[p], "c_tokens": since[p] * TOKENS_PER_STEP, "compute_s": 0.1,
                         "key": ref.key, "nbytes": ref.nbytes, "sha256": ref.sha256, "codec": "fp32",
                         "update_id": f"{lid}p{p}r{n}"})
            since[p], made = 0, made + 1
        since = {p: s + 1 for p, s in since.items()}
        step += 1


async def one_run(arrival_seed: int) -> tuple[list[tuple], dict[str, str], dict]:
    cfg = replay_config()
    async with running(cfg) as (sync, client, store):
        joined = [await client.post("/join", json={"learner_id": lid}, headers=AUTH) for lid in LEARNERS]
        assert all(r.status == 200 for r in joined)
        plan = FragmentPlan.from_json((await joined[-1].json())["plan"])
        wall = random.Random(arrival_seed)
        made = await asyncio.wait_for(asyncio.gather(*(
            scripted_learner(client, store, plan, lid, random.Random(wall.random())) for lid in LEARNERS)), 120)
        assert all(m > 0 for m in made)
        counters = {"events": sync.gate.events, "rejoins": sync.report.counters.get("replay_rejoins", 0)}
    logs = [k for k in store.list("run1/epochs") if k.endswith("/merges.jsonl")]
    text = "".join(store.get_unverified(k).decode() for k in logs)
    records = [json.loads(line) for line in text.splitlines() if line.strip()]
    merges = [(r["fragment"], r["version"], r["sha256"], [c["learner"] for c in r["contributions"]]) for r in records]
    objects = {k: hashlib.sha256(store.get_unverified(k)).hexdigest()
               for k in store.list(keys.versions_prefix("run1"))}
    return merges, objects, counters


async def test_a_replay_publishes_the_same_versions_whatever_order_the_boundaries_arrive_in():
    first = await one_run(arrival_seed=1)
    second = await one_run(arrival_seed=2)
    merges, objects, counters = first
    assert len(merges) >= 6 and {p for p, *_ in merges} == {0, 1}
    assert any(len(merged) < len(LEARNERS) for *_, merged in merges)  # rounds closed without every learner
    assert counters["rejoins"] == 0
    assert second[0] == merges
    assert second[1] == objects and len(objects) >= 3
    assert second[2] == counters
