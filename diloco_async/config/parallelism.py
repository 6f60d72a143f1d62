"""What a learner group sharded with FSDP2 (``learners.parallelism = "fsdp"``) supports yet, checked
before anything starts (DESIGN §3.1).

A sharded group takes its outer gradients, adopts versions and keeps its base copies shard by
shard (``diloco_async/learner/fsdp_outer.py``) and saves its inner state with DCP, one writer
per rank (``fsdp_state.py``). The features below read or write whole fragments
on one rank, or the inner state in the one-file layout, and have no sharded path yet: a recipe
that combines one of them with ``fsdp`` is refused naming the field and its value.
"""

from __future__ import annotations

from typing import Any

__all__ = ["fsdp_conflicts", "check_parallelism"]


def fsdp_conflicts(cfg: Any) -> list[str]:
    """The settings of ``cfg`` (a :class:`~diloco_async.config.schema.Config`) that a sharded
    learner group cannot serve yet, each as ``"field=value: why"``; empty when none, or with ``ddp``."""
    lc, sc = cfg.learners, cfg.synchronizer
    if lc.parallelism != "fsdp":
        return []
    out = []
    if lc.adopt != "overwrite":
        out.append(f"learners.adopt={lc.adopt!r}: a sharded group adopts by overwrite only (each rank reads its "
                   "own rows of the published version)")
    if sc.download_codec != "fp32":
        out.append(f"synchronizer.download_codec={sc.download_codec!r}: a sharded group reads byte ranges of the "
                   "fp32 published version; compact downloads are not sharded yet")
    if lc.barrier:
        out.append("learners.barrier=true: the synchronous baseline runs with ddp only")
    if lc.optimizer == "muon":
        out.append("learners.optimizer='muon': torch 2.13's Muon does not orthogonalise a row-sharded DTensor "
                   "gradient as it does the whole matrix (measured: its update differs from the unsharded one by "
                   "the update's own size), so a sharded group would train another model; use ddp")
    if lc.error_feedback:
        out.append("learners.error_feedback=true: the residual of a sharded group's rows is not kept per rank yet "
                   "(each rank encodes and puts its own shard)")
    return out


def check_parallelism(cfg: Any) -> None:
    """Raise when :func:`fsdp_conflicts` finds any.

    Raises:
        ValueError: naming every conflicting field and its value.
    """
    conflicts = fsdp_conflicts(cfg)
    if conflicts:
        raise ValueError("learners.parallelism='fsdp' cannot run with " + "; ".join(conflicts))
