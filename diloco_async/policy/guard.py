"""The update guard (issue 14, item 3): each tensor of a contribution's outer gradient is held to a
robust running bound on its L2 norm before it may be merged.

For a tensor of ``n`` elements, with ``m`` the median norm *per inner step* of the last
``norm_window`` accepted contributions of that tensor (their raw outer gradients Δ, before
anchoring, each divided by the ``c_steps`` it covers), and ``c`` the steps of the contribution
judged (a learner that missed rounds sends one Δ over all their steps, with a norm as many times
larger):

* warm-up (fewer than ``norm_warmup`` accepted so far, or a contribution whose steps began inside
  the learner's learning-rate warm-up): ``bound = warmup_max_rms · √n``;
* after it: ``bound = min(warmup_max_rms · √n, max(norm_multiple · m · c, min_rms · √n))``.

A tensor over its bound is a ``norm_outlier``: the whole contribution is rejected
(``norm_action = "reject"``) or that tensor is scaled down to its bound (``"clip"``). Only
contributions accepted unclipped feed the median, so as long as fewer than half of the recent
accepted contributions come from one learner, that learner cannot move the bound by itself.
Contributions made during the learning-rate warm-up neither meet the median bound nor feed it:
their norms grow with the learning rate (tenfold and more over a warm-up), so a median of them
would reject the first honest contributions at full learning rate.
The median is the robust statistic (a mean would follow a single huge value). What this cannot
see: a wrong *direction* of ordinary size (a sign flip, a constant tensor scaled to the usual
norm). That is the direction guard's part.

The direction guard (:class:`DirectionGuard`, one per fragment) compares each contribution's outer
gradient Δ_i, over the whole fragment, with the consensus of the others in its round: the
token-weighted sum of their unit directions, ``R_i = Σ_{j≠i} w_j Δ_j/‖Δ_j‖``, giving
``cos_i = ⟨Δ_i, R_i⟩ / (‖Δ_i‖ ‖R_i‖)`` (only in rounds of 3 or more, where the others are a
majority against one). Honest learners of a round start from the same values and share the
loss's descent direction: on ``make run``'s recipe their cosines sit around 0.3-0.6 and never
below 0 (measured: minimum 0.09). A sign flip sits near the negative of that, a constant tensor
near 0. Each contribution's merge weight is multiplied by
``clamp(cos_i / (f_i · c_i), 0, 1)``, ``c`` the median of the recent cosines
and ``c_i`` what it would be for an outer gradient of ``t_i`` tokens (its ``c_tokens``) where that
is fewer than ``T``, the median ``c_tokens`` behind ``c``: ``c_i = 1/√(1 + (1/c² − 1)·T/t_i)``
(:func:`cosine_at_size`: t tokens of mean direction and √t of noise), else ``c``; ``f_i`` is
``direction_weight_fraction`` (0.5), times ``(t_i/T)^direction_weight_size_power`` (power 0.5)
where ``t_i < T``. Half the usual agreement of an outer gradient of its size or more keeps its full
weight, less loses weight in proportion, down to none at 0; a smaller outer gradient keeps it
further down. (A slow learner's short outer gradient is more noise for its size and agrees less:
judged by the longer ones' agreement it lost about half its weight, issue 47. Recent cosines of
fewer tokens than ``T`` are brought to ``T`` the same way before the median. Its cosine also
spreads wider around what is usual for its size: replayed on six merge logs of the heterogeneous
fleet, a tenth-speed learner's tenth percentile sat at 0.02-0.19 of it, the full-speed learners'
at 0.19-0.58. A ramp up to 0.5 for every size cut 20-32% of the slow learner's tokens, one up
to 0.3 for every size 9-19% but also weighted in the full-speed learners' weakest contributions;
the size power keeps 0.5 for the full-speed learners and lowers it to about 0.2 for the slow one
(0.11-0.17 of the usual tokens): bench-het 0.96 for it, against 0.92 at 0.3. A sign flip or a
constant tensor sits at or under 0 either way, issue 47.) While
three or more are judged and one points away from the rest (``cos_i ≤ 0``), the one pointing
away most is taken out of the others' consensus and the rest judged again without it,
so one flipped update cannot drag an honest one down (with two honest and one flipped, both
honest cosines sit near 0) and the weights of a round never all fall to zero. What is taken out
is left out of the merge (``direction_outlier``) if it points against the rest as much as honest
ones point with them (``cos_i ≤ -direction_fraction · c``, *anti-aligned*) and its learner has
kept pointing away: the mean of that learner's last ``direction_memory`` cosines
(:class:`LearnerDirections`, over all fragments, this one included, at least two known) is
anti-aligned too (:func:`sustained_anti_alignment`). Otherwise it is merged with zero weight
(counted per learner as ``zero_weight``). On a small model an honest round is now and then
anti-aligned by noise (measured on the test recipe: cosines down to -0.3 against a median of
0.45); a sign flip is anti-aligned nearly every round, so its mean crosses the bound from its
second contribution on, while an honest learner's mean of four would have to fall about four
standard deviations.
Only the positive cosines of contributions kept whole feed the median, over the same window as
the norms. Until ``direction_warmup`` are in, or while the median is under
:data:`MIN_REFERENCE_COSINE` (learners that do not agree cannot be told apart), nothing is left
out and only contributions pointing away from the rest (``cos_i ≤ 0``, taken out as above) lose
their weight; every other factor is 1. (Honest learners on ``make run``'s recipe never point
away: their minimum cosine is positive.)
(The outer momentum is no reference: honest outer gradients are nearly orthogonal to it, median
cosine 0.05, and often negative, as Nesterov's overshoot is corrected.)

Pure: plain values and tensors in, decisions with reasons out; no I/O, no clock.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from diloco_async.config.guard import GuardConfig

__all__ = ["NormVerdict", "NormGuard", "DirectionGuard", "DirectionCheck", "NO_DIRECTION_CHECK", "LearnerDirections",
           "leave_one_out_cosines", "cosine_at_size",
           "direction_factor", "sustained_anti_alignment",
           "MIN_REFERENCE_COSINE", "tensor_norms", "non_finite_tensors"]

#: the direction guard judges only while honest contributions agree at least this much (median)
MIN_REFERENCE_COSINE = 0.1


def tensor_norms(tensors: Mapping[str, torch.Tensor]) -> dict[str, float]:
    """name → L2 norm over all elements (float64 arithmetic; ``inf`` if it overflows)."""
    return {name: float(torch.linalg.vector_norm(t.detach().to(torch.float64))) for name, t in tensors.items()}


def non_finite_tensors(tensors: Mapping[str, torch.Tensor]) -> dict[str, int]:
    """name → number of NaN/Inf elements, for every tensor that has any."""
    out = {}
    for name, t in tensors.items():
        if t.is_floating_point() and bool(torch.isfinite(t.sum())):
            continue  # one pass, no tensor-sized temporary: a NaN or Inf makes the sum non-finite
        bad = int((~torch.isfinite(t)).sum())  # (a finite tensor whose sum overflows counts 0 here)
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

    def bound(self, name: str, lr_warmup: bool = False, steps: int = 1) -> tuple[float, str]:
        """(the norm bound of tensor ``name``, the rule that set it) for a contribution covering
        ``steps`` inner steps (its ``c_steps``, ≥ 1); ``lr_warmup``: the contribution began inside
        the learner's learning-rate warm-up (only the ceiling holds)."""
        root_n = math.sqrt(self.numel[name])
        ceiling = self.cfg.warmup_max_rms * root_n
        if lr_warmup:
            return ceiling, f"learning-rate warm-up: {self.cfg.warmup_max_rms} rms"
        if self.accepted[name] < self.cfg.norm_warmup:
            return ceiling, f"warm-up {self.accepted[name]}/{self.cfg.norm_warmup}: {self.cfg.warmup_max_rms} rms"
        steps = max(1, int(steps))
        median = statistics.median(self.recent[name])  # per inner step
        robust = max(self.cfg.norm_multiple * median * steps, self.cfg.min_rms * root_n)
        if robust >= ceiling:
            return ceiling, f"ceiling {self.cfg.warmup_max_rms} rms"
        per = f" per step x {steps} steps" if steps > 1 else ""
        return robust, f"{self.cfg.norm_multiple} x median {median:.4g}{per} of {len(self.recent[name])}"

    def check(self, norms: Mapping[str, float], lr_warmup: bool = False, steps: int = 1) -> NormVerdict:
        """The verdict on a contribution with these per-tensor norms (names the guard knows);
        ``lr_warmup`` and ``steps`` as in :meth:`bound`.

        Raises:
            KeyError: a tensor name the guard was not built with.
        """
        over = []
        scales = {}
        for name, norm in norms.items():
            limit, rule = self.bound(name, lr_warmup, steps)
            if not norm <= limit:  # also catches NaN
                over.append(f"{name} norm {norm:.4g} > bound {limit:.4g} ({rule})")
                scales[name] = limit / norm if math.isfinite(norm) and norm > 0 else 0.0
        if not over:
            return NormVerdict("accept")
        reason = "norm_outlier: " + "; ".join(over)
        if self.cfg.norm_action == "clip":
            return NormVerdict("clip", reason, scales)
        return NormVerdict("reject", reason)

    def record(self, norms: Mapping[str, float], steps: int = 1) -> None:
        """Add the norms of a contribution accepted unclipped, made after the learning-rate
        warm-up, covering ``steps`` inner steps, to the running window (as norms per step)."""
        steps = max(1, int(steps))
        for name, norm in norms.items():
            self.recent[name].append(float(norm) / steps)
            self.accepted[name] += 1


