"""Ablation suite files (``configs/ablations/*.toml``): a base recipe, arms, seeds, one token
budget for every run, the figures to compare and the paper's claims.

A suite file::

    [suite]
    name = "merge"
    config = "configs/default.toml"      # the base recipe
    overrides = ["learners.count=8"]     # applied to every arm, before the arm's own
    seeds = [0, 1, 2]                    # run.seed of each run (model init and data order)
    tokens = 400000                      # budget.tokens of every run: all arms at equal tokens
    tokens_why = "..."                   # why that budget is enough for the differences in question
    wall_s = 400.0                       # budget.wall_s: a safety stop, never the intended end
    figures = ["eval_loss", "compute_goodput", "bytes_per_token"]

    [[arms]]
    name = "mean"
    set = ["synchronizer.merge=mean"]
    # synchronous = true                 # run the arm as synchronous DiLoCo (K = M, no grace, barrier)

    [[comparisons]]                      # the difference b - a of one figure, and the paper's claim
    name = "RDA vs plain mean (M = 8)"
    figure = "eval_loss"
    a = "mean"
    b = "rda"
    expect = "lower"                     # lower | higher | equivalent | not-higher | not-lower
    margin = 0.0                         # equivalent / not-*: fixed here, before running
    paper = "text avg: mean 54.1, RDA 55.4"

Figures: ``eval_loss`` (held-out nats per token of the final global model), ``compute_goodput``,
``token_goodput``, ``uptime``, ``bytes_per_token`` ((bytes in + bytes out) at the synchronizer
per token processed), ``tokens``, ``wall_s``, or any other numeric key of the run summary.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from diloco_async.ablation.stats import CLAIM_KINDS, Claim
from diloco_async.config.resolved import synchronous_diloco, synchronous_fields, with_fields
from diloco_async.config.schema import Config
from diloco_async.config.tomlfile import load_toml_model
from diloco_async.validate import recipe_field

__all__ = ["Arm", "Comparison", "SuiteSpec", "Suite", "load_suite", "arm_overrides", "run_fields",
           "run_config", "owned_fields", "check_extra", "figures_of"]

#: figures computed from a run (the rest are read from the summary by name)
COMPUTED_FIGURES = ("eval_loss", "bytes_per_token", "tokens")
#: lower is better for these; higher for the rest (bar charts and the report say which)
LOWER_IS_BETTER = ("eval_loss", "bytes_per_token", "wall_s")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class Arm(_Strict):
    """One arm: a name (file-name safe), its ``section.field=value`` overrides and whether it runs
    as synchronous DiLoCo (:func:`~diloco_async.config.resolved.synchronous_diloco`, after ``set``)."""

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
    set: list[str] = Field(default_factory=list)
    synchronous: bool = Field(False, description="synchronous DiLoCo: K = M, no grace window, learners wait "
                                                 "at each round (the paper's synchronous baseline)")
    description: str = ""


class Comparison(_Strict):
    """The paper's claim about ``b - a`` of ``figure`` (see :mod:`diloco_async.ablation.stats`)."""

    name: str
    figure: str
    a: str
    b: str
    expect: str
    margin: float = 0.0
    paper: str = ""

    @field_validator("expect")
    @classmethod
    def _kind(cls, v: str) -> str:
        if v not in CLAIM_KINDS:
            raise ValueError(f"expect must be one of {', '.join(CLAIM_KINDS)}, got {v!r}")
        return v

    def claim(self) -> Claim:
        return Claim(self.expect, self.margin)


