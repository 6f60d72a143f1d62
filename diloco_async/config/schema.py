"""Typed configuration tree (pydantic). A recipe file (TOML) is complete and validated;
unknown keys are rejected with a message that names the field.

Load with :func:`load_config` (once, at an entry point); override single fields with ``section.field=value``
strings there. Processes and harnesses pass the value on (:mod:`diloco_async.config.resolved`).
"""

from __future__ import annotations

import hashlib
import json
import os
import tomllib
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from diloco_async.config import feedback, schedules
from diloco_async.config.data import DataConfig
from diloco_async.config.faults import FaultsConfig, moved_keys_message
from diloco_async.config.guard import GuardConfig, drop_old_weight_ramp, weight_ramp_as_stored
from diloco_async.config.model import ModelConfig
from diloco_async.config.network import NetworkConfig
from diloco_async.config.parallelism import check_parallelism
from diloco_async.config.replay import ReplayConfig, check_replay, drop_default_replay_fields
from diloco_async.config.slices import check_slices, drop_default_slice_fields
from diloco_async.config.tomlfile import read_toml
from diloco_async.config.tracking import TrackingConfig
from diloco_async.runtime.devices import LearnerDeviceFields

__all__ = [
    "RunConfig",
    "set_dotted",
    "ModelConfig",
    "LearnerConfig",
    "SynchronizerConfig",
    "BudgetConfig",
    "TrackingConfig",
    "FaultsConfig",
    "NetworkConfig",
    "Config",
    "load_config",
    "apply_overrides",
    "config_hash",
    "config_differences",
    "STORE_SCHEMES",
]


#: URL schemes of ``run.store`` (diloco_async.storage.backends.PROTOCOLS and their fsspec aliases)
STORE_SCHEMES = frozenset({"file", "local", "memory", "s3", "s3a", "gs", "gcs"})


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class RunConfig(_Section):
    name: str = Field("diloco", description="Human name of the run (MLflow run name prefix).")
    seed: int = Field(0, description="Seed of the model initialisation and the data order.")
    schedule: Literal["free", "replay"] = Field("free", description="'free': learners and rounds run on the wall "
                                                "clock; 'replay': on a seeded virtual clock ([replay]; DESIGN §3.2).")
    store: str = Field(
        "file://.local/store",
        description="Root URL of the object store (file://, memory://, s3://, gs://). Each run lives "
        "under {store}/{run_id}/. A relative file:// path is taken from the working directory.",
    )
    storage_options: dict[str, Any] = Field(default_factory=dict, description="fsspec storage options (endpoint, "
                                            "profile). Never logged.")
    workdir: str = Field(".local/runs", description="Local folder for process logs of a run.")
    launcher: Literal["local", "deployments"] = Field(
        "local",
        description="How the train flow starts learners: 'local' runs each as a subprocess of the flow run (the "
        "embedded default); 'deployments' creates one flow run of the Prefect deployment "
        "`learner_deployment` per learner, on its region's work pool (needs a Prefect server, workers and "
        "`prefect deploy`, see docs/deployments.md).",
    )
    regions: list[str] = Field(
        default_factory=lambda: ["region-a", "region-b"],
        description="Regions (Prefect work pools) of the learners with launcher='deployments': learner i runs in "
        "regions[i % len(regions)].",
    )
    learner_deployment: str = Field(
        "learner/{region}",
        description="Deployment that runs one learner ('flow name/deployment name'); '{region}' is replaced by "
        "the learner's region.",
    )

    @model_validator(mode="after")
    def _deployment_fields(self) -> RunConfig:
        url = urlsplit(self.store)
        if len(url.scheme) > 1 and "://" not in self.store:  # s3:/bucket would be a local folder named "s3:"
            scheme, rest = url.scheme, self.store.split(":", 1)[1]  # one letter is a Windows drive, C:/x
            rest = rest if scheme in ("file", "local") else rest.lstrip("/")  # file:/abs -> file:///abs
            raise ValueError(f"run.store={self.store!r} starts with a URL scheme but has no '//' after it; did you "
                             f"mean {scheme}://{rest}? A local folder is a plain path or file://PATH")
        scheme = self.store.split("://", 1)[0].lower() if "://" in self.store else "file"
        if scheme not in STORE_SCHEMES:
            raise ValueError(f"run.store={self.store!r}: unknown URL scheme {scheme!r}; known: "
                             f"{', '.join(sorted(STORE_SCHEMES))}")
        if not self.regions or any(not r.strip() for r in self.regions):
            raise ValueError("run.regions must list at least one non-empty region name")
        if "/" not in self.learner_deployment:
            raise ValueError(f"run.learner_deployment={self.learner_deployment!r} must look like "
                             "'flow name/deployment name', e.g. 'learner/{region}'")
        return self


