"""Evaluation of the global model on the held-out text: nats per token, and bits per byte
(:func:`~diloco_async.data.tokens.bits_per_byte`) so that runs with different tokenizers compare."""

from __future__ import annotations

import torch

from diloco_async.config.schema import Config
from diloco_async.data.tokens import HeldoutSplit, open_corpus
from diloco_async.models import build_run_model, trainable_parameters
from diloco_async.models.transformer import evaluate_loss
from diloco_async.storage.checkpoint import Checkpoint

__all__ = ["model_from_checkpoint", "heldout_loss", "heldout_batches", "heldout_split"]


def model_from_checkpoint(cfg: Config, ckpt: Checkpoint) -> torch.nn.Module:
    """The global model Θ held by a synchronizer checkpoint: the recipe's model (any
    ``model.kind``; with LoRA, the frozen base) with the checkpoint's trainable tensors (fp32).

    Raises:
        ValueError: the checkpoint lacks a trainable tensor of the model.
    """
    model = build_run_model(cfg)
    params = trainable_parameters(model)
    loaded = set()
    with torch.no_grad():
        for key, tensor in ckpt.tensors.items():
            _p, kind, name = key.split("/", 2)
            if kind == "param":
                if name not in params:
                    raise ValueError(f"checkpoint {ckpt.seq} holds {name!r}, not a trainable tensor of "
                                     f"model.kind={cfg.model.kind!r}")
                params[name].copy_(tensor)
                loaded.add(name)
    missing = set(params) - loaded
    if missing:
        raise ValueError(f"checkpoint {ckpt.seq} lacks tensors {sorted(missing)[:5]}")
    return model


def heldout_split(cfg: Config) -> HeldoutSplit:
    """The fixed held-out windows of the configured corpus (the same for every learner count and,
    in the bytes they cover, every tokenizer) with the split's token and byte counts."""
    corpus = open_corpus(cfg.data, cfg.model.context)
    return corpus.heldout_split(cfg.learners.batch_size_of(0), cfg.data.eval_batches)


def heldout_batches(cfg: Config) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The fixed held-out windows of the configured corpus (:func:`heldout_split`'s batches)."""
    return heldout_split(cfg).batches


def heldout_loss(model: torch.nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Mean held-out cross-entropy in nats per token (ln 256 ≈ 5.545 for a uniform byte model);
    :meth:`HeldoutSplit.bits_per_byte` turns it into bits per byte."""
    return evaluate_loss(model, batches)
