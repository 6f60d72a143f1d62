"""Heterogeneous fleets (issue 47, parts 2 and 3) against real processes on loopback: a synchronizer
process, a real learner process training a tiny model as fast as this machine lets it, and scripted
protocol clients (:mod:`diloco_async.chaos.scripted`) that jump their step count or claim an absurd
step time.

* The fast learner is never clamped or refused ``implausible_steps``; a learner that jumps its step
  count far beyond the pace it was measured at is (the old fuzz case).
* A learner claiming ``step_time_s = 1e6`` (the largest accepted) while the honest ones send none
  does not hold the rounds in grace: each round waits at most the honest fleet's own grace.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field

import pytest
from tiny_recipe import ROOT

from diloco_async.chaos.scripted import ScriptedLearners
from diloco_async.config.resolved import with_fields
from diloco_async.config.schema import Config
from diloco_async.protocol.auth import learner_token
from diloco_async.protocol.client import SyncClient, fetch_status
from diloco_async.run import RunProcesses
from diloco_async.storage import keys

from polling import await_until, wait_until

pytestmark = [pytest.mark.timeout(300)]

FAST_STEPS_PER_S = 300.0  # the pace of a real learner on a tiny model that the fixed bound refused


@dataclass
class FastRun:
    """What the run with the fast learner and the jumper showed."""

    peak_steps_per_s: float = 0.0  # the fast learner's fastest pace over >= 1 s between two polls
    status: dict = field(default_factory=dict)  # /status at the end
    jump_ack: dict = field(default_factory=dict)  # the answer to the jumper's announcement
    jumper_bound: str = ""  # the jumper's pace bound just before it jumped


def fast_config(tmp_path) -> Config:
    """A tiny model (1 layer, 8 wide, 8 tokens of context, batch 1) that trains at hundreds of steps
    per second on one core; two learner slots, quorum 1. Heartbeats once a second (an ordinary
    setting for a slow link): the fixed bound of before issue 47 (64 + 100 steps/s x two heartbeat
    periods) clamped any learner above about 264 steps/s then."""
    return with_fields(Config(), {
        "run.store": f"file://{tmp_path}/store", "run.workdir": f"{tmp_path}/runs",
        "data.cache_dir": str((ROOT / "data").resolve()),
        "model.n_layer": 1, "model.d_model": 8, "model.n_head": 1, "model.context": 8,
        "learners.count": 2, "learners.batch_size": 1, "learners.heartbeat_s": 1.0,
        "synchronizer.num_fragments": 2, "synchronizer.sync_every": 48, "synchronizer.heartbeat_timeout_s": 5.0,
        "synchronizer.checkpoint_every_s": 100000.0, "synchronizer.drain_s": 0.0, "budget.wall_s": 600.0})


async def jump(url: str, run: RunProcesses, out: FastRun) -> None:
    """Learner-1, scripted: 5 s of honest heartbeats at 100 steps/s from the step it joined at (past
    its 3 s warm-up), then one heartbeat 10^6 steps ahead and an announcement of 10^5 more steps than
    it reported, to an open round (again while the rounds it names close before it announces)."""
    lid = "learner-1"
    async with SyncClient(url, learner_token(run.token, run.run_id, lid), request_timeout_s=10.0) as client:
        step = (await client.join({"learner_id": lid}))["start_step"]  # the global step: it continues there
        tokens = 0  # 16 a step (2 x batch 1 x context 8 is the most)
        for _ in range(20):
            step, tokens = step + 25, tokens + 25 * 16
            await client.heartbeat({"learner_id": lid, "step": step, "tokens_total": tokens})
            await asyncio.sleep(0.25)
        out.jumper_bound = (await client.status())["learners"][lid]["pace_bound"]
        await client.heartbeat({"learner_id": lid, "step": step + 10**6, "tokens_total": tokens})

        async def refused():  # (its honest step again: below the one credited, it changes nothing)
            hb = await client.heartbeat({"learner_id": lid, "step": step, "tokens_total": tokens})
            for r in hb["open_rounds"]:
                p, n = r["fragment"], r["round_n"]
                ack = await client.announce({
                    "learner_id": lid, "fragment": p, "round_n": n, "base_version": r["version"],
                    "c_steps": step + 10**5, "c_tokens": step + 10**5, "compute_s": 1.0,
                    "key": keys.contribution_key(run.run_id, p, n, lid, uuid.uuid4().hex[:8]),
                    "nbytes": 100, "sha256": "0" * 64, "codec": "fp32", "update_id": uuid.uuid4().hex[:12]})
                if ack["status"] == "rejected":
                    return ack
            return None
        out.jump_ack = await await_until(refused, 60, "the jumper's announcement to meet an open round", 0.05)


@pytest.fixture(scope="module")
def fast_run(tmp_path_factory) -> FastRun:
    tmp_path = tmp_path_factory.mktemp("pace")
    run = RunProcesses(fast_config(tmp_path))
    out = FastRun()
    try:
        url = run.start_synchronizer()
        run.start_learner(0)
        seen: list[tuple[float, int]] = []  # (monotonic s, the fast learner's step) at each poll

        def poll() -> dict:
            st = fetch_status(url)
            if "learner-0" in st["learners"]:
                seen.append((time.monotonic(), st["learners"]["learner-0"]["step"]))
            return st

        def warm_and_merging() -> bool:  # the fast learner measured past its warm-up, 10 merges
            st = poll()
            me = st["learners"].get("learner-0")
            return me is not None and me["pace_bound"].startswith("4 x measured") and st["merges"] >= 10
        try:
            wait_until(warm_and_merging, 120, "the fast learner's pace measured and 10 merges", interval_s=0.5)
        except AssertionError as err:  # (the fixed bound of before issue 47: every contribution refused)
            st = fetch_status(url)
            raise AssertionError(f"{err}: merges {st['merges']}, clamped {st['clamped_by_reason']}, rejected "
                                 f"{st['rejected_by_reason']}, abandoned {st['rounds_abandoned_by_reason']}") from None
        asyncio.run(jump(url, run, out))
        wait_until(lambda: poll() and seen[-1][0] - seen[0][0] > 20, 60, "20 s of the fast learner's steps",
                   interval_s=0.5)
        out.status = fetch_status(url)
        out.peak_steps_per_s = max(((s2 - s1) / (t2 - t1) for i, (t1, s1) in enumerate(seen)
                                    for t2, s2 in seen[i + 1:] if t2 - t1 >= 1.0), default=0.0)
    finally:
        run.stop_all()
    return out


def test_a_fast_learner_is_never_clamped_or_refused_implausible_steps(fast_run):
    """Issue 47: on a small model real learners run ~300 inner steps/s; the fixed bound of 100
    steps/s clamped their heartbeats and refused their contributions (implausible_steps), and the
    rounds were abandoned. Fails on the code before issue 47 (its heartbeats are clamped)."""
    st, me = fast_run.status, fast_run.status["learners"]["learner-0"]
    print(f"fast learner: peak {fast_run.peak_steps_per_s:.0f} steps/s between polls, measured "
          f"{me['measured_steps_per_s']:.0f} steps/s, bound {me['pace_bound_steps_per_s']:.0f} ({me['pace_bound']}); "
          f"{st['merges']} merges")
    assert st["clamped_by_reason"].get("implausible_steps", 0) == 1  # the jumper's jump, none of learner-0's
    assert "rejected" not in me["contributions"] and me["contributions"]["merged"] >= 10
    assert st["merges"] >= 10 and st["rounds_abandoned"] == 0
    if fast_run.peak_steps_per_s < FAST_STEPS_PER_S:  # checked, but not at the pace the case is about
        pytest.skip(f"this machine ran the tiny learner at only {fast_run.peak_steps_per_s:.0f} steps/s "
                    f"(the case needs {FAST_STEPS_PER_S:.0f}+); the checks above held")


def test_a_learner_that_jumps_beyond_its_measured_pace_is_refused(fast_run):
    """The old fuzz case, calibrated: the jumper's bound came from its measured pace (~100 steps/s),
    and its jump was clamped and its announcement refused, counted once."""
    st = fast_run.status
    assert fast_run.jumper_bound.startswith("4 x measured"), fast_run.jumper_bound
    assert fast_run.jump_ack["reason"].startswith("implausible_steps"), fast_run.jump_ack
    assert "4 x measured" in fast_run.jump_ack["reason"]
    assert st["rejected_by_reason"].get("implausible_steps") == 1
    assert st["clamped_by_reason"].get("implausible_steps", 0) >= 1
    assert st["learners"]["learner-1"]["step"] < 10**5  # its jump was not taken


# -- the grace window -------------------------------------------------------------------------

class HeartbeatOnly(ScriptedLearners):
    """Scripted learners that heartbeat (and step) like the honest ones but never contribute."""

    async def _contribute(self, client, lid, r) -> None:
        return None


def grace_config(tmp_path) -> Config:
    """Scripted learners only (no model): 2 fragments, H = 4, quorum 2 of 3 live learners, grace
    as in the default recipe (cap: one step time of the slowest learner; 0.5 s before any estimate)."""
    return with_fields(Config(), {
        "run.store": f"file://{tmp_path}/store", "run.workdir": f"{tmp_path}/runs", "model.n_layer": 1,
        "model.d_model": 16, "model.n_head": 2, "model.context": 8, "learners.count": 3,
        "synchronizer.num_fragments": 2, "synchronizer.sync_every": 4, "synchronizer.min_quorum": 2,
        "synchronizer.heartbeat_timeout_s": 5.0, "synchronizer.checkpoint_every_s": 100000.0,
        "synchronizer.drain_s": 0.0, "budget.wall_s": 3600.0})


async def drive_grace(run: RunProcesses, url: str, merges: int) -> tuple[dict, list[dict]]:
    """Honest "a" and "c" (no step time reported) contribute to every round; "b" heartbeats with the
    same steps, claims a step time of 1e6 s and never contributes, so each round waits out its grace
    window. Returns the status once ``merges`` merges happened, and the metric points."""
    stop = asyncio.Event()
    honest = ScriptedLearners(url, run.run_id, run.token, run.store, ["a", "c"], step_time_s=None)
    liar = HeartbeatOnly(url, run.run_id, run.token, run.store, ["b"], step_time_s=1e6)
    tasks = [asyncio.create_task(honest.run(stop)), asyncio.create_task(liar.run(stop))]
    try:
        async with SyncClient(url, run.token) as client:
            async def merged():
                st = await client.status()
                return st if st["merges"] >= merges else None
            st = await await_until(merged, 120, f"{merges} merges with the liar live", 0.2)
            points = (await client.metrics(0))["metrics"]
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
    return st, points


def test_a_learner_claiming_a_step_time_of_1e6_s_does_not_hold_the_rounds_in_grace(tmp_path):
    """Issue 47: with only the liar reporting a step time, its 1e6 s set the median alone and every
    round with the honest quorum verified waited up to 600 s. Now the grace window's step time is
    measured from the heartbeats: every round merges after at most the honest fleet's own grace,
    one measured step time of the slower honest learner (0.5 s, the initial grace, before any
    learner was measured). Fails on the code before issue 47 (no merge within the wait)."""
    run = RunProcesses(grace_config(tmp_path))
    try:
        url = run.start_synchronizer()
        st, points = asyncio.run(drive_grace(run, url, merges=12))
    finally:
        run.stop_all()
    graces = [p["value"] for p in points if p["key"] == "sync/grace_s"]
    honest_step_s = max(st["learners"][lid]["measured_step_time_s"] for lid in ("a", "c"))
    liar_step_s = st["learners"]["b"]["measured_step_time_s"]
    print(f"grace per merge (s): {[round(g, 3) for g in graces]}; measured step time (s): honest "
          f"{honest_step_s:.3f}, liar {liar_step_s:.3f}")
    assert len(graces) >= 12 and st["contributions_merged"] >= 24
    assert all(g <= 0.5 for g in graces)  # the initial grace, then a measured step time
    measured = [g for g in graces if g < 0.5]
    assert len(measured) >= 6 and max(measured) <= 1.5 * honest_step_s  # 1.5: the heartbeat timing of three clients
