"""A learner that spans several processes: one ``torchrun`` group with DDP inside (DESIGN §3).

``learners.nproc_per_learner = N`` (``nnodes`` nodes) starts each learner as
``python -m torch.distributed.run ... --module diloco_async.learner`` (:func:`torchrun_args`).
Rank 0 runs the whole :class:`~diloco_async.learner.process.Learner`: it alone talks to the
synchronizer and the store, sends heartbeats and outer gradients, writes the timeline. The
other ranks (followers, :func:`run_follower`) only train. On the group's process group (gloo
on CPU; NCCL for CUDA tensors):

1. **config**: rank 0 joins and broadcasts the run's config (None if it could not join: the
   followers exit 3 too);
2. **start**: rank 0 loads its starting point (saved inner state or the versions named at join)
   and broadcasts its AdamW state, sampler state and step; wrapping the model in
   ``DistributedDataParallel`` broadcasts its parameters;
3. **each step boundary**: rank 0 broadcasts a :class:`Decision` (stop, step or wait, the
   fragments it adopted) and then the tensors of every adopted fragment, so each rank adopts
   the same versions at the same inner step, and the run's tokens it last heard of, so each rank
   steps with the same learning rate (the schedule's progress). DDP averages the gradients, so the ranks stay
   identical, and the outer gradient rank 0 sends covers the whole group's batch. The token
   count of a step covers every rank (``Workload.tokens_per_step``).

A rank that dies makes ``torchrun`` (``--max-restarts 0``) stop the others and exit non-zero;
the run's supervisor (or the flow) starts the whole group again as the learner's next
incarnation: the synchronizer only ever sees one learner.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from diloco_async.config.schema import Config
from diloco_async.inner.workload import Workload
from diloco_async.learner.fsdp import shard_workload
from diloco_async.learner.fsdp_outer import ContributionOrder, ShardedOuter, ShardedUpload
from diloco_async.learner.fsdp_state import load_sharded_state, save_sharded_state
from diloco_async.models.transformer import embedding_names
from diloco_async.policy.fragments import FragmentPlan, plan_fragments, specs_of
from diloco_async.protocol.messages import VersionInfo
from diloco_async.runtime.devices import LearnerDeviceFields, amp_dtype, resolve_device, set_cpu_math
from diloco_async.runtime.parent_death import die_with_parent
from diloco_async.storage import keys
from diloco_async.storage.store import ObjectStore

__all__ = ["Decision", "LearnerGroup", "DataParallelLoss", "torchrun_args", "place_workload", "run_follower"]

log = logging.getLogger("diloco.learner")

def torchrun_args(lc: LearnerDeviceFields, rdzv_id: str) -> list[str]:
    """``python`` arguments that start one learner as a torchrun group, up to and including
    ``--module diloco_async.learner`` (the learner's own arguments follow).

    One node: ``--standalone`` (a local rendezvous on a free port). Several: a c10d rendezvous at
    ``learners.rdzv_endpoint`` with id ``rdzv_id`` (the same on every node of this incarnation).
    ``--max-restarts 0``: a dead rank ends the group, which the supervisor restarts whole.
    """
    args = ["-m", "torch.distributed.run", "--nproc-per-node", str(lc.nproc_per_learner),
            "--nnodes", str(lc.nnodes), "--max-restarts", "0", "--monitor-interval", "0.2"]
    if lc.nnodes == 1:
        args.append("--standalone")
    else:
        args += ["--rdzv-backend", "c10d", "--rdzv-endpoint", lc.rdzv_endpoint, "--rdzv-id", rdzv_id]
    return args + ["--module", "diloco_async.learner"]


def _on_cpu(value):
    """``value`` (an optimizer's state dict: nested dicts, lists, tensors) with its tensors on the CPU."""
    if isinstance(value, torch.Tensor):
        return value.to("cpu")
    if isinstance(value, dict):
        return {k: _on_cpu(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_on_cpu(v) for v in value)
    return value


@dataclass
class Decision:
    """What every rank does at one step boundary, as rank 0 decided it. A sharded group
    (``parallelism = "fsdp"``) also names the versions every rank reads its rows of and the
    contributions every rank puts its shard of; ``uploads`` is what the ranks put (rank 0)."""

    stop: bool = False
    step: bool = True  # False: wait (barrier), no inner step this time
    adopted: list[int] = field(default_factory=list)  # fragments whose new values follow
    run_tokens: float = 0.0  # the run's tokens processed as rank 0 last heard (the lr schedule's progress)
    versions: list[VersionInfo] = field(default_factory=list)  # fsdp: versions to adopt, in order
    orders: list[ContributionOrder] = field(default_factory=list)  # fsdp: contributions to take and put
    uploads: list[ShardedUpload] = field(default_factory=list)  # fsdp, rank 0: the shard refs of each order
    save: dict | None = None  # fsdp: save the inner state now ({"seq", "inner": rank 0's meta})


class DataParallelLoss(DistributedDataParallel):
    """``DistributedDataParallel`` over ``model.loss``: ``loss(inputs, targets)`` runs the wrapped
    module's forward (which returns ``model.loss``), so DDP averages the gradients of it."""

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self(inputs, targets)


class _LossForward(torch.nn.Module):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.model.loss(inputs, targets)


class LearnerGroup:
    """This process's place in its learner's torchrun group, and the collectives of the protocol.

    Args:
        rank, world, local_rank: as torchrun sets them (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``).
        timeout_s: timeout of one collective (``learners.group_timeout_s``).

    The process group uses gloo for CPU tensors and, where CUDA is available, NCCL for CUDA tensors.
    """

    def __init__(self, rank: int, world: int, local_rank: int, timeout_s: float) -> None:
        self.rank, self.world, self.local_rank = rank, world, local_rank
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
        if not dist.is_initialized():
            dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))
        self._cpu = torch.device("cpu")
        self.outer: ShardedOuter | None = None  # parallelism = "fsdp": this rank's side of the outer loop
        self.state_seq = 0  # fsdp, rank 0: the newest inner-state sequence number used (its next save: + 1)

    @classmethod
    def from_env(cls, timeout_s: float) -> LearnerGroup | None:
        """The group of a process started by torchrun with ``WORLD_SIZE`` > 1, else None."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1:
            return None
        die_with_parent()  # the torchrun agent starts ranks in their own sessions: a SIGKILL of its group misses them
        return cls(int(os.environ["RANK"]), world, int(os.environ.get("LOCAL_RANK", "0")), timeout_s)

    @property
    def is_leader(self) -> bool:
        """Rank 0: the rank that talks to the synchronizer and the store."""
        return self.rank == 0

    def share_config(self, config: dict | None = None) -> dict | None:
        """Rank 0's run config (as plain data) on every rank; None when rank 0 could not join."""
        box = [config if self.is_leader else None]
        dist.broadcast_object_list(box, src=0, device=self._cpu)
        return box[0]

    def share_start(self, workload: Workload, step: int = 0) -> int:
        """Give every rank rank 0's inner optimizer state, sampler state and local step; returns the step."""
        box: list = [None]
        if self.is_leader:
            opt = _on_cpu(workload.optimizer.state_dict())  # AdamW's, or Muon's and AdamW's
            box = [{"opt": opt, "rng": workload.generator.get_state(), "step": step}]
        dist.broadcast_object_list(box, src=0, device=self._cpu)
        if not self.is_leader:
            workload.optimizer.load_state_dict(box[0]["opt"])
            workload.generator.set_state(box[0]["rng"])
        return int(box[0]["step"])

    def wrap(self, workload: Workload) -> None:
        """Make ``workload`` this rank of the group: DDP over its model (which broadcasts rank 0's
        parameters), its slice of each batch, the loss averaged over the group."""
        dev = workload.device
        ddp = DataParallelLoss(_LossForward(workload.model), device_ids=[dev.index] if dev.type == "cuda" else None,
                               forward_sync_buffers=False)
        workload.join_group(self.rank, self.world, ddp, self.mean)

    def shard(self, workload: Workload, cfg: Config, store: ObjectStore, learner_id: str, plan: FragmentPlan) -> None:
        """``parallelism = "fsdp"``: shard ``workload``'s model over the group (FSDP2,
        :func:`~diloco_async.learner.fsdp.shard_workload`), make it this rank of the group (its
        slice of each batch, the loss averaged) and set up :attr:`outer` over the sharded parameters.

        Raises:
            ValueError: the model cannot be sharded as configured (the parameter is named).
        """
        shard_workload(workload, self.rank, self.world, cfg.learners.precision)
        workload.join_group(self.rank, self.world, workload.model, self.mean)
        self.outer = ShardedOuter(store, learner_id, self.rank, self.world, plan, workload.params)

    def start_sharded(self, run_id: str | None = None, versions: list[VersionInfo] | None = None,
                      saved: dict | None = None, workload: Workload | None = None) -> dict | None:
        """Rank 0's run id, starting versions and newest saved sharded inner state (its manifest,
        :func:`~diloco_async.learner.fsdp_state.latest_sharded_state`, or None) on every rank; that
        state restored (DCP, needs ``workload``), then every rank's rows of the starting versions
        adopted: overwritten, or rebased onto them where the state was saved on another version.
        Returns the manifest restored, or None.

        Raises:
            ValueError: the state was saved by a group of another size (both are named); no
                state and no version of a fragment to start from.
        """
        assert self.outer is not None
        box = [(run_id, versions, saved) if self.is_leader else None]
        dist.broadcast_object_list(box, src=0, device=self._cpu)
        self.outer.run_id, start, saved = box[0]
        missing = set(range(self.outer.plan.num_fragments)) - {v.fragment for v in start}
        if missing and saved is None:  # a model built on meta holds no value until it adopts them
            raise ValueError(f"{self.outer.learner_id}: no version of fragment(s) {sorted(missing)} to start from")
        if saved is not None:
            assert workload is not None, "restoring a sharded inner state needs the workload"
            load_sharded_state(self.outer.store, saved, workload, self.outer, self.outer.learner_id)
            have = {int(p): int(v) for p, v in saved["inner"]["base_versions"].items()}
            start = [v for v in start if have.get(v.fragment) != v.version]
        self.outer.adopt(start, rebase=saved is not None)
        return saved

    def mean(self, value: torch.Tensor) -> torch.Tensor:
        """The mean of a 0-dim tensor over the ranks (a sum all-reduce; gloo has no average)."""
        out = value.detach().clone()
        dist.all_reduce(out)
        return out / self.world

    def decide(self, decision: Decision | None, num_fragments: int) -> Decision:
        """Rank 0 sends ``decision``; every rank returns it."""
        msg = torch.zeros(3 + num_fragments, dtype=torch.int64)
        if self.is_leader:
            assert decision is not None
            msg[0], msg[1] = int(decision.stop), int(decision.step)
            msg[2:3] = torch.tensor([decision.run_tokens], dtype=torch.float64).view(torch.int64)  # its bits
            for p in decision.adopted:
                msg[3 + p] = 1
        dist.broadcast(msg, src=0)
        run_tokens = float(msg[2:3].view(torch.float64)[0])
        return Decision(bool(msg[0]), bool(msg[1]), [p for p in range(num_fragments) if msg[3 + p]], run_tokens)

    def share_fragments(self, params: dict[str, torch.nn.Parameter], plan: FragmentPlan, fragments: list[int]) -> None:
        """Broadcast rank 0's values of every tensor of ``fragments`` into each rank's parameters."""
        with torch.no_grad():
            for p in fragments:
                for name in plan.names(p):
                    dist.broadcast(params[name].data, src=0)

    def boundary(self, decision: Decision | None, workload: Workload, plan: FragmentPlan) -> Decision:
        """One step boundary: the decision, then the adopted fragments' values. A sharded group:
        the decision whole, then every rank reads its rows of the versions named and puts its
        shard of each contribution ordered (in that order: Δ is taken on the adopted base), and
        every rank saves its share of the inner state when rank 0 asks (``Decision.save``)."""
        if self.outer is not None:
            box = [decision if self.is_leader else None]
            dist.broadcast_object_list(box, src=0, device=self._cpu)
            d = box[0]
            self.outer.adopt(d.versions)
            d.uploads = self.outer.contribute(d.orders)
            if d.save is not None:  # after the adoption: the state saved holds the bases just adopted
                save_sharded_state(self.outer.store, keys.learner_prefix(self.outer.run_id, self.outer.learner_id),
                                   d.save["seq"], workload, self.outer, d.save["inner"], self.outer.learner_id)
            return d
        d = self.decide(decision, plan.num_fragments)
        self.share_fragments(workload.params, plan, d.adopted)
        return d

    def close(self, barrier_timeout_s: float = 10.0) -> None:
        """Leave the process group (nothing if it is gone). On gloo the ranks first meet at a
        barrier (at most ``barrier_timeout_s``; a dead peer only shortens it): a rank that tore its
        pairs down while another still used them aborted once ("terminate called without an active
        exception")."""
        if not dist.is_initialized():
            return
        if dist.get_backend() == "gloo":
            try:
                dist.monitored_barrier(timeout=timedelta(seconds=barrier_timeout_s))
            except Exception as err:  # noqa: BLE001 - leaving anyway
                log.warning("learner group: ranks did not meet before leaving (%s)", err)
        dist.destroy_process_group()


def place_workload(workload: Workload, cfg: Config, index: int, local_rank: int = 0) -> torch.device:
    """Put learner ``index``'s workload on its device (local rank ``local_rank`` of its group) and
    precision; returns the device.

    Raises:
        ValueError: the device is absent here (see :func:`diloco_async.runtime.devices.resolve_device`).
    """
    lc = cfg.learners
    device = resolve_device(lc.device_of(index), local_rank, lc.nproc_per_learner)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    workload.place(device, amp_dtype(lc.precision))
    return device


def run_follower(group: LearnerGroup, index: int, incarnation: int,
                 make_workload: Callable[[Config, int, int], Workload] = Workload.from_config,
                 store: ObjectStore | None = None, learner_id: str = "") -> int:
    """The life of a rank other than 0: build the same workload, take rank 0's start, then at
    every step boundary do what rank 0 decided. ``store`` and ``learner_id``: a sharded group's
    rank reads and writes its own shards there. Returns 0 when told to stop, 3 when rank 0
    could not join."""
    raw = group.share_config()
    if raw is None:
        return 3
    cfg = Config.model_validate(raw)
    set_cpu_math(cfg.learners.threads, cfg.learners.flush_denormal)
    workload = make_workload(cfg, index, incarnation)
    place_workload(workload, cfg, index, group.local_rank)
    plan = plan_fragments(specs_of({n: p.detach() for n, p in workload.params.items()}),
                          cfg.synchronizer.num_fragments, embedding_names(workload.model),
                          mode=cfg.synchronizer.fragmentation)
    step = group.share_start(workload)
    if cfg.learners.parallelism == "fsdp":
        assert store is not None, "a rank of a sharded group needs the store"
        group.shard(workload, cfg, store, learner_id, plan)
        saved = group.start_sharded(workload=workload)
        if saved is not None:  # rank 0 continues from max(its join step, the saved step) too
            step = max(step, int(saved["inner"]["step"]))
    else:
        group.wrap(workload)
    workload.load_data(cfg, index)
    log.info("rank %d/%d of learner %d ready at step %d on %s", group.rank, group.world, index, step,
             workload.device)
    while True:
        d = group.boundary(None, workload, plan)
        if d.stop:
            return 0
        if d.step:
            workload.step(step, d.run_tokens)
            step += 1
