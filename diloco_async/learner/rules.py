"""The learner's outer rules as pure functions on tensors (DESIGN §3 steps 4 and 8).

* :func:`outer_gradient` — Δ = Θ^base − θ of one fragment (step 4, *Contribute*; paper §3).
* :func:`adopt` — the fragment's parameters after a published version is adopted (step 8,
  *Adopt*): ``overwrite`` (the paper's rule), ``mix`` or ``rebase``.
* :func:`progress_after_adopt` — what is left of the fragment's counters after that adoption.

Nothing here mutates its arguments; the training thread copies the results into the model.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import torch

from diloco_async.codec import wire

__all__ = ["ADOPT_RULES", "Progress", "outer_gradient", "adopt", "progress_after_adopt"]

#: The values of ``learners.adopt``.
ADOPT_RULES = ("overwrite", "mix", "rebase")


class Progress(NamedTuple):
    """A learner's local progress on one fragment since its base: ``steps`` (inner steps),
    ``tokens`` and ``compute_s`` (inner-step seconds) — the counters c_steps, c_tokens of §3."""

    steps: int = 0
    tokens: int = 0
    compute_s: float = 0.0

    def plus(self, tokens: int, compute_s: float) -> Progress:
        """The progress after one more inner step of ``tokens`` tokens and ``compute_s`` seconds."""
        return Progress(self.steps + 1, self.tokens + tokens, self.compute_s + compute_s)


def outer_gradient(base: Mapping[str, torch.Tensor], params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Δ = Θ^base − θ for every tensor name of ``params`` (DESIGN §3.4; DiLoCo, paper §3).

    Args:
        base: Θ^base, the adopted version of the fragment, by tensor name; on the host (pinned,
            for a learner on a GPU) or on θ's device.
        params: θ, the learner's parameters of the fragment (a snapshot), by tensor name.

    Returns:
        New tensors of the shapes and dtype of ``params`` (float32 in this project), on θ's
        device: each base tensor is copied there first (without a wait from pinned memory; fp32
        subtraction is correctly rounded, so Δ is bit for bit the CPU's). Where that copy, or a
        lookup of a ``base`` whose ``fresh_reads`` is true (a base file), is already a tensor of
        its own, Δ is computed in it: one new tensor per name, not two.

    Raises:
        KeyError: ``base`` lacks a name of ``params``.
    """
    fresh = bool(getattr(base, "fresh_reads", False))
    return {name: _delta(base[name], t, fresh) for name, t in params.items()}


def _delta(b: torch.Tensor, t: torch.Tensor, fresh: bool) -> torch.Tensor:
    """Θ^base − θ of one tensor, in ``b``'s copy on θ's device when that copy is new (or ``b``
    itself when ``fresh``: a tensor the caller owns), else in a new tensor."""
    d = _to(b, t)
    if fresh or d is not b:
        return d.sub_(t)  # the same correctly rounded fp32 subtraction, written in place
    return d - t


def _to(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``x`` on ``like``'s device (itself when already there; copied without a wait from pinned memory)."""
    return x.to(like.device, non_blocking=True)


def encoded_outer_gradient(base: Mapping[str, torch.Tensor], params: Mapping[str, torch.Tensor],
                           codec: str) -> dict[str, torch.Tensor]:
    """:func:`outer_gradient` encoded in ``codec`` (:func:`diloco_async.codec.wire.encode`), one tensor
    at a time: only one tensor's fp32 Δ exists at once, not the fragment's. Same bytes as
    encoding :func:`outer_gradient`'s result (encoding is per tensor).

    Raises:
        KeyError: ``base`` lacks a name of ``params``. ValueError: an unknown codec.
    """
    out: dict[str, torch.Tensor] = {}
    fresh = bool(getattr(base, "fresh_reads", False))
    for name, t in params.items():
        out.update(wire.encode({name: _delta(base[name], t, fresh)}, codec))
    return out


def adopt(rule: str, params: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor], *,
          mix_alpha: float = 0.5, base: Mapping[str, torch.Tensor] | None = None,
          snapshot: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """θ after adopting the published version Θ^new of a fragment (DESIGN §3.8), for every name of ``new``.

    * ``overwrite``: θ ← Θ^new (the paper's rule).
    * ``mix``: θ ← (1 − α)·θ + α·Θ^new with α = ``mix_alpha``.
    * ``rebase``: θ ← θ + (Θ^new − ref), which keeps the local progress made since ``ref``: the
      ``snapshot`` of the contribution in flight when there is one, else ``base`` (Θ^base).

    Args:
        rule: one of :data:`ADOPT_RULES`.
        params: θ, the learner's current parameters, by name (read only).
        new: Θ^new, the published version, by name (``new``, ``base`` and ``snapshot`` may be on
            the host: ``mix`` and ``rebase`` compute on θ's device).
        mix_alpha: α of ``mix``, in (0, 1].
        base, snapshot: references of ``rebase`` (``base`` is required when ``snapshot`` is None).

    Returns:
        Tensors (float32 like the inputs) by the names of ``new``, not tracked by autograd; for
        ``overwrite`` they are the tensors of ``new`` themselves.

    Raises:
        ValueError: an unknown ``rule``, or ``rebase`` without a reference.
    """
    if rule == "overwrite":
        return dict(new)
    if rule == "mix":
        return {n: params[n].detach().mul(1 - mix_alpha).add_(_to(val, params[n]), alpha=mix_alpha)
                for n, val in new.items()}
    if rule == "rebase":
        ref = snapshot if snapshot is not None else base
        if ref is None:
            raise ValueError("adopt 'rebase' needs the snapshot or the base it measures progress from")
        return {n: params[n].detach().add(_to(val, params[n]) - _to(ref[n], params[n])) for n, val in new.items()}
    raise ValueError(f"unknown adopt rule {rule!r}; expected one of {ADOPT_RULES}")


def progress_after_adopt(rule: str, progress: Progress, in_flight: Progress | None = None) -> Progress:
    """The counters of a fragment after a version of it is adopted (DESIGN §3.8).

    ``overwrite`` and ``mix`` reset them. ``rebase`` keeps the progress that the adopted version
    does not contain: minus the contribution in flight (``in_flight``, the counters at its
    snapshot) when there is one, else all of it.
    """
    if rule != "rebase":
        return Progress()
    if in_flight is None:
        return progress
    return Progress(progress.steps - in_flight.steps, progress.tokens - in_flight.tokens,
                    progress.compute_s - in_flight.compute_s)
