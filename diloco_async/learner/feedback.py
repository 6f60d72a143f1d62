"""A learner's error-feedback residuals, by fragment (``learners.error_feedback``; DESIGN §6).

The comms thread encodes each contribution with :func:`~diloco_async.codec.feedback.compensate`
(Δ plus the fragment's residual) and keeps the residual it leaves only for an upload that was
made and taken:

* the encode or the put fails: nothing was sent, the residual stays as it was;
* the put succeeded: the new residual is current at once (the next upload of the fragment, which
  the comms thread makes after this one, builds on it);
* the announcement is then refused, late, or never acknowledged (anything but ``accepted`` or
  ``duplicate``): the synchronizer will not merge what was sent, and the learner's progress it
  carried either stays in θ (the next Δ measures it again from the same base) or is thrown away by
  an overwrite adoption; either way the residual goes back to the one before the upload, unless a
  newer upload of the fragment already built on it (only possible with announcements that run
  beside the uploads, ``synchronizer.shards`` > 1; logged).

The training thread reads :meth:`ErrorFeedback.tensors` into the inner state it spools: residuals
are replaced whole, never written in place, so the spooled ones are consistent without a copy.
"""

from __future__ import annotations

import logging
import threading

import torch

from diloco_async.codec.feedback import compensate, residual_bound

__all__ = ["ErrorFeedback", "RESIDUAL_PREFIX"]

log = logging.getLogger("diloco.learner")

#: key prefix of the residuals in an inner state: ``residual/{fragment}/{tensor name}``
RESIDUAL_PREFIX = "residual/"

#: acknowledgement statuses of a contribution the synchronizer took
TAKEN = ("accepted", "duplicate")


class ErrorFeedback:
    """The residuals of one learner, fp32 on the host, by fragment then tensor name (about the
    model's fp32 size once every fragment has uploaded). Thread-safe."""

    def __init__(self, learner_id: str) -> None:
        self.learner_id = learner_id
        self._lock = threading.Lock()
        self._residual: dict[int, dict[str, torch.Tensor]] = {}
        self.reverted = 0  # residuals put back after an upload that was not taken
        self.kept = 0  # residuals of uploads that were not taken, kept because a newer upload built on them

    def encode(self, fragment: int, delta: dict[str, torch.Tensor], codec: str
               ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Δ of ``fragment`` plus its residual, encoded in ``codec``; returns (encoded, the residual
        it would leave), which :meth:`put_made` makes current. ``delta`` is consumed.

        Raises:
            ValueError: as :func:`~diloco_async.codec.feedback.compensate`.
        """
        with self._lock:
            residual = self._residual.get(fragment)
        return compensate(delta, residual, codec)

    def put_made(self, fragment: int, residual: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
        """The upload that left ``residual`` was put: it becomes current. Returns the one before
        (None: zeros), for :meth:`settle`."""
        with self._lock:
            before = self._residual.get(fragment)
            self._residual[fragment] = residual
        return before

    def settle(self, fragment: int, residual: dict[str, torch.Tensor], before: dict[str, torch.Tensor] | None,
               status: str) -> None:
        """The announcement of the upload that left ``residual`` ended with ``status``: a
        contribution not taken gives the residual ``before`` it back (see the module docstring)."""
        if status in TAKEN:
            return
        with self._lock:
            if self._residual.get(fragment) is residual:
                if before is None:
                    self._residual.pop(fragment, None)
                else:
                    self._residual[fragment] = before
                self.reverted += 1
                what = "put back"
            else:
                self.kept += 1
                what = "kept (a newer upload builds on it)"
        log.info("%s fragment %d: contribution %s, its error-feedback residual %s", self.learner_id, fragment,
                 status, what)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The residuals as inner-state entries ``residual/{fragment}/{name}`` (the live tensors)."""
        with self._lock:
            return {f"{RESIDUAL_PREFIX}{p}/{n}": t for p, r in self._residual.items() for n, t in r.items()}

    def restore(self, tensors: dict[str, torch.Tensor]) -> int:
        """Take the ``residual/…`` entries of a saved inner state (removed from ``tensors``);
        returns how many fragments had one."""
        restored: dict[int, dict[str, torch.Tensor]] = {}
        for key in [k for k in tensors if k.startswith(RESIDUAL_PREFIX)]:
            p, name = key[len(RESIDUAL_PREFIX):].split("/", 1)
            restored.setdefault(int(p), {})[name] = tensors.pop(key).to(torch.float32)
        with self._lock:
            self._residual = restored
        return len(restored)

    def largest(self) -> float:
        """The largest |e| over every fragment's residual (0.0 with none)."""
        with self._lock:
            return max((residual_bound(r) for r in self._residual.values()), default=0.0)
