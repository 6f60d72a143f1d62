"""Run checkpoints of a run whose synchronizer is several shards (issue 40 item 3; DESIGN §2.2;
docs/resume-and-fencing.md).

Each shard checkpoints its own fragments under its own root
(:func:`diloco_async.storage.keys.synchronizer_root`). A *run checkpoint* is one manifest,
``{run_id}/checkpoints/run-{seq:08d}.json``, naming one checkpoint per shard with the sha256 of
that checkpoint's manifest (which names its state file's digest)::

    {"run_id": "...", "seq": 3, "shards": 2, "written_unix_s": ...,
     "checkpoints": {"0": {"seq": 7, "manifest_sha256": "...", "lease_epoch": 1, "versions": {"0": 12}},
                     "1": {"seq": 6, "manifest_sha256": "...", "lease_epoch": 2, "versions": {"1": 11}}}}

It is written last (publish, then mark): by a shard right after its own checkpoint's manifest
(:func:`write_run_manifest`, exclusive create; a shard that loses the race for a sequence number
takes the next), naming its new checkpoint and each other shard's newest complete one. Fragments
share nothing, so any set of per-shard checkpoints is a state the run can continue from; the run
manifest fixes *which* set a resume restores, so every shard of one resume starts from the same one.
:func:`open_run_checkpoint` verifies one: every shard of the run named exactly once, each named
checkpoint present, its manifest's digest as named and its state file verifying.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

from diloco_async.storage import keys
from diloco_async.storage.checkpoint import Checkpoint, load_checkpoint, verify_checkpoint
from diloco_async.storage.store import IntegrityError, ObjectStore

__all__ = ["RunCheckpoint", "write_run_manifest", "list_run_manifest_seqs", "open_run_checkpoint",
           "latest_run_checkpoint", "newest_complete_checkpoint", "named_checkpoint", "RUN_MANIFEST_TRIES"]

log = logging.getLogger("diloco.checkpoint")

RUN_MANIFEST_TRIES = 8
"""Sequence numbers a shard tries when other shards take them first (exclusive create)."""


@dataclass
class RunCheckpoint:
    """A verified run checkpoint: its sequence number, its manifest, and each shard's checkpoint
    (shard -> :class:`~diloco_async.storage.checkpoint.Checkpoint`; ``tensors`` empty unless loaded)."""

    seq: int
    manifest: dict[str, Any]
    shards: dict[int, Checkpoint]

    def combined(self) -> Checkpoint:
        """Every shard's checkpoint as one (``seq``: the run checkpoint's): the tensors of every
        fragment, shard 0's manifest with the versions of every fragment. What evaluating the
        run's model (``model_from_checkpoint``) reads."""
        tensors: dict = {}
        versions: dict = {}
        for ckpt in self.shards.values():
            tensors.update(ckpt.tensors)
            versions.update(ckpt.manifest.get("versions", {}))
        return Checkpoint(seq=self.seq, manifest={**self.shards[0].manifest, "versions": versions,
                                                  "run_checkpoint": self.manifest}, tensors=tensors)


def list_run_manifest_seqs(store: ObjectStore, run_id: str) -> list[int]:
    """The run checkpoints' sequence numbers, ascending."""
    seqs = (keys.run_manifest_seq(run_id, k) for k in store.list(keys.checkpoint_prefix(run_id)))
    return sorted(s for s in seqs if s is not None)


def newest_complete_checkpoint(store: ObjectStore, root: str) -> tuple[int, bytes] | None:
    """The newest checkpoint under ``root`` whose manifest is in the store (by the manifest's
    ``lease_epoch``, then ``seq``, as :func:`~diloco_async.storage.checkpoint.latest_checkpoint` ranks them) and
    that manifest's bytes; None when there is none. Its state file is not read (a shard does this
    after each of its checkpoints: streaming every other shard's state each time would cost their
    size); :func:`open_run_checkpoint` verifies it."""
    prefix = keys.checkpoint_prefix(root)
    ranked = []
    for seq in sorted({s for k in store.list(prefix) if (s := keys.state_seq_of(prefix, k)) is not None}):
        try:
            raw = store.get_unverified(keys.state_manifest_key(prefix, seq))
            epoch = int(json.loads(raw).get("lease_epoch") or 0)
        except FileNotFoundError:
            continue  # being written, or torn: not complete
        except (ValueError, TypeError, AttributeError):
            continue
        ranked.append((epoch, seq, raw))
    if not ranked:
        return None
    _, seq, raw = max(ranked, key=lambda r: (r[0], r[1]))
    return seq, raw


def _named(store: ObjectStore, run_id: str, shards: int) -> dict[str, dict] | None:
    """Each shard's newest complete checkpoint as a run manifest names it; None while one has none."""
    named: dict[str, dict] = {}
    for i in range(shards):
        found = newest_complete_checkpoint(store, keys.synchronizer_root(run_id, i, shards))
        if found is None:
            return None
        seq, raw = found
        doc = json.loads(raw)
        named[str(i)] = {"seq": seq, "manifest_sha256": hashlib.sha256(raw).hexdigest(),
                         "lease_epoch": int(doc.get("lease_epoch") or 0), "versions": doc.get("versions", {})}
    return named