class LearnerConfig(_Section, LearnerDeviceFields, schedules.InnerScheduleFields, feedback.ErrorFeedbackFields):
    """The learners; devices, batch, group: :class:`LearnerDeviceFields`; ``schedules``; error ``feedback``."""

    count: int = Field(4, ge=1, description="M, the number of learner processes.")
    lr: float = Field(3e-3, gt=0, description="Inner AdamW learning rate.")
    weight_decay: float = Field(0.1, ge=0, description="Inner AdamW decoupled weight decay.")
    warmup_steps: int = Field(20, ge=0, description="Linear warm-up of the inner learning rate.")
    grad_clip: float = Field(1.0, gt=0, description="Clip of the global gradient norm of each inner step.")
    adopt: Literal["overwrite", "mix", "rebase"] = Field("overwrite", description="How a published version is "
                                                         "adopted (DESIGN §3.8).")
    mix_alpha: float = Field(0.5, gt=0, le=1, description="Weight of the global version when adopt='mix'.")
    codec: Literal["fp32", "bf16", "int8", "int4", "int2"] = Field("bf16", description="Wire codec (DESIGN §6).")
    link_codecs: list[Literal["fp32", "bf16", "int8", "int4", "int2"]] = Field(
        default_factory=list, description="Upload codecs a link-bound learner steps down to, one at a time, after "
        "`codec` (each more compressed than the one before), and back up when its link keeps up with margin "
        "(DESIGN §3 'A link-bound learner adapts'); empty: always `codec`.")
    heartbeat_s: float = Field(0.25, gt=0, description="Heartbeat period.")
    threads: int = Field(1, ge=1, description="torch intra-op threads per learner process.")
    request_timeout_s: float = Field(10.0, gt=0, description="Timeout of one HTTP request.")
    storage_timeout_s: float = Field(60.0, gt=0, description="Timeout of one store call.")
    announce_timeout_s: float = Field(60.0, ge=1, le=3600, description="Seconds an announcement is retried before "
                                      "it is given up, counted undeliverable to its fragment's synchronizer (shard).")
    checkpoint_every_s: float = Field(
        30.0, ge=0, description="Period of the learner's own inner-state checkpoints (0: never)."
    )
    restart_delay_s: float = Field(
        1.0, ge=0, description="Wait this long (seconds) before the train flow restarts a learner whose process "
        "exited non-zero or whose flow run crashed or failed, as a new incarnation."
    )
    max_restarts: int = Field(10, ge=0, description="Restarts per learner slot before the flow gives up on it.")
    barrier: bool = Field(
        False, description="Wait after each contribution until its round published (synchronous DiLoCo baseline)."
    )
    @model_validator(mode="after")
    def _link_codecs_compress_further(self) -> LearnerConfig:
        order = ("fp32", "bf16", "int8", "int4", "int2")  # least to most compressed (DESIGN §6)
        ladder = [self.codec, *self.link_codecs]
        for a, b in zip(ladder, ladder[1:], strict=False):
            if order.index(b) <= order.index(a):
                raise ValueError(f"learners.link_codecs = {self.link_codecs}: {b!r} is not more compressed than "
                                 f"{a!r} before it (learners.codec = {self.codec!r} comes first)")
        return self

    @model_validator(mode="before")
    @classmethod
    def _moved_to_faults(cls, data: Any) -> Any:
        message = moved_keys_message(data) if isinstance(data, dict) else None
        if message:
            raise ValueError(message)
        return data


