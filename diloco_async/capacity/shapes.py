"""The model a plan is about: from a recipe, from a Hugging Face config, or from a parameter count.

A recipe's or a config's model is built on torch's ``meta`` device: every tensor has its shape and
no memory, so a 12B model is planned in seconds on any machine. Nothing is read here; the caller
loads the recipe or the ``config.json``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from diloco_async.capacity.inputs import ModelShape
from diloco_async.config.schema import Config
from diloco_async.models import build_run_model, trainable_parameters
from diloco_async.policy.fragments import TensorSpec

__all__ = ["shape_from_config", "shape_from_hf_config", "shape_from_count"]


def _specs(model: torch.nn.Module) -> tuple[TensorSpec, ...]:
    return tuple(TensorSpec(n, tuple(p.shape), str(p.dtype).removeprefix("torch."))
                 for n, p in trainable_parameters(model).items())


def _hf_dims(config: Any, specs: tuple[TensorSpec, ...]) -> dict[str, Any]:
    """Layers, width, MLP width and vocabulary of a transformers config (gpt2's names included)."""
    d = getattr(config, "hidden_size", None)
    width = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or (d and 4 * d)
    return {"n_layer": getattr(config, "num_hidden_layers", None), "d_model": d, "mlp_width": width,
            "vocab_size": getattr(config, "vocab_size", None),
            "gated_mlp": any("gate_proj" in s.name or "gate_up_proj" in s.name for s in specs)}


def shape_from_config(cfg: Config, source: str = "recipe") -> ModelShape:
    """The run's model of ``cfg`` (``model.kind`` byte-gpt, hf or factory), built on the meta device.

    Raises:
        ValueError: the model cannot be built (see :func:`diloco_async.models.build_model`).
    """
    with torch.device("meta"):
        model = build_run_model(cfg)
    specs = _specs(model)
    mc = cfg.model
    dims: dict[str, Any] = {}
    if mc.kind == "byte-gpt":
        dims = {"n_layer": mc.n_layer, "d_model": mc.d_model, "mlp_width": 4 * mc.d_model,
                "vocab_size": mc.vocab_size, "gated_mlp": False}
    elif mc.kind == "hf" and mc.lora is None:
        net = getattr(model, "net", model)
        dims = _hf_dims(net.config, specs)
    return ModelShape(sum(s.numel for s in specs), specs, source=source, **dims)


def shape_from_hf_config(fields: Mapping[str, Any], source: str = "HF config") -> ModelShape:
    """A transformers causal LM from the fields of its ``config.json`` (``model_type`` names the
    architecture), built on the meta device.

    Raises:
        ValueError: no ``model_type``, or one transformers does not know.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    rest = dict(fields)
    model_type = rest.pop("model_type", None)
    if not isinstance(model_type, str) or not model_type:
        raise ValueError(f"{source}: no model_type (got {model_type!r}): the HF config.json names its architecture "
                         "there, e.g. \"llama\"")
    for key in ("architectures", "transformers_version", "torch_dtype", "dtype", "auto_map"):
        rest.pop(key, None)
    config = AutoConfig.for_model(model_type, **rest)
    with torch.device("meta"):
        net = AutoModelForCausalLM.from_config(config)
    specs = tuple(TensorSpec(n, tuple(p.shape), "float32") for n, p in net.named_parameters() if p.requires_grad)
    return ModelShape(sum(s.numel for s in specs), specs, source=source, **_hf_dims(config, specs))


def shape_from_count(n_params: int) -> ModelShape:
    """A bare parameter count: fragments of ``n_params / P`` each, activations not modelled.

    Raises:
        ValueError: ``n_params`` below 1.
    """
    if isinstance(n_params, bool) or not isinstance(n_params, int) or n_params < 1:
        raise ValueError(f"params={n_params!r}: must be an integer >= 1")
    return ModelShape(n_params, source="parameter count")
