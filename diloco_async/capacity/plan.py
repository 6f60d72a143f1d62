"""One capacity plan: memory per process, traffic per link, DDP over the same links (issue 40 item 6)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from diloco_async.capacity.inputs import PlanInputs
from diloco_async.capacity.memory import ProcessMemory, learner_rank_memory, synchronizer_shard_memory
from diloco_async.capacity.sizes import FragmentSizes, fragment_sizes
from diloco_async.capacity.traffic import (
    DdpBaseline,
    LearnerTraffic,
    RegionLink,
    ShardTraffic,
    ddp_baseline,
    learner_traffic,
    region_links,
    shard_traffic,
    speedup,
)

__all__ = ["Plan", "make_plan"]


@dataclass(frozen=True)
class Plan:
    """What :func:`make_plan` predicts (bytes, bytes per second, Gbit/s, seconds).

    Attributes:
        inputs: what it was asked.
        fragments: the fragments' elements and their bytes up and down.
        learner_rank, synchronizer_shard: memory of a learner's rank 0 and of the largest shard.
        learner: one learner's traffic, per step and per token.
        links: each region's link: bytes per second, the mean and no-wait rates, utilisation.
        ddp: DDP's all-reduce over the same links.
        shards: each synchronizer shard's traffic with the store.
        bandwidth_ratio: DDP's needed rate over Decoupled DiLoCo's mean one (busiest link).
        speedup: DDP's step time over Decoupled DiLoCo's on the given links.
    """

    inputs: PlanInputs
    fragments: FragmentSizes
    learner_rank: ProcessMemory
    synchronizer_shard: ProcessMemory
    learner: LearnerTraffic
    links: tuple[RegionLink, ...]
    ddp: DdpBaseline
    shards: tuple[ShardTraffic, ...]
    bandwidth_ratio: float | None
    speedup: float | None

    def to_json(self) -> dict[str, Any]:
        """The plan as plain JSON data (the model's tensor specs left out: their count only)."""
        out = dataclasses.asdict(self)
        model = out["inputs"]["model"]
        model["tensors"] = len(self.inputs.model.tensors)
        for key, mem in (("learner_rank", self.learner_rank), ("synchronizer_shard", self.synchronizer_shard)):
            out[key]["host_bytes"], out[key]["device_bytes"] = mem.host_bytes, mem.device_bytes
            out[key]["disk_bytes"] = mem.disk_bytes
        return out


def make_plan(inputs: PlanInputs) -> Plan:
    """The plan of ``inputs`` (formulas in :mod:`~diloco_async.capacity.memory` and
    :mod:`~diloco_async.capacity.traffic`). Pure: no I/O.

    Raises:
        ValueError: inputs no run could have (:meth:`PlanInputs.check`), naming the field and value.
    """
    inputs.check()
    sizes = fragment_sizes(inputs.model, inputs.sync)
    traffic = learner_traffic(inputs, sizes)
    links = region_links(inputs, sizes, traffic)
    ddp = ddp_baseline(inputs)
    busiest = max((link.mean_gbps for link in links if link.mean_gbps is not None), default=None)
    ratio = None if busiest is None or ddp.needed_gbps is None or busiest == 0 else ddp.needed_gbps / busiest
    return Plan(inputs, sizes, learner_rank_memory(inputs, sizes), synchronizer_shard_memory(inputs, sizes), traffic,
                tuple(links), ddp, tuple(shard_traffic(inputs, sizes)), ratio, speedup(inputs, links, ddp))
