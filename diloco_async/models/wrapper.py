"""A thin ``nn.Module`` around a model that gives logits, adding the project's training loss.

The learner, the evaluation and the fragment plan see one interface whatever the model:
``forward(inputs[B, T] int64) -> logits[B, T, V]`` and ``loss(inputs, targets) -> 0-dim mean
cross-entropy in nats per token``. Parameter names are the wrapped model's, prefixed by ``net.``.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["CausalLM"]


class CausalLM(nn.Module):
    """Wraps ``net``; with ``hf=True`` it is called as ``net(input_ids=inputs, use_cache=False)``
    and its output's ``.logits`` are taken, else ``net(inputs)`` must return the logits.

    Args:
        net: the model (a transformers ``PreTrainedModel``, a ``peft`` model, or any module).
        context: window length the model was built for (tokens).
        hf: call convention of ``net`` (see above).
    """

    def __init__(self, net: nn.Module, context: int, *, hf: bool) -> None:
        super().__init__()
        self.net = net
        self.context = context
        self.hf = hf

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """``inputs`` int64 [B, T] -> logits [B, T, V] (the net's dtype, float32 unless autocast)."""
        if self.hf:
            return self.net(input_ids=inputs, use_cache=False).logits
        out = self.net(inputs)
        return out.logits if hasattr(out, "logits") else out

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of the next tokens ``targets`` (int64 [B, T], already shifted), in
        nats per token; 0-dim float32."""
        logits = self(inputs)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
