"""The outer Nesterov step of a fragment, in place and by chunks (DESIGN §4.5, §4.5a).

Part of :mod:`diloco_async.merge.core` (import it from there). Pure: torch only.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from diloco_async.merge import buffers as _buf
from diloco_async.merge import native as merge_native
from diloco_async.merge.buffer_pool import BufferPool
from diloco_async.merge.buffers import _all_finite, _check_finite, _check_same_keys, _check_shapes, _chunks, _flat

__all__ = ["OuterOptimizer", "OuterState"]


class OuterOptimizer:
    """The outer Nesterov step of one fragment (DESIGN §4.5), in place and by chunks.

    ``b ← μb + g; Θ ← Θ − η(g + μb)``, bit for bit as ``torch.optim.SGD(lr=η, momentum=μ,
    nesterov=True)`` (the same elementwise operations in the same order); on the first step
    ``b = g``. The optimizer owns its values: float32, or float64 when given float64 (set
    ``dtype`` to force one).

    A step writes the new ``Θ`` and ``b`` into new tensors chunk by chunk, checking ``g`` (and,
    if asked, the result) for NaN/Inf in the same pass; the state is switched only once the
    whole step succeeded, so a bad input leaves it unchanged without any rollback copy. The
    tensors it replaced are never written again: :meth:`step_shared`, :meth:`shared_state`
    hand them out without a copy.

    Args:
        params: name → the fragment's current value ``Θ`` (copied; the caller's tensors are not
            touched).
        lr: outer learning rate η (> 0). DiLoCo's default 0.7.
        momentum: Nesterov momentum μ (0 < μ < 1). DiLoCo's default 0.9.
        dtype: keyword-only; the dtype of the optimizer's state. ``None``: float64 stays float64,
            anything else becomes float32.

    Raises:
        ValueError: for ``lr``/``momentum`` out of range, an empty or non-finite ``params``.
    """

    def __init__(
        self,
        params: dict[str, Tensor],
        lr: float = 0.7,
        momentum: float = 0.9,
        *,
        dtype: torch.dtype | None = None,
    ) -> None:
        if not (math.isfinite(lr) and lr > 0):
            raise ValueError(f"outer lr must be finite and > 0, got {lr}")
        self._check_momentum(momentum)
        if not params:
            raise ValueError("OuterOptimizer needs at least one tensor")
        _check_finite(params, "initial params")
        self._lr = float(lr)
        self._mu = float(momentum)
        self._params: dict[str, Tensor] = {}
        for name, t in params.items():
            want = dtype or (torch.float64 if t.dtype == torch.float64 else torch.float32)
            self._params[name] = t.detach().to(dtype=want, copy=True).contiguous()
        self._momentum: dict[str, Tensor] | None = None  # None before the first step: b = g
        self._steps = 0
        self.pool = BufferPool()  # the new Θ and b of each step; reused once nothing holds them

    def _empty_like(self, p: Tensor) -> Tensor:
        """A new tensor like ``p``, from :attr:`pool` (fresh memory costs page faults)."""
        return self.pool.empty(p.shape, p.dtype) if p.device.type == "cpu" else torch.empty_like(p)

    def _scratch(self, n: int, like: Tensor) -> Tensor:
        """A 1-D tensor of ``n`` elements of ``like``'s dtype and device, from :attr:`pool`."""
        if like.device.type == "cpu":
            return self.pool.empty((n,), like.dtype)
        return torch.empty(n, dtype=like.dtype, device=like.device)

    def empty_like_params(self) -> dict[str, Tensor]:
        """name → an uninitialised contiguous tensor of the param's shape and dtype, from the
        optimizer's buffer pool: where a merge writes ``g`` (``merge_outer_gradients(out=...)``) so
        that ``step_shared(g, consume=True)`` keeps it as the momentum without fresh memory."""
        return {name: self._empty_like(p) for name, p in self._params.items()}

    def _check_momentum(self, momentum: float) -> None:
        """Raise ``ValueError`` for a momentum this optimizer cannot use (subclasses may differ)."""
        if not (0 < momentum < 1):
            raise ValueError(f"outer momentum must be in (0, 1) for Nesterov, got {momentum}")

    @property
    def steps_taken(self) -> int:
        """Outer steps taken since construction, or the count restored by :meth:`load_state`."""
        return self._steps

    @property
    def lr(self) -> float:
        """Outer learning rate η of the next step (``synchronizer.outer_lr_schedule`` sets it before each)."""
        return self._lr

    @lr.setter
    def lr(self, value: float) -> None:
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"outer lr must be finite and > 0, got {value}")
        self._lr = float(value)

    @property
    def mu(self) -> float:
        """Nesterov momentum μ."""
        return self._mu

    def _check_like_params(self, tensors: Mapping[str, Tensor], what: str) -> None:
        _check_same_keys(tensors, self._params, what)
        _check_shapes(tensors, self._params, what)
        _check_finite(tensors, what)

    def step(self, outer_grad: dict[str, Tensor]) -> dict[str, Tensor]:
        """Apply one outer step with the merged outer gradient ``g``.

        Args:
            outer_grad: name → ``g``, the same names and shapes as the params; cast to the
                optimizer's dtype.

        Returns:
            name → the new value ``Θ`` (detached clones).

        Raises:
            ValueError: if names or shapes differ or a value is NaN/Inf; the state is then left
                unchanged.
        """
        return {name: t.clone() for name, t in self.step_shared(outer_grad).items()}

    def step_shared(self, outer_grad: Mapping[str, Tensor], *, require_finite: bool = False,
                    consume: bool = False, grad_scales: Mapping[str, Tensor] | None = None) -> dict[str, Tensor]:
        """:meth:`step` without the copy: the new ``Θ`` tensors are the optimizer's own.

        They are never written again (the next step writes new tensors), so they may be kept,
        published and read from other threads; the caller must not write to them.

        Args:
            outer_grad: as :meth:`step`.
            require_finite: keyword-only; also refuse a step whose result has NaN/Inf
                (``ValueError`` "non-finite values after the outer step in [names]").
            consume: keyword-only; ``outer_grad``'s tensors are the caller's to give away (e.g.
                a merge's output): each one that is contiguous and of the optimizer's dtype is
                overwritten with the new momentum ``b`` and kept as it, instead of a new tensor.
                The caller must not use them afterwards, even when the step is refused.
            grad_scales: keyword-only; name → 0-dim tensor ``s``: the gradient of that tensor is
                ``outer_grad[name] * s`` (``merge_outer_gradients(deferred_scales=...)``), computed
                chunk by chunk as the step reads it, bit for bit as ``outer_grad[name].mul_(s)``.

        Returns:
            name → the new value ``Θ`` (the optimizer's dtype, contiguous).

        Raises:
            ValueError: as :meth:`step`, and for a non-finite result with ``require_finite``; the
                state is then left unchanged.
        """
        _check_same_keys(outer_grad, self._params, "outer step")
        _check_shapes(outer_grad, self._params, "outer step")
        scales = {} if grad_scales is None else grad_scales
        return self.step_shared_from(lambda name: (outer_grad[name], scales.get(name)),
                                     require_finite=require_finite, consume=consume)

    def step_shared_from(self, grad_of: Callable[[str], tuple[Tensor, Tensor | None]], *,
                         require_finite: bool = False, consume: bool = False) -> dict[str, Tensor]:
        """:meth:`step_shared` with each tensor's gradient made just before its step:
        ``grad_of(name)`` returns ``(g, scale)`` (``scale`` a 0-dim tensor or None, as
        ``grad_scales``), called once per tensor in the params' order, so that a merge can write
        each tensor's ``g`` right before the step reads it, while it is still in the cache
        (:func:`diloco_async.merge.core.merge_and_step`). Bit for bit :meth:`step_shared` of the same
        gradients.

        Raises:
            ValueError: a ``g`` of another shape, and as :meth:`step_shared`; whatever ``grad_of``
                raises. The state is then left unchanged.
        """
        new_params: dict[str, Tensor] = {}
        new_momentum: dict[str, Tensor] = {}
        not_finite: list[str] = []
        for name, p in self._params.items():
            b = None if self._momentum is None else self._momentum[name]
            g, scale = grad_of(name)
            if tuple(g.shape) != tuple(p.shape):
                raise ValueError(f"outer step: tensor {name!r} has shape {tuple(g.shape)}, expected {tuple(p.shape)}")
            new_p, new_b, finite = self._step_tensor(name, p, b, g, require_finite, consume, scale)
            if not finite:
                not_finite.append(name)
            new_params[name], new_momentum[name] = new_p, new_b
        if not_finite:
            raise ValueError(f"non-finite values after the outer step in {not_finite}")
        self._params, self._momentum = new_params, new_momentum
        self._steps += 1
        return dict(new_params)

    def _step_tensor(self, name: str, p: Tensor, b: Tensor | None, g: Tensor, require_finite: bool,
                     consume: bool, scale: Tensor | None = None) -> tuple[Tensor, Tensor, bool]:
        """One tensor's step by chunks into new tensors: (new Θ, new b, whether Θ is finite);
        ``g`` is ``g * scale`` when a scale is given."""
        mu, neg_lr = self._mu, -self._lr
        g = g.detach()
        if scale is not None and (g.dtype != p.dtype or g.device != p.device):
            g, scale = g * scale, None  # scaled in its own dtype, then cast, as before
        if g.dtype != p.dtype or g.device != p.device:
            g = g.to(dtype=p.dtype, device=p.device)
        in_place = consume and g.is_contiguous() and g.dtype == p.dtype and g.device == p.device
        if b is not None and (scale is None or scale.dim() == 0) and merge_native.usable(p, b, g, scale):
            return self._step_fused(name, p, b, g, require_finite, in_place, scale)
        g_flat, p_flat = _flat(g), p.view(-1)
        b_flat = None if b is None else b.view(-1)
        new_p = self._empty_like(p)
        new_b = g if in_place else self._empty_like(p)
        np_flat, nb_flat = new_p.view(-1), new_b.view(-1)
        n_tmp = min(_buf.CHUNK_ELEMENTS, p.numel())
        g_copy = self._scratch(n_tmp, p) if in_place or scale is not None else None
        tmp = self._scratch(n_tmp, p)
        finite = True
        for lo, hi in _chunks(p.numel()):
            gc, nb = g_flat[lo:hi], nb_flat[lo:hi]
            if scale is not None:  # g of this chunk, scaled; also kept apart when gc becomes b
                gc = torch.mul(gc, scale, out=g_copy[: hi - lo])
            elif g_copy is not None:  # gc is about to become b: keep g of this chunk
                gc = g_copy[: hi - lo].copy_(gc)
            # with require_finite, a non-finite g always makes the result non-finite (IEEE: a
            # finite x + y has finite x and y), so g is only looked at when the result is not
            if not require_finite and not _all_finite(gc):
                raise ValueError(f"outer step: tensor {name!r} has non-finite values (NaN or Inf)")
            if b_flat is None:  # torch's first step: b = g
                if not in_place or scale is not None:
                    nb.copy_(gc)
            else:  # buf.mul_(momentum).add_(grad, alpha=1 - dampening)
                torch.mul(b_flat[lo:hi], mu, out=nb).add_(gc, alpha=1)
            t = torch.add(gc, nb, alpha=mu, out=tmp[: hi - lo])  # grad.add(buf, alpha=momentum)
            npc = torch.add(p_flat[lo:hi], t, alpha=neg_lr, out=np_flat[lo:hi])  # param.add_(grad, alpha=-lr)
            if require_finite and finite and not _all_finite(npc):
                if not _all_finite(gc):
                    raise ValueError(f"outer step: tensor {name!r} has non-finite values (NaN or Inf)")
                finite = False
        return new_p, new_b, finite

    def _step_fused(self, name: str, p: Tensor, b: Tensor, g: Tensor, require_finite: bool, in_place: bool,
                    scale: Tensor | None) -> tuple[Tensor, Tensor, bool]:
        """:meth:`_step_tensor`'s chunk loop with a momentum, in one fused pass: the same
        operations, the same finite checks per chunk, the same errors (DESIGN §4.5c)."""
        new_p = self._empty_like(p)
        new_b = g if in_place else self._empty_like(p)
        step = merge_native.NesterovSettings(self._mu, -self._lr, require_finite, _buf.CHUNK_ELEMENTS)
        status = merge_native.outer_step(new_p.view(-1), new_b.view(-1), p.view(-1), b.view(-1), g.view(-1), scale,
                                         step)
        if status == merge_native.STEP_BAD_GRAD:
            raise ValueError(f"outer step: tensor {name!r} has non-finite values (NaN or Inf)")
        return new_p, new_b, status != merge_native.STEP_NOT_FINITE

    def take_back_lookahead(self, share: float) -> dict[str, Tensor]:
        """Take back ``share`` of the last step's momentum look-ahead: ``Θ ← Θ + share·η·μ·b``
        (new tensors; ``b`` and the step count stay). With ``share = 1`` the last step becomes a
        plain outer-gradient step ``Θ − η·g`` from where it started (DESIGN §4.5): the last round of
        a drain, after which no round follows for the look-ahead to anticipate (issue 44).

        Returns:
            name → the new value ``Θ`` (the optimizer's own tensors, as :meth:`step_shared`).

        Raises:
            ValueError: ``share`` outside [0, 1]; the state is then left unchanged.
        """
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"take_back_lookahead: share must be in [0, 1], got {share}")
        if self._momentum is None or share == 0.0:
            return dict(self._params)
        alpha = share * self._lr * self._mu
        new = {name: torch.add(p, self._momentum[name], alpha=alpha, out=self._empty_like(p))
               for name, p in self._params.items()}
        self._params = new
        return dict(new)

    def params(self) -> dict[str, Tensor]:
        """name → current value ``Θ`` (detached clones, the optimizer's dtype)."""
        return {name: p.clone() for name, p in self._params.items()}

    def momentum(self) -> dict[str, Tensor]:
        """name → momentum buffer ``b`` (detached clones; zeros before the first step)."""
        if self._momentum is None:
            return {name: torch.zeros_like(p) for name, p in self._params.items()}
        return {name: b.clone() for name, b in self._momentum.items()}

    def shared_state(self) -> OuterState:
        """The current state without copies (the tensors are never written again; do not write
        them): for :meth:`restore`, and the momentum to keep or checkpoint."""
        return OuterState(dict(self._params), None if self._momentum is None else dict(self._momentum),
                          self._steps)

    def restore(self, state: OuterState) -> None:
        """Go back to a state of :meth:`shared_state` (no copy, no check: it was this one's)."""
        self._params = dict(state.params)
        self._momentum = None if state.momentum is None else dict(state.momentum)
        self._steps = state.steps_taken

    def load_state(
        self,
        params: dict[str, Tensor],
        momentum: dict[str, Tensor] | None = None,
        *,
        steps_taken: int | None = None,
    ) -> None:
        """Restore values and momentum exactly, e.g. from a checkpoint.

        After ``load_state(o.params(), o.momentum())`` the next step equals ``o``'s next step bit
        for bit. Without ``momentum`` the optimizer is fresh: its next step is a first step
        (``b = g``), as after construction.

        Args:
            params: name → value ``Θ``, the optimizer's names and shapes (copied).
            momentum: name → buffer ``b`` (copied), or ``None`` for a fresh optimizer.
            steps_taken: the step count to report; default 0 without momentum, else unchanged.

        Raises:
            ValueError: on differing names or shapes, non-finite values, or a negative
                ``steps_taken``; the state is then left unchanged.
        """
        self._check_like_params(params, "load_state(params)")
        if momentum is not None:
            self._check_like_params(momentum, "load_state(momentum)")
        if steps_taken is not None and steps_taken < 0:
            raise ValueError(f"steps_taken must be >= 0, got {steps_taken}")
        self._params = {name: params[name].detach().to(dtype=p.dtype, device=p.device, copy=True).contiguous()
                        for name, p in self._params.items()}
        if momentum is not None:
            self._momentum = {name: momentum[name].detach().to(dtype=p.dtype, device=p.device, copy=True)
                              .contiguous() for name, p in self._params.items()}
        else:
            self._momentum = None
        if steps_taken is not None:
            self._steps = int(steps_taken)
        elif momentum is None:
            self._steps = 0


@dataclass(frozen=True)


class OuterState:
    """An :class:`OuterOptimizer`'s state by reference: name → ``Θ``, name → ``b`` (None before
    the first step) and the step count. The tensors are shared and must not be written."""

    params: dict[str, Tensor]
    momentum: dict[str, Tensor] | None
    steps_taken: int
