"""A learner's leased slices (issue 45 items 2 and 4; DESIGN §5.2): which tokens its next inner step
trains on, which slices each contribution names, and which it hands back.

:class:`SliceFeed` is shared by the training thread and the comms thread. The comms thread's
:func:`lease_loop` keeps up to :data:`PREFETCH_SLICES` slices ahead of the one being trained (the
next lease is asked for while the current one trains) and hands back finished slices. The training
thread takes each inner step's tokens from the slice in hand (:meth:`SliceFeed.take`: contiguous
windows, in stream order), credits them to every fragment (:meth:`SliceFeed.trained`), names a
fragment's slices in its contribution (:meth:`SliceFeed.named`: those trained since the learner last
adopted that fragment, the same span ``c_tokens`` counts) and forgets them when it adopts
(:meth:`SliceFeed.adopted`). A slice is released once it is finished and no fragment's next
contribution can name it again.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any

import aiohttp

from diloco_async.protocol.client import ProtocolError

__all__ = ["SliceFeed", "lease_loop", "PREFETCH_SLICES"]

log = logging.getLogger("diloco.learner")

#: slices held beyond the one in hand: the next is leased while the current one trains
PREFETCH_SLICES = 1


@dataclass
class _InHand:
    slice_id: int
    start: int  # first token in the training stream
    tokens: int
    used: int = 0  # tokens trained so far


class SliceFeed:
    """The slices of one learner (see the module docstring).

    Args:
        fragments: P, the fragments of the plan (each keeps its own slices since its adoption).
    """

    def __init__(self, fragments: int) -> None:
        self.lock = threading.Lock()
        self.queue: deque[_InHand] = deque()  # leased, not started (comms adds, training takes)
        self.hand: _InHand | None = None  # the slice being trained (training thread)
        self.finished: set[int] = set()  # trained to the end, not released yet (training thread)
        self.to_release: list[int] = []  # for the next lease request (under lock)
        self.revoked: set[int] = set()  # no longer ours: the synchronizer said so (under lock)
        self.since: list[dict[int, int]] = [{} for _ in range(fragments)]  # per fragment: slice -> tokens
        self.outstanding: dict[tuple[int, int], list[int]] = {}  # (fragment, round) uploading or announcing -> slices
        self.epoch = 0
        self.starved = 0  # steps skipped for want of a slice
        self.step_tokens = 0  # tokens of one inner step (the training thread's last take)

    # -- training thread ----------------------------------------------------------------------

    def take(self, tokens: int) -> tuple[int, int] | None:
        """(slice, first token) of the next ``tokens`` tokens to train on, or None when no leased
        slice has that many left (the step waits; the comms thread is asking for more)."""
        with self.lock:
            self.step_tokens = tokens
            while True:
                hand = self.hand
                if hand is not None and hand.slice_id not in self.revoked and hand.used + tokens <= hand.tokens:
                    first = hand.start + hand.used
                    hand.used += tokens
                    return hand.slice_id, first
                if hand is not None:
                    if hand.slice_id not in self.revoked:
                        self.finished.add(hand.slice_id)
                    self.hand = None
                    self._releasable()
                if not self.queue:
                    self.starved += 1
                    return None
                self.hand = self.queue.popleft()

    def trained(self, slice_id: int, tokens: int) -> None:
        """One inner step trained ``tokens`` tokens of ``slice_id``: every fragment's next contribution covers them."""
        for since in self.since:
            since[slice_id] = since.get(slice_id, 0) + tokens

    def named(self, fragment: int, round_n: int) -> list[int]:
        """The slices the contribution of ``fragment`` to round ``round_n`` names (trained since the
        fragment's last adoption, still ours); none is released until :meth:`settled` hears its fate."""
        with self.lock:
            named = self.outstanding[(fragment, round_n)] = sorted(s for s in self.since[fragment]
                                                                   if s not in self.revoked)
            return named

    def settled(self, fragment: int, round_n: int) -> None:
        """The synchronizer answered that contribution (or its upload failed): the synchronizer now
        knows whether it is in a round, so its slices may be handed back once nothing else names them."""
        with self.lock:
            if self.outstanding.pop((fragment, round_n), None) is not None:
                self._releasable()

    def adopted(self, fragment: int, progress_kept: bool) -> None:
        """``fragment`` was adopted; unless the adoption kept the progress (``rebase``), its next
        contribution covers none of the slices trained before."""
        if not progress_kept:
            self.since[fragment].clear()
            with self.lock:
                self._releasable()

    def _releasable(self) -> None:
        busy = {s for named in self.outstanding.values() for s in named}
        done = [s for s in self.finished if s not in busy and all(s not in since for since in self.since)]
        for s in done:
            self.finished.discard(s)
        self.to_release.extend(done)

    # -- comms thread -------------------------------------------------------------------------

    def request_body(self, learner_id: str, incarnation: int) -> dict | None:
        """The next ``LeaseRequest``, or None when nothing is wanted nor to hand back."""
        with self.lock:
            hand = self.hand
            in_hand = hand is not None and hand.used + self.step_tokens <= hand.tokens
            want = max(0, PREFETCH_SLICES + 1 - len(self.queue) - in_hand)
            if not want and not self.to_release:
                return None
            held = [h.slice_id for h in self.queue] + ([hand.slice_id] if hand is not None else [])
            body = {"learner_id": learner_id, "incarnation": incarnation, "want": want,
                    "release": list(self.to_release), "held": held}
            self.to_release.clear()
            return body

    def answered(self, resp: dict) -> int:
        """Take a ``LeaseResponse``: new slices queued, revoked ones dropped. Returns the slices added."""
        with self.lock:
            self.epoch = int(resp.get("epoch", self.epoch))
            gone = set(int(s) for s in resp.get("revoked", ()))
            self.revoked |= gone
            self.queue = deque(h for h in self.queue if h.slice_id not in gone)
            have = {h.slice_id for h in self.queue} | ({self.hand.slice_id} if self.hand else set()) | self.finished
            added = 0
            for s, start, tokens in resp.get("slices", ()):
                if int(s) in have and int(s) not in gone:  # leased to us again (a restarted synchronizer): once
                    continue
                self.revoked.discard(int(s))
                self.queue.append(_InHand(int(s), int(start), int(tokens)))
                added += 1
            return added

    def unsent(self, body: dict) -> None:
        """A request that got no answer: its releases go with the next one."""
        with self.lock:
            self.to_release.extend(body["release"])