class SynchronizerConfig(_Section, schedules.OuterScheduleFields):
    """The synchronizer; the outer learning-rate schedule's keys in ``schedules.OuterScheduleFields``."""
    host: str = Field("127.0.0.1", description="Address the synchronizer listens on (0.0.0.0: every interface).")
    port: int = Field(0, ge=0, le=65535, description="0 picks a free port.")
    num_fragments: int = Field(4, ge=1, description="P, fragments of the model (<= number of tensors).")
    shards: int = Field(
        1, ge=1, description="S, synchronizer processes the fragments are divided among (fragment p on shard "
        "p mod S, diloco_async.policy.shards; <= num_fragments). 1: one synchronizer, as before shards existed. "
        "A training field: a learner or resume with another S is refused.")
    sync_every: int = Field(24, ge=1, description="H, inner steps between two rounds of one fragment.")
    max_open_rounds: int = Field(2, ge=1, description="tau, rounds open at once.")
    merges_in_flight: int = Field(
        1, ge=1, description="Merges run at once, each in a worker thread with its own working set (about three "
        "fragments' worth of fp32 beyond its contributions): more merge fragments in parallel on a many-core host, "
        "at that price in memory each.")
    verifies_in_flight: int = Field(
        2, ge=1, description="Contributions fetched and verified at once, each in a worker thread holding its "
        "payload and one tensor's decoding: more overlap remote fetches (S3, GCS) at that price in memory each.")
    min_quorum: int = Field(1, ge=1, description="K, contributions needed before a round may merge.")
    grace_gamma: float = Field(0.8, gt=0, le=1, description="gamma of the grace window (Eq. 3).")
    grace_initial_s: float = Field(0.5, ge=0, description="Grace window before any estimate exists.")
    grace_cap_s: float | None = Field(
        None, ge=0, description="Upper bound of the grace window; None = one step of the slowest learner."
    )
    grace_enabled: bool = Field(
        True, description="False merges as soon as the quorum is met (synchronous baseline uses K=M)."
    )
    max_staleness: int = Field(4, ge=0, description="S, versions kept; older bases are rejected.")
    fold_late: bool = Field(
        True, description="A contribution announced after its round closed joins its fragment's next round "
        "when that one is open, its base is still kept and its learner has not answered it (DESIGN §3.5); "
        "false answers it late.")
    merge: Literal["rda", "mean"] = Field("rda", description="Merge of outer gradients (DESIGN §4.4).")
    download_codec: Literal["fp32", "bf16", "int8", "int4", "int2"] = Field(
        "fp32", description="Codec of the published versions learners download (diloco_async/codec/versions.py); "
        "fp32: the master value itself, else learners adopt (and merges anchor on) its compressed published value.")
    download_mode: Literal["delta", "whole"] = Field(
        "delta", description="Compressed versions travel as version-to-version deltas with error feedback, or "
        "whole (ignored with download_codec fp32).")
    download_block_size: int = Field(64, ge=1, description="Quantization block of int8/int4 downloads (elements).")

    @property
    def download(self) -> tuple[str, str, int]:
        """(download_codec, download_mode, download_block_size)."""
        return self.download_codec, self.download_mode, self.download_block_size
    outer_lr: float = Field(0.7, gt=0, description="Outer learning rate of the merged outer gradient (paper §3).")
    outer_momentum: float = Field(0.9, ge=0, lt=1, description="Outer Nesterov momentum (paper §3).")
    outer_optimizer: Literal["nesterov", "sgd", "delayed-nesterov"] = Field(
        "nesterov", description="Outer optimizer of every fragment (DESIGN §4.5b): the paper's Nesterov, plain SGD "
        "(no momentum), or Delayed Nesterov (Liu et al. 2024: momentum updated every outer_momentum_every steps).")
    outer_momentum_every: int = Field(
        4, ge=1, description="N of outer_optimizer='delayed-nesterov': outer steps of a fragment between two "
        "momentum updates (about learners.count / min_quorum); ignored by the others.")
    fragmentation: Literal["balanced", "tensor", "layer"] = Field(
        "balanced", description="How tensors are cut into num_fragments fragments (DESIGN §4.6): 'balanced' by "
        "size, 'tensor' contiguous runs of tensors in model order by count, 'layer' whole transformer blocks.")
    heartbeat_timeout_s: float = Field(5.0, gt=0, description="A learner silent this long is lost.")
    checkpoint_every_s: float = Field(60.0, gt=0, description="Period of outer-state checkpoints.")
    keep_checkpoints: int = Field(
        3, ge=0, description="After each checkpoint, collect garbage behind the newest verified one, keeping "
        "this many complete checkpoints (0: never collect)."
    )
    read_lease_versions: int = Field(
        64, ge=0, description="Garbage collection never deletes a version a live learner was told to read and has "
        "not finished reading (its read lease, from its heartbeats: policy/catchup.py), up to this many versions "
        "behind the fragment's current one; older ones are collected as usual (a learner then reads a newer one).")
    storage_timeout_s: float = Field(60.0, gt=0, description="Timeout of one store call.")
    orphan_age_s: float = Field(
        86400.0, gt=0, description="Garbage collection also removes temporary files and multipart uploads left by "
        "writers that died, once this old (s); must exceed the longest upload of the run."
    )
    client_max_size_bytes: int = Field(1 << 20, ge=1024, description="Largest accepted HTTP body.")
    max_learners: int = Field(256, ge=1, description="Learner ids a run accepts; a join of one more is refused "
                              "(learner_cap). A learner rejoining its own id does not count twice.")
    request_body_timeout_s: float = Field(30.0, gt=0, description="A request body not received in this many "
                                          "seconds gets 408 (body_timeout).")
    idle_timeout_s: float = Field(75.0, gt=0, description="A connection that sends no complete request for this "
                                  "long is closed (idle keep-alive, or headers trickled in slowly).")
    ema_alpha: float = Field(0.3, gt=0, le=1, description="Smoothing of step and sync time estimates.")
    drain_s: float = Field(
        10.0, ge=0, description="On a stop, first open a last round of every fragment so the learners' progress "
        "since their last contribution is merged; wait at most this long for those rounds (0: stop at once)."
    )
    drain_lookahead: float = Field(0.0, ge=0, le=1, description="Share of the Nesterov look-ahead (eta*mu*b) "
                                   "a drain's last round takes: 0 plain step -eta*g, 1 full (docs/end-of-run.md).")
    lease_ttl_s: float = Field(30.0, gt=0, description="A run's lease not renewed this long may be taken over "
                               "by another synchronizer (docs/resume-and-fencing.md).")
    lease_renew_s: float = Field(5.0, gt=0, description="Renewal period of the lease; below lease_ttl_s / 2.")


