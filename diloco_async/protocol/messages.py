"""Control messages between learners and the synchronizer (JSON over HTTP, pydantic-validated).

Bulk data never travels here: messages carry object keys, sizes and sha256 digests; the bytes
live in the object store (DESIGN §2). Unknown fields are rejected, and every field is bounded
(issue 14): steps, versions, rounds and incarnations in [0, 2**53] (exact as float64, the metric
stream's type); tokens and bytes in [0, 2**50] (far inside int64, and c_tokens² still a finite
float64); seconds in [0, 1e9]; floats finite (no NaN or Infinity); ids from a short charset of at
most 64 characters; keys at most 1024 characters; at most 4096 fragments.
"""

from __future__ import annotations

import hashlib
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer

from diloco_async.codec.wire import CODECS

__all__ = [
    "CompactInfo",
    "VersionInfo",
    "JoinRequest",
    "JoinResponse",
    "Heartbeat",
    "RoundOpen",
    "HeartbeatResponse",
    "Announcement",
    "AnnouncementAck",
    "LeaseRequest",
    "LeaseResponse",
    "SLICES_MAX",
    "MetricsQuery",
    "LEARNER_ID_PATTERN",
    "STEP_MAX",
    "COUNT_MAX",
    "SECONDS_MAX",
    "FRAGMENTS_MAX",
    "KEY_MAX_CHARS",
    "SHARDS_MAX",
    "ShardObject",
    "shard_list_digest",
]

LEARNER_ID_PATTERN = r"^[A-Za-z0-9_.-]{1,64}$"
STEP_MAX = 2**53
"""Largest step, version, round number or incarnation: exact as a float64 (metric values are floats)."""
COUNT_MAX = 2**50
"""Largest token or byte count (about 1.1e15): within int64, and c_tokens² / c_steps is a finite float64."""
SECONDS_MAX = 1e9
"""Largest duration in seconds (about 31 years)."""
FRAGMENTS_MAX = 4096
"""Fragment indices lie in [0, FRAGMENTS_MAX); a map by fragment has at most this many entries."""
KEY_MAX_CHARS = 1024
#: the most shard objects one announcement names (ranks of a sharded learner group)
SHARDS_MAX = 1024
"""Longest object key."""
#: the most slices one announcement or lease message names (issue 45; DESIGN §5.2)
SLICES_MAX = 4096

Step = Annotated[int, Field(ge=0, le=STEP_MAX)]
Count = Annotated[int, Field(ge=0, le=COUNT_MAX)]
Seconds = Annotated[float, Field(ge=0, le=SECONDS_MAX)]
FragmentIndex = Annotated[int, Field(ge=0, lt=FRAGMENTS_MAX)]
LearnerId = Annotated[str, Field(pattern=LEARNER_ID_PATTERN)]
Sha256 = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
Key = Annotated[str, Field(min_length=1, max_length=KEY_MAX_CHARS)]
SliceId = Annotated[int, Field(ge=0, le=COUNT_MAX)]


