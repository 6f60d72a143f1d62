"""Fault injection of a learner (config ``learners.poison``): poisoned outer gradients, to test the
update guard (issue 14). Pure: the transforms take and return tensors.

* ``scale``: Δ · 10⁶ (caught by the guard's norm bound);
* ``sign_flip``: −Δ (same norm: the guard cannot see it; RDA and token weighting dilute it);
* ``constant``: every element of a tensor set to that tensor's RMS (same norm, no information).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

__all__ = ["POISON_MODES", "POISON_SCALE", "poison_outer_gradient"]

POISON_MODES = ("none", "scale", "sign_flip", "constant")
POISON_SCALE = 1e6


def poison_outer_gradient(delta: Mapping[str, torch.Tensor], mode: str) -> dict[str, torch.Tensor]:
    """The outer gradient a learner poisoned with ``mode`` sends instead of ``delta`` (new tensors).

    Raises:
        ValueError: an unknown mode.
    """
    if mode not in POISON_MODES:
        raise ValueError(f"unknown poison mode {mode!r}; expected one of {POISON_MODES}")
    if mode == "none":
        return dict(delta)
    if mode == "scale":
        return {n: t * POISON_SCALE for n, t in delta.items()}
    if mode == "sign_flip":
        return {n: -t for n, t in delta.items()}
    return {n: torch.full_like(t, float(t.float().pow(2).mean().sqrt())) for n, t in delta.items()}
