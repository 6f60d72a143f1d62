"""The ``[replay]`` section and what a replayed run supports yet (issue 44 item 2; DESIGN §3.2).

``run.schedule = "replay"`` runs the learners' real math on a virtual clock: each learner's step
time is drawn from a seeded model (:class:`~diloco_async.policy.replay.VirtualSteps`) and the
synchronizer applies the learners' step boundaries in virtual-time order. What would let the wall
clock or the machine's load back into a decision has no replayed path yet, and a recipe that combines
it with ``replay`` is refused before anything starts, naming the field and its value
(:func:`replay_conflicts`). With ``run.schedule = "free"`` (the default) the section is not read, and at
its defaults it is left out of the config hash (runs from before it resume).
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["ReplayConfig", "replay_conflicts", "check_replay", "drop_default_replay_fields", "JITTER_CLIP",
           "SPEED_CLIP_SIGMAS"]

#: a step's relative noise |N(0, jitter)| is clipped at this many jitters (a bounded slowest step)
JITTER_CLIP = 3.0
#: a learner's seeded lognormal speed exp(N(0, spread)) is clipped at this many spreads
SPEED_CLIP_SIGMAS = 3.0


class ReplayConfig(BaseModel):
    """The virtual step-time model of ``run.schedule = "replay"``; per-learner speeds and per-step noise
    come from ``faults.speed_factors`` and ``faults.step_jitter`` (the chaos scenarios' fields)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    step_s: float = Field(1.0, gt=0, le=3600, description="Virtual seconds of one inner step of a learner at speed 1 "
                          "(replay only); a learner of faults.speed_factors s takes step_s / s.")
    speed_spread: float = Field(0.0, ge=0, le=2, description="Sigma of the seeded lognormal speed exp(N(0, sigma)) of "
                                "each learner that faults.speed_factors does not list (replay only; 0: speed 1).")
    stall_timeout_s: float = Field(600.0, gt=0, description="Wall seconds the replay waits for a learner's next step "
                                   "boundary before the synchronizer stops the run (a failure mode only: a learner "
                                   "that died; it never changes what a replayed run computes).")


def _slowest_step_s(cfg: Any) -> float:
    """The longest virtual step any learner of ``cfg`` can take."""
    speeds = [*cfg.faults.speed_factors[:cfg.learners.count]]
    if len(speeds) < cfg.learners.count:
        speeds.append(math.exp(-SPEED_CLIP_SIGMAS * cfg.replay.speed_spread))
    return cfg.replay.step_s / min(speeds) * (1.0 + JITTER_CLIP * cfg.faults.step_jitter)


def replay_conflicts(cfg: Any) -> list[str]:
    """The settings of ``cfg`` (a :class:`~diloco_async.config.schema.Config`) that a replayed run cannot
    serve yet, each as ``"field=value: why"``; empty when none, or with ``run.schedule = "free"``."""
    if cfg.run.schedule != "replay":
        return []
    lc, sc, f = cfg.learners, cfg.synchronizer, cfg.faults
    out = []
    if sc.shards > 1:
        out.append(f"synchronizer.shards={sc.shards}: one synchronizer schedules the replay; shards would each "
                   "need the others' virtual times")
    if lc.ranks_per_learner > 1:
        out.append(f"learners.nproc_per_learner x nnodes={lc.ranks_per_learner}: learner groups (DDP/FSDP) have "
                   "no replayed step boundary yet")
    if getattr(cfg.data, "slices", False):
        out.append("data.slices=true: slice leases are granted in the order their requests arrive (wall clock)")
    if lc.barrier:
        out.append("learners.barrier=true: the synchronous baseline waits on the wall clock")
    if lc.link_codecs:
        out.append(f"learners.link_codecs={list(lc.link_codecs)}: the codec step-down follows measured link "
                   "seconds (wall clock)")
    for name in ("control_drop_prob", "control_delay_s"):
        if getattr(f, name) > 0:
            out.append(f"faults.{name}={getattr(f, name)!r}: control-message faults are not replayed yet")
    if f.storage_faults:
        out.append(f"faults.storage_faults={dict(f.storage_faults)!r}: storage faults are not replayed yet")
    if any(s >= 0 for s in f.unreachable_shard):
        out.append(f"faults.unreachable_shard={list(f.unreachable_shard)}: cut routes are not replayed yet")
    slowest = _slowest_step_s(cfg)
    if slowest >= sc.heartbeat_timeout_s:
        out.append(f"replay.step_s={cfg.replay.step_s!r}: the slowest learner's virtual step ({slowest:.3g} s) "
                   f"reaches synchronizer.heartbeat_timeout_s={sc.heartbeat_timeout_s!r}, so it would be marked lost "
                   "between two of its own steps")
    return out


def check_replay(cfg: Any) -> None:
    """Raise when :func:`replay_conflicts` finds any.

    Raises:
        ValueError: naming every conflicting field and its value.
    """
    conflicts = replay_conflicts(cfg)
    if conflicts:
        raise ValueError("run.schedule='replay' cannot run this recipe deterministically yet: " + "; ".join(conflicts))


def drop_default_replay_fields(d: dict) -> None:
    """Remove, in place, ``run.schedule`` and the ``replay`` section of a public config dict when they
    hold their defaults (so runs from before they existed hash as before)."""
    if d.get("run", {}).get("schedule") == "free":
        del d["run"]["schedule"]
    if d.get("replay") == ReplayConfig().model_dump(mode="json"):
        del d["replay"]
