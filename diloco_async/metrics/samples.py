"""Generated text from a model while it trains: fixed prompts from the held-out text, continued greedily.

A loss curve says how well a language model predicts; a few continuations of the same prompts at
every evaluation show what it has learned to write. The prompts are the first tokens of held-out
windows spread over the split (:func:`heldout_prompts`), the same at every evaluation of a run, so
the samples of two evaluations differ only by the model. Decoding is greedy (``do_sample=False``):
the same model gives the same text.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn

from diloco_async.models.wrapper import CausalLM

__all__ = ["heldout_prompts", "generate_samples", "format_samples"]


def heldout_prompts(batches: Sequence[tuple[torch.Tensor, torch.Tensor]], tokenizer: Any, count: int,
                    prompt_tokens: int) -> list[str]:
    """``count`` prompts: the first ``prompt_tokens`` tokens of the first window of ``count``
    batches spread evenly over ``batches``, decoded to text.

    Args:
        batches: the held-out (inputs, targets) batches, inputs int64 [B, T].
        tokenizer: a transformers tokenizer (``decode(list[int]) -> str``).
        count: how many prompts (at most one per batch).
        prompt_tokens: tokens per prompt (at most T).

    Raises:
        ValueError: ``count`` or ``prompt_tokens`` below 1, or no batches.
    """
    if count < 1 or prompt_tokens < 1:
        raise ValueError(f"count and prompt_tokens must be >= 1, got {count} and {prompt_tokens}")
    if not batches:
        raise ValueError("no held-out batches to take prompts from")
    count = min(count, len(batches))
    picks = [round(i * (len(batches) - 1) / max(1, count - 1)) for i in range(count)]
    return [tokenizer.decode(batches[i][0][0, :prompt_tokens].tolist()) for i in picks]


def generate_samples(model: nn.Module, tokenizer: Any, prompts: Sequence[str], max_new_tokens: int) -> list[str]:
    """Greedy continuations of ``prompts`` by a transformers (or peft) model, one prompt at a time.

    Args:
        model: a :class:`~diloco_async.models.wrapper.CausalLM` around a model with ``generate``
            (``model.kind = "hf"``), on the CPU or a GPU; left in the train/eval mode it was in.
        tokenizer: a transformers tokenizer: ``encode(str, add_special_tokens=False) -> list[int]``
            and ``decode(list[int]) -> str``.
        prompts: the prompt texts.
        max_new_tokens: tokens generated per prompt; a prompt keeps its last ``context -
            max_new_tokens`` tokens, so prompt and continuation fit the model's window.

    Returns:
        for each prompt, the generated text only (its new tokens decoded), same order.

    Raises:
        TypeError: ``model`` is not an ``hf`` model.
        ValueError: ``max_new_tokens`` below 1 or not below the model's context.
    """
    if not isinstance(model, CausalLM) or not model.hf:
        raise TypeError(f"generate_samples needs a model of kind 'hf', got {type(model).__name__}")
    if not 1 <= max_new_tokens < model.context:
        raise ValueError(f"max_new_tokens must be in [1, {model.context - 1}] (the context is {model.context}), "
                         f"got {max_new_tokens}")
    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    was_training = model.training
    model.eval()
    out = []
    try:
        with torch.no_grad():
            for prompt in prompts:
                ids = tokenizer.encode(prompt, add_special_tokens=False)[-(model.context - max_new_tokens):] or [pad]
                inputs = torch.tensor([ids], dtype=torch.int64, device=device)
                generated = model.net.generate(input_ids=inputs, attention_mask=torch.ones_like(inputs),
                                               max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad)
                out.append(tokenizer.decode(generated[0, inputs.shape[1]:].tolist()))
    finally:
        model.train(was_training)
    return out


def format_samples(step: int, prompts: Sequence[str], samples: Sequence[str]) -> str:
    """The text artifact of one evaluation: each prompt and its continuation, headed by ``step``
    (merges so far)."""
    parts = [f"global model after {step} merges: greedy continuations of held-out prompts\n"]
    for prompt, sample in zip(prompts, samples, strict=True):
        parts.append(f"--- prompt {prompt!r}\n{prompt}{sample}\n")
    return "\n".join(parts)