class BudgetConfig(_Section):
    tokens: int | None = Field(None, ge=1, description="Stop after this many tokens processed by all learners.")
    max_steps: int | None = Field(None, ge=1, description="Stop when the global step g reaches this.")
    wall_s: float | None = Field(None, gt=0, description="Stop after this many seconds of training.")

    @model_validator(mode="after")
    def _some_budget(self) -> BudgetConfig:
        if self.tokens is None and self.max_steps is None and self.wall_s is None:
            raise ValueError("budget: set at least one of tokens, max_steps, wall_s")
        return self


class Config(_Section):
    run: RunConfig = RunConfig()
    data: DataConfig = DataConfig()
    model: ModelConfig = ModelConfig()
    learners: LearnerConfig = LearnerConfig()
    synchronizer: SynchronizerConfig = SynchronizerConfig()
    budget: BudgetConfig = BudgetConfig(tokens=4_000_000)
    guard: GuardConfig = GuardConfig()
    tracking: TrackingConfig = TrackingConfig()
    faults: FaultsConfig = FaultsConfig()
    network: NetworkConfig = NetworkConfig()
    replay: ReplayConfig = ReplayConfig()

    @model_validator(mode="after")
    def _cross_checks(self) -> Config:
        sc = self.synchronizer
        if sc.min_quorum > self.learners.count:
            raise ValueError(f"synchronizer.min_quorum={sc.min_quorum} exceeds learners.count={self.learners.count}")
        if sc.shards > sc.num_fragments:
            raise ValueError(f"synchronizer.shards={sc.shards} exceeds synchronizer.num_fragments={sc.num_fragments}")
        if not 2 * sc.lease_renew_s < sc.lease_ttl_s:
            raise ValueError(f"synchronizer.lease_renew_s={sc.lease_renew_s} must be below lease_ttl_s / 2 "
                             f"(lease_ttl_s={sc.lease_ttl_s})")
        schedules.check_schedules(self)
        self.network.check_learners(self.learners.count)
        check_parallelism(self)
        check_replay(self)
        check_slices(self)
        return self

    def public_dict(self) -> dict:
        """The config as plain data without secrets (storage_options removed)."""
        d = self.model_dump(mode="json")
        d["run"].pop("storage_options", None)
        return d


def _parse_value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """Apply ``section.field=value`` overrides (values parsed as TOML, else taken as strings).

    Raises:
        ValueError: an override without ``=``, without a section, or with a field under a value.
    """
    out = json.loads(json.dumps(raw))
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r} must look like section.field=value")
        key, value = item.split("=", 1)
        set_dotted(out, key.strip(), _parse_value(value.strip()), f"override {item!r}")
    return out


def set_dotted(raw: dict, name: str, value: Any, label: str) -> None:
    """Set ``raw[section][...][field] = value`` for ``name`` = ``section.field`` (or deeper), making
    missing sections; ``label`` names the input in errors (an override, a field).

    Raises:
        ValueError: a name without a section, or one whose section is a value.
    """
    parts = name.split(".")
    if len(parts) < 2:
        raise ValueError(f"{label} must name a section and a field, e.g. learners.count")
    node = raw
    for depth, part in enumerate(parts[:-1]):
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ValueError(f"{label}: {'.'.join(parts[:depth + 1])} is a value, not a section with fields")
    node[parts[-1]] = value


