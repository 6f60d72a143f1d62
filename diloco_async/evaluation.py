"""Evaluation of the global model on the held-out text."""

from __future__ import annotations

import torch

from diloco_async.config import Config
from diloco_async.data import Corpus, corpus_urls, load_corpus
from diloco_async.model import ByteGPT, evaluate_loss
from storage.checkpoint import Checkpoint

__all__ = ["model_from_checkpoint", "heldout_loss", "heldout_batches"]


def model_from_checkpoint(cfg: Config, ckpt: Checkpoint) -> ByteGPT:
    """The global model Θ held by a synchronizer checkpoint (parameters only, fp32)."""
    model = ByteGPT(cfg.model)
    params = dict(model.named_parameters())
    loaded = set()
    with torch.no_grad():
        for key, tensor in ckpt.tensors.items():
            _p, kind, name = key.split("/", 2)
            if kind == "param":
                params[name].copy_(tensor)
                loaded.add(name)
    missing = set(params) - loaded
    if missing:
        raise ValueError(f"checkpoint {ckpt.seq} lacks tensors {sorted(missing)[:5]}")
    return model


def heldout_batches(cfg: Config) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The fixed held-out windows of the configured corpus."""
    corpus = Corpus(load_corpus(corpus_urls(cfg.data)), cfg.data.eval_fraction, cfg.model.context)
    return corpus.eval_batches(cfg.learners.batch_size_of(0), cfg.data.eval_batches)


def heldout_loss(model: ByteGPT, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Mean held-out cross-entropy in nats per byte (ln 256 ≈ 5.545 for a uniform model)."""
    return evaluate_loss(model, batches)
