"""Text samples of a Hugging Face model at each evaluation (diloco_async/metrics/samples.py): prompts
from the held-out windows, greedy continuations that are the model's own argmax tokens."""

from __future__ import annotations

import pytest
import torch
from test_models import tiny_hf
from transformers import PreTrainedTokenizerFast

from diloco_async.config.model import ModelConfig
from diloco_async.data.tokenizer import train_bpe
from diloco_async.metrics.samples import format_samples, generate_samples, heldout_prompts
from diloco_async.models import build_model

TEXT = ("ROMEO: But soft, what light through yonder window breaks?\n"
        "JULIET: O Romeo, Romeo, wherefore art thou Romeo?\n") * 20


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(tokenizer_object=train_bpe(TEXT.encode(), 300))


def _windows(tok, count: int, t: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    ids = torch.tensor(tok.encode(TEXT, add_special_tokens=False))
    out = []
    for i in range(count):
        w = ids[i * 7:i * 7 + t + 1].repeat(2, 1)
        out.append((w[:, :-1], w[:, 1:]))
    return out


def test_prompts_are_the_first_tokens_of_windows_spread_over_the_split(tokenizer):
    batches = _windows(tokenizer, 5)
    prompts = heldout_prompts(batches, tokenizer, 3, 4)
    assert prompts == [tokenizer.decode(batches[i][0][0, :4].tolist()) for i in (0, 2, 4)]
    assert heldout_prompts(batches, tokenizer, 9, 4) == heldout_prompts(batches, tokenizer, 5, 4)  # one per batch
    with pytest.raises(ValueError, match="count and prompt_tokens"):
        heldout_prompts(batches, tokenizer, 0, 4)
    with pytest.raises(ValueError, match="no held-out batches"):
        heldout_prompts([], tokenizer, 1, 4)


def test_samples_are_greedy_continuations_and_leave_the_model_as_it_was(tokenizer):
    vocab = len(tokenizer)
    model = build_model(tiny_hf(), vocab, seed=0)
    model.train()
    prompts = heldout_prompts(_windows(tokenizer, 4), tokenizer, 2, 5)
    first = generate_samples(model, tokenizer, prompts, 6)
    assert model.training  # restored
    assert len(first) == 2 and first == generate_samples(model, tokenizer, prompts, 6)  # greedy: deterministic
    for prompt, sample in zip(prompts, first, strict=True):
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        model.eval()
        with torch.no_grad():
            expected = []
            for _ in range(6):  # the argmax of the next token, one step at a time
                logits = model(torch.tensor([ids + expected]))
                expected.append(int(logits[0, -1].argmax()))
        assert sample == tokenizer.decode(expected)
    text = format_samples(12, prompts, first)
    assert text.startswith("global model after 12 merges") and text.count("--- prompt ") == 2
    assert all(p + s in text for p, s in zip(prompts, first, strict=True))


def test_a_byte_model_or_a_too_long_continuation_is_refused(tokenizer):
    model = build_model(tiny_hf(), len(tokenizer), seed=0)
    with pytest.raises(ValueError, match=r"max_new_tokens must be in \[1, 15\].*got 16"):
        generate_samples(model, tokenizer, ["ROMEO"], 16)
    byte_model = build_model(ModelConfig(n_layer=1, d_model=16, n_head=2, context=16), 256, seed=0)
    with pytest.raises(TypeError, match="kind 'hf'"):
        generate_samples(byte_model, tokenizer, ["ROMEO"], 4)
