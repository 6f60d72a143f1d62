"""Resuming a whole run: one checkpoint with one synchronizer, one run checkpoint with several
shards (issue 40 item 3; DESIGN §2.2; docs/resume-and-fencing.md).

What ``diloco-async resume`` (the ``resume`` flow) opens before it starts anything. With
``synchronizer.shards = 1`` it is :func:`~diloco_async.sync.persistence.open_checkpoint`. With more,
a checkpoint URL's sequence number names a run checkpoint (``{run_id}/checkpoints/run-{seq}.json``),
and a run URL without one the newest that verifies; every shard is then started with the run
checkpoint's URL and restores the checkpoint of its own that it names.
"""

from __future__ import annotations

from diloco_async.config.schema import Config
from diloco_async.policy.rounds import budget_spent_at_checkpoint
from diloco_async.storage import keys
from diloco_async.storage.checkpoint import Checkpoint
from diloco_async.storage.run_checkpoints import latest_run_checkpoint, list_run_manifest_seqs, open_run_checkpoint
from diloco_async.storage.store import ObjectStore
from diloco_async.sync.persistence import open_checkpoint

__all__ = ["open_run"]


def open_run(url: str, cfg: Config | None, storage_options: dict) -> tuple[Config, ObjectStore, str, Checkpoint]:
    """Resolve a checkpoint URL into (config, store, run id, verified checkpoint of the whole run).

    With several shards the checkpoint is the run checkpoint's shards' checkpoints as one
    (:meth:`~diloco_async.storage.run_checkpoints.RunCheckpoint.combined`: every fragment's tensors; ``seq``
    the run checkpoint's, which :func:`diloco_async.storage.keys.checkpoint_url` makes the URL each shard resumes
    from). Shard 0's checkpoint is checked against the config as by
    :func:`~diloco_async.sync.persistence.open_checkpoint` (each shard checks its own when it starts).

    Raises:
        ValueError: as :func:`~diloco_async.sync.persistence.open_checkpoint`; with several shards also
            no run checkpoint verifies, or the one named does not (the message names the shard and
            its checkpoint), or the run checkpoint spent the budget.
    """
    cfg, store, run_id, ckpt = open_checkpoint(url, cfg, storage_options, 0)
    shards = cfg.synchronizer.shards
    if shards == 1:
        return cfg, store, run_id, ckpt
    seq = keys.split_checkpoint_url(url)[2]
    if seq is None:
        rc = latest_run_checkpoint(store, run_id, shards, load=True)
        if rc is None:
            found = len(list_run_manifest_seqs(store, run_id))
            raise ValueError(f"no run checkpoint of run {run_id} verifies ({found} "
                             f"under {store.url}/{keys.checkpoint_prefix(run_id)} ); a run with synchronizer.shards="
                             f"{shards} resumes from one run-{{seq}}.json naming a checkpoint of every shard")
    else:
        rc = open_run_checkpoint(store, run_id, shards, seq, load=True)
    combined = rc.combined()
    spent = budget_spent_at_checkpoint(cfg.budget, combined.manifest)
    if spent is not None:
        raise ValueError(f"run {run_id} has nothing left to train at run checkpoint {rc.seq}: {spent}")
    return cfg, store, run_id, combined