#: elements per piece of :func:`leave_one_out_cosines`' passes (512 KiB of float32): the pieces
#: of all M outer gradients are read again from the cache while they are summed
COSINE_PIECE_ELEMENTS = 1 << 17


def _pieces(flat: Sequence[torch.Tensor]):
    """(tensor index, lo, hi) over every :data:`COSINE_PIECE_ELEMENTS` piece of 1-D tensors."""
    for k, t in enumerate(flat):
        for lo in range(0, t.numel(), COSINE_PIECE_ELEMENTS):
            yield k, lo, min(lo + COSINE_PIECE_ELEMENTS, t.numel())


def _norms(flat: Sequence[Sequence[torch.Tensor]], dtype: torch.dtype) -> list[float]:
    """The L2 norm of each outer gradient (1-D tensors), from products of pieces in ``dtype``."""
    return [math.sqrt(math.fsum(float(torch.dot(x, x)) for x in (ts[k][lo:hi].to(dtype) for k, lo, hi in _pieces(ts))))
            for ts in flat]


def leave_one_out_cosines(deltas: Sequence[Mapping[str, torch.Tensor]],
                          weights: Sequence[float]) -> list[float | None]:
    """For each outer gradient Δ_i (a dict name → tensor; the same names and shapes in all), the
    cosine between Δ_i and ``R_i = Σ_{j≠i} w_j Δ_j/‖Δ_j‖``, norms and products over all tensors
    together: products of float32 pieces of :data:`COSINE_PIECE_ELEMENTS` (float32 Δ as they
    are, others converted), summed across pieces in float64 (a relative error near 1e-6, far
    below what the guard's thresholds tell apart); in float64 throughout where a float32
    product overflows. None for all when there are fewer than 3, and for a Δ_i of zero or
    non-finite norm or an R_i of zero norm. Two reads of each Δ; memory: one piece of each (no
    fragment-sized copy).

    Raises:
        ValueError: ``deltas`` and ``weights`` differ in length.
    """
    if len(deltas) != len(weights):
        raise ValueError(f"{len(deltas)} outer gradients but {len(weights)} weights")
    if len(deltas) < 3:
        return [None] * len(deltas)
    total = math.fsum(weights)
    probs = [w / total if total > 0 else 1.0 / len(weights) for w in weights]
    flat = [[d[name].detach().reshape(-1) for name in deltas[0]] for d in deltas]
    dtype = torch.float32
    norms = _norms(flat, dtype)
    if not all(math.isfinite(n) for n in norms):  # a float32 product overflowed (or a NaN): float64
        dtype = torch.float64
        norms = _norms(flat, dtype)
    # S = Σ_j p_j u_j with u_j = Δ_j/‖Δ_j‖; then ⟨u_i, R_i⟩ = ⟨u_i, S⟩ - p_i and
    # ‖R_i‖² = ‖S‖² - 2 p_i ⟨u_i, S⟩ + p_i² (R_i = S - p_i u_i)
    sq_parts: list[float] = []
    dot_parts: list[list[float]] = [[] for _ in deltas]
    for k, lo, hi in _pieces(flat[0]):
        xs = [ts[k][lo:hi].to(dtype) if 0 < n < math.inf else None for ts, n in zip(flat, norms, strict=True)]
        s = torch.zeros(hi - lo, dtype=dtype)
        for x, p, n in zip(xs, probs, norms, strict=True):
            if x is not None:
                s.add_(x, alpha=p / n)
        sq_parts.append(float(torch.dot(s, s)))
        for i, (x, n) in enumerate(zip(xs, norms, strict=True)):
            if x is not None:
                dot_parts[i].append(float(torch.dot(x, s)) / n)
    total_sq = math.fsum(sq_parts)
    out: list[float | None] = []
    for parts, p, n in zip(dot_parts, probs, norms, strict=True):
        dot = math.fsum(parts)
        r_sq = total_sq - 2 * p * dot + p * p
        if not 0 < n < math.inf or r_sq <= 1e-24 or not math.isfinite(dot + r_sq):
            out.append(None)
        else:
            out.append(max(-1.0, min(1.0, (dot - p) / math.sqrt(r_sq))))
    return out


