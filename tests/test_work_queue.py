"""The synchronizer's verification queue (:mod:`diloco_async.sync.work_queue`): order, slots, errors."""

import asyncio

import pytest

from diloco_async.sync.work_queue import WorkQueue


def test_jobs_run_in_order_at_most_slots_at_once_and_a_failure_does_not_stop_the_queue():
    async def go():
        tasks, running, peak, done = set(), [0], [0], []

        def spawn(coro):
            t = asyncio.get_running_loop().create_task(coro)
            tasks.add(t)
            t.add_done_callback(tasks.discard)

        async def job(i):
            running[0] += 1
            peak[0] = max(peak[0], running[0])
            await asyncio.sleep(0.001)
            running[0] -= 1
            if i == 3:
                raise RuntimeError("boom")
            done.append(i)

        q = WorkQueue(2, spawn)
        for i in range(8):
            q.submit(job, i)
        assert q.workers == 2 and len(tasks) == 2 and len(q) == 8  # two workers, not one task per job
        while tasks:
            await asyncio.gather(*list(tasks))
        return q, peak[0], done

    q, peak, done = asyncio.run(go())
    assert peak == 2 and done == [0, 1, 2, 4, 5, 6, 7] and q.workers == 0 and len(q) == 0


def test_slots_must_be_positive():
    with pytest.raises(ValueError):
        WorkQueue(0, lambda coro: None)
