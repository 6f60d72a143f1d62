"""The simulator's one parameter set, loaded from TOML and validated with pydantic.

Every field is required (a calibration file is complete and readable on its own) and unknown keys
are rejected. :func:`load_calibration` turns a validation failure into a ``ValueError`` whose
message names the file and the dotted field, e.g. ``elastic.reshard_pause_s: Input should be
greater than or equal to 0``. Where each value comes from is written next to it in
``configs/calibration.toml``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from diloco_async.config.tomlfile import load_toml_model

__all__ = [
    "FailureParams",
    "SliceParams",
    "RecoveryParams",
    "ElasticParams",
    "NonElasticParams",
    "StragglerParams",
    "RunParams",
    "HeterogeneityParams",
    "Calibration",
    "DEFAULT_CALIBRATION",
    "default_calibration_path",
    "load_calibration",
]

DEFAULT_CALIBRATION = "configs/calibration.toml"
"""Where the CLI looks first (relative to the working directory)."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class FailureParams(_Section):
    mtbi_chip_years: float = Field(
        gt=0, description="Mean time between interruptions of one chip, in years (paper §5.2)."
    )
    seconds_per_year: float = Field(gt=0, description="Length of the year used for the MTBI, in s.")
    hazard_clock: Literal["busy"] = Field(
        description="'busy': a chip accrues failure hazard only while it computes (paused, stalled "
        "or blocked chips do not fail). The only clock implemented; stated so the file says it."
    )


class SliceParams(_Section):
    chips_per_slice: int = Field(ge=1, description="Chips per slice, the unit that fails and recovers.")


class RecoveryParams(_Section):
    distribution: Literal["exponentiated_weibull"] = Field(
        description="Distribution of a slice's recovery time (paper §5.2)."
    )
    scale_s: float = Field(gt=0, description="Scale of the exponentiated Weibull, in s.")
    shape_k: float = Field(gt=0, description="Weibull shape k (k < 1: heavier than exponential tail).")
    shape_alpha: float = Field(gt=0, description="Exponentiation shape alpha.")


class ElasticParams(_Section):
    reshard_pause_s: float = Field(ge=0, description="Whole-job pause to re-shard after a slice fails, s.")
    scale_up_pause_s: float = Field(ge=0, description="Whole-job pause to take back recovered slices, s.")
    scale_up_batch_window_s: float = Field(
        ge=0,
        description="A recovered slice waits at most this long to join the next re-shard for free "
        "before the job pays a scale-up pause for it, s (0: scale up at once).",
    )


class NonElasticParams(_Section):
    restart_pause_s: float = Field(
        ge=0, description="Restart of the whole job once its failed slice is back, s."
    )


class StragglerParams(_Section):
    slice_step_noise: float = Field(
        ge=0, lt=1, description="Relative std of a slice's step time, i.i.d. per slice and step."
    )
    barrier_samples: int = Field(
        ge=64, description="Steps sampled to estimate quorum-barrier waits (quorum K > 1 only)."
    )


class RunParams(_Section):
    horizon_s: float = Field(gt=0, description="Simulated wall-clock time per cell, s.")


class HeterogeneityParams(_Section):
    learners: int = Field(ge=1, description="Learners M.")
    slow_learners: int = Field(ge=0, description="How many of them run on the slower chip type.")
    slow_step_factor: float = Field(ge=1, description="Step-time multiplier of the slower type.")
    learner_step_noise: float = Field(
        ge=0, lt=1, description="Relative std of a learner's step time, i.i.d. per learner and step."
    )
    chips_per_learner: int = Field(ge=1, description="Chips per learner.")
    quorums: list[int] = Field(min_length=1, description="Quorums K to simulate.")
    paper_goodput: dict[str, float] = Field(
        description="Paper's goodput (0-1) per quorum, keyed by K as a string."
    )
    with_failures: bool = Field(description="Whether chip failures are simulated in this case.")

    @model_validator(mode="after")
    def _consistent(self) -> HeterogeneityParams:
        if self.slow_learners > self.learners:
            raise ValueError(
                f"heterogeneity.slow_learners={self.slow_learners} exceeds learners={self.learners}"
            )
        bad = [k for k in self.quorums if not 1 <= k <= self.learners]
        if bad:
            raise ValueError(f"heterogeneity.quorums {bad} outside 1..learners={self.learners}")
        for key, value in self.paper_goodput.items():
            if not key.isdigit() or int(key) not in self.quorums:
                raise ValueError(f"heterogeneity.paper_goodput key {key!r} is not one of quorums")
            if not 0 <= value <= 1:
                raise ValueError(f"heterogeneity.paper_goodput[{key}]={value} is outside [0, 1]")
        return self


class Calibration(_Section):
    failures: FailureParams
    slices: SliceParams
    recovery: RecoveryParams
    elastic: ElasticParams
    non_elastic: NonElasticParams
    stragglers: StragglerParams
    run: RunParams
    heterogeneity: HeterogeneityParams

    @model_validator(mode="after")
    def _finite(self) -> Calibration:
        for name, section in self:
            for field, value in section:
                if isinstance(value, float) and not math.isfinite(value):
                    raise ValueError(f"{name}.{field}={value} must be finite")
        return self


def default_calibration_path() -> Path:
    """``configs/calibration.toml`` in the working directory, else the one of this checkout."""
    here = Path(DEFAULT_CALIBRATION)
    if here.exists():
        return here
    return Path(__file__).resolve().parents[2] / DEFAULT_CALIBRATION


def load_calibration(path: str | Path | None = None) -> Calibration:
    """Read and validate a calibration file.

    Args:
        path: TOML file; ``None`` means :func:`default_calibration_path`.

    Raises:
        ValueError: the file is missing, is not TOML, or a field is missing, unknown or out of range;
            the message names the file and every offending field.
    """
    p = Path(path) if path is not None else default_calibration_path()
    try:
        return load_toml_model(p, Calibration, "calibration")
    except FileNotFoundError:
        raise ValueError(f"calibration file not found: {p}") from None
