"""Inner-state checkpoints of a learner group sharded with FSDP2, through ``torch.distributed.checkpoint``
(DCP; ``learners.parallelism = "fsdp"`` with ``learners.checkpoint_every_s > 0``; DESIGN §3.1).

A sharded group's inner state is its parameters and AdamW moments (``get_state_dict``: ``DTensor``
shards), each rank's rows of the base copies Θ^base (wrapped as ``DTensor``s of the same ``Shard(0)``
placement, so DCP records them as chunks of the whole tensors) and the sampler's generator state;
the outer loop's bookkeeping (local step, base versions, per-fragment counters: the same ``meta``
as a one-process learner's, :func:`diloco_async.inner.state.state_meta`) is rank 0's and goes
into the manifest. Every rank is a writer:

1. **save** (:func:`save_sharded_state`, a collective at a step boundary): ``dcp.save`` into a
   local spool folder of each rank (``FileSystemWriter``: the rank's own ``__{rank}_0.distcp``
   holding its ``DTensor`` shards only, and rank 0 also DCP's ``.metadata`` and ``replicated.pt``,
   what every rank holds whole: AdamW's step counts and hyperparameters, the generator state; kept
   out of DCP, whose deduplication would put them in any rank's file), then each rank puts its files under
   ``{learner prefix}/{seq:08d}/dcp/`` (immutable keys, digests), and rank 0 writes
   ``manifest.json`` naming every file's size and sha256, once all ranks' puts succeeded (publish,
   then mark: a state folder without a manifest does not count). Training waits for the write and
   the put of this rank's share (1/N of the state).
2. **restore** (:func:`load_sharded_state`): each rank fetches ``.metadata``, then, as DCP's load
   plan asks for them, only the files holding chunks of its own rows (:class:`_FetchingReader`:
   with the same group size, its own file), and rank 0's ``replicated.pt``, each verified against
   the manifest's digest; ``set_state_dict`` puts them back.

A group of another size is refused before it loads anything, naming both sizes: DCP would reshard
the tensors, but that path is not tested here.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor, Shard

from diloco_async.inner.workload import Workload
from diloco_async.learner.fsdp_outer import ShardedOuter
from diloco_async.learner.spool import new_spool_folder, remove_dead_spool_folders
from diloco_async.storage import keys
from diloco_async.storage.checkpoint import list_state_seqs
from diloco_async.storage.store import ObjectRef, ObjectStore

__all__ = ["FORMAT", "latest_sharded_state", "save_sharded_state", "load_sharded_state", "check_world",
           "check_saved_group_sizes"]

log = logging.getLogger("diloco.learner")

#: the manifest's ``format`` of a sharded inner state
FORMAT = "dcp"
_METADATA = ".metadata"  # DCP's metadata file (FileSystemWriter), written by the coordinator (rank 0)
_REPLICATED = "replicated.pt"  # rank 0's copy of what every rank holds whole (torch.save; a few KiB)


def _leaves(tree: dict | list, path: str = ""):
    """``(container, key, path)`` of every leaf of a nested state dict (dicts and lists)."""
    for k, v in (tree.items() if isinstance(tree, dict) else enumerate(tree)):
        where = f"{path}/{k}" if path else str(k)
        if isinstance(v, dict | list):
            yield from _leaves(v, where)
        else:
            yield tree, k, where


def _split(sd: dict) -> tuple[dict[str, DTensor], dict[str, Any]]:
    """The ``DTensor`` shards of ``sd`` (what DCP writes, each by its owner) and the rest (AdamW's
    step counts, its hyperparameters, the generator state: the same on every rank), by path."""
    sharded, rest = {}, {}
    for container, key, where in _leaves(sd):
        (sharded if isinstance(container[key], DTensor) else rest)[where] = container[key]
    return sharded, rest


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= n
    return tuple(reversed(stride))


def _state_dict(workload: Workload, outer: ShardedOuter, base: Mapping[int, Mapping[str, torch.Tensor]]) -> dict:
    """What DCP saves and loads in place: model and optimizer (``get_state_dict``: sharded, AdamW's
    lazily made state made first), ``base`` (this rank's rows, ``(b - a, *shape[1:])`` float32, as
    ``DTensor`` shards of the whole tensors) and the generator state (uint8, the same on every rank)."""
    model_sd, optim_sd = get_state_dict(workload.model, workload.optimizer)
    mesh = next(p.device_mesh for p in workload.params.values() if isinstance(p, DTensor))
    wrapped = {}
    for p, tensors in base.items():
        for name, t in tensors.items():
            shape = outer.shapes[p][name]
            wrapped[f"{p}/{name}"] = DTensor.from_local(t, mesh, [Shard(0)], run_check=False, shape=torch.Size(shape),
                                                        stride=_contiguous_stride(shape))
    return {"model": model_sd, "optim": optim_sd, "base": wrapped, "rng": workload.generator.get_state()}


def _spool_id(learner_id: str, rank: int) -> str:
    return f"{learner_id}.rank{rank}"


def _put_files(store: ObjectStore, prefix: str, seq: int, folder: str) -> dict[str, dict]:
    """Put every file of ``folder`` under ``{prefix}/{seq:08d}/dcp/``; name → ref (JSON)."""
    out = {}
    for name in sorted(os.listdir(folder)):
        ref = store.put_from_file(f"{keys.state_folder(prefix, seq)}/{FORMAT}/{name}", os.path.join(folder, name),
                                  max_concurrency=1)
        out[name] = ref.to_json()
    return out


def _prune(store: ObjectStore, prefix: str, newest: int) -> None:
    """Delete this learner's inner states older than ``newest`` (logged, retried after the next save)."""
    try:
        for key in store.list(prefix):
            seq = keys.state_seq_of(prefix, key)
            if seq is not None and seq < newest:
                store.delete(key)
    except Exception as err:  # noqa: BLE001 - the next save prunes again
        log.warning("%s: could not prune old inner states (%s: %s)", prefix, type(err).__name__, err)


