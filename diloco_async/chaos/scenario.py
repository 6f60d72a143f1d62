"""Chaos scenarios and their seeded fault schedules (issue 4). Pure: no I/O besides reading a
scenario file, no clock.

A scenario (TOML, ``configs/chaos/*.toml``) names the training recipe, the number of learner
slots M, how long every method runs, and the faults: per-slot failures as a Poisson process
(mean time between failures, counted in up-time) with recovery delays from a distribution,
persistent stragglers (speed factors) and per-step jitter, stalls (SIGSTOP, later SIGCONT),
dropped or delayed control messages, and storage faults. :func:`make_schedule` turns it into the
exact same list of timed events for every method, given the seed.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from diloco_async.config.resolved import (
    decoupled_diloco,
    decoupled_fields,
    synchronous_diloco,
    synchronous_fields,
    with_fields,
)
from diloco_async.config.schema import Config
from diloco_async.config.tomlfile import load_toml_model
from diloco_async.storage.faults import OPS
from diloco_async.validate import recipe_field

__all__ = ["METHODS", "Scenario", "LinkSlot", "StorageFaults",
           "FaultEvent", "Schedule", "load_scenario", "make_schedule", "method_config",
           "harness_fields", "check_user_overrides", "with_user_overrides"]

ScenarioT = TypeVar("ScenarioT", bound="Scenario")

#: The methods of DESIGN §8, in table order.
METHODS = ("ddp", "sync-diloco", "decoupled")


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class FailureModel(_Section):
    mtbf_s: float | None = Field(None, gt=0, description="Mean up-time between failures of one slot (None: none).")
    recovery: Literal["fixed", "exponential", "lognormal"] = Field(
        "fixed", description="Distribution of the time a failed slot stays down.")
    recovery_mean_s: float = Field(30.0, ge=0, description="Mean time down after a failure, seconds.")
    recovery_sigma: float = Field(0.5, gt=0, description="Sigma of log(time down), lognormal only.")
    min_uptime_s: float = Field(0.0, ge=0, description="No failure in a slot's first seconds after it (re)starts.")


class StragglerModel(_Section):
    speed: dict[str, float] = Field(default_factory=dict,
                                    description="Slot index -> speed factor in (0, 1]; others run at 1.0.")
    jitter: float = Field(0.0, ge=0, description="Relative per-step slowdown noise.")


class StallModel(_Section):
    mtbs_s: float | None = Field(None, gt=0, description="Mean time between stalls of one slot (None: none).")
    duration_s: float = Field(5.0, gt=0, description="How long a stalled (SIGSTOPped) slot stays frozen.")


class ControlFaults(_Section):
    drop_prob: float = Field(0.0, ge=0, lt=1, description="Chance a heartbeat/announce is dropped.")
    delay_s: float = Field(0.0, ge=0, description="Mean extra delay of a control message, seconds.")


class StorageFaults(_Section):
    p_transient: float = Field(0.0, ge=0, le=1, description="Chance a store call fails with a transient error.")
    p_slow: float = Field(0.0, ge=0, le=1, description="Chance a store call takes slow_s longer.")
    slow_s: float = Field(0.05, ge=0, description="Extra seconds of a slow store call.")
    ops: list[Literal[OPS]] | None = Field(  # type: ignore[valid-type]
        None, description="The store operations the faults hit (diloco_async.storage.faults.OPS; 'read' is one "
                          "whole read or one chunk of a streamed one); None: every operation.")
    slots: list[int] = Field(default_factory=list,
                             description="The slots whose store is faulty (e.g. [3]: one learner with slow reads); "
                                         "empty: every slot's.")


class LinkSlot(_Section):
    """One learner slot behind a shaped link (``tc tbf`` in network namespaces: needs root). The
    synchronizer, the store (moto's S3 server) and the other learners share the hub namespace;
    this slot's learner runs in a region namespace joined to it by the shaped link."""

    slot: int = Field(ge=0, description="The slot whose learner sits behind the link.")
    up_mbit: float = Field(gt=0, description="Learner -> hub rate, Mbit/s (10^6 bit/s, tc tbf).")
    down_mbit: float = Field(gt=0, description="Hub -> learner rate, Mbit/s.")
    delay_ms: float = Field(0.0, ge=0, description="One-way added latency, ms (added by the learner itself).")
    tolerance: float = Field(0.15, gt=0, lt=1, description="A link measured outside +-tolerance refuses the run.")
    verify_bytes: int | None = Field(None, ge=1, description="Bytes of the timed transfer that verifies the link.")
    shaped: bool = Field(True, description="False: the slot's learner runs in the hub beside the others, unshaped "
                                           "(the full-speed baseline keeps the same store and placement).")


class DdpSettings(_Section):
    checkpoint_every_steps: int = Field(25, ge=1, description="torchrun-style checkpoint period of the DDP baseline.")


class ScenarioSection(_Section):
    name: str
    seed: int = 0
    slots: int = Field(ge=1, description="M, learner slots (DDP ranks).")
    wall_s: float = Field(gt=0, description="Each method runs this long: equal wall time.")
    eval_tokens: int = Field(
        ge=1, description="Tokens in the global model at which 'eval loss at equal tokens' is read.")
    methods: list[Literal["ddp", "sync-diloco", "decoupled"]] = Field(default_factory=lambda: list(METHODS))
    config: str = Field("configs/default.toml", description="The training recipe all methods share.")
    overrides: list[str] = Field(default_factory=list, description="section.field=value on top of the recipe.")
    snapshot_every_s: float = Field(5.0, gt=0, description="Period of the checkpoints used for equal-token evaluation.")

    @field_validator("config")
    @classmethod
    def _resolve_recipe(cls, v: str) -> str:  # a path from any folder, or a shipped recipe's name
        return recipe_field(v)


class Scenario(_Section):
    """A validated scenario file. Unknown keys are rejected."""

    scenario: ScenarioSection
    failures: FailureModel = FailureModel()
    stragglers: StragglerModel = StragglerModel()
    stalls: StallModel = StallModel()
    control: ControlFaults = ControlFaults()
    storage: StorageFaults = StorageFaults()
    link: LinkSlot | None = None
    ddp: DdpSettings = DdpSettings()

    @model_validator(mode="after")
    def _check(self) -> Scenario:
        for k, v in self.stragglers.speed.items():
            if not k.isdigit() or int(k) >= self.scenario.slots:
                raise ValueError(f"stragglers.speed: slot {k!r} is not in 0..{self.scenario.slots - 1}")
            if not 0 < v <= 1:
                raise ValueError(f"stragglers.speed[{k}] must be in (0, 1], got {v}")
        slots = self.scenario.slots
        bad = [i for i in self.storage.slots if not 0 <= i < slots]
        if bad:
            raise ValueError(f"[storage] slots: {bad} not in 0..{slots - 1}")
        if self.link is not None and self.link.slot >= slots:
            raise ValueError(f"link.slot = {self.link.slot} is not in 0..{slots - 1}")
        if self.link is not None and "ddp" in self.scenario.methods:
            raise ValueError("a scenario with a [link] runs the DiLoCo methods only (sync-diloco, decoupled), not ddp")
        return self

    def speed_factors(self) -> list[float]:
        """Speed factor of every slot, index order."""
        return [float(self.stragglers.speed.get(str(i), 1.0)) for i in range(self.scenario.slots)]

    def at_full_speed(self: ScenarioT) -> ScenarioT:
        """The same scenario with every learner at full speed: the baseline of the heterogeneity
        bars. No speed factors (the jitter stays), no storage faults that only some slots have
        (faults every slot has stay), and the shaped link's slot unshaped in the same placement
        (same store, same processes). Failures, stalls and control faults stay."""
        update: dict[str, Any] = {"stragglers": self.stragglers.model_copy(update={"speed": {}})}
        if self.storage.slots:
            update["storage"] = StorageFaults()
        if self.link is not None:
            update["link"] = self.link.model_copy(update={"shaped": False})
        return self.model_copy(update=update)


def load_scenario(path: str | Path, model: type[Scenario] = Scenario) -> Scenario:
    """Read and validate a scenario file (as ``model``: a WAN scenario adds link settings).

    Raises:
        FileNotFoundError: no such file.
        ValueError: a TOML syntax error, or a field that is unknown or out of range (named).
    """
    return load_toml_model(path, model, "scenario", "storm.toml")


@dataclass(frozen=True)
class FaultEvent:
    """At ``t_s`` seconds after the start, slot ``slot`` fails (down for ``duration_s``) or
    stalls (frozen for ``duration_s``)."""

    t_s: float
    slot: int
    kind: Literal["fail", "stall"]
    duration_s: float


@dataclass(frozen=True)
class Schedule:
    events: tuple[FaultEvent, ...]
    wall_s: float
    slots: int

    def down_intervals(self) -> dict[int, list[tuple[float, float]]]:
        """Slot -> planned ``(t0, t1)`` down intervals (seconds from the start)."""
        out: dict[int, list[tuple[float, float]]] = {i: [] for i in range(self.slots)}
        for e in self.events:
            if e.kind == "fail":
                out[e.slot].append((e.t_s, e.t_s + e.duration_s))
        return out

    def availability(self) -> float:
        """Mean planned share of the wall time each slot is up."""
        down = self.down_intervals()
        shares = [1.0 - sum(max(0.0, min(b, self.wall_s) - a) for a, b in ivs) / self.wall_s for ivs in down.values()]
        return sum(shares) / len(shares)


def _recovery(rng: random.Random, f: FailureModel) -> float:
    if f.recovery == "fixed":
        return f.recovery_mean_s
    if f.recovery == "exponential":
        return rng.expovariate(1.0 / f.recovery_mean_s) if f.recovery_mean_s > 0 else 0.0
    mu = math.log(max(f.recovery_mean_s, 1e-9)) - f.recovery_sigma ** 2 / 2  # mean of the lognormal = recovery_mean_s
    return rng.lognormvariate(mu, f.recovery_sigma)


def make_schedule(sc: Scenario) -> Schedule:
    """The seeded fault schedule of a scenario: the same events for the same file.

    Each slot has its own random stream. Failures: up-time to the next failure is exponential
    with mean ``mtbf_s`` (plus ``min_uptime_s``), then the slot is down for a recovery delay.
    Stalls: a Poisson process with mean gap ``mtbs_s``; a stall that would overlap a planned
    down interval is dropped. Events are sorted by time.
    """
    s = sc.scenario
    events: list[FaultEvent] = []
    for slot in range(s.slots):
        rng = random.Random(f"{s.seed}/{slot}/failures")
        down: list[tuple[float, float]] = []
        if sc.failures.mtbf_s:
            t = 0.0
            while True:
                t += sc.failures.min_uptime_s + rng.expovariate(1.0 / sc.failures.mtbf_s)
                if t >= s.wall_s:
                    break
                d = _recovery(rng, sc.failures)
                events.append(FaultEvent(t, slot, "fail", d))
                down.append((t, t + d))
                t += d
        if sc.stalls.mtbs_s:
            rng = random.Random(f"{s.seed}/{slot}/stalls")
            t = 0.0
            while True:
                t += rng.expovariate(1.0 / sc.stalls.mtbs_s)
                if t >= s.wall_s:
                    break
                d = sc.stalls.duration_s
                if not any(a - d <= t <= b for a, b in down):
                    events.append(FaultEvent(t, slot, "stall", d))
                t += d
    events.sort(key=lambda e: (e.t_s, e.slot))
    return Schedule(tuple(events), s.wall_s, s.slots)


def harness_fields(sc: Scenario) -> set[str]:
    """The ``section.field`` names the harness sets for every method (slots, faults, quorum,
    grace, barrier, checkpoints, budget): a user override of one of them would change what the
    methods are, so :func:`check_user_overrides` refuses it."""
    return {*_common_fields(sc), "faults.storage_faults", "faults.storage_fault_learners",
            *synchronous_fields(sc.scenario.slots), *decoupled_fields()}


def check_user_overrides(sc: Scenario, overrides: list[str]) -> None:
    """Raises ValueError naming any override of a field the harness controls."""
    clash = sorted({o.split("=", 1)[0].strip() for o in overrides if "=" in o} & harness_fields(sc))
    if clash:
        raise ValueError(f"the chaos harness sets {', '.join(clash)} itself (from the scenario and the method); "
                         "change the scenario file instead")


def _common_fields(sc: Scenario) -> dict[str, Any]:
    """The fields every method gets: M slots, the learner-side faults (speeds, jitter, control and
    storage faults), the snapshot period, and a budget that only the scenario's wall time ends."""
    s = sc.scenario
    out: dict[str, Any] = {
        "learners.count": s.slots, "faults.speed_factors": list(sc.speed_factors()),
        "faults.step_jitter": sc.stragglers.jitter,
        "faults.control_drop_prob": sc.control.drop_prob, "faults.control_delay_s": sc.control.delay_s,
        "synchronizer.checkpoint_every_s": s.snapshot_every_s, "synchronizer.keep_checkpoints": 0,
        "budget.wall_s": s.wall_s + 600, "budget.tokens": 1_000_000_000_000}
    st = sc.storage
    if st.p_transient or st.p_slow:
        plan: dict[str, Any] = {"p_transient": st.p_transient, "p_slow": st.p_slow, "slow_s": st.slow_s}
        if st.ops is not None:
            plan["ops"] = list(st.ops)
        out["faults.storage_faults"] = plan
        if st.slots:
            out["faults.storage_fault_learners"] = list(st.slots)
    return out


def method_config(sc: Scenario, method: str, base: Config) -> Config:
    """``base`` (the scenario's recipe with its overrides and the user's, resolved once by the
    entry point) as ``method`` under this scenario's learner-side faults: typed fields, validated
    (:func:`~diloco_async.config.resolved.with_fields`); ``sync-diloco`` is
    :func:`~diloco_async.config.resolved.synchronous_diloco`.

    Raises:
        ValueError: an unknown method, or the result does not validate.
    """
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; known: {', '.join(METHODS)}")
    cfg = with_fields(base, _common_fields(sc))
    if method == "sync-diloco":
        return synchronous_diloco(cfg)
    if method == "decoupled":
        return decoupled_diloco(cfg)
    return cfg


def with_user_overrides(sc: ScenarioT, overrides: list[str] | None,
                        methods: list[str] | None) -> tuple[ScenarioT, list[str]]:
    """The scenario with the user's ``overrides`` after its own, and the methods to run (the
    scenario's when ``methods`` is None), in the order given. Works for any scenario model
    with a ``scenario`` section (chaos and WAN scenarios alike).

    Raises:
        ValueError: an override of a field the harness sets, an unknown method, ``ddp`` in a
            scenario with a ``[link]``.
    """
    check_user_overrides(sc, list(overrides or []))
    if overrides:
        sc = sc.model_copy(update={"scenario": sc.scenario.model_copy(
            update={"overrides": [*sc.scenario.overrides, *overrides]})})
    chosen = list(methods or sc.scenario.methods)
    for m in chosen:
        if m not in METHODS:
            raise ValueError(f"unknown method {m!r}; known: {', '.join(METHODS)}")
    if sc.link is not None and "ddp" in chosen:
        raise ValueError("a scenario with a [link] runs the DiLoCo methods only (sync-diloco, decoupled), not ddp")
    return sc, chosen
