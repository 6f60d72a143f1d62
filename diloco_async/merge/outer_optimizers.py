"""Pluggable outer optimizers (``synchronizer.outer_optimizer``, DESIGN §4.5b).

Part of :mod:`diloco_async.merge.core` (import it from there). Pure: torch only.

Three outer optimizers share :class:`~diloco_async.merge.outer_step.OuterOptimizer`'s contract: one
step per merged round of a fragment, in place and by chunks into new tensors, the state switched
only once the whole step succeeded (a non-finite ``g`` or, with ``require_finite``, a non-finite
result leaves it unchanged; the synchronizer restores a ``shared_state`` by reference), and the
state is the fragment's value ``Θ``, one buffer ``b`` of the same shapes (checkpointed as the
"momentum") and the step count, so a checkpoint and resume continue bit for bit.

* ``nesterov`` (default, the paper's): :class:`~diloco_async.merge.outer_step.OuterOptimizer`.
* ``sgd``: plain outer SGD, ``Θ ← Θ − η·g``, no momentum (``b`` stays 0). The ablation baseline:
  what the outer momentum buys.
* ``delayed-nesterov``: Delayed Nesterov (DN) of Liu et al., "Asynchronous Local-SGD Training for
  Language Modeling" (arXiv 2401.09135, 2024), proposed for asynchronous outer updates whose
  outer gradients are stale: the momentum buffer is updated only every ``N`` outer steps, from
  the mean of the outer gradients gathered since the last update, and the steps in between are
  plain gradient steps. It is the outer optimizer of the literature designed for the delays
  this product has (a learner's outer gradient is computed on a version up to ``S`` versions old).
  Our reading, written down here because it was taken from a summary of the paper and not from
  its pseudo-code: with the momentum ``m`` (0 at the start) and the step count ``t`` (1-based),

  ``Θ ← Θ − η·g`` for every step, and when ``t mod N = 0`` also ``m ← μm + (g_{t−N+1} + … + g_t)/N``
  and ``Θ ← Θ − η·μm`` (the Nesterov look-ahead, once per period).

  The buffer kept is ``b = μm + (outer gradients so far in this period)/N``: one buffer, not two
  (``m`` and the sum), so checkpoints keep their layout. With ``N = 1`` this is the Nesterov
  step bit for bit (``b`` is then ``μ`` times torch's momentum buffer). In Liu et al. each outer
  step is one worker's update and ``N`` is about the number of workers; here each step already
  merges a quorum of ``K`` learners, so ``N ≈ M / K`` plays that role.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from diloco_async.merge import buffers as _buf
from diloco_async.merge.buffers import _all_finite, _chunks, _flat
from diloco_async.merge.outer_step import OuterOptimizer

__all__ = ["OUTER_OPTIMIZERS", "SgdOuterOptimizer", "DelayedNesterovOuterOptimizer", "make_outer_optimizer"]

OUTER_OPTIMIZERS = ("nesterov", "sgd", "delayed-nesterov")
"""Names of ``synchronizer.outer_optimizer``."""


def _grad_like(p: Tensor, g: Tensor) -> Tensor:
    g = g.detach()
    if g.dtype != p.dtype or g.device != p.device:
        g = g.to(dtype=p.dtype, device=p.device)
    return g


def _check_chunk(name: str, gc: Tensor, npc: Tensor, require_finite: bool, finite: bool) -> bool:
    """Whether the result is still finite after this chunk; raises for a non-finite ``g`` (looked
    at before the result without ``require_finite``, else only once the result is not finite)."""
    if require_finite:
        if finite and not _all_finite(npc):
            if not _all_finite(gc):
                raise ValueError(f"outer step: tensor {name!r} has non-finite values (NaN or Inf)")
            return False
        return finite
    if not _all_finite(gc):
        raise ValueError(f"outer step: tensor {name!r} has non-finite values (NaN or Inf)")
    return finite


class SgdOuterOptimizer(OuterOptimizer):
    """Plain outer SGD: ``Θ ← Θ − η·g``; ``momentum`` is accepted and unused (``b`` stays 0).

    Args and errors as :class:`~diloco_async.merge.outer_step.OuterOptimizer`, except that any
    ``momentum`` is accepted."""

    def _check_momentum(self, momentum: float) -> None:
        pass

    def _zeros(self, name: str, p: Tensor) -> Tensor:
        """The constant zero buffer of ``name`` (made once, never written: shared like ``b``)."""
        zeros = getattr(self, "_zero_buffers", None)
        if zeros is None:
            zeros = self._zero_buffers = {}
        if name not in zeros:
            zeros[name] = torch.zeros_like(p)
        return zeros[name]

    def _step_tensor(self, name: str, p: Tensor, b: Tensor | None, g: Tensor, require_finite: bool,
                     consume: bool, scale: Tensor | None = None) -> tuple[Tensor, Tensor, bool]:
        g = g if scale is None else g * scale
        g_flat, p_flat = _flat(_grad_like(p, g)), p.view(-1)
        new_p = self._empty_like(p)
        np_flat = new_p.view(-1)
        finite = True
        for lo, hi in _chunks(p.numel()):
            gc = g_flat[lo:hi]
            npc = torch.add(p_flat[lo:hi], gc, alpha=-self._lr, out=np_flat[lo:hi])
            finite = _check_chunk(name, gc, npc, require_finite, finite)
        return new_p, self._zeros(name, p), finite


class DelayedNesterovOuterOptimizer(OuterOptimizer):
    """Delayed Nesterov (Liu et al. 2024; the update in the module docstring).

    Args:
        params, lr, momentum, dtype: as :class:`~diloco_async.merge.outer_step.OuterOptimizer`.
        period: keyword-only; ``N`` ≥ 1, outer steps between two momentum updates.

    Raises:
        ValueError: as the base class, and for ``period`` < 1.
    """

    def __init__(self, params: dict[str, Tensor], lr: float = 0.7, momentum: float = 0.9, *,
                 period: int = 4, dtype: torch.dtype | None = None) -> None:
        if isinstance(period, bool) or not isinstance(period, int) or period < 1:
            raise ValueError(f"delayed-nesterov period must be an int >= 1, got {period!r}")
        super().__init__(params, lr, momentum, dtype=dtype)
        self._period = period

    @property
    def period(self) -> int:
        """``N``, outer steps between two momentum updates."""
        return self._period

    def take_back_lookahead(self, share: float) -> dict[str, Tensor]:
        """Unchanged ``Θ``: DN's look-ahead comes once per period, not with every step, so the last
        step has none of its own to take back (checks ``share`` as the base class)."""
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"take_back_lookahead: share must be in [0, 1], got {share}")
        return dict(self._params)

    def _step_tensor(self, name: str, p: Tensor, b: Tensor | None, g: Tensor, require_finite: bool,
                     consume: bool, scale: Tensor | None = None) -> tuple[Tensor, Tensor, bool]:
        g = g if scale is None else g * scale
        mu, neg_lr, inv_n = self._mu, -self._lr, 1.0 / self._period
        updates_momentum = (self._steps + 1) % self._period == 0
        g_flat, p_flat = _flat(_grad_like(p, g)), p.view(-1)
        b_flat = None if b is None else b.view(-1)
        new_p, new_b = self._empty_like(p), self._empty_like(p)
        np_flat, nb_flat = new_p.view(-1), new_b.view(-1)
        tmp = self._scratch(min(p.numel(), _buf.CHUNK_ELEMENTS), p)
        finite = True
        for lo, hi in _chunks(p.numel()):
            gc, nb = g_flat[lo:hi], nb_flat[lo:hi]
            if b_flat is None:  # m = 0 before the first step: b = g/N
                torch.mul(gc, inv_n, out=nb)
            else:  # b = μm + (sum so far)/N
                torch.add(b_flat[lo:hi], gc, alpha=inv_n, out=nb)
            if updates_momentum:  # b is the new m: Nesterov's g + μm, then the next period starts at μm
                t = torch.add(gc, nb, alpha=mu, out=tmp[: hi - lo])
                npc = torch.add(p_flat[lo:hi], t, alpha=neg_lr, out=np_flat[lo:hi])
                nb.mul_(mu)
            else:
                npc = torch.add(p_flat[lo:hi], gc, alpha=neg_lr, out=np_flat[lo:hi])
            finite = _check_chunk(name, gc, npc, require_finite, finite)
        return new_p, new_b, finite


def make_outer_optimizer(kind: str, params: Mapping[str, Tensor], lr: float, momentum: float, *,
                         period: int = 4, dtype: torch.dtype | None = None) -> OuterOptimizer:
    """The outer optimizer ``kind`` (one of :data:`OUTER_OPTIMIZERS`) of one fragment.

    Args:
        kind: ``"nesterov"``, ``"sgd"`` or ``"delayed-nesterov"``.
        params: name → the fragment's current value (copied).
        lr, momentum: outer learning rate η and momentum μ (unused by ``sgd``).
        period: ``N`` of ``delayed-nesterov`` (ignored by the others).
        dtype: the state's dtype, as :class:`~diloco_async.merge.outer_step.OuterOptimizer`.

    Raises:
        ValueError: an unknown ``kind``, or what the optimizer's constructor raises.
    """
    if kind == "nesterov":
        return OuterOptimizer(dict(params), lr, momentum, dtype=dtype)
    if kind == "sgd":
        return SgdOuterOptimizer(dict(params), lr, momentum, dtype=dtype)
    if kind == "delayed-nesterov":
        return DelayedNesterovOuterOptimizer(dict(params), lr, momentum, period=period, dtype=dtype)
    raise ValueError(f"unknown outer optimizer {kind!r}; expected one of {OUTER_OPTIMIZERS}")
