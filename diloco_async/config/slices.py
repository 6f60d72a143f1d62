"""What a run that leases its training tokens in slices (``data.slices``, DESIGN §5.2) needs, checked
before anything starts, and how the fields hash.

Refused, each naming the field and its value: a slice smaller than one inner step of some learner
(``grad_accum_steps x batch_size x context`` tokens: a lease must hold at least one batch); more than
one synchronizer shard (the ledger has one owner, the synchronizer, and shards share nothing at run
time); a learner of several ranks (the ranks would each need their part of the slice's batch, not
built yet); learner inner-state checkpoints (a restarted learner would restore progress made on
leases that its lapse returned to the pool: those tokens could then be trained twice).
"""

from __future__ import annotations

from typing import Any

__all__ = ["slice_conflicts", "check_slices", "drop_default_slice_fields", "step_tokens"]


def step_tokens(cfg: Any) -> int:
    """Tokens of one inner step of ``cfg``'s learner with the largest batch (``grad_accum_steps x
    batch_size x context``)."""
    lc = cfg.learners
    return max(lc.grad_accum_steps * lc.batch_size_of(i) * cfg.model.context for i in range(lc.count))


def slice_conflicts(cfg: Any) -> list[str]:
    """The settings of ``cfg`` (a :class:`~diloco_async.config.schema.Config`) that leases cannot
    serve, each as ``"field=value: why"``; empty when none, or when ``data.slices`` is off."""
    d, lc, sc = cfg.data, cfg.learners, cfg.synchronizer
    if not d.slices:
        return []
    out = []
    per_step = step_tokens(cfg)
    if d.slice_tokens < per_step:
        out.append(f"data.slice_tokens={d.slice_tokens}: smaller than one batch of a learner "
                   f"(grad_accum_steps x batch_size x context = {per_step} tokens)")
    if sc.shards > 1:
        out.append(f"synchronizer.shards={sc.shards}: the slice ledger has one owner, and shards share nothing at "
                   "run time; use one synchronizer")
    if lc.ranks_per_learner > 1:
        out.append(f"learners.nproc_per_learner x nnodes = {lc.ranks_per_learner} ranks per learner: a group's "
                   "ranks do not split a leased slice yet")
    if lc.checkpoint_every_s > 0:
        out.append(f"learners.checkpoint_every_s={lc.checkpoint_every_s:g}: a restarted learner would restore "
                   "progress on leases its lapse returned to the pool (those tokens trained twice); set it to 0")
    return out


def check_slices(cfg: Any) -> None:
    """Raise when :func:`slice_conflicts` finds any.

    Raises:
        ValueError: naming every conflicting field and its value.
    """
    conflicts = slice_conflicts(cfg)
    if conflicts:
        raise ValueError("data.slices=true cannot run with " + "; ".join(conflicts))


def drop_default_slice_fields(d: dict) -> None:
    """Remove, in place, ``data.slices`` and ``data.slice_tokens`` from a public config dict when leases
    are off, so runs from before the fields existed hash (and resume) as before."""
    node = d.get("data", {})
    if not node.get("slices", False):
        node.pop("slices", None)
        node.pop("slice_tokens", None)
