"""Is the learner's link fast enough? (issue 13 item 4, the learner side.)

Each fragment is synchronized once per H inner steps and the P fragments take turns, so one
fragment's network work — the upload of its outer gradient plus the download of its new version —
must fit in the time of H/P inner steps, or the link falls behind the compute (uploads queue up,
versions arrive late). The learner never waits for the network on its training thread (uploads
and downloads run on the comms thread); :class:`LinkMeter` measures the seconds each transfer
takes, by fragment, and says when the link cannot keep up ("link-bound"), with the figures, in
the log and in the heartbeat (``link_s_per_fragment``, ``link_budget_s``). A link-bound learner
adapts: :class:`UploadCodecs` steps its upload codec down a configured ladder
(``learners.link_codecs``; :mod:`diloco_async.policy.link_bound`) and back up when the link keeps up.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

from diloco_async.policy.link_bound import LinkFigures, check_ladder, upload_codec_step

__all__ = ["LinkMeter", "UploadCodecs", "link_budget_s"]

log = logging.getLogger("diloco.learner")


def link_budget_s(step_time_s: float | None, sync_every: int, num_fragments: int) -> float | None:
    """Seconds of H/P inner steps (``step_time_s · sync_every / num_fragments``): the time one
    fragment's upload plus download may take; None while the step time is unknown."""
    if step_time_s is None or num_fragments < 1:
        return None
    return step_time_s * sync_every / num_fragments


class LinkMeter:
    """Seconds and bytes of this learner's transfers, by fragment and direction; thread-safe.

    The seconds of a direction are an exponential moving average (``alpha``) of its transfers.

    Args:
        learner_id: for the log. alpha: EMA weight of the newest transfer, in (0, 1].
        log_every_s: a link-bound learner logs it at most this often.
        confirm: checks in a row (one per heartbeat) before the verdict changes.
    """

    def __init__(self, learner_id: str, alpha: float = 0.3, log_every_s: float = 30.0, confirm: int = 3) -> None:
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.learner_id, self.alpha, self.log_every_s = learner_id, alpha, log_every_s
        self._lock = threading.Lock()
        self._s: dict[str, dict[int, float]] = {"up": {}, "down": {}}
        self.bytes_by_fragment: dict[str, dict[int, int]] = {"up": {}, "down": {}}
        self.uploads = 0  # upload transfers recorded
        self.bound = False
        self.confirm = confirm
        self._streak = 0  # checks in a row that disagree with ``bound``
        self._logged_s = -float("inf")

    def record(self, direction: str, fragment: int, nbytes: int, seconds: float) -> None:
        """One transfer of ``nbytes`` bytes of ``fragment`` that took ``seconds``; ``direction``
        is ``up`` or ``down``.

        Raises:
            ValueError: another direction, or negative bytes or seconds.
        """
        if direction not in self._s or nbytes < 0 or seconds < 0:
            raise ValueError(f"bad transfer record: {direction!r}, {nbytes} bytes, {seconds} s")
        with self._lock:
            ema = self._s[direction]
            old = ema.get(fragment)
            ema[fragment] = seconds if old is None else old + self.alpha * (seconds - old)
            counts = self.bytes_by_fragment[direction]
            counts[fragment] = counts.get(fragment, 0) + nbytes
            self.uploads += direction == "up"

    def upload_s_per_fragment(self) -> float | None:
        """The mean over fragments uploaded of the upload seconds (EMA); None before any upload."""
        with self._lock:
            up = self._s["up"]
            return sum(up.values()) / len(up) if up else None

    def seconds_per_fragment(self) -> float | None:
        """The mean over fragments of (upload seconds + download seconds): the network time one
        fragment's sync takes; None before any transfer."""
        with self._lock:
            frags = set(self._s["up"]) | set(self._s["down"])
            if not frags:
                return None
            return sum(self._s["up"].get(p, 0.0) + self._s["down"].get(p, 0.0) for p in frags) / len(frags)

    def forget_uploads(self) -> None:
        """Drop the upload seconds measured so far (the codec changed: they no longer predict the next)."""
        with self._lock:
            self._s["up"].clear()

    def bytes_snapshot(self) -> tuple[dict[int, int], dict[int, int]]:
        """(bytes up by fragment, bytes down by fragment) since the process started (copies)."""
        with self._lock:
            return dict(self.bytes_by_fragment["up"]), dict(self.bytes_by_fragment["down"])

    def check(self, budget_s: float | None, now_s: float | None = None) -> tuple[float | None, bool]:
        """(seconds per fragment, link-bound?) against ``budget_s`` (:func:`link_budget_s`), with
        hysteresis: bound after ``confirm`` checks in a row that need more than the budget, free
        again after ``confirm`` in a row that need less than 0.9 of it (step times are noisy).
        Logs "link-bound: needs X s per fragment, has Y s" when it becomes bound and then at most
        every ``log_every_s``, and once when it keeps up again."""
        need = self.seconds_per_fragment()
        now_s = time.monotonic() if now_s is None else now_s
        if need is None or budget_s is None:
            return need, self.bound
        over = need > budget_s if not self.bound else need >= 0.9 * budget_s
        self._streak = 0 if over == self.bound else self._streak + 1
        if self._streak >= self.confirm:
            self.bound, self._streak = over, 0
            if not self.bound:
                log.info("%s link keeps up again: %.3f s per fragment, has %.3f s", self.learner_id, need, budget_s)
        if self.bound and now_s - self._logged_s >= self.log_every_s:
            log.warning("%s link-bound: needs %.3f s per fragment, has %.3f s (H/P inner steps); the link cannot "
                        "carry one fragment per H/P steps", self.learner_id, need, budget_s)
            self._logged_s = now_s
        return need, self.bound


class UploadCodecs:
    """The codec this learner encodes its next contributions with; the comms thread updates it
    once per heartbeat from the :class:`LinkMeter` (:func:`~diloco_async.policy.link_bound.upload_codec_step`)
    and logs each change with its figures. The training and upload threads read :attr:`codec`.

    Args:
        learner_id: for the log. ladder: ``learners.codec`` then ``learners.link_codecs``.
        settle_uploads: uploads measured at a codec before it changes again (the meter's upload
            seconds are forgotten at each change; one per fragment measures them all again).

    Raises:
        ValueError: a ladder that is not ever more compressed (:func:`~diloco_async.policy.link_bound.check_ladder`).
    """

    def __init__(self, learner_id: str, ladder: Sequence[str], settle_uploads: int = 4) -> None:
        self.learner_id, self.ladder, self.settle_uploads = learner_id, check_ladder(ladder), settle_uploads
        self.index = 0
        self._uploads_at_change = 0
        self.changes = 0  # steps down or up so far

    @property
    def codec(self) -> str:
        return self.ladder[self.index]

    def update(self, meter: LinkMeter, bound: bool, need_s: float | None, budget_s: float | None) -> str:
        """The codec after this heartbeat's check of ``meter`` (``bound``, ``need_s`` and
        ``budget_s`` from :meth:`LinkMeter.check`)."""
        if len(self.ladder) == 1:
            return self.codec
        figures = LinkFigures(bound, need_s, meter.upload_s_per_fragment(), budget_s)
        step = upload_codec_step(self.ladder, self.index, figures, meter.uploads - self._uploads_at_change,
                                 self.settle_uploads)
        if step.index != self.index:
            log.warning("%s upload codec %s -> %s: %s", self.learner_id, self.codec, self.ladder[step.index],
                        step.reason)
            self.index, self._uploads_at_change = step.index, meter.uploads
            meter.forget_uploads()
            self.changes += 1
        return self.codec
