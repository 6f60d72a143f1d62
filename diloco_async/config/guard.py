"""The ``[guard]`` section of the config: the update guard and the pace limits (issue 14, items 3-4).

Kept apart from :mod:`diloco_async.config.schema` (which references :class:`GuardConfig`) so that
module stays small. What each bound means, and what it does not catch, is in ``docs/`` (threat
model) and in :mod:`diloco_async.policy.guard` and :mod:`diloco_async.policy.pace`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["GuardConfig", "REMOVED_GUARD_KEYS", "weight_ramp_as_stored", "drop_old_weight_ramp"]

#: keys a ``[guard]`` table may no longer set, with what replaced them (issue 47)
REMOVED_GUARD_KEYS = {
    "max_steps_per_s": "the pace bound is calibrated to each learner since issue 47: set "
                       "guard.pace_initial_steps_per_s (the bound before a learner's pace is measured) and "
                       "guard.pace_tolerance (the multiple of its measured pace after that) instead",
}


class GuardConfig(BaseModel):
    """Bounds on what one learner can push into a run."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    norm_action: Literal["reject", "clip"] = Field(
        "reject", description="What happens to a tensor whose outer-gradient norm is over its bound: 'reject' the "
        "whole contribution (reason norm_outlier) or 'clip' that tensor to the bound.")
    norm_multiple: float = Field(
        10.0, gt=1, description="Per tensor, bound = norm_multiple x the median L2 norm of the recent accepted "
        "contributions' outer gradients of that tensor.")
    norm_window: int = Field(64, ge=1, description="Accepted norms per tensor the median is taken over.")
    norm_warmup: int = Field(
        8, ge=1, description="Accepted contributions of a tensor before the median bound applies; until then the "
        "absolute bound warmup_max_rms x sqrt(numel) applies.")
    warmup_max_rms: float = Field(
        1.0, gt=0, description="Warm-up bound on the root mean square of one tensor's outer gradient (parameter "
        "units per element); also an absolute ceiling after the warm-up.")
    min_rms: float = Field(
        1e-6, ge=0, description="Floor of the median bound, as a root mean square per element (a tensor whose "
        "recent norms are all zero still accepts a small update).")
    direction_fraction: float = Field(
        0.5, ge=0, le=1, description="Direction guard: a contribution whose leave-one-out cosine with the rest of "
        "its round is at or under minus this fraction of the recent median cosine is anti-aligned (see "
        "direction_memory). 0 turns the direction guard off.")
    direction_weight_fraction: float = Field(
        0.5, ge=0, le=1, description="Direction guard: a contribution whose leave-one-out cosine is under this "
        "fraction of the usual cosine of an outer gradient of its size loses merge weight in proportion, down to "
        "none at 0 (0: no contribution with a positive cosine loses weight); for a contribution smaller than "
        "the usual, see direction_weight_size_power. Not used while direction_fraction is 0 (guard off). A run "
        "stored before this field existed resumes with it equal to direction_fraction, as it was trained.")
    direction_weight_size_power: float = Field(
        0.5, ge=0, le=2, description="Direction guard: a contribution of t c_tokens, fewer than the median T "
        "behind the usual cosine, loses weight under direction_weight_fraction x (t/T)^this of the usual cosine "
        "of its size: a short outer gradient's cosine spreads wider around what is usual for its size (on the "
        "heterogeneous fleet a tenth-speed learner's tenth percentile sat at 0.02-0.19 of it, full-speed "
        "learners' at 0.19-0.58; issue 47). 0: one fraction for every size. A run stored before this field "
        "existed resumes with 0, as it was trained.")
    direction_warmup: int = Field(
        3, ge=1, description="Positive cosines of merged contributions per fragment before the direction guard "
        "applies.")
    direction_memory: int = Field(
        4, ge=1, description="An anti-aligned contribution is left out (direction_outlier) only when the mean of "
        "its learner's last direction_memory cosines (over all fragments, this one included; at least 2 of them "
        "known, unless this is 1) is anti-aligned too; otherwise it is merged with zero weight. One noisy honest "
        "round does not reject an honest learner; a learner that keeps pointing away is left out.")
    pace_initial_steps_per_s: float = Field(
        1000.0, gt=0, description="Inner-step rate bound of a learner whose pace is not measured yet (its first "
        "pace_warmup_s seconds heard stepping): a reported step, c_steps and tokens_total cannot grow faster than "
        "this (plus burst_steps). Generous on purpose: it only has to catch jumps until the learner is measured.")
    pace_warmup_s: float = Field(
        3.0, gt=0, description="Seconds the synchronizer hears a learner stepping (from its first heartbeat that "
        "advanced its step) before its measured pace replaces pace_initial_steps_per_s.")
    pace_tolerance: float = Field(
        4.0, ge=1, description="After the warm-up, a learner's rate bound is this multiple of its measured pace: "
        "the steps credited to it divided by the seconds it was heard since its first step. A learner may speed "
        "up this much over its own history; a sudden jump beyond it is clamped (heartbeats) or refused "
        "(implausible_steps).")
    pace_growth: float = Field(
        1.25, ge=1, description="A learner's measured pace credits at most this multiple of the pace measured so "
        "far (steps beyond it are still taken, only not measured): a learner that claims the most it may at every "
        "heartbeat raises its bound only as (seconds heard)^(pace_growth - 1), while an honest one that speeds up "
        "is measured at its new pace within seconds.")
    pace_floor_steps_per_s: float = Field(
        10.0, gt=0, description="Lowest rate bound after the warm-up (a learner measured at almost no steps, "
        "e.g. stalled right after its first step, can still resume).")
    burst_steps: int = Field(
        64, ge=0, description="Steps a learner may report beyond its rate bound: a token bucket per learner that "
        "the rate refills and each heartbeat spends, not renewed per message (nor by a rejoin).")
    max_tokens_per_step: int | None = Field(
        None, ge=1, description="Most tokens one inner step can process; None = 2 x learners.grad_accum_steps x "
        "learners.batch_size x "
        "model.context.")
    max_step_time_s: float = Field(
        600.0, gt=0, description="The step time of the grace window is each live learner's step time as the "
        "synchronizer measures it from its heartbeats (seconds heard per step credited; self-reported step times "
        "play no part), clamped to at most this ...")
    step_time_multiple: float = Field(
        8.0, ge=1, description="... and to at most this multiple of the (lower) median measured step time of the "
        "live learners, so one learner's pace cannot stretch every round's grace window.")
    round_timeout_s: float = Field(
        300.0, gt=0, description="An open round without quorum is abandoned (reason round_timeout) and reopened "
        "after this many seconds; sooner (reason quorum_unreachable) once its live learners cannot make the "
        "quorum for heartbeat_timeout_s, and at once when enough learners are live but rejected "
        "contributions stand in the way.")

    @model_validator(mode="before")
    @classmethod
    def _removed_keys(cls, data: Any) -> Any:
        if isinstance(data, dict):
            removed = [f"guard.{k} was removed: {why}" for k, why in REMOVED_GUARD_KEYS.items() if k in data]
            if removed:
                raise ValueError("; ".join(removed))
        return data