def save_sharded_state(store: ObjectStore, prefix: str, seq: int, workload: Workload, outer: ShardedOuter,
                       meta: dict[str, Any], learner_id: str) -> ObjectRef | None:
    """Save the group's inner state as state ``seq`` under ``prefix`` (a collective of the group;
    see the module's docstring). ``meta``: rank 0's bookkeeping (its value elsewhere is ignored).

    Returns:
        on rank 0, the manifest's ref; None on the other ranks, and on every rank when a rank
        could not write or put its files (logged; nothing counts, the next period tries again).
    """
    rank, world = outer.rank, outer.world
    remove_dead_spool_folders(_spool_id(learner_id, rank))
    folder = new_spool_folder(_spool_id(learner_id, rank))
    files: dict[str, dict] | None = None
    try:
        try:
            sharded, rest = _split(_state_dict(workload, outer, outer.base))
            dcp.save(sharded, storage_writer=dcp.FileSystemWriter(folder))
            if rank == 0:
                torch.save(rest, os.path.join(folder, _REPLICATED))
        except Exception as err:  # noqa: BLE001 - DCP raises on every rank when any rank failed
            log.warning("%s rank %d: inner state %d not written (%s: %s)", learner_id, rank, seq, type(err).__name__,
                        err)
            return None
        try:
            files = _put_files(store, prefix, seq, folder)
        except Exception as err:  # noqa: BLE001 - reported to rank 0 as missing: no manifest
            log.warning("%s rank %d: inner state %d not put (%s: %s)", learner_id, rank, seq, type(err).__name__, err)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    gathered: list = [None] * world if rank == 0 else []
    dist.gather_object(files, gathered if rank == 0 else None, dst=0)
    if rank != 0:
        return None
    if any(g is None for g in gathered):
        log.warning("%s: inner state %d incomplete (a rank could not put its files); no manifest", learner_id, seq)
        return None
    body = {"format": FORMAT, "world": world, "seq": seq, "inner": meta, "learner": learner_id,
            "files": {k: v for g in gathered for k, v in g.items()}}
    ref = store.put_json(keys.state_manifest_key(prefix, seq), body)
    _prune(store, prefix, seq)
    nbytes = sum(f["nbytes"] for f in body["files"].values())
    log.info("%s saved its sharded inner state as checkpoint %d (step %d, %d ranks, %.1f MiB)", learner_id, seq,
             meta["step"], world, nbytes / 2**20)
    return ref


def latest_sharded_state(store: ObjectStore, prefix: str) -> dict | None:
    """The manifest of the newest complete sharded inner state under ``prefix`` (rank 0 reads it),
    or None. A folder without a manifest, or of another format, is skipped (logged)."""
    for seq in reversed(list_state_seqs(store, prefix)):
        try:
            manifest = store.get_json(keys.state_manifest_key(prefix, seq))
        except FileNotFoundError:
            log.warning("%s: skipping incomplete inner state %d (no manifest)", prefix, seq)
            continue
        if manifest.get("format") != FORMAT:
            log.warning("%s: skipping inner state %d (format %r, not a sharded group's)", prefix, seq,
                        manifest.get("format", "safetensors"))
            continue
        return manifest
    return None


