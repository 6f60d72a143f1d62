"""A small decoder-only transformer language model over bytes (vocab 256).

Pre-norm blocks, causal self-attention through ``F.scaled_dot_product_attention``, a GELU MLP,
learned positions, and an output head tied to the token embedding by default.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
import torch.nn.functional as F

if TYPE_CHECKING:  # the config package imports the models package, which imports this module
    from diloco_async.config.model import ModelConfig

__all__ = ["ByteGPT", "embedding_names", "evaluate_loss", "generate"]


class _Block(nn.Module):
    def __init__(self, d: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class ByteGPT(nn.Module):
    """Decoder-only LM. ``forward(idx[B, T] int64) -> logits[B, T, vocab] float32``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.context, cfg.d_model)
        self.blocks = nn.ModuleList(_Block(cfg.d_model, cfg.n_head) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.tok_emb.weight
        self.apply(self._init)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight") or name.endswith("out.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(t, device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy in nats per byte; ``idx``, ``targets``: int64 [B, T]."""
        logits = self(idx)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def embedding_names(model: ByteGPT) -> list[str]:
    """Tensors merged with the plain weighted mean (DESIGN §4.4): the token embedding, which is
    also the output head when tied, and an untied head."""
    names = ["tok_emb.weight"]
    if not model.cfg.tie_embeddings:
        names.append("head.weight")
    return names


@torch.no_grad()
def evaluate_loss(model: ByteGPT, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Mean held-out loss in nats per byte over the given (inputs, targets) batches."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for x, y in batches:
        total += float(model.loss(x, y)) * y.numel()
        count += y.numel()
    model.train(was_training)
    return total / max(count, 1)


@torch.no_grad()
def generate(model: nn.Module, prompt: bytes, n_bytes: int, temperature: float = 0.8,
             generator: torch.Generator | None = None) -> bytes:
    """Sample ``n_bytes`` bytes after ``prompt`` (the last ``context`` bytes condition each step)
    from a byte-level model: a :class:`ByteGPT` or any model whose ``forward`` gives logits and
    that has a ``context`` attribute (token ids 0-255 are the bytes; larger ids are never drawn).

    Raises:
        ValueError: an empty prompt or a temperature <= 0.
    """
    if not prompt:
        raise ValueError("prompt must not be empty")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    was_training = model.training
    model.eval()
    context = model.cfg.context if isinstance(model, ByteGPT) else int(getattr(model, "context", len(prompt) + n_bytes))
    idx = torch.tensor(list(prompt), dtype=torch.long)[None, :]
    for _ in range(n_bytes):
        logits = model(idx[:, -context:])[0, -1, :256].float() / temperature
        nxt = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)
        idx = torch.cat([idx, nxt[None, :]], dim=1)
    model.train(was_training)
    return bytes(idx[0, len(prompt):].tolist())