async def lease_loop(shared: Any, client: Any, learner_id: str, incarnation: int, period_s: float = 0.05) -> None:
    """Keep ``shared.slices`` (the learner's :class:`SliceFeed`; None with leases off: returns) supplied
    through ``client.lease`` until ``shared.stop_event`` is set; waits for ``shared.ready`` (the
    run's config known). A failed request is logged and tried again (its releases kept).
    ``shared``: the learner's :class:`~diloco_async.learner.state.Shared`."""
    while not shared.ready.is_set():
        if shared.stop_event.is_set():
            return
        await asyncio.sleep(period_s)
    feed: SliceFeed | None = shared.slices
    if feed is None:
        return
    failures = 0
    while not shared.stop_event.is_set():
        body = feed.request_body(learner_id, incarnation)
        if body is None:
            await asyncio.sleep(period_s)
            continue
        try:
            added = feed.answered(await client.lease(body))
            failures = 0
        except (TimeoutError, aiohttp.ClientError, OSError, ProtocolError) as err:
            feed.unsent(body)
            failures += 1
            if failures & (failures - 1) == 0:
                log.warning("%s lease request failed (%d so far): %s", learner_id, failures, err)
            added = 0
        if body["want"] and not added:  # the pool is empty for now (or the run stops): ask again later
            await asyncio.sleep(max(period_s, 0.25))
