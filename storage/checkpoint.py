"""Checkpoints of the synchronizer's outer state (DESIGN §5).

A checkpoint is ``checkpoints/{seq:08d}/state.safetensors`` (every fragment's parameters and
momentum buffers, fp32) plus ``manifest.json``, written LAST and naming the state file's size
and sha256. A checkpoint without a manifest, or whose state does not verify, does not count:
:func:`latest_checkpoint` skips it and logs why.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Mapping

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from storage import keys
from storage.store import IntegrityError, ObjectRef, ObjectStore

__all__ = ["Checkpoint", "write_checkpoint", "latest_checkpoint", "load_checkpoint", "list_checkpoint_seqs"]

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


def write_checkpoint(
    store: ObjectStore, run_id: str, seq: int, tensors: Mapping[str, torch.Tensor], manifest: dict[str, Any]
) -> ObjectRef:
    """Write state then manifest (publish, then mark). Returns the manifest's ref.

    Raises:
        ValueError: a tensor holds NaN or Inf (nothing is written).
        FileExistsError: checkpoint ``seq`` already exists.
    """
    bad = [k for k, t in tensors.items() if not bool(torch.isfinite(t).all())]
    if bad:
        raise ValueError(f"refusing to checkpoint non-finite tensors: {bad[:5]}")
    data = st_save({k: t.contiguous() for k, t in tensors.items()})
    state_ref = store.put(keys.checkpoint_state_key(run_id, seq), data)
    body = dict(manifest, seq=seq, run_id=run_id, state=state_ref.to_json())
    return store.put_json(keys.checkpoint_manifest_key(run_id, seq), body)


def list_checkpoint_seqs(store: ObjectStore, run_id: str) -> list[int]:
    """Sequence numbers that have any object, ascending (complete or not)."""
    seqs = set()
    prefix = keys.checkpoint_prefix(run_id)
    for key in store.list(prefix):
        part = key[len(prefix):].strip("/").split("/", 1)[0]
        if part.isdigit():
            seqs.add(int(part))
    return sorted(seqs)


def load_checkpoint(store: ObjectStore, run_id: str, seq: int) -> Checkpoint:
    """Load and verify checkpoint ``seq``.

    Raises:
        FileNotFoundError: no manifest (incomplete checkpoint).
        IntegrityError: the state file is missing a byte, has the wrong digest, or holds
            non-finite values.
    """
    manifest = store.get_json(keys.checkpoint_manifest_key(run_id, seq))
    ref = ObjectRef.from_json(manifest["state"])
    tensors = st_load(store.get(ref))
    if any(not bool(torch.isfinite(t).all()) for t in tensors.values()):
        raise IntegrityError(f"checkpoint {seq} holds non-finite values")
    return Checkpoint(seq=seq, manifest=manifest, tensors=tensors)


def latest_checkpoint(store: ObjectStore, run_id: str) -> Checkpoint | None:
    """The newest checkpoint whose manifest exists and whose state verifies, or None."""
    for seq in reversed(list_checkpoint_seqs(store, run_id)):
        try:
            return load_checkpoint(store, run_id, seq)
        except FileNotFoundError:
            log.warning("skipping incomplete checkpoint %d (no manifest)", seq)
        except (IntegrityError, ValueError, KeyError) as err:
            log.warning("skipping checkpoint %d: %s", seq, err)
    return None


def is_finite_number(x: float) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)
