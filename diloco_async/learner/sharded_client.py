"""A learner's client of a run's synchronizer shards (issue 40 item 2; DESIGN §2.2).

:class:`ShardedSyncClient` has the API the comms use from one
:class:`~diloco_async.protocol.client.SyncClient` (``join``, ``heartbeat``, ``announce``, ``push``,
``request_timeout_s``, ``before_post``, ``sent_by_transport``) over one client per shard:

* ``join`` joins every shard; an answer whose ``shards`` differs from the number of URLs, or whose
  ``shard`` is not its URL's position, raises :class:`ShardListMismatch` (the learner exits 2); the
  shards' plans must be equal. The answers merge: versions (disjoint by fragment) concatenated, the
  run's config and plan of the first, the highest ``start_step``, the epochs joined with ``+``, the
  highest ``run_tokens`` (every shard counts every learner's heartbeats).
* ``heartbeat`` goes to every shard (each computes the global step from the same heartbeats); the
  answers merge: open rounds and versions concatenated, ``stop`` when every shard that answered
  said stop (the budget stop is the run's: the shards follow the first that stops, DESIGN §2.2; a
  learner cut off from one shard then still hears it from the others), the epochs joined (an
  unreachable shard's as it last answered, so it does not look restarted), the highest
  ``run_tokens`` (an unreachable shard's as it last answered). A
  shard that answers ``known=False`` is joined again at once (that shard only). A shard that cannot
  be reached is logged, counted (:attr:`ShardedSyncClient.unreachable`) and left out of the answer
  while another answers; when none answers the first error is raised (the comms' retry and give-up
  apply).
* ``announce`` goes to the owner of the contribution's fragment (:func:`~diloco_async.policy.shards.shard_of`).
* ``push`` opens every shard's channel and hands on their events as one stream; it ends (the comms
  reconnect) when any of them ends. A ``stop`` event is handed on once every shard has sent one: the
  shards drain their own last rounds, and one whose drain ended first would otherwise stop the
  learner before it answered another's (which then waited out its whole drain, issue 40 part c).

With one URL it behaves as the one client it wraps.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from diloco_async.policy.shards import shard_of
from diloco_async.protocol.client import ProtocolError, SyncClient

__all__ = ["ShardedSyncClient", "ShardListMismatch", "split_sync_urls"]

log = logging.getLogger("diloco.learner")


class ShardListMismatch(ProtocolError):
    """The learner's list of shard URLs disagrees with the shards' join answers (the learner exits 2)."""


def split_sync_urls(urls: str) -> list[str]:
    """The shard URLs of ``--sync-url`` (comma-separated, in shard order), without trailing slashes.

    Raises:
        ValueError: an empty entry (the message names the list).
    """
    out = [u.strip().rstrip("/") for u in urls.split(",")]
    if not all(out):
        raise ValueError(f"--sync-url {urls!r}: an empty URL in the comma-separated list of shard URLs")
    return out


class ShardedSyncClient:
    """Clients of every shard of one run, used as one (see the module doc).

    Args:
        urls: the shards' base URLs, in shard order (one: an unsharded run).
        token: this learner's own token (the same for every shard).
        link_delay_s: as :class:`~diloco_async.protocol.client.SyncClient`.
    """

    def __init__(self, urls: list[str], token: str | None, *, link_delay_s: float = 0.0) -> None:
        self.urls = list(urls)
        self.clients = [SyncClient(u, token, link_delay_s=link_delay_s) for u in self.urls]
        self._join_body: dict | None = None
        self._epochs = [""] * len(self.urls)  # each shard's epoch as last answered
        self._run_tokens = [0.0] * len(self.urls)  # each shard's run_tokens as last answered
        self.unreachable: Counter[int] = Counter()  #: heartbeats a shard did not answer, by shard

    @property
    def request_timeout_s(self) -> float:
        return self.clients[0].request_timeout_s

    @request_timeout_s.setter
    def request_timeout_s(self, value: float) -> None:
        for c in self.clients:
            c.request_timeout_s = value

    @property
    def before_post(self) -> Callable[[str], Awaitable[None]] | None:
        return self.clients[0].before_post

    @before_post.setter
    def before_post(self, hook: Callable[[str], Awaitable[None]] | None) -> None:
        for c in self.clients:
            c.before_post = hook

    @property
    def sent_by_transport(self) -> Counter[str]:
        """Heartbeats and announcements sent, by transport: the one client's own counter (it goes on
        counting) with one shard, a sum taken now with more."""
        if len(self.clients) == 1:
            return self.clients[0].sent_by_transport
        return sum((c.sent_by_transport for c in self.clients), Counter())

    async def __aenter__(self) -> ShardedSyncClient:
        for c in self.clients:
            await c.__aenter__()
        return self

    async def __aexit__(self, *exc: object) -> None:
        for c in self.clients:
            await c.__aexit__(*exc)

    # -- requests -----------------------------------------------------------------------------

    def _check(self, i: int, answer: dict) -> None:
        shards, shard = int(answer.get("shards", 1)), int(answer.get("shard", 0))
        if shards != len(self.urls) or shard != i:
            raise ShardListMismatch(
                f"--sync-url lists {len(self.urls)} shard URL(s) and {self.urls[i]} is position {i} of them, but "
                f"that synchronizer answers shard={shard} of synchronizer.shards={shards}: list the run's shard URLs "
                "in shard order")

    async def join(self, body: dict) -> dict:
        """Join every shard; the merged ``JoinResponse`` (see the module doc).

        Raises:
            ShardListMismatch: the URL list disagrees with the answers, or the shards' plans differ.
        """
        self._join_body = dict(body)
        answers = await asyncio.gather(*(c.join(body) for c in self.clients))
        for i, a in enumerate(answers):
            self._check(i, a)
            if a["schema_hash"] != answers[0]["schema_hash"] or a["run_id"] != answers[0]["run_id"]:
                raise ShardListMismatch(f"shard {i} at {self.urls[i]} serves run {a['run_id']} schema "
                                        f"{a['schema_hash'][:12]}, shard 0 run {answers[0]['run_id']} schema "
                                        f"{answers[0]['schema_hash'][:12]}")
        if len(answers) == 1:
            return answers[0]
        merged = dict(answers[0])
        merged["versions"] = [v for a in answers for v in a["versions"]]
        merged["start_step"] = max(int(a.get("start_step", 0)) for a in answers)
        self._epochs = [a["epoch"] for a in answers]
        merged["epoch"] = "+".join(self._epochs)
        self._run_tokens = [float(a.get("run_tokens", 0.0)) for a in answers]
        merged["run_tokens"] = max(self._run_tokens)
        return merged

    async def heartbeat(self, body: dict) -> dict:
        """A heartbeat to every shard; the merged ``HeartbeatResponse`` (see the module doc)."""
        if len(self.clients) == 1:
            return await self.clients[0].heartbeat(body)
        answers = await asyncio.gather(*(c.heartbeat(body) for c in self.clients), return_exceptions=True)
        got: list[dict] = []
        for i, a in enumerate(answers):
            if isinstance(a, ProtocolError):
                raise a
            if isinstance(a, BaseException):
                self.unreachable[i] += 1
                log.warning("shard %d at %s unreachable (%s: %s); the other shards go on", i, self.urls[i],
                            type(a).__name__, a)
                continue
            if not a.get("known", True) and self._join_body is not None:
                self._check(i, await self.clients[i].join(self._join_body))  # that shard only
                a = await self.clients[i].heartbeat(body)
            self._epochs[i] = a.get("epoch", self._epochs[i])
            self._run_tokens[i] = float(a.get("run_tokens", self._run_tokens[i]))
            got.append(a)
        if not got:
            raise next(a for a in answers if isinstance(a, BaseException))
        return {"open_rounds": [r for a in got for r in a.get("open_rounds", [])],
                "versions": [v for a in got for v in a.get("versions", [])],
                "stop": all(a.get("stop", False) for a in got),
                "known": all(a.get("known", True) for a in got),
                "epoch": "+".join(self._epochs),  # an unreachable shard's as last answered
                "run_tokens": max(self._run_tokens)}

    async def announce(self, body: dict) -> dict:
        """An announcement to the shard that owns its fragment."""
        return await self.clients[shard_of(int(body["fragment"]), len(self.clients))].announce(body)

    async def lease(self, body: dict) -> dict:
        """A lease request, to shard 0 (leases run with one synchronizer: ``config/slices.py``)."""
        return await self.clients[0].lease(body)

    @contextlib.asynccontextmanager
    async def push(self, learner_id: str) -> AsyncIterator[AsyncIterator[dict]]:
        """Every shard's push channel as one stream of events (ends when the channel of a shard that
        has not stopped ends). A ``stop`` is handed on once every shard has sent its own: a shard
        whose drain ended first must not stop the learner while another shard's last rounds still
        wait for it."""
        if len(self.clients) == 1:
            async with self.clients[0].push(learner_id) as events:
                yield events
            return
        async with contextlib.AsyncExitStack() as stack:
            streams = [await stack.enter_async_context(c.push(learner_id)) for c in self.clients]
            queue: asyncio.Queue[Any] = asyncio.Queue()
            done = object()

            async def pump(i: int, events: AsyncIterator[dict]) -> None:
                try:
                    async for event in events:
                        await queue.put((i, event))
                finally:
                    await queue.put((i, done))

            tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]

            async def merged() -> AsyncIterator[dict]:
                stopped: set[int] = set()
                while True:
                    i, event = await queue.get()
                    if event is done:
                        if i in stopped:  # a shard that stopped and exited: the others' channels go on
                            continue
                        return
                    if event.get("type") == "stop":
                        stopped.add(i)
                        if len(stopped) < len(streams):
                            log.info("synchronizer shard %d stopped (%s); waiting for the other shards' stops",
                                     i, event.get("reason"))
                            continue
                    yield event

            try:
                yield merged()
            finally:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
