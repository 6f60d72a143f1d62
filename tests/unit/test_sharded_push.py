"""A learner's push channel over synchronizer shards (diloco_async/learner/sharded_client.py; DESIGN
§2.2): every shard's events as one stream, and a ``stop`` handed on only once every shard sent its
own, so a shard whose drain ended first does not stop the learner before another's last rounds (and
its channel ending as it exits does not end the stream)."""

from __future__ import annotations

import asyncio
import contextlib

from diloco_async.learner.sharded_client import ShardedSyncClient


class _Channel:
    """A shard's push channel: its scripted events; ``None`` waits for ``gate``; then it stays open,
    or ends when ``ends`` (the shard exited)."""

    def __init__(self, events: list[dict | None], gate: asyncio.Event, ends: bool = False) -> None:
        self.events, self.gate, self.ends = events, gate, ends

    @contextlib.asynccontextmanager
    async def push(self, learner_id: str):
        async def events():
            for event in self.events:
                if event is None:
                    await self.gate.wait()
                else:
                    yield event
            if not self.ends:
                await asyncio.Event().wait()

        yield events()


async def _stream() -> list[dict]:
    gate = asyncio.Event()
    client = ShardedSyncClient(["http://a", "http://b"], None)
    client.clients = [  # shard 0 stops, sends one more event and exits; shard 1 stops once the gate opens
        _Channel([{"type": "version", "fragment": 0}, {"type": "stop", "reason": "budget, shard 0"},
                  {"type": "version", "fragment": 2}], gate, ends=True),  # then shard 0 exits
        _Channel([{"type": "round_open", "fragment": 1}, None, {"type": "stop", "reason": "budget, shard 1"}], gate),
    ]
    seen: list[dict] = []
    async with client.push("learner-0") as events:
        stream = aiter(events)
        while len(seen) < 3:  # both shards' events before the gate, shard 0's last one after its stop
            seen.append(await asyncio.wait_for(anext(stream), 10))
        gate.set()  # shard 1's drain ends: its stop follows
        seen.append(await asyncio.wait_for(anext(stream), 10))
    return seen


def test_a_stop_is_handed_on_once_every_shard_has_sent_one() -> None:
    seen = asyncio.run(_stream())
    assert [e["type"] for e in seen[:-1]].count("stop") == 0, seen  # shard 0's stop was held back
    assert sorted(e["type"] for e in seen[:-1]) == ["round_open", "version", "version"]
    assert seen[-1] == {"type": "stop", "reason": "budget, shard 1"}