class SuiteSpec(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
    description: str = ""
    config: str = "configs/default.toml"
    overrides: list[str] = Field(default_factory=list)
    seeds: list[int] = Field(min_length=1)
    tokens: int = Field(gt=0, description="budget.tokens of every run")
    tokens_why: str = Field(min_length=1, description="why this budget is enough for the differences in question")
    wall_s: float = Field(gt=0, description="budget.wall_s of every run (a safety stop)")
    figures: list[str] = Field(min_length=1)
    confidence: float = Field(0.95, gt=0, lt=1)

    @field_validator("config")
    @classmethod
    def _resolve_recipe(cls, v: str) -> str:  # a path from any folder, or a shipped recipe's name
        return recipe_field(v)


class Suite(_Strict):
    """A whole suite file.

    Raises (on construction):
        pydantic.ValidationError: duplicate arm names or seeds, a comparison naming an unknown arm
            or a figure not in ``suite.figures``, an equivalence claim without a margin.
    """

    suite: SuiteSpec
    arms: list[Arm] = Field(min_length=1)
    comparisons: list[Comparison] = Field(default_factory=list)

    @model_validator(mode="after")
    def _consistent(self) -> Suite:
        names = [a.name for a in self.arms]
        if len(set(names)) != len(names):
            raise ValueError(f"arm names must be unique, got {names}")
        if len(set(self.suite.seeds)) != len(self.suite.seeds):
            raise ValueError(f"seeds must be unique, got {self.suite.seeds}")
        for c in self.comparisons:
            for arm in (c.a, c.b):
                if arm not in names:
                    raise ValueError(f"comparison {c.name!r} names arm {arm!r}; arms: {', '.join(names)}")
            if c.figure not in self.suite.figures:
                raise ValueError(f"comparison {c.name!r}: figure {c.figure!r} is not in suite.figures")
            c.claim()
        return self

    def arm(self, name: str) -> Arm:
        return next(a for a in self.arms if a.name == name)


def load_suite(path: str | Path) -> Suite:
    """Read and check a suite file.

    Raises:
        FileNotFoundError: no such file. ValueError: not TOML, or a field is wrong (the message
            names the file and the field).
    """
    return load_toml_model(path, Suite, "suite", "merge.toml")


def arm_overrides(suite: Suite, arm: Arm, extra: Sequence[str] = ()) -> list[str]:
    """The ``--set`` strings of an arm as written by people: the suite's overrides, the arm's, then
    ``extra`` (the command line's); the entry point parses them once with the suite's recipe."""
    return [*suite.suite.overrides, *arm.set, *extra]


def run_fields(suite: Suite, arm: Arm, seed: int) -> dict[str, Any]:
    """The fields the suite sets on every run of ``arm``: the seed, the token and wall budgets (every
    arm runs the same budget) and the run name."""
    s = suite.suite
    return {"run.seed": seed, "budget.tokens": s.tokens, "budget.wall_s": s.wall_s,
            "run.name": f"ablate-{s.name}-{arm.name}"}


def run_config(suite: Suite, arm: Arm, seed: int, base: Config) -> Config:
    """The config of one run: ``base`` (the recipe with :func:`arm_overrides`, resolved once) with
    :func:`run_fields`, then synchronous DiLoCo when the arm says so.

    Raises:
        ValueError: the result does not validate.
    """
    cfg = with_fields(base, run_fields(suite, arm, seed))
    return synchronous_diloco(cfg) if arm.synchronous else cfg


def owned_fields(suite: Suite) -> set[str]:
    """The ``section.field`` names the suite sets itself (seed, budgets, run name, every field an arm
    varies): an ``extra`` override of one would fake the replication or erase the arms' difference."""
    owned = set(run_fields(suite, suite.arms[0], 0))
    owned |= {item.split("=", 1)[0].strip() for arm in suite.arms for item in arm.set}
    if any(arm.synchronous for arm in suite.arms):
        owned |= set(synchronous_fields(1))
    return owned


def check_extra(suite: Suite, extra: Sequence[str]) -> None:
    """Raises ValueError when ``extra`` sets a field of :func:`owned_fields`."""
    taken = sorted({item.split("=", 1)[0].strip() for item in extra} & owned_fields(suite))
    if taken:
        raise ValueError(f"suite {suite.suite.name!r} sets {', '.join(taken)} itself (per arm, seed or budget); "
                         "change the suite file instead")


def figures_of(summary: dict, eval_loss: float, names: list[str]) -> dict[str, float | None]:
    """The requested figures of one finished run from its synchronizer summary and the held-out
    loss of its final global model (nats/token); a figure the summary lacks, or not a finite
    number, is None."""
    tokens = float(summary.get("tokens_processed") or 0.0)
    computed = {"eval_loss": eval_loss, "tokens": tokens,
                "bytes_per_token": (float(summary.get("bytes_in", 0)) + float(summary.get("bytes_out", 0))) / tokens
                if tokens > 0 else None}
    out: dict[str, float | None] = {}
    for name in names:
        v = computed[name] if name in COMPUTED_FIGURES else summary.get(name)
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        out[name] = float(v) if ok else None
    return out
