"""Control messages between learners and the synchronizer (JSON over HTTP, pydantic-validated).

Bulk data never travels here: messages carry object keys, sizes and sha256 digests; the bytes
live in the object store (DESIGN §2). Unknown fields are rejected.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from diloco_async.codec import CODECS

__all__ = [
    "VersionInfo",
    "JoinRequest",
    "JoinResponse",
    "Heartbeat",
    "RoundOpen",
    "HeartbeatResponse",
    "Announcement",
    "AnnouncementAck",
    "LEARNER_ID_PATTERN",
]

LEARNER_ID_PATTERN = r"^[A-Za-z0-9_.-]{1,64}$"


class _Msg(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class VersionInfo(_Msg):
    """Published version ``version`` of fragment ``fragment`` and where its bytes are."""

    fragment: int = Field(ge=0)
    version: int = Field(ge=0)
    key: str
    nbytes: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class JoinRequest(_Msg):
    learner_id: str = Field(pattern=LEARNER_ID_PATTERN)
    incarnation: int = Field(0, ge=0, description="Restart count of this learner slot.")
    uptime_s: float = Field(0.0, ge=0, description="Seconds since the learner process started.")


class JoinResponse(_Msg):
    run_id: str
    config: dict
    config_hash: str
    plan: dict
    schema_hash: str
    versions: list[VersionInfo]
    epoch: str = Field(description="Changes whenever the synchronizer (re)starts.")
    start_step: int = Field(0, ge=0, description="Local step a restarted learner slot continues from.")


class Heartbeat(_Msg):
    learner_id: str = Field(pattern=LEARNER_ID_PATTERN)
    incarnation: int = Field(0, ge=0)
    step: int = Field(ge=0, description="Local inner steps done.")
    step_time_s: float | None = Field(None, ge=0, description="EMA of one inner step.")
    tokens_total: int = Field(0, ge=0, description="Tokens processed since the process started.")
    train_loss: float | None = Field(None, description="Mean train loss since the last heartbeat (nats/byte).")
    tokens_per_s: float | None = Field(None, ge=0)
    bytes_down: int = Field(0, ge=0, description="Bytes of versions downloaded since the process started.")
    bytes_up: int = Field(0, ge=0, description="Bytes of contributions uploaded since the process started.")
    uptime_s: float = Field(0.0, ge=0)
    base_versions: dict[int, int] = Field(default_factory=dict)


class RoundOpen(_Msg):
    fragment: int
    round_n: int
    version: int = Field(ge=0, description="Current version of the fragment; the round publishes version + 1.")


class HeartbeatResponse(_Msg):
    open_rounds: list[RoundOpen]
    versions: list[VersionInfo]
    stop: bool = False
    known: bool = Field(True, description="False: the synchronizer does not know this learner; rejoin.")
    epoch: str = Field(description="Changes whenever the synchronizer (re)starts.")


class Announcement(_Msg):
    """A contribution uploaded and ready: DESIGN §3.4."""

    learner_id: str = Field(pattern=LEARNER_ID_PATTERN)
    fragment: int = Field(ge=0)
    round_n: int = Field(ge=1)
    base_version: int = Field(ge=0)
    c_steps: int = Field(ge=0)
    c_tokens: int = Field(ge=0)
    compute_s: float = Field(ge=0, description="Inner-step seconds covered by this contribution.")
    key: str
    nbytes: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    codec: Literal[CODECS]  # type: ignore[valid-type]
    update_id: str = Field(min_length=1, max_length=64)


class AnnouncementAck(_Msg):
    status: Literal["accepted", "duplicate", "late", "rejected"]
    reason: str