def _format_error(err: ValidationError, source: str) -> str:
    lines = [f"invalid config {source}:"]
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"]) or "(top level)"
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown field"
        elif e["type"] == "literal_error" or isinstance(e.get("input"), int | float | str):
            msg = f"{msg} (got {e.get('input')!r})"
        lines.append(f"  {loc}: {msg}")
    return "\n".join(lines)


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | None = None,
                base: dict | None = None) -> Config:
    """Read a TOML recipe (or ``base``, a config as plain data, e.g. a run's stored ``config.json``;
    or the defaults when both are None) and apply overrides. The one parser of recipes and ``--set``
    strings: entry points call it once and pass the :class:`Config` on (:mod:`diloco_async.config.resolved`).

    Raises:
        FileNotFoundError: the recipe does not exist.
        ValueError: the recipe is not valid TOML (the message names the file and the line), or a
            field is unknown or invalid (the message names every offending field).
    """
    raw: dict = {} if base is None else weight_ramp_as_stored(json.loads(json.dumps(base)))
    source = "(defaults)" if base is None else "(stored config)"
    if path is not None:
        source = str(path)
        raw = read_toml(path, "recipe")
    if overrides:
        source += f" with --set {' '.join(overrides)}"
    raw = apply_overrides(raw, overrides or [])
    try:
        return Config.model_validate(raw)
    except ValidationError as err:
        raise ValueError(_format_error(err, source)) from None


def _training_dict(d: dict) -> dict:
    """The part of a public config dict that defines the training itself: no budget (a resumed
    run may extend it), no tracking, no local paths, no store location."""
    d = json.loads(json.dumps(d))
    for key in ("budget", "tracking"):
        d.pop(key, None)
    if d.get("synchronizer", {}).get("shards") == 1:  # S = 1 hashes as before shards existed (old runs resume)
        del d["synchronizer"]["shards"]
    schedules.drop_default_schedule_fields(d)  # the schedule keys at their defaults hash as before they existed
    feedback.drop_default_feedback_fields(d)  # so does learners.error_feedback = false
    drop_default_replay_fields(d)  # and run.schedule = "free" with [replay] at its defaults
    drop_default_slice_fields(d)  # and data.slices = false
    drop_old_weight_ramp(d)  # and the guard's weight ramp at direction_fraction, as before it had its own field
    for section, fields in _OPERATIONAL.items():
        for key in fields:
            *parents, leaf = key.split(".")
            node = d.get(section, {})
            for part in parents:
                node = node.get(part) or {}
            node.pop(leaf, None)
        if section in d and not d[section]:  # a section all operational ([faults]) is left out, not kept empty
            del d[section]
    return d


# Fields that change how a run is operated, not what it computes: they may differ on resume.
_OPERATIONAL = {
    "run": ("workdir", "store", "name", "storage_options", "launcher", "regions", "learner_deployment"),
    "data": ("cache_dir", "token_cache_dir"),
    "model": ("hf.cache_dir",),
    "learners": ("heartbeat_s", "request_timeout_s", "storage_timeout_s", "announce_timeout_s", "threads",
                 "flush_denormal", "checkpoint_every_s", "device", "rdzv_endpoint", "group_timeout_s",
                 "restart_delay_s", "max_restarts"),
    "synchronizer": ("host", "port", "heartbeat_timeout_s", "checkpoint_every_s", "keep_checkpoints",
                     "read_lease_versions", "orphan_age_s", "storage_timeout_s", "client_max_size_bytes", "drain_s",
                     "drain_lookahead",
                     "lease_ttl_s", "lease_renew_s", "max_learners", "request_body_timeout_s", "idle_timeout_s",
                     "verifies_in_flight"),
    "faults": tuple(FaultsConfig.model_fields),  # injected faults test a run, never change what it computes
    "network": tuple(NetworkConfig.model_fields),  # how learners reach the synchronizer, never what they compute
}


def config_hash(cfg: Config) -> str:
    """sha256 (hex) of the canonical JSON of the training-defining config (see ``config_differences``)."""
    d = _training_dict(cfg.public_dict())
    return hashlib.sha256(json.dumps(d, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def config_differences(old: dict, new: dict) -> list[str]:
    """Fields of two public config dicts that change the training, as ``section.field: old -> new``."""
    def flat(d: dict, prefix: str = "") -> dict:
        out = {}
        for k, v in d.items():
            if isinstance(v, dict):
                out.update(flat(v, f"{prefix}{k}."))
            else:
                out[f"{prefix}{k}"] = v
        return out

    a, b = flat(_training_dict(old)), flat(_training_dict(new))
    return [f"{k}: {a.get(k, '(unset)')!r} -> {b.get(k, '(unset)')!r}" for k in sorted(set(a) | set(b))
            if a.get(k) != b.get(k)]
