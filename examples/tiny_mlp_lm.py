"""An example ``model.factory``: a tiny language model the user brings (see
``diloco_async/models/factory.py`` for the contract).

Each position sees an embedding of its own token and of the ``options.window - 1`` tokens before
it (a causal convolution), then an MLP predicts the next token. ``forward`` returns logits; the
project adds the cross-entropy. Recipe::

    [model]
    kind = "factory"
    factory = "examples.tiny_mlp_lm:build"
    options = { width = 64, window = 4 }
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class TinyMlpLM(nn.Module):
    """``forward(inputs int64 [B, T]) -> logits float32 [B, T, vocab_size]``."""

    def __init__(self, vocab_size: int, width: int, window: int) -> None:
        super().__init__()
        self.window = window
        self.embed = nn.Embedding(vocab_size, width)
        self.mix = nn.Conv1d(width, width, kernel_size=window)
        self.mlp = nn.Sequential(nn.GELU(), nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, vocab_size))

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        x = self.embed(inputs).transpose(1, 2)  # [B, width, T]
        x = self.mix(F.pad(x, (self.window - 1, 0)))  # causal: position t sees t - window + 1 .. t
        return self.mlp(x.transpose(1, 2))


def build(model_cfg, vocab_size: int) -> nn.Module:
    """The factory: ``model.options`` may set ``width`` (64) and ``window`` (4)."""
    opts = model_cfg.options
    return TinyMlpLM(vocab_size, int(opts.get("width", 64)), int(opts.get("window", 4)))

