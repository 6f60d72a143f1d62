"""The final global model of an ``hf`` run as a folder that transformers (or peft) loads back.

* full training: ``save_pretrained`` of the transformers model (``config.json`` and
  ``model.safetensors``): ``AutoModelForCausalLM.from_pretrained(folder)`` gives it back;
* LoRA: the adapter (``adapter_config.json``, ``adapter_model.safetensors``) and, when the base
  was randomly initialised rather than loaded, the base itself under ``base/``;
  :func:`load_saved_model` (or the snippet in the folder's ``LOADING.md``) puts the adapter back
  onto its base with ``peft.PeftModel.from_pretrained``.

A tokenizer (anything with ``save_pretrained``) is saved beside the model when the data side has one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch.nn as nn

from diloco_async.config.model import ModelConfig, hub_repo_id
from diloco_async.models.hf import fetch_pretrained, unwrap_hf
from diloco_async.models.wrapper import CausalLM
from storage.store import ObjectStore

__all__ = ["save_final_model", "load_saved_model", "upload_folder", "LOADING_FILE"]

LOADING_FILE = "LOADING.md"

_LOADING_FULL = """# Loading this model

    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained("<this folder>")

Inputs are token ids (the run's tokenizer; bytes 0-255 when it trained on bytes).
"""

_LOADING_LORA = """# Loading this LoRA adapter

The folder holds a LoRA adapter (peft) trained on a frozen base: {base}.

    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_pretrained("{base_path}")
    model = PeftModel.from_pretrained(base, "<this folder>")
    model = model.merge_and_unload()  # optional: one plain transformers model

or ``diloco_async.models.load_saved_model("<this folder>")``.
"""


def save_final_model(model: nn.Module, cfg: ModelConfig, folder: str | Path, tokenizer: Any | None = None) -> Path:
    """Write the ``hf`` model (a :class:`CausalLM` from ``build_model``) into ``folder``.

    Returns:
        ``folder``.

    Raises:
        TypeError: ``model`` is not an ``hf`` model.
    """
    if cfg.kind != "hf" or not isinstance(model, CausalLM):
        raise TypeError(f"save_final_model needs model.kind = 'hf' (got {cfg.kind!r})")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    net = unwrap_hf(model)
    net.save_pretrained(str(folder))
    if cfg.lora is None:
        text = _LOADING_FULL
    elif cfg.hf.pretrained is not None:
        hub = hub_repo_id(cfg.hf.pretrained)  # a Hub id loads from any host; a local copy only here
        text = _LOADING_LORA.format(base=f"the pretrained model {cfg.hf.pretrained!r}",
                                    base_path=hub if hub else fetch_pretrained(cfg.hf.pretrained, cfg.hf.cache_dir))
    else:
        net.get_base_model().save_pretrained(str(folder / "base"))
        text = _LOADING_LORA.format(base="its randomly initialised base, saved in base/",
                                    base_path="<this folder>/base")
    (folder / LOADING_FILE).write_text(text)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(folder))
    return folder


def load_saved_model(folder: str | Path, base: str | Path | None = None) -> nn.Module:
    """A folder written by :func:`save_final_model`, loaded back as a float32 transformers model
    (an adapter is merged into its base: ``base``, else ``folder/base``, else the base path the
    adapter names).

    Raises:
        ValueError: an adapter whose base folder does not exist.
    """
    from transformers import AutoModelForCausalLM

    folder = Path(folder)
    if not (folder / "adapter_config.json").exists():
        return AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True)
    from peft import PeftConfig, PeftModel

    base_path = Path(base) if base is not None else folder / "base"
    if not base_path.is_dir():
        base_path = Path(PeftConfig.from_pretrained(str(folder)).base_model_name_or_path or "")
    if not base_path.is_dir():
        raise ValueError(f"the base model of the adapter in {folder} is not at {str(base_path)!r}; pass base=")
    net = AutoModelForCausalLM.from_pretrained(str(base_path), local_files_only=True)
    return PeftModel.from_pretrained(net, str(folder)).merge_and_unload()


def upload_folder(store: ObjectStore, prefix: str, folder: str | Path) -> list[str]:
    """Put every file under ``folder`` into ``store`` at ``prefix`` + its relative path (exclusive
    create); returns the keys written, sorted."""
    folder = Path(folder)
    out = []
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        key = prefix + path.relative_to(folder).as_posix()
        store.put_from_file(key, path)
        out.append(key)
    return out
