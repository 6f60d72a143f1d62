"""The figures of a WAN run, per method (issue 13's report, like the paper's): time to a target
held-out loss, bytes on the wire per token, mean link utilisation, and the link bandwidth the
method needs to keep its learners busy. Pure: every figure is computed from a :class:`WireRun`
(what the harness measured) and can be checked on synthetic inputs.

Units: bytes, seconds, Mbit/s (10^6 bit/s). Bytes on the wire are the veth counters of every
region's link (``WanNet.link_counters()``: IP packets with their headers, both directions), the
difference between the start and the end of a method's run.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["WireRun", "time_to_target_s", "ring_allreduce_bytes", "figures", "json_row", "target_loss"]

#: one point of a held-out loss curve: (seconds since every learner was ready, tokens in the model, loss)
CurvePoint = tuple[float, float, float]


@dataclass
class WireRun:
    """What the harness measured for one method over the shaped links.

    Attributes:
        method: ``ddp``, ``sync-diloco`` or ``decoupled``.
        curve: held-out loss of the global model over the run, time order (:data:`CurvePoint`).
        eval_loss_equal_tokens: held-out loss at the scenario's ``eval_tokens`` (None: not reached).
        tokens: tokens trained by all learners (ranks) together.
        learner_steps: inner steps of all learners together.
        compute_s_per_step: median seconds of one learner's inner step without network waits.
        tokens_per_s_per_learner: mean over learners of tokens / (last step end - first step start).
        link_s: seconds the link counters cover (launch to stop).
        counters: region -> ``{"up_bytes", "down_bytes"}`` moved during the run.
        rates: region -> ``{"up_mbit", "down_mbit"}``: the shaped rates (None: unshaped).
        verified: region -> the link's verification (``WanNet.verified``), for the record.
        learners_per_region: learners sharing one region's link.
    """

    method: str
    curve: list[CurvePoint]
    eval_loss_equal_tokens: float | None
    tokens: float
    learner_steps: int
    compute_s_per_step: float
    tokens_per_s_per_learner: float
    link_s: float
    counters: dict[str, dict[str, int]]
    rates: dict[str, dict[str, float]] | None
    verified: dict[str, dict] = field(default_factory=dict)
    learners_per_region: int = 1


def time_to_target_s(curve: Sequence[CurvePoint], target: float) -> float | None:
    """Seconds until the loss first reaches ``target`` (<=), linearly interpolated in time between
    the snapshot before and the first one at or below it; None if it never does."""
    for i, (t, _, loss) in enumerate(curve):
        if loss <= target:
            if i == 0:
                return t
            ta, _, la = curve[i - 1]
            return ta + (t - ta) * (la - target) / (la - loss) if la > loss else t
    return None


def ring_allreduce_bytes(model_bytes: int, workers: int) -> float:
    """Bytes one worker sends (and receives) in a ring all-reduce of ``model_bytes``:
    2 (N - 1) / N x bytes (reduce-scatter, then all-gather)."""
    if workers < 2:
        return 0.0
    return 2.0 * (workers - 1) / workers * model_bytes


def target_loss(rule: str, runs: dict[str, WireRun], fixed: float | None = None) -> float | None:
    """The target held-out loss: DDP's final (``ddp-final``; None without a DDP curve) or ``fixed``.

    Raises:
        ValueError: an unknown rule.
    """
    if rule == "fixed":
        return fixed
    if rule != "ddp-final":
        raise ValueError(f"unknown target rule {rule!r}; known: ddp-final, fixed")
    ddp = runs.get("ddp")
    return ddp.curve[-1][2] if ddp is not None and ddp.curve else None


def _mbit(bytes_: float, seconds: float) -> float:
    return bytes_ * 8 / 1e6 / seconds if seconds > 0 else math.inf


def figures(run: WireRun, target: float | None) -> dict:
    """The report's figures of one method.

    Returns:
        ``time_to_target_s`` (None: never reached, or no target), ``up_bytes``, ``down_bytes``
        (all links), ``bytes_per_token`` (up + down over tokens trained), ``up_bytes_per_token``,
        ``down_bytes_per_token``, ``link_utilisation`` (mean over links and directions of bytes
        moved / (rate x link_s); None when unshaped), ``needed_mbit`` (the rate one region's
        link needs, in the busier direction, to move one learner step's traffic in one step's
        compute time: bytes per learner step x learners per region / compute_s_per_step), and
        ``needed_up_mbit``, ``needed_down_mbit``.
    """
    up = sum(c["up_bytes"] for c in run.counters.values())
    down = sum(c["down_bytes"] for c in run.counters.values())
    tokens = max(run.tokens, 1e-9)
    util = None
    if run.rates:
        shares = []
        for region, c in run.counters.items():
            rate = run.rates[region]
            shares.append(c["up_bytes"] * 8 / 1e6 / (rate["up_mbit"] * run.link_s))
            shares.append(c["down_bytes"] * 8 / 1e6 / (rate["down_mbit"] * run.link_s))
        util = sum(shares) / len(shares) if shares and run.link_s > 0 else None
    steps = max(run.learner_steps, 1)
    need = {d: _mbit(b / steps * run.learners_per_region, run.compute_s_per_step) for d, b in (("up", up),
                                                                                                ("down", down))}
    return {"time_to_target_s": None if target is None else time_to_target_s(run.curve, target),
            "up_bytes": up, "down_bytes": down, "bytes_per_token": (up + down) / tokens,
            "up_bytes_per_token": up / tokens, "down_bytes_per_token": down / tokens, "link_utilisation": util,
            "needed_up_mbit": need["up"], "needed_down_mbit": need["down"], "needed_mbit": max(need.values())}


def json_row(run: WireRun, target: float | None) -> dict:
    """One method's object of ``diloco-async wan --json``: ``method``, ``time_to_target_s``,
    ``bytes_per_token``, ``eval_loss_equal_tokens``, ``link_rates`` (region -> set and measured
    Mbit/s per direction, from the verification), then the other figures of :func:`figures` and
    ``target_loss``, ``tokens``, ``tokens_per_s_per_learner``, ``compute_s_per_step``, ``link_s``."""
    f = figures(run, target)
    rates = {r: {k: v[k] for k in ("up_mbit_set", "up_mbit_measured", "down_mbit_set", "down_mbit_measured")
                 if k in v} for r, v in run.verified.items()}
    return {"method": run.method, "time_to_target_s": f["time_to_target_s"],
            "bytes_per_token": f["bytes_per_token"], "eval_loss_equal_tokens": run.eval_loss_equal_tokens,
            "link_rates": rates, "target_loss": target, **{k: v for k, v in f.items() if k not in (
                "time_to_target_s", "bytes_per_token")},
            "tokens": run.tokens, "tokens_per_s_per_learner": run.tokens_per_s_per_learner,
            "compute_s_per_step": run.compute_s_per_step, "link_s": run.link_s, "learner_steps": run.learner_steps,
            "final_loss": run.curve[-1][2] if run.curve else None,
            "eval_curve": [list(c) for c in run.curve]}
