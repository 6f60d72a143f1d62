"""``model.kind = "factory"``: the user's own model, built by a function the recipe names.

The contract of ``model.factory = "package.module:function"``:

* it is called as ``function(model_cfg, vocab_size)``: ``model_cfg`` is the recipe's
  :class:`~diloco_async.config.model.ModelConfig` (free settings in ``model_cfg.options``, the
  window length in ``model_cfg.context``), ``vocab_size`` the tokenizer's number of tokens;
* it returns a ``torch.nn.Module`` whose parameters are float32 on CPU, initialised from torch's
  global RNG (the caller seeds it with the run's seed, so every process builds the same Θ⁰);
* the module either has ``loss(inputs, targets)`` returning a 0-dim mean cross-entropy in nats per
  token (``inputs``, ``targets``: int64 [B, T], targets are the next tokens), or its
  ``forward(inputs)`` returns logits [B, T, vocab_size] (or an object with ``.logits``), and the
  cross-entropy is added around it (:class:`~diloco_async.models.wrapper.CausalLM`);
* its trainable parameters (``requires_grad``) are what the learners train and exchange.

``examples/tiny_mlp_lm.py`` is a complete example.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch.nn as nn

from diloco_async.config.model import ModelConfig
from diloco_async.models.wrapper import CausalLM

__all__ = ["load_factory", "build_factory"]


def load_factory(path: str) -> Callable[[ModelConfig, int], nn.Module]:
    """The function named by ``"package.module:function"``.

    Raises:
        ValueError: the module does not import, or has no such callable.
    """
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"model.factory={path!r}: module {module_name!r} does not import ({err})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"model.factory={path!r}: {module_name} has no callable {attr!r}")
    return fn


def build_factory(cfg: ModelConfig, vocab_size: int) -> nn.Module:
    """Call the factory of ``cfg`` (the caller seeds the RNG); wrap it when it has no ``loss``.

    Raises:
        ValueError: see :func:`load_factory`. TypeError: it did not return an ``nn.Module``, or
            the module has no trainable parameters.
    """
    assert cfg.factory is not None
    module = load_factory(cfg.factory)(cfg, vocab_size)
    if not isinstance(module, nn.Module):
        raise TypeError(f"model.factory={cfg.factory!r} returned a {type(module).__name__}, not a torch.nn.Module")
    if not any(p.requires_grad for p in module.parameters()):
        raise TypeError(f"model.factory={cfg.factory!r} returned a module without trainable parameters")
    return module if callable(getattr(module, "loss", None)) else CausalLM(module, cfg.context, hf=False)
