"""WAN scenarios (issue 13): a chaos scenario (:mod:`diloco_async.chaos.scenario`) with link
settings. Pure: no I/O besides reading the file, no clock.

A WAN scenario file (``configs/wan/*.toml``) has every section of a chaos scenario, plus:

* ``[links]``: the regions (``r0``, ``r1``, ...), how many learner slots each holds, and the
  shaped rate of every region's link to the hub, per direction, in Mbit/s (``up_mbit``: region
  -> hub, ``down_mbit``: hub -> region), and the one-way added latency ``delay_ms``;
* ``[target]``: the held-out loss every method is timed to: ``rule = "ddp-final"`` (DDP's final
  held-out loss in the same run) or ``rule = "fixed"`` with ``loss``;
* ``[budget]``: the token budget of every method (DDP: as many steps as that many tokens); every
  method stops at its budget or at ``scenario.wall_s``, whichever comes first.

Slot ``i`` lives in region ``regions[i // learners_per_region]``; the synchronizer and the
object store live in the hub.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from diloco_async.chaos.scenario import Scenario, _Section, load_scenario, method_config
from diloco_async.config.resolved import with_fields
from diloco_async.config.schema import Config

__all__ = ["Links", "Target", "Budget", "WanScenario", "load_wan_scenario", "wan_config", "ddp_max_steps"]

_REGION = re.compile(r"[a-z0-9-]{1,8}")


class Links(_Section):
    regions: list[str] = Field(min_length=1, description="Region names, [a-z0-9-]{1,8}, one namespace each.")
    learners_per_region: int = Field(1, ge=1, description="Learner slots (DDP ranks) per region.")
    up_mbit: float = Field(gt=0, description="Region -> hub rate of every link, Mbit/s (tc tbf).")
    down_mbit: float = Field(gt=0, description="Hub -> region rate of every link, Mbit/s (tc tbf).")
    delay_ms: float = Field(0.0, ge=0, description="One-way added latency, ms (application level: no netem here).")
    tolerance: float = Field(0.15, gt=0, lt=1, description="A link measured outside +-tolerance refuses the run.")
    verify_bytes: int | None = Field(None, ge=1, description="Bytes of the timed transfer that verifies a link.")


class Target(_Section):
    rule: Literal["ddp-final", "fixed"] = Field(
        "ddp-final", description="ddp-final: DDP's final held-out loss of the same run; fixed: `loss`.")
    loss: float | None = Field(None, gt=0, description="The target held-out loss (nats/token) of rule = fixed.")


class Budget(_Section):
    tokens: int = Field(ge=1, description="Tokens every method trains for (all learners / ranks together).")


class WanScenario(Scenario):
    """A validated WAN scenario file. Unknown keys are rejected."""

    links: Links
    target: Target = Target()
    budget: Budget

    @model_validator(mode="before")
    @classmethod
    def _no_single_link(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("link") is not None:
            raise ValueError("a WAN scenario shapes every region's link in [links]; [link] (one shaped slot) is for "
                             "chaos scenarios")
        return data

    @model_validator(mode="after")
    def _check_links(self) -> WanScenario:
        ln = self.links
        for r in ln.regions:
            if not _REGION.fullmatch(r):
                raise ValueError(f"links.regions: {r!r} is not a region name ([a-z0-9-]{{1,8}})")
        if len(set(ln.regions)) != len(ln.regions):
            raise ValueError(f"links.regions: a region is named twice in {ln.regions}")
        if len(ln.regions) * ln.learners_per_region != self.scenario.slots:
            raise ValueError(f"scenario.slots = {self.scenario.slots} but links has {len(ln.regions)} regions x "
                             f"{ln.learners_per_region} learners = {len(ln.regions) * ln.learners_per_region}")
        if self.target.rule == "fixed" and self.target.loss is None:
            raise ValueError("target.rule = 'fixed' needs target.loss")
        if self.target.rule == "ddp-final" and "ddp" not in self.scenario.methods:
            raise ValueError("target.rule = 'ddp-final' needs 'ddp' in scenario.methods")
        return self

    def region_of(self, slot: int) -> str:
        """The region of learner slot ``slot`` (0 .. slots-1).

        Raises:
            ValueError: ``slot`` out of range.
        """
        if not 0 <= slot < self.scenario.slots:
            raise ValueError(f"slot {slot} is not in 0..{self.scenario.slots - 1}")
        return self.links.regions[slot // self.links.learners_per_region]

    def link_settings(self) -> list[tuple[str, float, float, float]]:
        """``(region, up_mbit, down_mbit, delay_ms)`` of every link, region order."""
        ln = self.links
        return [(r, ln.up_mbit, ln.down_mbit, ln.delay_ms) for r in ln.regions]


def load_wan_scenario(path: str | Path) -> WanScenario:
    """Read and validate a WAN scenario file.

    Raises:
        FileNotFoundError: no such file.
        ValueError: a TOML syntax error, an unknown or out-of-range field, a bad region name,
            slots that do not match the regions (named).
    """
    sc = load_scenario(path, WanScenario)
    assert isinstance(sc, WanScenario)
    return sc


def ddp_max_steps(sc: WanScenario, batch_size: int, context: int) -> int:
    """DDP steps that train ``budget.tokens`` tokens: ceil(tokens / (slots x batch x context))."""
    return max(1, math.ceil(sc.budget.tokens / (sc.scenario.slots * batch_size * context)))


def wan_config(sc: WanScenario, method: str, base: Config, seed: int | None = None) -> Config:
    """``base`` as ``method`` under the chaos harness (:func:`~diloco_async.chaos.scenario.method_config`)
    with the WAN run's own fields on top: the token budget (the run ends there or at the scenario's
    wall time, whichever comes first) and, when given, the seed of the model and data.

    Raises:
        ValueError: an unknown method, or the result does not validate.
    """
    fields: dict[str, Any] = {"budget.tokens": sc.budget.tokens}
    if seed is not None:
        fields["run.seed"] = int(seed)
    return with_fields(method_config(sc, method, base), fields)
