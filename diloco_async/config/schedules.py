"""The configuration keys of the learning-rate schedules and gradient accumulation (issue 44 item 5).

:class:`InnerScheduleFields` holds ``learners.lr_schedule``, ``lr_decay_fraction``,
``lr_final_fraction`` and ``grad_accum_steps`` (``LearnerConfig`` inherits them);
:class:`OuterScheduleFields` holds ``synchronizer.outer_lr_schedule``, ``outer_lr_warmup_fraction`` and
``outer_lr_final_fraction`` (``SynchronizerConfig`` inherits them). :func:`check_schedules` is the
cross-section check, run when the whole config is validated, so a bad schedule is refused before
anything starts. The schedules themselves are :mod:`diloco_async.policy.schedules`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

__all__ = ["InnerScheduleFields", "OuterScheduleFields", "check_schedules", "drop_default_schedule_fields"]


class InnerScheduleFields(BaseModel):
    """The learner keys of the inner learning-rate schedule and of gradient accumulation."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    lr_schedule: Literal["constant", "cosine", "wsd"] = Field(
        "constant", description="Inner learning rate over the run's global progress (tokens processed by "
        "all learners, as the synchronizer counts them, / budget.tokens: a late or restarted learner is at the "
        "run's point): "
        "'constant' (the warm-up, then lr), 'cosine' (down to lr_final_fraction x lr), 'wsd' "
        "(warmup-stable-decay: lr until the last lr_decay_fraction of the budget, then linear down to "
        "lr_final_fraction x lr). Times the warm-up of warmup_steps. Not 'constant': needs budget.tokens.")
    lr_decay_fraction: float = Field(
        0.2, gt=0, le=1, description="Share of the token budget over which lr_schedule='wsd' decays; in (0, 1].")
    lr_final_fraction: float = Field(
        0.1, ge=0, le=1, description="The inner lr at the end of the budget, as a fraction of lr ('cosine', 'wsd').")
    grad_accum_steps: int = Field(
        1, ge=1, le=4096, description="Micro-batches of batch_size windows accumulated per inner optimizer step "
        "(a small device reaches the recipe's batch): a step trains on, and counts, grad_accum_steps x "
        "batch_size x context tokens per rank; a learner group's DDP all-reduces once, at the last micro-batch.")

    @field_validator("grad_accum_steps", mode="before")
    @classmethod
    def _accum_at_least_one(cls, v: Any) -> Any:
        if isinstance(v, int) and not isinstance(v, bool) and v < 1:
            raise ValueError(f"learners.grad_accum_steps = {v}: at least 1 micro-batch per optimizer step")
        return v


class OuterScheduleFields(BaseModel):
    """The synchronizer keys of the outer learning-rate schedule."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    outer_lr_schedule: Literal["constant", "linear_warmup", "cosine"] = Field(
        "constant", description="Outer lr of each fragment's steps over the run's progress when it merges (tokens "
        "processed / budget.tokens, kept in checkpoints; DESIGN §4.5d): 'constant' (outer_lr), 'linear_warmup' "
        "(up to outer_lr over the first outer_lr_warmup_fraction of the budget), 'cosine' (down to "
        "outer_lr_final_fraction x outer_lr). Not 'constant': needs budget.tokens.")
    outer_lr_warmup_fraction: float = Field(
        0.1, gt=0, le=1, description="Share of the token budget over which outer_lr_schedule='linear_warmup' "
        "rises to outer_lr; in (0, 1].")
    outer_lr_final_fraction: float = Field(
        0.1, ge=0, le=1, description="The outer lr at the end of the budget with outer_lr_schedule='cosine', as "
        "a fraction of outer_lr.")


def _fleet_tokens_per_step(cfg: Any) -> int:
    """Tokens one inner step of every learner together trains on."""
    lc = cfg.learners
    per_rank = sum(lc.batch_size_of(i) for i in range(lc.count))
    return per_rank * lc.ranks_per_learner * lc.grad_accum_steps * cfg.model.context


def check_schedules(cfg: Any) -> None:
    """Refuse a schedule the run cannot follow, naming the values: a schedule other than
    'constant' without ``budget.tokens``; a learner warm-up that outlasts the schedule (its tokens,
    ``warmup_steps`` x every learner's tokens per step, at or past the budget, or for 'wsd' past the
    start of the decay).

    Raises:
        ValueError: as above.
    """
    lc, sc, tokens = cfg.learners, cfg.synchronizer, cfg.budget.tokens
    for key, value in (("learners.lr_schedule", lc.lr_schedule), ("synchronizer.outer_lr_schedule",
                                                                   sc.outer_lr_schedule)):
        if value != "constant" and tokens is None:
            raise ValueError(f"{key} = {value!r} follows the run's token budget, but budget.tokens is not set "
                             f"(budget.max_steps = {cfg.budget.max_steps}, budget.wall_s = {cfg.budget.wall_s}); "
                             "set budget.tokens, or use 'constant'")
    if lc.lr_schedule == "constant" or tokens is None:
        return
    warm = lc.warmup_steps * _fleet_tokens_per_step(cfg)
    end = tokens * (1.0 - lc.lr_decay_fraction) if lc.lr_schedule == "wsd" else tokens
    if warm >= end:
        where = (f"the start of the decay at (1 - learners.lr_decay_fraction = {lc.lr_decay_fraction}) x "
                 f"budget.tokens = {end:.0f}" if lc.lr_schedule == "wsd" else f"budget.tokens = {tokens}")
        raise ValueError(f"learners.warmup_steps = {lc.warmup_steps} is longer than the learning-rate schedule: "
                         f"{warm} tokens of warm-up (x {_fleet_tokens_per_step(cfg)} tokens per step of all "
                         f"learners) reach {where} with learners.lr_schedule = {lc.lr_schedule!r}")


#: the schedule keys at their defaults are left out of the config hash, so runs and checkpoints
#: from before the schedules existed hash (and resume) as before
_DEFAULTS = {"learners": {"lr_schedule": "constant", "lr_decay_fraction": 0.2, "lr_final_fraction": 0.1,
                          "grad_accum_steps": 1},
             "synchronizer": {"outer_lr_schedule": "constant", "outer_lr_warmup_fraction": 0.1,
                              "outer_lr_final_fraction": 0.1}}


def drop_default_schedule_fields(d: dict) -> None:
    """Remove, in place, the schedule keys of a public config dict that hold their default value."""
    for section, fields in _DEFAULTS.items():
        node = d.get(section, {})
        for key, default in fields.items():
            if key in node and node[key] == default:
                del node[key]