def write_run_manifest(store: ObjectStore, run_id: str, shards: int) -> int | None:
    """Write the next run checkpoint, naming each shard's newest complete checkpoint
    (:func:`newest_complete_checkpoint`); call it after a shard's checkpoint is written. Returns its
    sequence number; the newest one's when that already names the same checkpoints; None while a
    shard has none yet (no run checkpoint can name it). A sequence number another shard took first
    is followed by the next, with the shards' checkpoints looked up again (so the higher number
    names checkpoints at least as new).

    Raises:
        RuntimeError: :data:`RUN_MANIFEST_TRIES` sequence numbers in a row were taken by others.
    """
    for _ in range(RUN_MANIFEST_TRIES):
        named = _named(store, run_id, shards)
        if named is None:
            return None
        existing = list_run_manifest_seqs(store, run_id)
        if existing and store.get_json(keys.run_manifest_key(run_id, existing[-1])).get("checkpoints") == named:
            return existing[-1]
        seq = (existing[-1] if existing else 0) + 1
        try:
            store.put_json(keys.run_manifest_key(run_id, seq), {"run_id": run_id, "seq": seq, "shards": shards,
                                                                "written_unix_s": time.time(), "checkpoints": named})
            return seq
        except FileExistsError:
            continue
    raise RuntimeError(f"run checkpoint of {run_id}: {RUN_MANIFEST_TRIES} sequence numbers in a row were taken "
                       f"by other shards")


def named_checkpoint(store: ObjectStore, run_id: str, shard: int) -> int | None:
    """The checkpoint of shard ``shard`` that the run's newest run checkpoint names (its manifest read,
    not verified), or None when there is none: what a shard's garbage collection stays behind."""
    seqs = list_run_manifest_seqs(store, run_id)
    if not seqs:
        return None
    entry = (store.get_json(keys.run_manifest_key(run_id, seqs[-1])).get("checkpoints") or {}).get(str(shard))
    return None if entry is None else int(entry["seq"])


def open_run_checkpoint(store: ObjectStore, run_id: str, shards: int, seq: int, load: bool = False,
                        only: int | None = None) -> RunCheckpoint:
    """Verify run checkpoint ``seq`` of a run with ``shards`` shards: it names every shard in
    ``[0, shards)`` once and no other, each named checkpoint's manifest is in the store with the
    named sha256, and its state file verifies. ``load``: keep the tensors (of shard ``only``
    alone when given; the others are verified as they stream by).

    Raises:
        ValueError: any of those fails; the message names the run checkpoint, the shard and the
            checkpoint (a shard that never started has no checkpoint to name).
    """
    key = keys.run_manifest_key(run_id, seq)
    try:
        doc = store.get_json(key)
    except FileNotFoundError:
        raise ValueError(f"run checkpoint {seq} of run {run_id} does not exist (no {key})") from None
    named = doc.get("checkpoints") or {}
    for s in sorted(named, key=int):
        if not 0 <= int(s) < shards:
            raise ValueError(f"run checkpoint {seq} of run {run_id} names synchronizer shard {s}, which never "
                             f"started: the run has synchronizer.shards={shards}")
    out: dict[int, Checkpoint] = {}
    for i in range(shards):
        if str(i) not in named:
            raise ValueError(f"run checkpoint {seq} of run {run_id} names no checkpoint of synchronizer shard {i}")
        out[i] = _verified_shard(store, run_id, shards, seq, i, named[str(i)], load and only in (None, i))
    return RunCheckpoint(seq=seq, manifest=doc, shards=out)


def _verified_shard(store: ObjectStore, run_id: str, shards: int, run_seq: int, i: int, entry: dict,
                    load: bool) -> Checkpoint:
    root = keys.synchronizer_root(run_id, i, shards)
    prefix = keys.checkpoint_prefix(root)
    seq = int(entry["seq"])
    where = f"run checkpoint {run_seq} of run {run_id} names checkpoint {seq} of synchronizer shard {i}"
    try:
        raw = store.get_unverified(keys.state_manifest_key(prefix, seq))
    except FileNotFoundError:
        raise ValueError(f"{where}, which is not in the store (no {keys.state_manifest_key(prefix, seq)}): "
                         f"shard {i} never wrote it, or it was deleted") from None
    if hashlib.sha256(raw).hexdigest() != entry.get("manifest_sha256"):
        raise ValueError(f"{where}, whose manifest does not match the digest named (sha256 "
                         f"{hashlib.sha256(raw).hexdigest()[:12]}, named {str(entry.get('manifest_sha256'))[:12]})")
    try:
        return (load_checkpoint if load else verify_checkpoint)(store, root, seq)
    except (FileNotFoundError, IntegrityError) as err:
        raise ValueError(f"{where}, whose state does not verify: {err}") from None


def latest_run_checkpoint(store: ObjectStore, run_id: str, shards: int, load: bool = False) -> RunCheckpoint | None:
    """The newest run checkpoint that verifies (:func:`open_run_checkpoint`), or None; those that do
    not are logged and skipped."""
    for seq in reversed(list_run_manifest_seqs(store, run_id)):
        try:
            return open_run_checkpoint(store, run_id, shards, seq, load)
        except ValueError as err:
            log.warning("skipping %s", err)
    return None