class _Msg(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class CompactInfo(_Msg):
    """A compressed form of a published version (``synchronizer.download_codec``,
    :mod:`diloco_async.codec.versions`): the payload's object, its codec and mode, the version a
    delta applies to (None: whole) and the sha256 of the published value it rebuilds."""

    key: Key
    nbytes: Count
    sha256: Sha256
    codec: Literal["fp32", "bf16", "int8", "int4", "int2"]
    mode: Literal["delta", "whole"]
    block_size: int = Field(ge=1, le=1 << 20)
    base_version: Step | None = None
    published_sha256: Sha256


class VersionInfo(_Msg):
    """Published version ``version`` of fragment ``fragment`` and where its bytes are (the
    published value, fp32), and its compact form when downloads are compressed."""

    fragment: FragmentIndex
    version: Step
    key: Key
    nbytes: Count
    sha256: Sha256
    compact: CompactInfo | None = None


class JoinRequest(_Msg):
    learner_id: LearnerId
    incarnation: Step = Field(0, description="Restart count of this learner slot.")
    uptime_s: Seconds = Field(0.0, description="Seconds since the learner process started.")
    network_mode: Literal["direct", "tls"] = Field(
        "direct", description="How the learner reaches the synchronizer (config network.mode); set by the "
        "synchronizer's edge from the port the join came on, whatever the learner sent.")


class JoinResponse(_Msg):
    run_id: str
    config: dict
    config_hash: str
    plan: dict
    schema_hash: str
    versions: list[VersionInfo]
    epoch: str = Field(description="Changes whenever the synchronizer (re)starts.")
    start_step: int = Field(0, ge=0, description="Local step a restarted learner slot continues from.")
    shard: int = Field(0, ge=0, description="This synchronizer's shard index (DESIGN §2.2); its versions and "
                       "rounds are those of its own fragments, fragment p on shard p mod shards.")
    shards: int = Field(1, ge=1, description="synchronizer.shards: how many shards the run's fragments are divided "
                        "among (1: one synchronizer, as before shards existed).")
    run_tokens: float = Field(0.0, ge=0, le=COUNT_MAX, description="Tokens processed by the run's learners as the "
                              "synchronizer counts them for budget.tokens, rounded down to 0.1% of it: the progress "
                              "of the learning-rate schedule (policy/schedules.py).")


class Heartbeat(_Msg):
    learner_id: LearnerId
    incarnation: Step = 0
    step: Step = Field(description="Local inner steps done.")
    step_time_s: float | None = Field(None, ge=0, le=1e6, description="EMA of one inner step.")
    tokens_total: Count = Field(0, description="Tokens processed since the process started.")
    train_loss: float | None = Field(None, ge=-1e6, le=1e6,
                                     description="Mean train loss since the last heartbeat (nats/token).")
    tokens_per_s: float | None = Field(None, ge=0, le=1e12)
    bytes_down: Count = Field(0, description="Bytes of versions downloaded since the process started.")
    bytes_up: Count = Field(0, description="Bytes of contributions uploaded since the process started.")
    uptime_s: Seconds = 0.0
    blocked_s: Seconds = Field(0.0, description="Seconds spent blocked (waiting on the synchronizer or on peers) "
                               "since the process started.")
    base_versions: dict[FragmentIndex, Step] = Field(default_factory=dict, max_length=FRAGMENTS_MAX)
    bytes_down_by_fragment: dict[FragmentIndex, Count] = Field(
        default_factory=dict, max_length=FRAGMENTS_MAX, description="bytes_down by fragment.")
    bytes_up_by_fragment: dict[FragmentIndex, Count] = Field(
        default_factory=dict, max_length=FRAGMENTS_MAX, description="bytes_up by fragment.")
    undeliverable_by_fragment: dict[FragmentIndex, Count] = Field(
        default_factory=dict, max_length=FRAGMENTS_MAX, description="Contributions of each fragment whose "
        "announcement this learner gave up (its synchronizer shard unreachable for learners.announce_timeout_s), "
        "since the process started; told to every shard (DESIGN §2.2).")
    link_s_per_fragment: float | None = Field(
        None, ge=0, le=1e6, description="Seconds of network work (upload + download) one fragment's sync takes.")
    link_budget_s: float | None = Field(
        None, ge=0, le=1e9, description="Seconds of H/P inner steps: the time one fragment's sync may take.")
    known_versions: dict[FragmentIndex, Step] = Field(
        default_factory=dict, max_length=FRAGMENTS_MAX, description="Newest version of each fragment this learner "
        "was told of: it starts no read of an older one (its read lease, policy/catchup.py).")
    fetching_versions: dict[FragmentIndex, Step] = Field(
        default_factory=dict, max_length=FRAGMENTS_MAX, description="The version of each fragment it is reading "
        "from the store now (kept from garbage collection until a heartbeat no longer names it).")
    replay_announcements: list[Announcement] | None = Field(
        None, max_length=FRAGMENTS_MAX, description="run.schedule='replay' only: this heartbeat is the learner's step "
        "boundary at local step `step`, held by the synchronizer and answered in virtual-time order (DESIGN §3.2); "
        "it carries the contributions uploaded since the last boundary. None: an ordinary heartbeat.")


class RoundOpen(_Msg):
    fragment: int
    round_n: int
    version: Step = Field(description="Current version of the fragment; the round publishes version + 1.")


class HeartbeatResponse(_Msg):
    open_rounds: list[RoundOpen]
    versions: list[VersionInfo]
    stop: bool = False
    known: bool = Field(True, description="False: the synchronizer does not know this learner; rejoin.")
    epoch: str = Field(description="Changes whenever the synchronizer (re)starts.")
    run_tokens: float = Field(0.0, ge=0, le=COUNT_MAX, description="As in the join answer, now.")
    acks: list[AnnouncementAck] | None = Field(None, max_length=FRAGMENTS_MAX, description="Replay only: the answers "
                                                "to the heartbeat's replay_announcements, in their order.")
    virtual_s: Seconds | None = Field(None, description="Replay only: the virtual time of the step boundary answered.")

    @model_serializer(mode="wrap")
    def _replay_fields_in_a_replay_only(self, handler: SerializerFunctionWrapHandler) -> dict:
        """Without the replay's fields when unset: the answer of a free run stays as before it had them
        (a learner of before rejects fields it does not know)."""
        out = handler(self)
        for name in ("acks", "virtual_s"):
            if out.get(name, 0) is None:
                del out[name]
        return out


class ShardObject(_Msg):
    """One rank's shard of a sharded learner group's contribution: an object of its own (DESIGN §3.1)."""

    key: Key
    nbytes: Count
    sha256: Sha256


def shard_list_digest(shards: list[ShardObject]) -> str:
    """The ``sha256`` an announcement of the shard objects ``shards`` carries: the sha256 of one
    line ``key nbytes sha256`` per shard, in rank order (DESIGN §3.1)."""
    lines = "".join(f"{s.key} {s.nbytes} {s.sha256}\n" for s in shards)
    return hashlib.sha256(lines.encode()).hexdigest()


class Announcement(_Msg):
    """A contribution uploaded and ready: DESIGN §3.4. A sharded learner group (DESIGN §3.1)
    names its N shard objects in ``shards`` (rank order); ``key`` is then shard 0's, ``nbytes``
    their total and ``sha256`` :func:`shard_list_digest` of the list."""

    learner_id: LearnerId
    fragment: FragmentIndex
    round_n: int = Field(ge=1, le=STEP_MAX)
    base_version: Step
    c_steps: Step
    c_tokens: Count
    compute_s: Seconds = Field(description="Inner-step seconds covered by this contribution.")
    key: Key
    nbytes: Count
    sha256: Sha256
    codec: Literal[CODECS]  # type: ignore[valid-type]
    update_id: str = Field(pattern=LEARNER_ID_PATTERN)
    shards: list[ShardObject] | None = Field(None, min_length=1, max_length=SHARDS_MAX,
                                             description="The shard objects of a sharded group, by rank.")
    slices: list[SliceId] = Field(default_factory=list, max_length=SLICES_MAX,
                                  description="With data.slices: the leased slices whose tokens this contribution's "
                                  "c_tokens counts (trained since the learner last adopted the fragment).")

    def object_keys(self) -> list[str]:
        """Every key this announcement names: ``key`` and each shard object's (each must lie under
        the announcing learner's own contribution prefix, DESIGN §10)."""
        return [self.key, *(s.key for s in self.shards or ())]


class AnnouncementAck(_Msg):
    status: Literal["accepted", "duplicate", "late", "rejected"]
    reason: str
    round_n: int | None = Field(None, ge=1, le=STEP_MAX, description="The round it was admitted into when not "
                                "the one announced: a late contribution folded into its fragment's next round "
                                "(DESIGN §3.5).")


class LeaseRequest(_Msg):
    """A learner asks for slices of the training tokens and hands back those it is done with (DESIGN §5.2)."""

    learner_id: LearnerId
    incarnation: Step = 0
    want: int = Field(ge=0, le=64, description="Slices wanted now.")
    release: list[SliceId] = Field(default_factory=list, max_length=SLICES_MAX, description="Slices this learner "
                                   "finished that no contribution of it will name again.")
    held: list[SliceId] = Field(default_factory=list, max_length=SLICES_MAX, description="Slices it believes it "
                                "holds; those it does not are answered in ``revoked``.")


class LeaseResponse(_Msg):
    """Slices leased (each ``[slice, first token, tokens]`` of the training tokens), the slices of
    ``held`` no longer this learner's, and the ledger's epoch."""

    slices: list[tuple[SliceId, Count, Count]] = Field(default_factory=list)
    revoked: list[SliceId] = Field(default_factory=list)
    epoch: Step = 0


class MetricsQuery(_Msg):
    """The query of ``GET /metrics``: the number of the first metric point wanted."""

    since: Step = 0


Heartbeat.model_rebuild()  # replay_announcements names Announcement, defined below it
HeartbeatResponse.model_rebuild()
