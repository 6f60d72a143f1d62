"""PREVIOUS IMPLEMENTATION of ``diloco_async.policy.guard.leave_one_out_cosines`` (main at 8c4b547),
frozen for comparison: whole tensors converted to float64 (a float64 copy of each tensor per
read, three reads of each outer gradient). ``benchmarks/merge.py`` times the piece-by-piece
version against it as context. Not used by the library; do not edit or "fix" it."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

__all__ = ["leave_one_out_cosines"]


def leave_one_out_cosines(deltas: Sequence[Mapping[str, torch.Tensor]],
                          weights: Sequence[float]) -> list[float | None]:
    """For each outer gradient Δ_i (a dict name → tensor; the same names and shapes in all), the
    cosine between Δ_i and ``R_i = Σ_{j≠i} w_j Δ_j/‖Δ_j‖``, norms and products over all tensors
    together (float64). None for all when there are fewer than 3, and for a Δ_i or an R_i of zero
    norm. Memory: one float64 copy of the fragment (the weighted sum of the unit directions).

    Raises:
        ValueError: ``deltas`` and ``weights`` differ in length.
    """
    if len(deltas) != len(weights):
        raise ValueError(f"{len(deltas)} outer gradients but {len(weights)} weights")
    if len(deltas) < 3:
        return [None] * len(deltas)
    total = math.fsum(weights)
    probs = [w / total if total > 0 else 1.0 / len(weights) for w in weights]
    norms = [math.sqrt(math.fsum(float(t.detach().to(torch.float64).pow(2).sum()) for t in d.values()))
             for d in deltas]
    # S = Σ_j p_j u_j with u_j = Δ_j/‖Δ_j‖; then ⟨u_i, R_i⟩ = ⟨u_i, S⟩ - p_i and
    # ‖R_i‖² = ‖S‖² - 2 p_i ⟨u_i, S⟩ + p_i² (R_i = S - p_i u_i)
    total_sq, dots = 0.0, [0.0] * len(deltas)
    for name in deltas[0]:
        s = torch.zeros(deltas[0][name].shape, dtype=torch.float64)
        for d, p, n in zip(deltas, probs, norms, strict=True):
            if n > 0:
                s.add_(d[name].detach().to(torch.float64), alpha=p / n)
        total_sq += float(s.pow(2).sum())
        for i, (d, n) in enumerate(zip(deltas, norms, strict=True)):
            if n > 0:
                dots[i] += float((d[name].detach().to(torch.float64) * s).sum()) / n
    out: list[float | None] = []
    for dot, p, n in zip(dots, probs, norms, strict=True):
        r_sq = total_sq - 2 * p * dot + p * p
        if n <= 0 or r_sq <= 1e-24 or not math.isfinite(dot + r_sq):
            out.append(None)
        else:
            out.append(max(-1.0, min(1.0, (dot - p) / math.sqrt(r_sq))))
    return out
