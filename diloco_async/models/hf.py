"""``model.kind = "hf"``: a transformers causal LM, random init or ``from_pretrained``, with an
optional LoRA adapter (``peft``).

transformers and peft are imported on first use (they take seconds), and only ever read local
files: a pretrained model named by an fsspec URL is copied once into ``model.hf.cache_dir`` (a
folder named by the URL's hash), one named by a Hub id is found in ``model.hf.cache_dir/hub`` where
the flow downloaded it (:mod:`diloco_async.runtime.hub`), and either is loaded with ``local_files_only``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import fsspec
import torch
import torch.nn as nn

from diloco_async.config.model import HfModelConfig, LoraSettings, ModelConfig, hub_repo_id
from diloco_async.models.wrapper import CausalLM
from diloco_async.runtime.hub import cached_snapshot

__all__ = ["build_hf", "fetch_pretrained", "hf_config", "apply_lora", "unwrap_hf"]

log = logging.getLogger("diloco.models")

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never the hub, whoever imports transformers after us
_MARKER = ".diloco-complete"


def fetch_pretrained(url: str, cache_dir: str, revision: str | None = None) -> Path:
    """The local folder of a pretrained model: ``url`` itself when it is a local folder; for a Hub
    id, its snapshot at ``revision`` in ``cache_dir/hub`` (never downloaded here); else a copy of
    the folder at the fsspec ``url`` in ``cache_dir/<sha256(url)[:16]>`` (made once; a marker file
    says the copy is complete).

    Raises:
        ValueError: nothing exists at ``url``, or a Hub id that was not downloaded.
    """
    repo_id = hub_repo_id(url)
    if repo_id is not None:
        try:
            return cached_snapshot(repo_id, revision, cache_dir)
        except FileNotFoundError as err:
            raise ValueError(f"model.hf.pretrained={url!r}: {err}") from None
    local = Path(url.removeprefix("file://")).expanduser()
    if "://" not in url or url.startswith("file://"):
        if not local.is_dir():
            raise ValueError(f"model.hf.pretrained={url!r}: no such folder")
        return local.resolve()
    dest = Path(cache_dir) / hashlib.sha256(url.encode()).hexdigest()[:16]
    if (dest / _MARKER).exists():
        return dest.resolve()
    fs, root = fsspec.core.url_to_fs(url)
    if not fs.exists(root):
        raise ValueError(f"model.hf.pretrained={url!r}: nothing at that URL")
    tmp = dest.with_name(f"{dest.name}.tmp-{uuid.uuid4().hex[:8]}")
    fs.get(root.rstrip("/") + "/", str(tmp) + "/", recursive=True)
    (tmp / _MARKER).write_text(url + "\n")
    try:
        tmp.rename(dest)
    except OSError:  # another process finished the same copy first
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("copied pretrained model %s into %s", url, dest)
    return dest.resolve()


def hf_config(hf: HfModelConfig, vocab_size: int, context: int) -> Any:
    """The transformers config of a randomly initialised model: ``hf.architecture`` with the
    fields of ``hf.config``; ``vocab_size`` and the positions default to the tokenizer's vocabulary
    and ``context``.

    Raises:
        ValueError: an unknown architecture or config field, or a vocabulary smaller than the tokenizer's.
    """
    from transformers import CONFIG_MAPPING

    arch = hf.architecture
    if arch not in CONFIG_MAPPING:
        raise ValueError(f"model.hf.architecture={arch!r} is not a transformers model type "
                         f"(e.g. 'llama', 'gpt2', 'qwen2', 'mistral')")
    config_class = CONFIG_MAPPING[arch]
    defaults = config_class()
    unknown = sorted(k for k in hf.config if not hasattr(defaults, k))
    if unknown:
        raise ValueError(f"model.hf.config: {unknown} are not fields of the {arch!r} config")
    fields = dict(hf.config)
    fields.setdefault("vocab_size", vocab_size)
    positions = {"max_position_embeddings", config_class.attribute_map.get("max_position_embeddings", "")}
    if hasattr(defaults, "max_position_embeddings") and not positions & set(fields):
        fields["max_position_embeddings"] = context
    config = config_class(**fields)
    _check_fits(config, vocab_size, context, f"model.hf.config ({arch})")
    return config


def _check_fits(config: Any, vocab_size: int, context: int, what: str) -> None:
    if config.vocab_size < vocab_size:
        raise ValueError(f"{what}: vocab_size={config.vocab_size} is smaller than the tokenizer's "
                         f"vocabulary ({vocab_size} tokens)")
    positions = getattr(config, "max_position_embeddings", None)
    if positions is not None and positions < context:
        raise ValueError(f"{what}: max_position_embeddings={positions} is shorter than model.context={context}")


def _module_matches(name: str, target: str) -> bool:
    return name == target or name.endswith("." + target)


def apply_lora(net: nn.Module, lora: LoraSettings) -> nn.Module:
    """``net`` with a LoRA adapter (peft) on the modules named by ``lora.target_modules``; only
    the adapter's tensors train (the base is frozen).

    Raises:
        ValueError: a target module name matches no module of ``net``.
    """
    from peft import LoraConfig, get_peft_model

    names = [n for n, _ in net.named_modules()]
    unmatched = [t for t in lora.target_modules if not any(_module_matches(n, t) for n in names)]
    if unmatched:
        leaves = sorted({n.rsplit(".", 1)[-1] for n, m in net.named_modules() if isinstance(m, nn.Linear)})
        raise ValueError(f"model.lora.target_modules {unmatched} match no module of the model "
                         f"(its linear layers: {leaves})")
    config = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                        target_modules=list(lora.target_modules), bias="none")
    return get_peft_model(net, config)


def build_hf(cfg: ModelConfig, vocab_size: int, seed: int) -> CausalLM:
    """The ``hf`` model of ``cfg`` in float32 on CPU, wrapped in :class:`CausalLM`: random init
    seeded by ``seed``, or loaded from ``cfg.hf.pretrained``; with ``cfg.lora``, a peft model
    whose only trainable tensors are the adapter's (its init is seeded by ``seed`` too).

    Raises:
        ValueError: see :func:`fetch_pretrained`, :func:`hf_config` and :func:`apply_lora`.
    """
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if cfg.hf.pretrained is not None:
            folder = fetch_pretrained(cfg.hf.pretrained, cfg.hf.cache_dir, cfg.hf.revision)
            net = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, local_files_only=True)
            _check_fits(net.config, vocab_size, cfg.context, f"model.hf.pretrained={cfg.hf.pretrained!r}")
        else:
            net = AutoModelForCausalLM.from_config(hf_config(cfg.hf, vocab_size, cfg.context), dtype=torch.float32)
        if cfg.lora is not None:
            net = apply_lora(net, cfg.lora)
    net.train()
    return CausalLM(net, cfg.context, hf=True)


def unwrap_hf(model: nn.Module) -> nn.Module:
    """The transformers (or peft) model inside a :class:`CausalLM` (``model`` itself otherwise)."""
    return model.net if isinstance(model, CausalLM) else model