def check_world(manifest: Mapping[str, Any], world: int, where: str) -> None:
    """Raise when the saved state was written by a group of another size.

    Raises:
        ValueError: naming both sizes and the state (``where``: its prefix).
    """
    if int(manifest["world"]) != world:
        raise ValueError(f"{where}: sharded inner state {manifest['seq']} was saved by a group of {manifest['world']} "
                         f"ranks; this group has {world} (learners.nproc_per_learner x learners.nnodes). Start the "
                         f"group with {manifest['world']} ranks, or delete that state to rejoin from the published "
                         "versions")


def check_saved_group_sizes(store: ObjectStore, run_id: str, cfg: Any) -> None:
    """A resumed run (``cfg``: its :class:`~diloco_async.config.schema.Config`) whose learners are
    sharded and save inner states: refuse, before anything starts, a group size that a learner's
    newest saved state cannot serve (each learner's group would otherwise fail at its start).

    Raises:
        ValueError: as :func:`check_world`, for the first such learner.
    """
    lc = cfg.learners
    if lc.parallelism != "fsdp" or lc.checkpoint_every_s <= 0:
        return
    for i in range(lc.count):
        prefix = keys.learner_prefix(run_id, f"learner-{i}")
        manifest = latest_sharded_state(store, prefix)
        if manifest is not None:
            check_world(manifest, lc.nproc_per_learner * lc.nnodes, prefix)


class _FetchingReader(dcp.FileSystemReader):
    """DCP's file reader over a local folder that fetches from the store, verified, the files
    the load plan reads before reading them (each at most once)."""

    def __init__(self, folder: str, store: ObjectStore, files: Mapping[str, dict]) -> None:
        super().__init__(folder)
        self.folder, self.store, self.files = folder, store, files
        self.fetched: set[str] = set()
        self.fetch(_METADATA)

    def fetch(self, name: str) -> None:
        if name not in self.fetched:
            self.store.get_to_file(ObjectRef.from_json(self.files[name]), os.path.join(self.folder, name))
            self.fetched.add(name)

    def read_data(self, plan, planner):
        for item in plan.items:
            self.fetch(self.storage_data[item.storage_index].relative_path)
        return super().read_data(plan, planner)


def load_sharded_state(store: ObjectStore, manifest: Mapping[str, Any], workload: Workload,
                       outer: ShardedOuter, learner_id: str) -> set[str]:
    """Restore the state ``manifest`` names into ``workload`` (parameters, AdamW state, generator)
    and ``outer.base`` (a collective of the group). Returns the files this rank fetched.

    Raises:
        ValueError: saved by a group of another size (:func:`check_world`).
        IntegrityError, FileNotFoundError: a file is corrupt or gone (on the rank that read it;
            DCP raises on every rank).
    """
    check_world(manifest, outer.world, learner_id)
    base = {p: {n: torch.empty((b - a, *outer.shapes[p][n][1:]), dtype=torch.float32) for n, (a, b) in rows.items()}
            for p, rows in outer.rows.items()}
    sd = _state_dict(workload, outer, base)
    sharded, _ = _split(sd)
    remove_dead_spool_folders(_spool_id(learner_id, outer.rank))
    folder = new_spool_folder(_spool_id(learner_id, outer.rank))
    try:
        reader = _FetchingReader(folder, store, manifest["files"])
        dcp.load(sharded, storage_reader=reader)  # into the shards of ``sd`` in place
        reader.fetch(_REPLICATED)
        rest = torch.load(os.path.join(folder, _REPLICATED), weights_only=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    for container, key, where in list(_leaves(sd)):
        if not isinstance(container[key], DTensor):
            if where not in rest:
                raise ValueError(f"{learner_id}: sharded inner state {manifest['seq']} lacks {where}")
            container[key] = rest[where]
    set_state_dict(workload.model, workload.optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    workload.generator.set_state(sd["rng"])
    outer.base = base
    log.info("%s rank %d restored sharded inner state %d (fetched %s)", learner_id, outer.rank, manifest["seq"],
             sorted(reader.fetched))
    return reader.fetched
