"""The update guard (issue 14, item 3): each tensor of a contribution's outer gradient is held to a
robust running bound on its L2 norm before it may be merged.

For a tensor of ``n`` elements, with ``m`` the median of the norms of the last ``norm_window``
accepted contributions of that tensor (their raw outer gradients Δ, before anchoring):

* warm-up (fewer than ``norm_warmup`` accepted so far, or a contribution whose steps began inside
  the learner's learning-rate warm-up): ``bound = warmup_max_rms · √n``;
* after it: ``bound = min(warmup_max_rms · √n, max(norm_multiple · m, min_rms · √n))``.

A tensor over its bound is a ``norm_outlier``: the whole contribution is rejected
(``norm_action = "reject"``) or that tensor is scaled down to its bound (``"clip"``). Only
contributions accepted unclipped feed the median, so as long as fewer than half of the recent
accepted contributions come from one learner, that learner cannot move the bound by itself.
Contributions made during the learning-rate warm-up neither meet the median bound nor feed it:
their norms grow with the learning rate (tenfold and more over a warm-up), so a median of them
would reject the first honest contributions at full learning rate.
The median is the robust statistic (a mean would follow a single huge value). What this cannot
see: a wrong *direction* of ordinary size (a sign flip, a constant tensor scaled to the usual
norm) passes; RDA, token weighting and the quorum dilute it, they do not reject it.

Pure: plain values and tensors in, decisions with reasons out; no I/O, no clock.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from diloco_async.config_guard import GuardConfig

__all__ = ["NormVerdict", "NormGuard", "tensor_norms", "non_finite_tensors"]


def tensor_norms(tensors: Mapping[str, torch.Tensor]) -> dict[str, float]:
    """name → L2 norm over all elements (float64 arithmetic; ``inf`` if it overflows)."""
    return {name: float(torch.linalg.vector_norm(t.detach().to(torch.float64))) for name, t in tensors.items()}


def non_finite_tensors(tensors: Mapping[str, torch.Tensor]) -> dict[str, int]:
    """name → number of NaN/Inf elements, for every tensor that has any."""
    out = {}
    for name, t in tensors.items():
        bad = int((~torch.isfinite(t)).sum())
        if bad:
            out[name] = bad
    return out


@dataclass(frozen=True)
class NormVerdict:
    """What to do with one contribution: ``status`` is ``accept``, ``clip`` or ``reject``.

    ``reason`` is ``"norm_outlier: <tensor> norm N > bound B (rule); ..."`` naming every outlier
    (empty when accepted); ``scales`` maps each clipped tensor to its factor in (0, 1).
    """

    status: str
    reason: str = ""
    scales: dict[str, float] = field(default_factory=dict)


class NormGuard:
    """The running per-tensor norm bounds of one run (owned by the synchronizer's actor).

    Args:
        cfg: the ``[guard]`` config.
        numel: tensor name → number of elements, for every tensor that may be contributed.
    """

    def __init__(self, cfg: GuardConfig, numel: Mapping[str, int]) -> None:
        self.cfg = cfg
        self.numel = dict(numel)
        self.recent: dict[str, deque[float]] = {n: deque(maxlen=cfg.norm_window) for n in numel}
        self.accepted: dict[str, int] = dict.fromkeys(numel, 0)

    def bound(self, name: str, lr_warmup: bool = False) -> tuple[float, str]:
        """(the norm bound of tensor ``name``, the rule that set it); ``lr_warmup``: the
        contribution began inside the learner's learning-rate warm-up (only the ceiling holds)."""
        root_n = math.sqrt(self.numel[name])
        ceiling = self.cfg.warmup_max_rms * root_n
        if lr_warmup:
            return ceiling, f"learning-rate warm-up: {self.cfg.warmup_max_rms} rms"
        if self.accepted[name] < self.cfg.norm_warmup:
            return ceiling, f"warm-up {self.accepted[name]}/{self.cfg.norm_warmup}: {self.cfg.warmup_max_rms} rms"
        median = statistics.median(self.recent[name])
        robust = max(self.cfg.norm_multiple * median, self.cfg.min_rms * root_n)
        if robust >= ceiling:
            return ceiling, f"ceiling {self.cfg.warmup_max_rms} rms"
        return robust, f"{self.cfg.norm_multiple} x median {median:.4g} of {len(self.recent[name])}"

    def check(self, norms: Mapping[str, float], lr_warmup: bool = False) -> NormVerdict:
        """The verdict on a contribution with these per-tensor norms (names the guard knows);
        ``lr_warmup`` as in :meth:`bound`.

        Raises:
            KeyError: a tensor name the guard was not built with.
        """
        over = []
        scales = {}
        for name, norm in norms.items():
            limit, rule = self.bound(name, lr_warmup)
            if not norm <= limit:  # also catches NaN
                over.append(f"{name} norm {norm:.4g} > bound {limit:.4g} ({rule})")
                scales[name] = limit / norm if math.isfinite(norm) and norm > 0 else 0.0
        if not over:
            return NormVerdict("accept")
        reason = "norm_outlier: " + "; ".join(over)
        if self.cfg.norm_action == "clip":
            return NormVerdict("clip", reason, scales)
        return NormVerdict("reject", reason)

    def record(self, norms: Mapping[str, float]) -> None:
        """Add the norms of a contribution accepted unclipped, made after the learning-rate
        warm-up, to the running window."""
        for name, norm in norms.items():
            self.recent[name].append(float(norm))
            self.accepted[name] += 1