def cosine_at_size(cosine: float, from_tokens: float, to_tokens: float) -> float:
    """The cosine to its round's consensus that an honest outer gradient of ``to_tokens`` tokens
    shows where one of ``from_tokens`` shows ``cosine`` (in (0, 1]): with Δ = t·s + √t·n (t tokens,
    s the mean direction per token, n its noise), cos = 1/√(1 + a/t), a = |n|²/|s|², so
    ``1/√(1 + (1/cosine² − 1) · from_tokens / to_tokens)``."""
    c = min(1.0, max(cosine, 1e-6))
    return 1.0 / math.sqrt(1.0 + (1.0 / (c * c) - 1.0) * from_tokens / to_tokens)


def direction_factor(cosine: float | None, reference_cosine: float | None, fraction: float,
                     token_ratio: float = 1.0) -> float:
    """The merge-weight factor in [0, 1] of a contribution with this ``cosine`` to its round:
    ``clamp(cosine / (fraction · expected), 0, 1)``, ``expected`` the reference cosine brought to the
    contribution's size (:func:`cosine_at_size`) when it is smaller than the reference's
    (``token_ratio`` < 1), else the reference itself; 1 when either cosine is None (nothing to
    compare with, or the guard is still warming up) or ``fraction`` is 0 (guard off).

    ``token_ratio`` is the contribution's ``c_tokens`` over the median ``c_tokens`` of the
    contributions behind ``reference_cosine`` (:meth:`DirectionCheck.token_ratio`): an outer gradient
    of few steps, from a slow learner, is more noise for its size and agrees less with the others;
    it is judged against what an honest one of its size shows. A larger one is judged as before
    (never more strictly). Its token weight already scales its pull.
    """
    if cosine is None or reference_cosine is None or fraction <= 0:
        return 1.0
    expected = reference_cosine
    if 0 < token_ratio < 1:
        expected = cosine_at_size(reference_cosine, 1.0, token_ratio)
    elif token_ratio <= 0:
        return 1.0 if cosine > 0 else 0.0
    return min(1.0, max(0.0, cosine / (fraction * expected)))


