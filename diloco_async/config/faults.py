"""The ``[faults]`` section of the config: fault injection of chaos and guard tests (issue 42).

None of it is part of a production learner: a learner applies it once, where it is assembled
(:mod:`diloco_async.learner.faults`: a faulty store, a faulty client transport, a slowed
workload), and its training and comms code has no branch on it. Every field is operational
(``config_hash`` leaves the section out: a resumed run may change its faults). The keys lived
under ``[learners]`` before; :data:`MOVED_FROM_LEARNERS` names them, so a recipe that still uses
one fails with a message that names the new key.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["FaultsConfig", "MOVED_FROM_LEARNERS", "moved_keys_message"]


class FaultsConfig(BaseModel):
    """Injected faults, per learner index where a field is a list (missing indexes: no fault)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    speed_factors: list[float] = Field(
        default_factory=list,
        description="Emulated hardware speed per learner index (1.0 = as fast as this machine; 0.5 = half "
                    "speed); missing indexes run at 1.0. Chaos scenarios set it.",
    )
    step_jitter: float = Field(0.0, ge=0, description="Relative per-step slowdown noise, |N(0, jitter)| x step time.")
    control_drop_prob: float = Field(
        0.0, ge=0, lt=1, description="Chance that a control message (heartbeat, announce) is dropped before sending."
    )
    control_delay_s: float = Field(
        0.0, ge=0, description="Mean extra delay of a control message (exponential), seconds."
    )
    nice_after_ready: int = Field(
        0, ge=0, le=19,
        description="Lower the process priority by this much once ready to train (chaos runs that emulate many "
                    "machines on one host: a restarting learner's start-up is then not slowed by the others' "
                    "training).",
    )
    storage_faults: dict[str, Any] = Field(
        default_factory=dict,
        description="FaultPlan arguments (p_transient, p_hang, p_slow, slow_s, hold_s, ops) for the learners' store.",
    )
    storage_fault_learners: list[int] = Field(
        default_factory=list,
        description="Learner indexes whose store gets storage_faults (e.g. [1]: one learner with slow reads beside "
                    "healthy ones); empty: every learner's.",
    )
    unreachable_shard: list[int] = Field(
        default_factory=list,
        description="Fault injection (a cut route, DESIGN §2.2): per learner index, the synchronizer shard its "
                    "client cannot hand contributions to (every announcement to it fails as a lost link would; "
                    "joins and heartbeats pass); missing indexes and -1: every shard reachable.",
    )
    poison: list[Literal["none", "scale", "sign_flip", "constant"]] = Field(
        default_factory=list,
        description="Fault injection (tests of the update guard): per learner index, the poisoned outer gradients "
                    "it sends: 'scale' (x 1e6), 'sign_flip', 'constant' (every element the tensor's RMS, so the norm "
                    "is unchanged); missing indexes and 'none' are honest.",
    )

    @model_validator(mode="after")
    def _check_speeds(self) -> FaultsConfig:
        bad = [s for s in self.speed_factors if not 0 < s <= 1]
        if bad:
            raise ValueError(f"faults.speed_factors must be in (0, 1], got {bad}")
        negative = [i for i in self.storage_fault_learners if i < 0]
        if negative:
            raise ValueError(f"faults.storage_fault_learners must be learner indexes >= 0, got {negative}")
        below = [i for i in self.unreachable_shard if i < -1]
        if below:
            raise ValueError(f"faults.unreachable_shard must be shard indexes >= 0 (or -1: none), got {below}")
        return self


#: the keys that moved from ``[learners]`` to ``[faults]`` (issue 42); fields added since never lived there
MOVED_FROM_LEARNERS = ("speed_factors", "step_jitter", "control_drop_prob", "control_delay_s", "nice_after_ready",
                       "storage_faults", "poison")


def moved_keys_message(section: dict) -> str | None:
    """The error for a raw ``[learners]`` table that still sets a key now under ``[faults]``; None
    when it sets none. E.g. ``learners.poison moved to faults.poison``."""
    moved = [k for k in MOVED_FROM_LEARNERS if k in section]
    if not moved:
        return None
    return ("; ".join(f"learners.{k} moved to faults.{k}" for k in moved)
            + " (fault injection is its own [faults] section, applied by wrappers where a learner is assembled)")
