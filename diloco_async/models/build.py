"""Model construction for every ``model.kind``, and what the fragment plan needs of a model:
its trainable parameters, its embedding tensors and its identity (DESIGN §4.6).

The plan covers the **trainable** parameters only (with LoRA: the adapter), so only they are
exchanged, merged and checkpointed. The plan's schema hash also covers the model identity
(:func:`identity_of`): kind, architecture config, LoRA settings and the sha256 of the frozen base
tensors, so a learner whose model differs in any of these is refused at join.
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from diloco_async.config.model import ModelConfig
from diloco_async.models.factory import build_factory
from diloco_async.models.hf import build_hf
from diloco_async.models.transformer import ByteGPT
from diloco_async.models.transformer import embedding_names as byte_gpt_embeddings
from diloco_async.models.wrapper import CausalLM
from diloco_async.policy.fragments import FragmentPlan, plan_fragments, specs_of

if TYPE_CHECKING:
    from diloco_async.config.schema import Config

__all__ = ["build_model", "build_run_model", "run_vocab_size", "trainable_parameters", "embedding_names",
           "identity_of", "plan_of", "frozen_digest"]

# config fields of a transformers model that do not change what it computes
_VOLATILE_HF_FIELDS = ("_name_or_path", "transformers_version", "architectures", "dtype", "torch_dtype",
                       "id2label", "label2id", "use_cache", "output_attentions", "output_hidden_states",
                       "return_dict")


def run_vocab_size(cfg: Config) -> int:
    """Tokens of the run's vocabulary, which every kind of model is built for (today
    ``model.vocab_size``; 256 for bytes)."""
    return cfg.model.vocab_size


def build_model(cfg: ModelConfig, vocab_size: int, seed: int) -> nn.Module:
    """The model of ``cfg`` for a vocabulary of ``vocab_size`` tokens, float32 on CPU, its random
    init drawn from ``torch.manual_seed(seed)`` (torch's global RNG is left as it was).

    Returns:
        a module with ``loss(inputs, targets)`` (0-dim mean cross-entropy, nats/token) and
        ``forward(inputs) -> logits``; an ``identity`` attribute (see :func:`identity_of`).

    Raises:
        ValueError: a factory that does not import, a pretrained path that does not exist, LoRA
            target modules that match nothing, a model vocabulary smaller than ``vocab_size``, an
            unknown architecture or config field. TypeError: a factory that returns no module.
    """
    if cfg.kind == "hf":
        model = build_hf(cfg, vocab_size, seed)
    else:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = ByteGPT(cfg) if cfg.kind == "byte-gpt" else build_factory(cfg, vocab_size)
    model.identity = _identity(cfg, model, vocab_size)
    return model


def build_run_model(cfg: Config) -> nn.Module:
    """The run's model (``cfg.model`` for :func:`run_vocab_size` tokens, seeded by ``run.seed``)."""
    return build_model(cfg.model, run_vocab_size(cfg), cfg.run.seed)


def trainable_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The parameters that train (``requires_grad``), by name: what the fragment plan covers."""
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def embedding_names(model: nn.Module) -> list[str]:
    """Trainable tensors merged with the plain weighted mean (DESIGN §4.4): ByteGPT's token
    embedding (and untied head); a transformers model's input and output embeddings."""
    if isinstance(model, ByteGPT):
        return byte_gpt_embeddings(model)
    net = model.net if isinstance(model, CausalLM) else model
    getters = [getattr(net, "get_input_embeddings", None), getattr(net, "get_output_embeddings", None)]
    wanted = []
    for get in getters:
        module = get() if callable(get) else None
        if module is not None and getattr(module, "weight", None) is not None:
            wanted.append(module.weight)
    ids = {id(p) for p in wanted if p.requires_grad}
    return [n for n, p in model.named_parameters() if id(p) in ids]


def frozen_digest(model: nn.Module) -> str | None:
    """sha256 (hex) of the frozen tensors (names, dtypes, shapes, values in name order): the base
    every learner must share; None when every parameter trains."""
    frozen = sorted((n, p) for n, p in model.named_parameters() if not p.requires_grad)
    if not frozen:
        return None
    h = hashlib.sha256()
    for name, p in frozen:
        t = p.detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}\n".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _canonical(d: Any) -> Any:
    return json.loads(json.dumps(d, sort_keys=True, default=str))


def _identity(cfg: ModelConfig, model: nn.Module, vocab_size: int) -> dict:
    if cfg.kind == "byte-gpt":
        return identity_of(model)
    out: dict[str, Any] = {"kind": cfg.kind, "vocab_size": vocab_size}
    if cfg.kind == "factory":
        out.update(factory=cfg.factory, options=cfg.options)
    else:
        net = model.net.get_base_model() if cfg.lora is not None else model.net
        hf_cfg = {k: v for k, v in net.config.to_dict().items() if k not in _VOLATILE_HF_FIELDS}
        out.update(architecture=net.config.model_type, config=hf_cfg, pretrained=cfg.hf.pretrained,
                   lora=cfg.lora.model_dump() if cfg.lora is not None else None)
    out["base_digest"] = frozen_digest(model)
    return _canonical(out)


def identity_of(model: nn.Module) -> dict:
    """What the model is, as plain JSON data: the ``identity`` that :func:`build_model` attached;
    for a :class:`ByteGPT` built directly, its kind and shape fields; else its class."""
    ident = getattr(model, "identity", None)
    if isinstance(ident, dict):
        return ident
    if isinstance(model, ByteGPT):
        c = model.cfg
        return {"kind": "byte-gpt", "vocab_size": c.vocab_size, "n_layer": c.n_layer, "n_head": c.n_head,
                "d_model": c.d_model, "context": c.context, "tie_embeddings": c.tie_embeddings}
    return {"kind": "module", "class": f"{type(model).__module__}.{type(model).__qualname__}",
            "base_digest": frozen_digest(model)}


def plan_of(model: nn.Module, num_fragments: int, mode: str = "balanced") -> FragmentPlan:
    """The fragment plan of ``model``'s trainable parameters (in ``named_parameters`` order), with
    its identity in the schema; ``mode`` is ``synchronizer.fragmentation``.

    Raises:
        ValueError: more fragments than trainable tensors or layers, an unknown mode (see
            :func:`plan_fragments`).
    """
    params = trainable_parameters(model)
    return plan_fragments(specs_of({n: p.detach() for n, p in params.items()}), num_fragments,
                          embedding_names(model), identity=identity_of(model), mode=mode)
