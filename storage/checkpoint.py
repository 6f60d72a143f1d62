"""Checkpoints of the synchronizer's outer state (DESIGN §5).

A checkpoint is a state folder ``checkpoints/{seq:08d}/`` (:mod:`storage.keys`):
``state.safetensors`` (every fragment's parameters and momentum buffers, fp32) plus
``manifest.json``, written LAST and naming the state file's size and sha256. A checkpoint
without a manifest, or whose state does not verify, does not count: :func:`latest_checkpoint`
skips it and logs why.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from storage import keys
from storage.store import IntegrityError, ObjectRef, ObjectStore

__all__ = ["Checkpoint", "write_checkpoint", "latest_checkpoint", "load_checkpoint", "list_checkpoint_seqs",
           "write_state", "load_state", "latest_state", "list_state_seqs", "tensor_key"]

log = logging.getLogger("diloco.checkpoint")


@dataclass
class Checkpoint:
    """A verified checkpoint: ``tensors`` maps ``p{p:03d}/param/{name}`` and
    ``p{p:03d}/momentum/{name}`` to fp32 tensors; ``manifest`` holds the rest of the state."""

    seq: int
    manifest: dict[str, Any]
    tensors: dict[str, torch.Tensor]


def tensor_key(fragment: int, kind: str, name: str) -> str:
    return f"p{fragment:03d}/{kind}/{name}"


def write_state(store: ObjectStore, prefix: str, seq: int, tensors: Mapping[str, torch.Tensor],
                manifest: dict[str, Any]) -> ObjectRef:
    """Write ``{prefix}/{seq:08d}/state.safetensors``, then ``manifest.json`` naming its size and
    sha256 (publish, then mark). Returns the manifest's ref.

    Raises:
        ValueError: a tensor holds NaN or Inf (nothing is written).
        FileExistsError: ``seq`` already exists under ``prefix``.
    """
    bad = [k for k, t in tensors.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    if bad:
        raise ValueError(f"refusing to checkpoint non-finite tensors: {bad[:5]}")
    data = st_save({k: t.contiguous() for k, t in tensors.items()})
    state_ref = store.put(keys.state_file_key(prefix, seq), data)
    body = dict(manifest, seq=seq, state=state_ref.to_json())
    return store.put_json(keys.state_manifest_key(prefix, seq), body)


def list_state_seqs(store: ObjectStore, prefix: str) -> list[int]:
    """Sequence numbers under ``prefix`` that have any object, ascending (complete or not)."""
    seqs = {keys.state_seq_of(prefix, key) for key in store.list(prefix)}
    return sorted(seq for seq in seqs if seq is not None)


def load_state(store: ObjectStore, prefix: str, seq: int) -> Checkpoint:
    """Load and verify ``{prefix}/{seq:08d}``.

    Raises:
        FileNotFoundError: no manifest (incomplete).
        IntegrityError: the state file is short, has the wrong digest, or holds non-finite values.
    """
    manifest = store.get_json(keys.state_manifest_key(prefix, seq))
    ref = ObjectRef.from_json(manifest["state"])
    try:
        tensors = st_load(store.get(ref))
    except IntegrityError:
        raise
    except Exception as err:  # safetensors' parse error on a corrupt file
        raise IntegrityError(f"{ref.key}: unreadable ({err})") from None
    if any(t.is_floating_point() and not bool(torch.isfinite(t).all()) for t in tensors.values()):
        raise IntegrityError(f"{keys.state_folder(prefix, seq)} holds non-finite values")
    return Checkpoint(seq=seq, manifest=manifest, tensors=tensors)


def latest_state(store: ObjectStore, prefix: str) -> Checkpoint | None:
    """The newest state under ``prefix`` whose manifest exists and whose data verifies, or None."""
    for seq in reversed(list_state_seqs(store, prefix)):
        try:
            return load_state(store, prefix, seq)
        except FileNotFoundError:
            log.warning("skipping incomplete checkpoint %d (no manifest)", seq)
        except (IntegrityError, ValueError, KeyError) as err:
            log.warning("skipping checkpoint %d: %s", seq, err)
    return None


def write_checkpoint(
    store: ObjectStore, run_id: str, seq: int, tensors: Mapping[str, torch.Tensor], manifest: dict[str, Any]
) -> ObjectRef:
    """Write synchronizer checkpoint ``seq`` of a run (see :func:`write_state`)."""
    return write_state(store, keys.checkpoint_prefix(run_id), seq, tensors, dict(manifest, run_id=run_id))


def list_checkpoint_seqs(store: ObjectStore, run_id: str) -> list[int]:
    """Checkpoint sequence numbers of a run that have any object, ascending."""
    return list_state_seqs(store, keys.checkpoint_prefix(run_id))


def load_checkpoint(store: ObjectStore, run_id: str, seq: int) -> Checkpoint:
    """Load and verify synchronizer checkpoint ``seq`` (see :func:`load_state`)."""
    return load_state(store, keys.checkpoint_prefix(run_id), seq)


def latest_checkpoint(store: ObjectStore, run_id: str) -> Checkpoint | None:
    """The synchronizer checkpoint of a run that a resume continues from, or None: of those that
    verify, the newest by (``lease_epoch`` of its manifest, ``seq``). A synchronizer fenced out by
    a successor (a higher lease epoch) can only write checkpoints of its lower epoch, so a late
    checkpoint of it never becomes the newest (docs/resume-and-fencing.md). Checkpoints without
    ``lease_epoch`` count as epoch 0.
    """
    prefix = keys.checkpoint_prefix(run_id)
    ranked = []
    for seq in list_state_seqs(store, prefix):
        try:
            epoch = int(store.get_json(keys.state_manifest_key(prefix, seq)).get("lease_epoch") or 0)
        except FileNotFoundError:
            log.warning("skipping incomplete checkpoint %d (no manifest)", seq)
            continue
        except (ValueError, TypeError, AttributeError) as err:
            log.warning("skipping checkpoint %d: unreadable manifest (%s)", seq, err)
            continue
        ranked.append((epoch, seq))
    for epoch, seq in sorted(ranked, reverse=True):
        try:
            return load_state(store, prefix, seq)
        except FileNotFoundError:
            log.warning("skipping checkpoint %d (lease epoch %d): deleted meanwhile", seq, epoch)
        except (IntegrityError, ValueError, KeyError) as err:
            log.warning("skipping checkpoint %d (lease epoch %d): %s", seq, epoch, err)
    return None
