"""A learner group's model sharded with FSDP2 (``learners.parallelism = "fsdp"``; DESIGN §3.1).

:func:`shard_workload` applies torch's ``fully_shard`` to each transformer block, then to the
root, and builds the inner optimizer again over the sharded parameters (AdamW's moments are then
1/N of the model on each rank). Which modules are blocks (:func:`fsdp_units`):

* the byte-level transformer: each of ``model.blocks``;
* a Hugging Face model: each module whose class is one of the model's ``_no_split_modules``
  (its decoder layers: ``LlamaDecoderLayer``, ``GPT2Block``, ...);
* a factory model: the modules its ``fsdp_units()`` method returns, when it has one (the hook), else
  none: the root alone is one unit (all of it gathered at once in each forward).

Every parameter becomes a ``DTensor`` sharded on dim 0 (``Shard(0)``, ``torch.chunk``'s split:
rows ``[r·c, min((r+1)·c, n))`` with ``c = ceil(n / N)``, so a rank may hold none of a small
tensor), which :func:`rows_of` computes and :func:`shard_workload` checks against each
parameter's local shard. The names stay the model's own, so the fragment plan, computed on the
unsharded model, names the same tensors in a DDP and an FSDP learner.

A model built on the meta device (``Workload.from_config``, where every value it holds is a
trainable parameter) is materialized after ``fully_shard`` with ``to_empty``: each rank allocates
only its shards, never the whole model, and the versions adopted at start fill them.

On CUDA with ``learners.precision = "bf16"`` the units take a ``MixedPrecisionPolicy`` (bf16
parameters in the forward and backward, fp32 gradient reduction) instead of autocast.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from diloco_async.inner.workload import Workload, inner_optimizer
from diloco_async.models import build_run_model, trainable_parameters

__all__ = ["fsdp_units", "rows_of", "local_rows", "shard_workload", "local_shards", "check_shardable",
           "check_sharded_run"]


def fsdp_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules sharded one by one before the root (see the module's docstring), in model order;
    empty when the model names none (the root alone is then one unit)."""
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, torch.nn.ModuleList) and hasattr(model, "cfg"):  # the byte-level transformer
        return list(blocks)
    net = getattr(model, "net", model)
    hook = getattr(net, "fsdp_units", None)
    if callable(hook):
        return list(hook())
    classes = set()
    for m in net.modules():
        classes.update(getattr(m, "_no_split_modules", None) or ())
    return [m for m in net.modules() if type(m).__name__ in classes]


def rows_of(n_rows: int, rank: int, world: int) -> tuple[int, int]:
    """Rows ``[start, stop)`` of dim 0 that rank ``rank`` of ``world`` holds of a tensor of
    ``n_rows`` rows under ``Shard(0)`` (``torch.chunk``: chunks of ``ceil(n_rows / world)``, the
    last ones shorter or empty)."""
    chunk = -(-n_rows // world) if n_rows else 0
    start = min(rank * chunk, n_rows)
    return start, min(start + chunk, n_rows)


def local_rows(shapes: Mapping[str, tuple[int, ...]], rank: int, world: int) -> dict[str, tuple[int, int]]:
    """:func:`rows_of` for every tensor of ``shapes`` (name → whole shape)."""
    return {name: rows_of(shape[0], rank, world) for name, shape in shapes.items()}


def local_shards(params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The local shard of each parameter (``DTensor.to_local()``: a view of this rank's rows, shape
    ``(stop - start, *shape[1:])``); a plain tensor is its own."""
    return {n: p.to_local() if isinstance(p, DTensor) else p for n, p in params.items()}


def check_shardable(model: torch.nn.Module) -> None:
    """Refuse a model that FSDP2 cannot shard on dim 0 as configured.

    Raises:
        ValueError: a trainable parameter is 0-dim; the message names it.
    """
    for name, p in trainable_parameters(model).items():
        if p.dim() == 0:
            raise ValueError(f"learners.parallelism='fsdp': parameter {name} is 0-dim, it cannot be sharded on "
                             "dim 0; use 'ddp' for this model")


def check_sharded_run(cfg: Any) -> None:
    """Before anything starts: with ``learners.parallelism = "fsdp"``, build the run's model on the
    meta device (no memory; shapes only) and :func:`check_shardable` it.

    Raises:
        ValueError: as :func:`check_shardable`, also naming ``model.kind``.
    """
    if cfg.learners.parallelism != "fsdp":
        return
    with torch.device("meta"):
        model = build_run_model(cfg)
    try:
        check_shardable(model)
    except ValueError as err:
        raise ValueError(f"model.kind={cfg.model.kind!r}: {err}") from None


def _mixed_precision(device: torch.device, precision: str) -> MixedPrecisionPolicy | None:
    if device.type == "cuda" and precision == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return None


def shard_workload(workload: Workload, rank: int, world: int, precision: str = "fp32") -> None:
    """Shard ``workload``'s model over the ``world`` ranks of the default process group (each unit
    of :func:`fsdp_units`, then the root), point ``workload.params`` at the sharded parameters and
    build its inner optimizer again over them (same learning rate and weight decay; an optimizer
    built before sharding would hold the replaced parameters). On CUDA with ``precision`` bf16 the
    forward runs on bf16 parameters (``MixedPrecisionPolicy``) rather than under autocast.

    Raises:
        ValueError: a trainable parameter cannot be sharded on dim 0 (a 0-dim one), or its local
            shard is not the rows :func:`rows_of` names; the message names it.
    """
    model = workload.model
    check_shardable(model)
    mp = _mixed_precision(workload.device, precision)
    kwargs = {"mp_policy": mp} if mp is not None else {}
    for unit in fsdp_units(model):
        fully_shard(unit, **kwargs)
    fully_shard(model, **kwargs)
    if any(p.is_meta for p in model.parameters()):  # built on meta (Workload.from_config): allocate the shards only
        model.to_empty(device=workload.device)  # their values come from the start's versions (start_sharded)
    if mp is not None:
        workload.amp_dtype = None  # the policy casts the parameters; autocast would cast again
    workload.params = trainable_parameters(model)
    for name, p in workload.params.items():
        rows = rows_of(p.shape[0], rank, world)
        if not isinstance(p, DTensor) or p.placements != (Shard(0),) or p.to_local().shape[0] != rows[1] - rows[0]:
            raise ValueError(f"learners.parallelism='fsdp': parameter {name} {list(p.shape)} was not sharded as "
                             f"rows {rows} of rank {rank}/{world} ({type(p).__name__}, "
                             f"{getattr(p, 'placements', None)})")
    group = workload.optimizer.param_groups[0]
    workload.optimizer = inner_optimizer(workload.params.values(), lr=group["lr"], weight_decay=group["weight_decay"])


def shard_fp32_bytes(shapes: Mapping[str, tuple[int, ...]], rank: int, world: int) -> int:
    """Bytes of this rank's rows of ``shapes`` in float32 (one fragment's shard, for the memory plan)."""
    return 4 * sum((b - a) * math.prod(shapes[n][1:]) for n, (a, b) in local_rows(shapes, rank, world).items())