@dataclass(frozen=True)
class DirectionCheck:
    """The direction guard's inputs for one round (:mod:`diloco_async.policy.guard`): ``reference``,
    the median recent leave-one-out cosine (None while the guard warms up); ``fraction``
    (``guard.direction_fraction``: the anti-aligned bound is ``-fraction · reference``; 0 turns the
    guard off); ``weight_fraction`` (``guard.direction_weight_fraction``, :meth:`weight`);
    ``reference_tokens``, the median
    ``c_tokens`` of the contributions behind it (a contribution's own is compared with it,
    :func:`direction_factor`); each learner's recent cosines (``learner_cosines``), of which the
    last ``memory`` count (``guard.direction_memory``)."""

    reference: float | None = None
    fraction: float = 0.0
    learner_cosines: Mapping[str, Sequence[float]] = field(default_factory=dict)
    memory: int = 1
    reference_tokens: float | None = None  # the median c_tokens behind ``reference`` (None: not known)
    weight_fraction: float | None = None  # the weight ramp's fraction (None: ``fraction``)
    size_power: float = 0.0  # ``guard.direction_weight_size_power`` (0: one ramp for every size)

    def weight(self, token_ratio: float = 1.0) -> float:
        """The fraction of the usual cosine of its size under which a contribution of ``token_ratio``
        (:meth:`token_ratio`) loses weight (:func:`direction_factor`): ``guard.direction_weight_fraction``,
        times ``token_ratio ** guard.direction_weight_size_power`` when the ratio is in (0, 1)
        (a short outer gradient's cosine spreads wider around what is usual for its size, issue 47);
        0 while the guard is off."""
        if self.fraction <= 0:
            return 0.0
        ramp = self.fraction if self.weight_fraction is None else self.weight_fraction
        if 0 < token_ratio < 1 and self.size_power > 0:
            ramp *= token_ratio ** self.size_power
        return ramp

    def token_ratio(self, c_tokens: float) -> float:
        """``c_tokens`` over :attr:`reference_tokens` (1 when that is not known)."""
        if not self.reference_tokens or self.reference_tokens <= 0:
            return 1.0
        return float(c_tokens) / self.reference_tokens


