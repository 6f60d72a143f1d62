"""A learner's step boundaries in a replayed run (``run.schedule = "replay"``; issue 44 item 2, DESIGN §3.2).

In a free run the comms thread hears of open rounds and new versions whenever they come, and the
training thread takes what has arrived at each step boundary, so what a learner computes depends on
the wall clock. In a replay the training thread asks instead: at each boundary it answers the rounds
the last answer named open (Δ taken here), waits until those contributions are uploaded, sends them
with a heartbeat naming its local step (``replay_announcements``), and waits for the synchronizer's
answer, which comes once every event before this boundary's virtual time has been applied
(:class:`~diloco_async.sync.replay_gate.ReplayGate`). The answer names the versions published up to
that time, which it downloads and adopts before its next step, and the rounds open to it, which it
answers at its next boundary. The comms thread still joins, uploads and sends ordinary heartbeats, but
takes in no round, version or stop from them or from the push channel.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

import aiohttp

from diloco_async.protocol.client import ProtocolError
from diloco_async.protocol.messages import HeartbeatResponse

if TYPE_CHECKING:
    from diloco_async.learner.comms import Comms

__all__ = ["ReplayBoundaries"]

log = logging.getLogger("diloco.learner")

#: seconds between two looks at the upload lane while a boundary waits for its contributions' uploads
UPLOAD_POLL_S = 0.005
#: seconds between two looks, while a boundary waits for its answer, at whether the comms loop still runs
STOP_CHECK_S = 0.5
#: seconds before a boundary not answered (a timeout: it waits for slower learners) is sent again
RESEND_PAUSE_S = 0.05


class ReplayBoundaries:
    """The training thread's side of a replay: :meth:`boundary` at each step boundary.

    Args:
        comms: the learner's comms (its loop, client, uploads, version downloads).
        give_up_after_s: wall seconds a boundary is sent again without an answer before the learner
            gives up (a failure mode only: the synchronizer died; ``replay.stall_timeout_s`` plus
            the client's give-up time).
    """

    def __init__(self, comms: Comms, give_up_after_s: float) -> None:
        self.comms, self.shared = comms, comms.shared
        self.give_up_after_s = give_up_after_s
        self.virtual_s = 0.0  #: the virtual time of the last boundary answered

    def boundary(self, step: int, owed: int) -> dict[tuple[int, int], tuple[int, float]] | None:
        """Boundary ``step`` (blocking), carrying the ``owed`` contributions just queued for upload: returns
        the rounds to answer at the next boundary, as ``shared.open_rounds`` maps them, after queueing
        the versions to adopt in ``shared.adopt_queue`` (downloaded); None when the synchronizer said
        stop (``stop_event`` is then set).

        No answer within ``give_up_after_s``, or one that does not know this learner: ``shared.fatal``
        is set and so is ``stop_event`` (the learner exits 3).
        """
        loop = self.comms.loop
        assert loop is not None, "the comms thread is not running"
        fut = asyncio.run_coroutine_threadsafe(self._exchange(step, owed), loop)
        resp = None
        while True:
            try:
                resp = fut.result(timeout=STOP_CHECK_S)
                break
            except TimeoutError:  # still waiting for the answer; unless the learner is stopping otherwise
                if self.shared.stop_event.is_set() and not loop.is_running():
                    fut.cancel()  # the comms loop has ended: nothing will answer
                    break
            except ProtocolError as err:
                log.error("%s %s", self.comms.learner_id, err)
                self.shared.fatal = str(err)
                break
        if resp is None or resp.stop:
            self.shared.stop_event.set()
            return None
        self.virtual_s = resp.virtual_s or 0.0
        self.shared.run_tokens = resp.run_tokens
        for v in sorted(resp.versions, key=lambda v: v.fragment):
            if v.version > self.shared.base.get(v.fragment, -1):
                self.comms.told(v)
                with self.comms.reading(v):
                    self.shared.adopt_queue.put((v, self.comms.fetch_version(v)))
        return {(r.fragment, r.round_n): (r.version, 0.0) for r in resp.open_rounds}

    async def _exchange(self, step: int, owed: int) -> HeartbeatResponse | None:
        """On the comms loop: the boundary's heartbeat, once the ``owed`` uploads are done, sent (again)
        until answered; None: stopped."""
        uploads, sh = self.comms.uploads, self.shared
        # counted, not read off the queue: a job taken off it is not yet marked as uploading (the upload
        # queue is a thread queue, with no event to await)
        while uploads.replay_done() < owed and not sh.stop_event.is_set():  # noqa: ASYNC110
            await asyncio.sleep(UPLOAD_POLL_S)
        announced = [(job, b) for job, b in uploads.take_replay_outbox() if b is not None]  # None: upload failed
        body = self.comms.heartbeat_body()
        body.update(step=step, replay_announcements=[b for _, b in announced])
        deadline = time.monotonic() + self.give_up_after_s
        while not sh.stop_event.is_set():
            try:
                resp = HeartbeatResponse.model_validate(await self.comms.client.clients[0].step_boundary(body))
            except (TimeoutError, aiohttp.ClientError, OSError) as err:
                if isinstance(err, aiohttp.ClientResponseError) and err.status == 503:
                    return None  # the synchronizer has stopped (answers no request any more)
                if isinstance(err, aiohttp.ClientResponseError) and err.status < 500:  # refused: sent again, alike
                    raise ProtocolError(f"replay: step boundary {step} refused: HTTP {err.status} {err.message}"
                                        ) from err
                if time.monotonic() > deadline:
                    raise ProtocolError(f"replay: no answer to step boundary {step} in {self.give_up_after_s:.0f}s"
                                        ) from err
                log.debug("%s replay boundary %d not answered yet (%s); sent again", self.comms.learner_id, step,
                          type(err).__name__)
                await asyncio.sleep(RESEND_PAUSE_S)
                continue
            if not resp.known:
                raise ProtocolError(f"replay: the synchronizer does not know {self.comms.learner_id} at step {step} "
                                    "(a replayed learner cannot rejoin yet)")
            uploads.settle_replayed(announced, resp.acks or [])
            return resp
        return None
