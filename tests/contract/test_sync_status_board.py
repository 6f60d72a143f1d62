"""The status snapshot is built on demand (issue 17): ``/health`` reads the actor's O(1) tick, and
a ``GET /status`` that finds the newest snapshot stale waits for the actor to build one, shared by
every request that waits, while no snapshot is built when nobody asks."""

from __future__ import annotations

import asyncio
import time
import uuid

from aiohttp.test_utils import TestClient, TestServer

from diloco_async.config.schema import load_config
from diloco_async.storage.store import ObjectStore
from diloco_async.sync import Synchronizer, make_app
from diloco_async.sync.snapshot import COST_FACTOR, StatusBoard

from polling import await_until

TOKEN = "test-token-status-board-123"
#: a wait that only a published snapshot or a closed board ends; the test gives up on it after
#: FAILS_AFTER_S (a failure mode, not a bound on seconds)
NEVER_S, FAILS_AFTER_S = 3600.0, 30.0


class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_a_stale_snapshot_is_waited_for_and_a_fresh_one_is_not():
    async def main() -> None:
        clock = _Clock()
        board = StatusBoard(clock)
        assert board.due() and board.health("r")[0] is False  # nothing yet: not healthy
        board.publish({"phase": "running", "n": 1}, build_s=0.01)
        clock.t += 0.5 * COST_FACTOR * 0.01  # younger than COST_FACTOR times its build: fresh
        await asyncio.wait_for(board.wait_fresh(timeout_s=NEVER_S), FAILS_AFTER_S)  # returns without a build
        assert not board.wanted()
        clock.t += COST_FACTOR * 0.01  # now stale: the requests wait for the actor
        waiters = [asyncio.ensure_future(board.wait_fresh(timeout_s=NEVER_S)) for _ in range(3)]
        await asyncio.sleep(0)  # each waiter runs to its wait
        assert board.wanted() and not any(w.done() for w in waiters)
        board.publish({"phase": "running", "n": 2}, build_s=0.01)  # one build for every waiting request
        await asyncio.wait_for(asyncio.gather(*waiters), FAILS_AFTER_S)  # only the publish can end them
        assert not board.wanted() and board.seq == 2 and '"n": 2' in board.status_body({})
        clock.t += 1.0
        t0 = time.monotonic()
        # no actor answers: the newest snapshot, after at least the timeout
        await asyncio.wait_for(board.wait_fresh(timeout_s=0.1), FAILS_AFTER_S)
        assert time.monotonic() - t0 >= 0.09 and board.seq == 2
        board.close()
        await asyncio.wait_for(board.wait_fresh(timeout_s=NEVER_S), FAILS_AFTER_S)  # the actor is gone: no wait
        board.tick("finishing")
        ok, body = board.health("r")
        assert ok and body["phase"] == "finishing" and body["status_age_s"] == 0.0

    asyncio.run(main())


async def actor_passes(board: StatusBoard, n: int) -> None:
    """Return once the actor has passed its loop at least ``n`` more times (each pass ticks the
    board with a new time); waiting for passes, not for a time in which some probably happened."""
    seen = {board.ticked_s}

    async def passed() -> bool:
        seen.add(board.ticked_s)
        return len(seen) > n

    await await_until(passed, FAILS_AFTER_S, f"{n} passes of the actor", interval_s=0.002)


def test_the_actor_builds_a_snapshot_only_when_one_is_asked_for():
    cfg = load_config(None, ["model.n_layer=1", "model.d_model=16", "model.n_head=2", "model.context=8",
                             "synchronizer.num_fragments=2", "budget.wall_s=600"])

    async def main() -> None:
        sync = Synchronizer(cfg, ObjectStore(f"memory://board-{uuid.uuid4().hex}"), "run1")
        client = TestClient(TestServer(make_app(sync, TOKEN), host="127.0.0.1"))
        await client.start_server()
        actor = asyncio.get_running_loop().create_task(sync.run())
        try:
            await actor_passes(sync.board, 5)  # the actor passes many times (its 50 ms tick): nobody asked
            assert sync.board.seq == 0 and sync.board.ticked_s is not None
            health = await (await client.get("/health")).json()
            # ok: the tick is younger than STALE_AFTER_S; its age is the tick's, not a snapshot's
            assert health["ok"] and health["phase"] == "running" and health["status_age_s"] >= 0
            assert sync.board.seq == 0  # /health builds nothing
            bodies = await asyncio.gather(*[(await client.get("/status")).json() for _ in range(4)])
            assert all(b["phase"] == "running" and "learners" in b for b in bodies)
            assert 1 <= sync.board.seq <= 4 and bodies[0]["snapshot_seq"] >= 1
            seq = sync.board.seq
            await actor_passes(sync.board, 5)
            assert sync.board.seq == seq  # again nobody asked: nothing built
        finally:
            actor.cancel()
            await asyncio.gather(actor, return_exceptions=True)
            await client.close()
            sync.close()

    asyncio.run(main())
