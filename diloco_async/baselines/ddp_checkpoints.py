"""Reading the data-parallel baseline's checkpoints back (DESIGN §8).

The ranks of :mod:`diloco_async.baselines.ddp` write ``torchrun``-style checkpoints (state folders
under ``{run_id}/ddp/checkpoints``, manifest written last); the chaos harness and the tests read
them here to evaluate the DDP curve at equal tokens or equal time.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import NamedTuple

import torch

from diloco_async.config.schema import Config
from diloco_async.models.transformer import ByteGPT
from diloco_async.storage import keys
from diloco_async.storage.checkpoint import latest_state, list_state_seqs, load_state
from diloco_async.storage.store import ObjectStore

__all__ = ["DdpCheckpointInfo", "checkpoint_prefix", "param_sha256", "ddp_checkpoints", "select_checkpoint",
           "load_ddp_params", "load_ddp_model", "load_final_ddp_model", "model_from_params"]


def checkpoint_prefix(run_id: str) -> str:
    """Store prefix of the data-parallel checkpoints of a run: ``{run_id}/ddp/checkpoints``."""
    return keys.ddp_checkpoint_prefix(run_id)


def param_sha256(params: Mapping[str, torch.Tensor]) -> str:
    """sha256 (hex) of the parameters' bytes, in sorted name order (equal models, equal digests)."""
    h = hashlib.sha256()
    for name in sorted(params):
        h.update(name.encode())
        h.update(params[name].detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()


class DdpCheckpointInfo(NamedTuple):
    """One committed data-parallel checkpoint: ``step`` (group steps done), ``tokens_committed``
    (tokens of all ranks in those steps), ``wall_unix`` (commit time, unix s), ``key`` (its
    manifest's key in the store)."""

    step: int
    tokens_committed: int
    wall_unix: float
    key: str


def select_checkpoint(checkpoints: list[DdpCheckpointInfo], *, max_tokens: int | None = None,
                      max_wall_unix: float | None = None) -> DdpCheckpointInfo | None:
    """The newest checkpoint with ``tokens_committed <= max_tokens`` and ``wall_unix <=
    max_wall_unix`` (a bound left None does not apply), or None when none qualifies."""
    ok = [c for c in checkpoints
          if (max_tokens is None or c.tokens_committed <= max_tokens)
          and (max_wall_unix is None or c.wall_unix <= max_wall_unix)]
    return max(ok, key=lambda c: (c.step, c.wall_unix), default=None)


def ddp_checkpoints(store: ObjectStore, run_id: str) -> list[DdpCheckpointInfo]:
    """The committed (manifest present) data-parallel checkpoints of a run, by step ascending.

    Only manifests are read: the state files are verified when loaded (:func:`load_ddp_params`).
    """
    prefix = checkpoint_prefix(run_id)
    out = []
    for seq in list_state_seqs(store, prefix):
        key = keys.state_manifest_key(prefix, seq)
        try:
            m = store.get_json(key)
        except FileNotFoundError:
            continue
        out.append(DdpCheckpointInfo(int(m["step"]), int(m["tokens_committed"]), float(m["wall_unix"]), key))
    return sorted(out, key=lambda c: (c.step, c.wall_unix))


def load_ddp_params(store: ObjectStore, key: str | DdpCheckpointInfo) -> dict[str, torch.Tensor]:
    """The parameters (name -> fp32 tensor, ``model.named_parameters()`` names) of one checkpoint.

    Args:
        key: a manifest key as listed by :func:`ddp_checkpoints` (or the info itself).

    Raises:
        FileNotFoundError: no manifest under the key.
        diloco_async.storage.store.IntegrityError: the state file does not verify.
        ValueError: the key names no checkpoint.
    """
    prefix, seq = keys.split_state_key(key.key if isinstance(key, DdpCheckpointInfo) else key)
    ck = load_state(store, prefix, seq)
    return {k[len("param/"):]: t for k, t in ck.tensors.items() if k.startswith("param/")}


def model_from_params(cfg: Config, params: Mapping[str, torch.Tensor]) -> ByteGPT:
    """A :class:`ByteGPT` of ``cfg.model`` holding ``params`` (name -> fp32 tensor).

    Raises:
        ValueError: a parameter of the model is missing or has another shape.
    """
    model = ByteGPT(cfg.model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            value = params.get(name)
            if value is None or value.shape != p.shape:
                raise ValueError(f"checkpoint lacks parameter {name} of shape {tuple(p.shape)}")
            p.copy_(value)
    return model


def load_ddp_model(cfg: Config, store: ObjectStore, key: str | DdpCheckpointInfo) -> ByteGPT:
    """A :class:`ByteGPT` of ``cfg.model`` holding the parameters of one checkpoint.

    Raises:
        FileNotFoundError, diloco_async.storage.store.IntegrityError: see :func:`load_ddp_params`.
        ValueError: the checkpoint does not fit ``cfg.model``.
    """
    return model_from_params(cfg, load_ddp_params(store, key))


def load_final_ddp_model(cfg: Config, store: ObjectStore, run_id: str) -> ByteGPT:
    """The model of the newest verified data-parallel checkpoint of a run.

    Raises:
        FileNotFoundError: the run has no verified data-parallel checkpoint.
        ValueError: the checkpoint does not fit ``cfg.model``.
    """
    ck = latest_state(store, checkpoint_prefix(run_id))
    if ck is None:
        raise FileNotFoundError(f"no verified data-parallel checkpoint under {checkpoint_prefix(run_id)}")
    return model_from_params(cfg, {k[len("param/"):]: t for k, t in ck.tensors.items() if k.startswith("param/")})