def weight_ramp_as_stored(d: dict) -> dict:
    """A run's stored config (plain data) from before ``guard.direction_weight_fraction`` or
    ``guard.direction_weight_size_power`` existed (issue 47): its weight ramp ended at
    ``guard.direction_fraction`` for every size, so it is given that fraction and the power 0, and
    a resumed run computes as it did. Changes ``d`` in place and returns it."""
    guard = d.get("guard")
    if isinstance(guard, dict):
        if "direction_weight_fraction" not in guard:
            guard["direction_weight_fraction"] = guard.get("direction_fraction",
                                                           GuardConfig.model_fields["direction_fraction"].default)
        guard.setdefault("direction_weight_size_power", 0.0)
    return d


def drop_old_weight_ramp(d: dict) -> dict:
    """A public config dict for the config hash: ``guard.direction_weight_fraction`` equal to
    ``guard.direction_fraction`` and ``guard.direction_weight_size_power`` 0 (the ramp before
    those fields existed) are left out, so runs checkpointed before them hash as before and resume.
    Changes ``d`` in place and returns it."""
    guard = d.get("guard")
    if isinstance(guard, dict):
        if guard.get("direction_weight_fraction") == guard.get("direction_fraction"):
            guard.pop("direction_weight_fraction", None)
        if guard.get("direction_weight_size_power") == 0:
            guard.pop("direction_weight_size_power", None)
    return d