#: the direction guard off (fraction 0)
NO_DIRECTION_CHECK = DirectionCheck()


class DirectionGuard:
    """The recent leave-one-out cosines of one fragment's contributions (owned by the
    synchronizer's actor; the merging thread gets :meth:`reference` as a plain float)."""

    def __init__(self, cfg: GuardConfig) -> None:
        self.cfg = cfg
        self.recent: deque[tuple[float, float | None]] = deque(maxlen=cfg.norm_window)  # (cosine, c_tokens)

    def reference_tokens(self) -> float | None:
        """The median ``c_tokens`` of the recent contributions that make the reference (None: none known)."""
        sizes = [t for _, t in self.recent if t is not None]
        return float(statistics.median(sizes)) if sizes else None

    def reference(self) -> float | None:
        """The median recent cosine, those of fewer tokens than the median brought to it first
        (:func:`cosine_at_size`), or None while warming up or while it is under
        :data:`MIN_REFERENCE_COSINE`."""
        if self.cfg.direction_fraction <= 0 or len(self.recent) < self.cfg.direction_warmup:
            return None
        size = self.reference_tokens()
        scaled = [cosine_at_size(c, t, size) if t and size and t < size else c for c, t in self.recent]
        median = statistics.median(scaled)
        return median if median >= MIN_REFERENCE_COSINE else None

    def check(self, learners: LearnerDirections) -> DirectionCheck:
        """The inputs of one round's direction guard: this fragment's reference, the learners' records."""
        return DirectionCheck(self.reference(), self.cfg.direction_fraction, learners.snapshot(),
                              self.cfg.direction_memory, self.reference_tokens(), self.cfg.direction_weight_fraction,
                              self.cfg.direction_weight_size_power)

    def record(self, cosine: float | None, factor: float, c_tokens: float | None = None) -> None:
        """Add the cosine of a merged contribution kept at full weight (positive ones only), with
        its ``c_tokens`` where known."""
        if cosine is not None and cosine > 0 and factor >= 1.0:
            self.recent.append((float(cosine), float(c_tokens) if c_tokens and c_tokens > 0 else None))


def sustained_anti_alignment(previous: Sequence[float], cosine: float, bound: float, memory: int) -> bool:
    """Whether an anti-aligned contribution (``cosine ≤ bound``, ``bound`` negative) comes from a
    learner that keeps pointing away: the mean of ``cosine`` and the learner's last ``memory - 1``
    ``previous`` cosines is at most ``bound``, with at least 2 values (1 when ``memory`` is 1)."""
    values = [*(list(previous)[-(memory - 1):] if memory > 1 else []), cosine]
    return cosine <= bound and len(values) >= min(2, memory) and math.fsum(values) / len(values) <= bound


class LearnerDirections:
    """Each learner's recent leave-one-out cosines over all fragments, newest last (owned by the
    synchronizer's actor; the merging thread gets :meth:`snapshot`, plain tuples)."""

    def __init__(self, memory: int) -> None:
        self.memory = max(1, int(memory))
        self.recent: dict[str, deque[float]] = {}

    def record(self, learner_id: str, cosine: float | None) -> None:
        """Add the cosine a learner's contribution had when it was last judged (None: not judged)."""
        if cosine is not None and math.isfinite(cosine):
            self.recent.setdefault(learner_id, deque(maxlen=self.memory)).append(float(cosine))

    def snapshot(self) -> dict[str, tuple[float, ...]]:
        return {lid: tuple(d) for lid, d in self.recent.items()}
